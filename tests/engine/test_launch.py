"""The training safeguards tools/train.py gives every config (linvit_mm.engine.launch)."""
from pathlib import Path

import pytest
from mmengine.config import Config

from linvit_mm.engine.launch import add_training_safeguards

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / 'tests' / 'data' / 'configs' / 'tiny_cls_mini.py'
ATOMIC = dict(backend='atomic_local')
RECORD = dict(type='ModelRecordHook')


def config(**fields):
    return Config(dict(work_dir='work_dirs/run', **fields))


def test_a_config_without_them_gets_them_and_the_log_says_so():
    cfg = Config.fromfile(str(TINY_CONFIG))
    cfg.work_dir = 'work_dirs/tiny'
    notes = add_training_safeguards(cfg)
    assert cfg.default_hooks.check_loss == dict(type='FiniteLossHook')
    assert cfg.default_hooks.record_model == RECORD
    checkpoint = cfg.default_hooks.checkpoint
    assert checkpoint.backend_args == ATOMIC and checkpoint.interval == 1  # the rest is kept
    assert cfg.default_hooks.logger.interval == 1
    assert len(notes) == 3
    assert 'added default_hooks.check_loss' in notes[0] and 'NaN or infinite loss' in notes[0]
    assert 'added default_hooks.record_model' in notes[1] and 'LinearViTs' in notes[1]
    assert 'checkpoints written atomically' in notes[2]


@pytest.mark.parametrize('hooks', [
    dict(custom_hooks=[dict(type='StagedRecordHook')]),
    dict(custom_hooks=[dict(type='linvit_mm.ModelRecordHook')]),
    dict(default_hooks=dict(record_model=None)),
], ids=['staged-record-hook', 'own-record-hook', 'switched-off'])
def test_a_record_hook_is_added_only_where_none_is(hooks):
    cfg = config(**hooks)
    add_training_safeguards(cfg)
    assert cfg.default_hooks.get('record_model') is None


def test_what_a_config_sets_itself_is_kept():
    checkpoint = dict(type='CheckpointHook', interval=5, backend_args=dict(backend='local'))
    cfg = config(default_hooks=dict(checkpoint=checkpoint),
                 custom_hooks=[dict(type='linvit_mm.FiniteLossHook')])
    assert [note.split('=')[0] for note in add_training_safeguards(cfg)] == [
        'added default_hooks.record_model']
    assert 'check_loss' not in cfg.default_hooks
    assert cfg.default_hooks.checkpoint == checkpoint


def test_switched_off_deliberately_stays_off():
    cfg = config(default_hooks=dict(check_loss=None, checkpoint=None, record_model=None))
    notes = add_training_safeguards(cfg)
    assert cfg.default_hooks == dict(check_loss=None, checkpoint=None, record_model=None)
    assert notes == ['finite-loss check switched off by the config '
                     '(default_hooks.check_loss=None)']


def test_built_hook_objects_are_left_as_they_are():
    from mmengine.hooks import CheckpointHook

    from linvit_mm.engine import FiniteLossHook
    checkpoint, check = CheckpointHook(interval=2), FiniteLossHook()
    cfg = config(default_hooks=dict(checkpoint=checkpoint, record_model=None),
                 custom_hooks=[check])
    assert add_training_safeguards(cfg) == []
    assert cfg.default_hooks.checkpoint is checkpoint and checkpoint.backend_args is None


def test_no_default_hooks_at_all():
    cfg = config()
    add_training_safeguards(cfg)
    # mmengine's own default checkpoint hook, with the atomic backend
    assert cfg.default_hooks == dict(
        check_loss=dict(type='FiniteLossHook'), record_model=RECORD,
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


# One leaf config per folder: a folder's configs share their recipe, runtime included.
LEAVES = sorted(p for p in (REPO / 'configs').rglob('*.py') if '_base_' not in p.parts)
ONE_PER_FOLDER = sorted({path.parent: path for path in reversed(LEAVES)}.values())


@pytest.mark.parametrize('path', ONE_PER_FOLDER, ids=lambda p: str(p.relative_to(REPO)))
def test_project_configs_train_with_both(path):
    cfg = Config.fromfile(str(path))
    cfg.work_dir = 'work_dirs/run'
    add_training_safeguards(cfg)
    assert cfg.default_hooks.check_loss == dict(type='FiniteLossHook')
    assert cfg.default_hooks.checkpoint.backend_args == ATOMIC
    hooks = [*cfg.default_hooks.values(), *(cfg.get('custom_hooks') or [])]
    assert any(hook and hook['type'] in ('ModelRecordHook', 'StagedRecordHook')
               for hook in hooks)


def test_the_demo_runtime_has_both_itself():
    cfg = Config.fromfile(str(REPO / 'configs' / 'demo' / '_base_' / 'schedule_runtime_mini.py'))
    assert cfg.default_hooks.check_loss == dict(type='FiniteLossHook')
    assert cfg.default_hooks.checkpoint.backend_args == ATOMIC
    assert [note.split('=')[0] for note in add_training_safeguards(cfg)] == [
        'added default_hooks.record_model']


# ---------------------------------------------------------------------------- CPU strategies
@pytest.mark.parametrize('strategy, key, value', [
    (dict(type='FSDPStrategy'), 'device_id', 'cpu'),
    (dict(type='ParamGroupFSDPStrategy', model_wrapper=dict(use_orig_params=True)),
     'device_id', 'cpu'),
    (dict(type='DDPStrategy'), 'device_ids', None),
], ids=['fsdp', 'fsdp-subclass', 'ddp'])
def test_a_flexible_runner_strategy_runs_on_cpu_processes(strategy, key, value):
    """mmengine gives the wrapper the local rank, a CUDA index; on CPU it gets the CPU."""
    from linvit_mm.engine.launch import _cpu_strategy
    strategy = Config(dict(strategy=strategy)).strategy
    note = _cpu_strategy(strategy)
    assert strategy.model_wrapper[key] == value and strategy.type in note
    assert strategy.model_wrapper.get('use_orig_params', True)  # the rest is kept


def test_a_strategy_without_a_cpu_path_is_refused():
    from linvit_mm.engine.launch import _cpu_strategy
    with pytest.raises(RuntimeError, match='DeepSpeedStrategy strategy has no CPU path'):
        _cpu_strategy(Config(dict(strategy=dict(type='DeepSpeedStrategy'))).strategy)
