"""Resuming after a failure: at a scaled learning rate (--resume-lr-scale), and from a work dir
whose last_checkpoint a kill left empty."""
import contextlib
import importlib.util
import io
import uuid
from pathlib import Path

import pytest

from linvit_mm.engine.hooks import ResumeLRScaleHook
from linvit_mm.engine.launch import repair_last_checkpoint
from linvit_mm.utils.checkpoint import load_checkpoint_file

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / 'tests' / 'data' / 'configs' / 'tiny_cls_mini.py'
spec = importlib.util.spec_from_file_location('resume_repairs_train', REPO / 'tools' / 'train.py')
TRAIN = importlib.util.module_from_spec(spec)
spec.loader.exec_module(TRAIN)


def train(work_dir, mini_data_root, *extra, iters):
    root = mini_data_root / 'imagenet'
    options = [f'{loader}.dataset.data_root={root}' for loader in (
        'train_dataloader', 'val_dataloader', 'test_dataloader')]
    stream = io.StringIO()
    with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
        TRAIN.main([str(TINY_CONFIG), '--work-dir', str(work_dir), '--no-validate', *extra,
                    '--cfg-options', *options, f'train_cfg.max_iters={iters}',
                    f'experiment_name=resume_{uuid.uuid4().hex[:12]}'])
    return stream.getvalue()


def learning_rate(checkpoint):
    return load_checkpoint_file(checkpoint)['optimizer']['param_groups'][0]['lr']


@pytest.fixture(scope='module')
def two_iterations(tmp_path_factory, mini_data_root):
    work_dir = tmp_path_factory.mktemp('run')
    train(work_dir, mini_data_root, iters=2)
    return work_dir


def test_resume_lr_scale_continues_at_the_scaled_rate(two_iterations, mini_data_root,
                                                      tmp_path):
    checkpoint = two_iterations / 'iter_2.pth'
    assert learning_rate(checkpoint) == pytest.approx(1e-3)
    # the config's rate does not reach a resumed run: the restored one wins
    train(tmp_path / 'plain', mini_data_root, '--resume', str(checkpoint),
          '--cfg-options', 'optim_wrapper.optimizer.lr=1e-5', iters=3)
    assert learning_rate(tmp_path / 'plain' / 'iter_3.pth') == pytest.approx(1e-3)
    log = train(tmp_path / 'scaled', mini_data_root, '--resume', str(checkpoint),
                '--resume-lr-scale', '0.25', iters=4)
    assert 'resumed learning rate 0.001 scaled by 0.25' in log
    assert learning_rate(tmp_path / 'scaled' / 'iter_3.pth') == pytest.approx(2.5e-4)
    assert learning_rate(tmp_path / 'scaled' / 'iter_4.pth') == pytest.approx(2.5e-4)


@pytest.mark.parametrize('argv, message', [
    (['--resume-lr-scale', '0.5'], 'give --resume too'),
    (['--resume', '--resume-lr-scale', '0'], 'must be a finite number > 0, got 0.0'),
    (['--resume', '--resume-lr-scale', 'nan'], 'must be a finite number > 0, got nan'),
])
def test_resume_lr_scale_mistakes_are_refused_before_anything_runs(argv, message, capsys):
    with pytest.raises(SystemExit):
        TRAIN.parse_args([str(TINY_CONFIG), *argv])
    assert message in capsys.readouterr().err


def test_the_hook_refuses_a_run_that_does_not_resume():
    with pytest.raises(ValueError, match='scale must be a finite number > 0'):
        ResumeLRScaleHook(-1)

    class Runner:
        _resume = False

    with pytest.raises(ValueError, match='this run does not resume'):
        ResumeLRScaleHook(0.5).before_train(Runner())


@pytest.mark.parametrize('content', ['', '/nowhere/iter_9.pth'], ids=['empty', 'gone'])
def test_a_broken_last_checkpoint_names_the_newest_checkpoint(tmp_path, content):
    for name in ('iter_2.pth', 'iter_10.pth', 'iter_9.pth', 'best_acc_iter_11.pth'):
        (tmp_path / name).write_bytes(b'x')
    (tmp_path / 'last_checkpoint').write_text(content)
    note = repair_last_checkpoint(str(tmp_path))
    assert 'it now names the newest checkpoint of the work dir' in note
    assert (tmp_path / 'last_checkpoint').read_text() == str(tmp_path / 'iter_10.pth')
    assert repair_last_checkpoint(str(tmp_path)) is None  # sound now: left alone
    assert not list(tmp_path.glob('.last_checkpoint*'))  # no temporary file left


def test_a_broken_last_checkpoint_without_checkpoints_is_removed(tmp_path):
    (tmp_path / 'last_checkpoint').write_text('')
    assert 'holds no checkpoint: removed it' in repair_last_checkpoint(str(tmp_path))
    assert not (tmp_path / 'last_checkpoint').exists()
    assert repair_last_checkpoint(str(tmp_path / 'absent')) is None


def test_resume_after_a_kill_that_emptied_last_checkpoint(two_iterations, mini_data_root,
                                                          tmp_path):
    import shutil
    work_dir = tmp_path / 'run'
    shutil.copytree(two_iterations, work_dir)
    (work_dir / 'last_checkpoint').write_text('')
    log = train(work_dir, mini_data_root, '--resume', iters=3)
    assert 'is empty (the run was stopped while writing it)' in log
    assert (work_dir / 'iter_3.pth').is_file()
    assert load_checkpoint_file(work_dir / 'iter_3.pth')['meta']['iter'] == 3
