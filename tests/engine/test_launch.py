"""The training safeguards tools/train.py gives every config (linvit_mm.engine.launch)."""
from pathlib import Path

import pytest
from mmengine.config import Config

from linvit_mm.engine.launch import add_training_safeguards

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / 'tests' / 'data' / 'configs' / 'tiny_cls_mini.py'
ATOMIC = dict(backend='atomic_local')


def config(**fields):
    return Config(dict(work_dir='work_dirs/run', **fields))


def test_a_config_without_them_gets_both_and_the_log_says_so():
    cfg = Config.fromfile(str(TINY_CONFIG))
    cfg.work_dir = 'work_dirs/tiny'
    notes = add_training_safeguards(cfg)
    assert cfg.default_hooks.check_loss == dict(type='FiniteLossHook')
    checkpoint = cfg.default_hooks.checkpoint
    assert checkpoint.backend_args == ATOMIC and checkpoint.interval == 1  # the rest is kept
    assert cfg.default_hooks.logger.interval == 1
    assert len(notes) == 2
    assert 'added default_hooks.check_loss' in notes[0] and 'NaN or infinite loss' in notes[0]
    assert 'checkpoints written atomically' in notes[1]


def test_what_a_config_sets_itself_is_kept():
    checkpoint = dict(type='CheckpointHook', interval=5, backend_args=dict(backend='local'))
    cfg = config(default_hooks=dict(checkpoint=checkpoint),
                 custom_hooks=[dict(type='linvit_mm.FiniteLossHook')])
    assert add_training_safeguards(cfg) == []
    assert 'check_loss' not in cfg.default_hooks
    assert cfg.default_hooks.checkpoint == checkpoint


def test_switched_off_deliberately_stays_off():
    cfg = config(default_hooks=dict(check_loss=None, checkpoint=None))
    notes = add_training_safeguards(cfg)
    assert cfg.default_hooks == dict(check_loss=None, checkpoint=None)
    assert notes == ['finite-loss check switched off by the config '
                     '(default_hooks.check_loss=None)']


def test_no_default_hooks_at_all():
    cfg = config()
    add_training_safeguards(cfg)
    # mmengine's own default checkpoint hook, with the atomic backend
    assert cfg.default_hooks == dict(
        check_loss=dict(type='FiniteLossHook'),
        checkpoint=dict(type='CheckpointHook', interval=1, backend_args=ATOMIC))


@pytest.mark.parametrize('checkpoint, work_dir', [
    (dict(type='CheckpointHook', out_dir='s3://bucket/runs'), 'work_dirs/run'),
    (dict(type='CheckpointHook'), 's3://bucket/runs/run'),
    (dict(type='CheckpointHook', file_client_args=dict(backend='disk')), 'work_dirs/run'),
])
def test_checkpoints_that_do_not_go_to_a_local_directory_keep_their_backend(checkpoint,
                                                                            work_dir):
    cfg = config(default_hooks=dict(checkpoint=dict(checkpoint)))
    cfg.work_dir = work_dir
    add_training_safeguards(cfg)
    assert cfg.default_hooks.checkpoint == checkpoint


@pytest.mark.parametrize('path', [
    # One config per runtime the project's configs end in: mmpretrain's, mmdet's (a leaf
    # overriding its hooks too), mmseg's and the demo's own, which has the safeguards itself.
    'classification/imagenet/linvit-relu-small_mlpcopy-distill_32xb128_in1k.py',
    'classification/robustness/linvit-elu-small_mlpcopy-distill_32xb128_in1k-a.py',
    'detection/mask-rcnn_linvit-adapter-ttt-tiny_fpn_1x_coco.py',
    'demo/mask-rcnn_linvit-adapter-relu-mini_fpn_mini-coco.py',
    'segmentation/upernet_linvit-adapter-mhla-base_8xb2-160k_ade20k-512x512.py',
    'demo/linvit-relu-mini_mlpcopy-distill_1xb24_mini-groups.py',
])
def test_project_configs_train_with_both(path):
    cfg = Config.fromfile(str(REPO / 'configs' / path))
    cfg.work_dir = 'work_dirs/run'
    notes = add_training_safeguards(cfg)
    assert cfg.default_hooks.check_loss == dict(type='FiniteLossHook')
    assert cfg.default_hooks.checkpoint.backend_args == ATOMIC
    assert (notes == []) == path.startswith('demo/linvit')
