"""tools/setup_env.py: failures name their step and log, long steps show their elapsed time,
a second run reuses everything."""
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_setup_env():
    spec = importlib.util.spec_from_file_location('setup_env', REPO / 'tools' / 'setup_env.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_failed_step_names_step_and_log(tmp_path):
    setup_env = load_setup_env()
    log = tmp_path / 'logs' / 'compile.log'
    with pytest.raises(setup_env.StepFailed) as err:
        setup_env.run_logged('compile', [sys.executable, '-c', 'print("boom"); raise SystemExit(3)'],
                             log)
    message = str(err.value)
    assert 'step "compile" failed (exit 3)' in message and str(log) in message
    assert 'boom' in message and 'boom' in log.read_text()


def test_slow_step_prints_a_heartbeat_with_elapsed_time(tmp_path, capsys):
    setup_env = load_setup_env()
    log = tmp_path / 'build.log'
    setup_env.run_logged('mmcv-build', [sys.executable, '-c', 'import time; time.sleep(2.2)'],
                         log, doing='mmcv: compiling cpu ops', heartbeat_s=0.4)
    beats = [line for line in capsys.readouterr().out.splitlines() if 'elapsed' in line]
    assert len(beats) >= 4
    assert all('mmcv: compiling cpu ops: ' in line and str(log) in line for line in beats)
    seconds = [int(re.search(r': (\d+) s elapsed', line).group(1)) for line in beats]
    assert seconds == sorted(seconds) and seconds[0] == 0 and seconds[-1] >= 1


def test_quick_step_prints_no_heartbeat(tmp_path, capsys):
    setup_env = load_setup_env()
    setup_env.run_logged('venv', [sys.executable, '-c', 'pass'], tmp_path / 'venv.log',
                         heartbeat_s=30)
    assert 'elapsed' not in capsys.readouterr().out


@pytest.mark.parametrize('seconds, text', [(0, '0 s'), (59.9, '59 s'), (270, '4 min 30 s'),
                                           (3725, '1 h 02 min')])
def test_elapsed_time_reads_like_a_clock(seconds, text):
    assert load_setup_env().format_elapsed(seconds) == text


def test_interrupted_step_does_not_keep_running(tmp_path, monkeypatch):
    setup_env = load_setup_env()
    started = []

    def interrupt(msg):  # the first heartbeat stands in for a Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(setup_env, 'log', interrupt)
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(setup_env.subprocess, 'Popen', popen)
    with pytest.raises(KeyboardInterrupt):
        setup_env.run_logged('slow', [sys.executable, '-c', 'import time; time.sleep(60)'],
                             tmp_path / 'slow.log', heartbeat_s=0.2)
    assert started[0].poll() is not None


def test_disk_check_stops_before_touching_anything(tmp_path):
    setup_env = load_setup_env()
    with pytest.raises(setup_env.StepFailed, match='only .* GiB is free. Nothing was changed'):
        setup_env.check_disk(tmp_path / 'venv', 10**9, 'a new environment')


def test_wrong_python_is_refused(monkeypatch):
    setup_env = load_setup_env()
    monkeypatch.setattr(setup_env, 'REQUIRED_PYTHON', (2, 7))
    with pytest.raises(setup_env.StepFailed, match='Python 2.7 is required'):
        setup_env.check_python()


def test_shell_entry_reports_missing_python(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path), LINVIT_PYTHON='')
    proc = subprocess.run(['/bin/bash', str(REPO / 'tools' / 'setup_env.sh')], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert 'no Python 3.11 found' in proc.stderr


def test_stamps_change_with_requirements(tmp_path, monkeypatch):
    setup_env = load_setup_env()
    req = tmp_path / 'runtime.txt'
    req.write_text('timm\n')
    first = setup_env.sha256_of(req)
    req.write_text('timm\nscipy\n')
    assert setup_env.sha256_of(req) != first


@pytest.mark.slow
@pytest.mark.skipif(not (REPO / '.venv' / '.linvit_stamps').is_dir(),
                    reason='needs the environment built by tools/setup_env.sh')
def test_second_run_reuses_the_environment():
    started = time.time()
    proc = subprocess.run(['bash', str(REPO / 'tools' / 'setup_env.sh')], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    elapsed = time.time() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    for step in ('build', 'torch', 'mmcv', 'openmmlab', 'project'):
        assert f'{step}: up to date' in proc.stdout
    assert elapsed < 60


def test_mmcv_ops_are_the_kept_list_unless_all_are_asked_for(monkeypatch):
    setup_env = load_setup_env()
    monkeypatch.delenv('LINVIT_MMCV_OPS', raising=False)
    kept = setup_env.mmcv_subset.read_kept_ops(REPO / 'requirements' / 'mmcv_ops.txt')
    assert setup_env.mmcv_ops_selection() == tuple(sorted(kept))
    monkeypatch.setenv('LINVIT_MMCV_OPS', 'all')
    assert setup_env.mmcv_ops_selection() is None
    monkeypatch.setenv('LINVIT_MMCV_OPS', 'nms')
    with pytest.raises(setup_env.StepFailed, match='LINVIT_MMCV_OPS=.nms.: the only value'):
        setup_env.mmcv_ops_selection()
