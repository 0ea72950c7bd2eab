"""The tools' CPU threading: chosen before torch loads, the user's variables untouched.

Each case runs a tool's ``--help`` as ``__main__`` in a fresh interpreter that stops at the
first import of torch and reports the environment at that moment: what libgomp would read
when it loads. Torch itself never loads, so the cases take interpreter start-ups only.
"""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from linvit_mm.cpu_threads import TOOL_MARKER, usable_cores

REPO = Path(__file__).resolve().parents[2]
TOOLS = ['tools/train.py', 'tools/test.py', 'tools/demo.py'] + sorted(
    str(path.relative_to(REPO)) for path in (REPO / 'tools/analysis_tools').glob('benchmark_*.py'))
NAMES = ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT', 'KMP_BLOCKTIME', 'OMP_NUM_THREADS',
         'MKL_NUM_THREADS', 'LINVIT_MM_AUTO_THREADS')
USER = {'OMP_WAIT_POLICY': 'ACTIVE', 'OMP_NUM_THREADS': '1'}

STOP_AT_TORCH = '''
import json, os, runpy, sys
NAMES = {names!r}

class StopAtTorch:
    def find_spec(self, name, path=None, target=None):
        if name == 'torch' or name.startswith('torch.'):
            threads = sys.modules.get('linvit_mm.cpu_threads')
            print(json.dumps(dict(
                env={{k: os.environ.get(k) for k in NAMES}},
                configured=None if threads is None else threads.configured,
                torch_loaded=None if threads is None else threads.torch_loaded_at_configuration)))
            sys.stdout.flush()
            os._exit(0)

sys.meta_path.insert(0, StopAtTorch())
{body}
print(json.dumps('torch was never imported'))
'''


def run_until_torch(body, extra_env):
    env = {k: v for k, v in os.environ.items() if k not in NAMES}
    env.update(extra_env)
    result = subprocess.run([sys.executable, '-c', STOP_AT_TORCH.format(names=NAMES, body=body)],
                            cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_tool_until_torch(tool, extra_env):
    body = f"sys.argv = [{tool!r}, '--help']\nrunpy.run_path({tool!r}, run_name='__main__')"
    return run_until_torch(body, extra_env)


def tool_id(tool):
    return Path(tool).stem


def test_every_benchmark_tool_is_covered():
    assert len(TOOLS) >= 8 and 'tools/analysis_tools/benchmark_backbone.py' in TOOLS


@pytest.mark.parametrize('tool', TOOLS, ids=tool_id)
def test_the_marker_precedes_every_import(tool):
    """Declared after an import, the marker might come after torch has loaded."""
    body = ast.parse((REPO / tool).read_text()).body
    marker = next(i for i, node in enumerate(body) if isinstance(node, ast.Assign)
                  and [t.id for t in node.targets] == [TOOL_MARKER])
    first_import = next(i for i, node in enumerate(body)
                        if isinstance(node, (ast.Import, ast.ImportFrom)))
    assert marker < first_import
    assert ast.literal_eval(body[marker].value) is True


@pytest.mark.parametrize('tool', TOOLS, ids=tool_id)
def test_unset_variables_are_chosen_before_torch_loads(tool):
    report = run_tool_until_torch(tool, {})
    # the thread count and its marker only: how idle threads wait stays libgomp's default
    chosen = {'OMP_NUM_THREADS': str(usable_cores()),
              'LINVIT_MM_AUTO_THREADS': str(usable_cores())}
    assert report['torch_loaded'] is False
    assert report['configured'] == chosen
    assert report['env'] == dict(dict.fromkeys(NAMES), **chosen)


@pytest.mark.parametrize('tool', TOOLS, ids=tool_id)
def test_the_users_variables_are_left_alone(tool):
    report = run_tool_until_torch(tool, USER)
    assert report['configured'] == {}
    assert report['env'] == dict(dict.fromkeys(NAMES), **USER)


def test_importing_linvit_mm_leaves_a_users_process_alone():
    """A script without the marker: none of the variables appears."""
    report = run_until_torch('import linvit_mm', {})
    assert report['configured'] == {}
    assert report['env'] == dict.fromkeys(NAMES)


@pytest.fixture(scope='module')
def demo():
    import importlib.util
    spec = importlib.util.spec_from_file_location('linvit_demo_threads', REPO / 'tools/demo.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Stop(Exception):
    pass


@pytest.mark.parametrize('above, shown', [(1, True), (0, False), (-1, False)],
                         ids=['load-above-cpus', 'load-equal', 'load-below'])
def test_demo_says_when_other_jobs_share_the_machine(demo, monkeypatch, capsys, tmp_path,
                                                     above, shown):
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, 'getloadavg', lambda: (cpus + above, 0., 0.))

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(demo, 'write_data_sets', stop)
    with pytest.raises(Stop):
        demo.main(['--work-dir', str(tmp_path), '--data-root', str(tmp_path / 'data')])
    out = capsys.readouterr().out
    assert ('other jobs share this machine' in out) == shown
