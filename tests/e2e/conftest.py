"""Run tools/train.py and tools/test.py in-process (same code path, no interpreter start-up)."""
import contextlib
import importlib.util
import io
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / 'configs' / 'demo'


def load_tool(name):
    spec = importlib.util.spec_from_file_location(f'linvit_tool_{name}',
                                                  REPO / 'tools' / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Tools:
    """``tools.train([...])`` / ``tools.test([...])`` return (result, captured log text)."""

    def __init__(self):
        self._train = load_tool('train')
        self._test = load_tool('test')

    @staticmethod
    def _run(main, argv):
        # Each Runner creates its logger (and its stdout handler) inside this block. mmengine
        # names that logger by config and second and reuses an existing one, so each run gets
        # its own experiment name; otherwise a second run within the same second would log into
        # the first run's stream.
        argv = [*argv, '--cfg-options', f'experiment_name=run_{uuid.uuid4().hex[:12]}']
        stream = io.StringIO()
        with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
            result = main(argv)
        return result, stream.getvalue()

    def train(self, argv):
        return self._run(self._train.main, [str(a) for a in argv])

    def test(self, argv):
        return self._run(self._test.main, [str(a) for a in argv])


@pytest.fixture(scope='session')
def tools():
    return Tools()
