"""tools/slurm_train.sh and tools/slurm_test.sh: the srun command line of the upstream scripts,
checked with a stand-in ``srun`` on PATH that records its arguments."""
import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAKE_SRUN = '''#!/usr/bin/env python3
import json, os, sys
with open(os.environ['SRUN_RECORD'], 'w') as f:
    json.dump(dict(argv=sys.argv[1:], pythonpath=os.environ.get('PYTHONPATH')), f)
'''


def run_script(tmp_path, script, args, **env):
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / 'srun'
    srun.write_text(FAKE_SRUN)
    srun.chmod(0o755)
    record = tmp_path / 'srun.json'
    venv_python = tmp_path / 'venv' / 'bin' / 'python'  # the default interpreter: a venv's
    venv_python.parent.mkdir(parents=True, exist_ok=True)
    venv_python.touch(mode=0o755)
    env.setdefault('LINVIT_VENV', str(tmp_path / 'venv'))
    for name in ('GPUS', 'GPUS_PER_NODE', 'CPUS_PER_TASK', 'SRUN_ARGS', 'PYTHON', 'PYTHONPATH'):
        env.setdefault(name, None)
    full_env = {**os.environ, 'PATH': f'{bin_dir}:{os.environ["PATH"]}',
                'SRUN_RECORD': str(record)}
    full_env.update({k: v for k, v in env.items() if v is not None})
    for name in [k for k, v in env.items() if v is None]:
        full_env.pop(name, None)
    proc = subprocess.run(['bash', str(REPO / 'tools' / script), *args], env=full_env,
                          capture_output=True, text=True, timeout=60)
    recorded = json.loads(record.read_text()) if record.exists() else None
    return proc, recorded


SRUN_DEFAULTS = ['-p', 'part', '--job-name=job', '--gres=gpu:8', '--ntasks=8',
                 '--ntasks-per-node=8', '--cpus-per-task=5', '--kill-on-bad-exit=1']


def test_train_runs_train_py_with_the_slurm_launcher(tmp_path):
    proc, recorded = run_script(tmp_path, 'slurm_train.sh',
                                ['part', 'job', 'configs/x.py', 'work_dirs/x', '--amp',
                                 '--cfg-options', 'model.backbone.init_cfg.checkpoint=a b.pth'])
    assert proc.returncode == 0, proc.stderr
    assert recorded['argv'] == SRUN_DEFAULTS + [
        str(tmp_path / 'venv' / 'bin' / 'python'), '-u', str(REPO / 'tools' / 'train.py'),
        'configs/x.py',
        '--work-dir=work_dirs/x', '--launcher=slurm', '--amp', '--cfg-options',
        'model.backbone.init_cfg.checkpoint=a b.pth']
    assert recorded['pythonpath'].split(':')[0] == str(REPO / 'tools' / '..')


def test_test_runs_test_py_with_the_slurm_launcher(tmp_path):
    proc, recorded = run_script(tmp_path, 'slurm_test.sh',
                                ['part', 'job', 'configs/x.py', 'ckpt.pth', '--out', 'res.pkl'])
    assert proc.returncode == 0, proc.stderr
    assert recorded['argv'] == SRUN_DEFAULTS + [
        str(tmp_path / 'venv' / 'bin' / 'python'), '-u', str(REPO / 'tools' / 'test.py'),
        'configs/x.py', 'ckpt.pth',
        '--launcher=slurm', '--out', 'res.pkl']


@pytest.mark.parametrize('script', ['slurm_train.sh', 'slurm_test.sh'])
def test_environment_variables_as_upstream(tmp_path, script):
    proc, recorded = run_script(tmp_path, script, ['gpu', 'big', 'c.py', 'x'], GPUS='16',
                                GPUS_PER_NODE='4', CPUS_PER_TASK='2',
                                SRUN_ARGS='--quotatype=auto --time=10', PYTHON='/opt/py',
                                PYTHONPATH='/site')
    assert proc.returncode == 0, proc.stderr
    argv = recorded['argv']
    assert argv[:10] == ['-p', 'gpu', '--job-name=big', '--gres=gpu:4', '--ntasks=16',
                         '--ntasks-per-node=4', '--cpus-per-task=2', '--kill-on-bad-exit=1',
                         '--quotatype=auto', '--time=10']
    assert argv[10:12] == ['/opt/py', '-u']
    assert recorded['pythonpath'] == f'{REPO / "tools" / ".."}:/site'


@pytest.mark.parametrize('script', ['slurm_train.sh', 'slurm_test.sh'])
def test_missing_arguments_print_the_usage(tmp_path, script):
    proc, recorded = run_script(tmp_path, script, ['part', 'job', 'c.py'])
    assert proc.returncode == 2 and recorded is None
    assert 'usage:' in proc.stderr and 'PARTITION JOB_NAME CONFIG' in proc.stderr
