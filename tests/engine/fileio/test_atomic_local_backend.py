"""AtomicLocalBackend: a checkpoint save killed midway leaves no partial ``*.pth``."""
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from mmengine.config import Config
from mmengine.fileio import LocalBackend, get_file_backend
from mmengine.runner import Runner

import linvit_mm.engine  # noqa: F401  (registers 'atomic_local')
from linvit_mm.engine import AtomicLocalBackend

REPO = Path(__file__).resolve().parents[3]
TINY_CONFIG = REPO / 'tests' / 'data' / 'configs' / 'tiny_cls_mini.py'
ATOMIC = dict(backend='atomic_local')

# Saves a checkpoint the way CheckpointHook does (mmengine's save_checkpoint with the hook's
# backend_args) and stalls at STALL_AT, so that the test can SIGKILL it there: 'write' after
# half the bytes of the file are on disk, 'rename' with the whole temporary file written.
SAVE_AND_STALL = textwrap.dedent('''
    import builtins, os, sys, time
    import torch
    import linvit_mm.engine  # noqa: F401
    from mmengine.runner.checkpoint import save_checkpoint

    target, backend, stall_at, ready = sys.argv[1:]
    real_open = builtins.open

    def stall():
        real_open(ready, 'w').close()
        time.sleep(600)

    class HalfThenStall:
        def __init__(self, file):
            self.file = file
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return self.file.__exit__(*exc)
        def __getattr__(self, name):
            return getattr(self.file, name)
        def write(self, data):
            self.file.write(data[:len(data) // 2])
            self.file.flush()
            os.fsync(self.file.fileno())
            stall()

    def open_stalling(file, mode='r', *args, **kwargs):
        opened = real_open(file, mode, *args, **kwargs)
        in_run_dir = os.path.dirname(os.path.abspath(file)) == os.path.dirname(target)
        return HalfThenStall(opened) if in_run_dir and mode in ('wb', 'xb') else opened

    if stall_at == 'write':
        builtins.open = open_stalling
    else:
        os.replace = lambda src, dst: stall()
    state = dict(state_dict=dict(weight=torch.arange(1 << 20, dtype=torch.float32)),
                 meta=dict(iter=3))
    save_checkpoint(state, target, backend_args=dict(backend=backend))
    ''')


def kill_while_saving(target, backend, stall_at, tmp_path):
    ready = tmp_path / 'ready'
    proc = subprocess.Popen([sys.executable, '-c', SAVE_AND_STALL, str(target), backend,
                             stall_at, str(ready)], cwd=REPO, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, 'the save never reached the stall point'
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    ready.unlink()


def load(path):
    return torch.load(path, map_location='cpu', weights_only=False)


@pytest.fixture
def run_dir(tmp_path):
    """A work dir holding one complete checkpoint, ``iter_2.pth``."""
    run_dir = tmp_path / 'run'
    run_dir.mkdir()
    torch.save(dict(state_dict=dict(weight=torch.zeros(4)), meta=dict(iter=2)),
               run_dir / 'iter_2.pth')
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize('stall_at, name', [
    ('write', 'iter_3.pth'),   # a new checkpoint, killed with half its bytes written
    ('write', 'iter_2.pth'),   # an existing one being overwritten (a resumed run)
    ('rename', 'iter_3.pth'),  # killed between the complete temporary file and the rename
])
def test_killed_save_leaves_only_complete_checkpoints(run_dir, tmp_path, stall_at, name):
    kill_while_saving(run_dir / name, 'atomic_local', stall_at, tmp_path)
    visible = sorted(p.name for p in run_dir.iterdir() if not p.name.startswith('.'))
    assert visible == ['iter_2.pth']
    assert load(run_dir / 'iter_2.pth')['meta'] == dict(iter=2)  # the old one, untouched
    leftovers = [p.name for p in run_dir.iterdir() if p.name.startswith('.')]
    assert len(leftovers) == 1 and leftovers[0].startswith(f'.{name}.')
    assert leftovers[0].endswith('.tmp')


@pytest.mark.slow
def test_the_kill_lands_mid_write(run_dir, tmp_path):
    """The same kill with mmengine's own local backend leaves a truncated checkpoint."""
    kill_while_saving(run_dir / 'iter_3.pth', 'local', 'write', tmp_path)
    with pytest.raises(Exception):
        load(run_dir / 'iter_3.pth')


def test_writes_whole_files_with_the_usual_permissions(tmp_path):
    backend = get_file_backend(str(tmp_path), backend_args=ATOMIC)
    assert isinstance(backend, AtomicLocalBackend)
    backend.put(b'\x00checkpoint', tmp_path / 'sub' / 'iter_1.pth')
    backend.put_text('work_dirs/run/iter_1.pth', str(tmp_path / 'last_checkpoint'))
    backend.put_text('replaced', str(tmp_path / 'last_checkpoint'))
    LocalBackend().put(b'plain', tmp_path / 'plain.pth')
    assert (tmp_path / 'sub' / 'iter_1.pth').read_bytes() == b'\x00checkpoint'
    assert (tmp_path / 'last_checkpoint').read_text() == 'replaced'
    assert sorted(p.name for p in tmp_path.rglob('*')) == [
        'iter_1.pth', 'last_checkpoint', 'plain.pth', 'sub']
    mode = stat.S_IMODE((tmp_path / 'plain.pth').stat().st_mode)
    assert stat.S_IMODE((tmp_path / 'sub' / 'iter_1.pth').stat().st_mode) == mode


def test_a_failed_write_removes_its_temporary_file(tmp_path, monkeypatch):
    (tmp_path / 'iter_1.pth').write_bytes(b'old')

    def no_space(src, dst):
        raise OSError(28, 'No space left on device')

    monkeypatch.setattr(os, 'replace', no_space)
    with pytest.raises(OSError, match='No space left'):
        AtomicLocalBackend().put(b'new', tmp_path / 'iter_1.pth')
    assert [p.name for p in tmp_path.iterdir()] == ['iter_1.pth']
    assert (tmp_path / 'iter_1.pth').read_bytes() == b'old'


@pytest.mark.slow
def test_runner_saves_prunes_and_resumes_through_it(tmp_path, mini_data_root):
    def cfg(max_iters):
        cfg = Config.fromfile(str(TINY_CONFIG))
        for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
            cfg[loader].dataset.data_root = str(mini_data_root / 'imagenet')
        cfg.work_dir = str(tmp_path)
        cfg.train_cfg.update(max_iters=max_iters, val_interval=100)
        cfg.default_hooks.checkpoint = dict(type='CheckpointHook', interval=1, by_epoch=False,
                                            max_keep_ckpts=2, backend_args=ATOMIC)
        return cfg

    Runner.from_cfg(cfg(3)).train()
    assert sorted(p.name for p in tmp_path.glob('*.pth')) == ['iter_2.pth', 'iter_3.pth']
    assert (tmp_path / 'last_checkpoint').read_text() == str(tmp_path / 'iter_3.pth')
    resumed = cfg(4)
    resumed.resume = True
    runner = Runner.from_cfg(resumed)
    runner.train()
    assert runner.iter == 4 and load(tmp_path / 'iter_4.pth')['meta']['iter'] == 4
    assert not [p for p in tmp_path.iterdir() if p.name.endswith('.tmp')]
