"""Fixtures of the tools' tests."""
import contextlib
import importlib.util
import io
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


class InProcessRunTool:
    """A stand-in for ``tools/demo.py``'s ``run_tool`` that runs tools/train.py, tools/test.py
    and the model converters in this process: the demo's code path less an interpreter
    start-up per run. Each Runner gets its own experiment name, as separate processes would
    (mmengine names a run by its config and the second it starts, and two runs of one
    config within a second would share a logger and message hub)."""

    def __init__(self):
        self.modules = {}
        self.runs = 0

    def module(self, path):
        if path not in self.modules:
            spec = importlib.util.spec_from_file_location(
                f'linvit_tool_{Path(path).stem}', REPO / path)
            self.modules[path] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(self.modules[path])
        return self.modules[path]

    def __call__(self, args, log_path, show=True, threads=None):
        self.runs += 1
        argv = [str(a) for a in args[1:]]
        if Path(args[0]).stem in ('train', 'test'):
            argv.append(f'experiment_name=tool_run_{self.runs}')
        stream = io.StringIO()
        with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
            self.module(args[0]).main(argv)
        Path(log_path).write_text(stream.getvalue())
        return stream.getvalue()


@pytest.fixture
def in_process_run_tool():
    return InProcessRunTool()
