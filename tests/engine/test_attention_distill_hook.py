"""AttentionDistillHook with the real mmengine Runner on the generated mini ImageNet set."""
import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.runner import Runner

import linvit_mm.engine  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / 'tests' / 'data' / 'configs' / 'tiny_cls_mini.py'
ARCH = dict(embed_dims=32, num_layers=2, num_heads=2, feedforward_channels=64)


class RecordLosses(Hook):
    """Keeps every iteration's log_vars, and the input the student backbone saw."""

    priority = 'LOWEST'

    def __init__(self):
        self.losses = []
        self.student_inputs = []
        self.teacher_inputs = []
        self.unmixed_inputs = []

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        preprocessor = runner.model.data_preprocessor
        self.unmixed_inputs.append(preprocessor(data_batch, training=False)['inputs'])

    def before_train(self, runner):
        runner.model.backbone.register_forward_pre_hook(
            lambda module, args: self.student_inputs.append(args[0].detach().clone())
            if module.training else None)
        # The distillation hook (priority NORMAL) has built its teacher by now.
        distill = [h for h in runner.hooks if type(h).__name__ == 'AttentionDistillHook']
        if distill:
            distill[0].teacher.register_forward_pre_hook(
                lambda module, args: self.teacher_inputs.append(args[0].detach().clone()))

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self.losses.append({k: float(v) for k, v in outputs.items()})


def teacher_cfg(ckpt, attn_type='softmax', **overrides):
    """The tiny Softmax teacher; ``ckpt=None``: randomly initialised (shapes may differ)."""
    cfg = dict(type='LinearViT', arch=ARCH, attn_type=attn_type, img_size=32, patch_size=8)
    if ckpt is not None:
        cfg['init_cfg'] = dict(type='Pretrained', checkpoint=str(ckpt))
    cfg.update(overrides)
    return cfg


def make_cfg(work_dir, mini_data_root, ckpt, attn_type='softmax', student_from_teacher=False,
             max_iters=2, **hook_kwargs):
    cfg = Config.fromfile(str(TINY_CONFIG))
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        cfg[loader].dataset.data_root = str(mini_data_root / 'imagenet')
    cfg.work_dir = str(work_dir)
    cfg.model.backbone.attn_type = attn_type
    if student_from_teacher:
        cfg.model.backbone.init_cfg = dict(type='Pretrained', checkpoint=str(ckpt))
    cfg.train_cfg.max_iters = max_iters
    cfg.train_cfg.val_interval = max_iters
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', interval=max_iters,
                                        by_epoch=False)
    hook = dict(type='AttentionDistillHook', teacher=teacher_cfg(ckpt), loss_weight=50.0)
    hook.update(hook_kwargs)
    cfg.custom_hooks = [hook]
    return cfg


def run(cfg, extra_hooks=()):
    runner = Runner.from_cfg(cfg)
    recorder = RecordLosses()
    runner.register_hook(recorder)
    for hook in extra_hooks:
        runner.register_hook(hook)
    runner.train()
    return runner, recorder


def distill_hook(runner):
    return next(h for h in runner.hooks if type(h).__name__ == 'AttentionDistillHook')


def test_student_equal_to_teacher_has_zero_loss_then_positive(tmp_path, mini_data_root,
                                                              teacher_ckpt):
    cfg = make_cfg(tmp_path, mini_data_root, teacher_ckpt, student_from_teacher=True)
    cfg.optim_wrapper.optimizer.lr = 1e-2
    _, recorder = run(cfg)
    first, second = recorder.losses
    assert first['loss_distill'] == 0.0
    assert second['loss_distill'] > 0.0
    # parse_losses sums it into the total loss, logged beside the task loss
    assert second['loss'] == pytest.approx(second['loss_distill'] + second['loss_task'])


def test_distillation_alone_drives_the_loss_down(tmp_path, mini_data_root, teacher_ckpt):
    # The teacher's weights in a relu student: the operator swap perturbs every block.
    cfg = make_cfg(tmp_path, mini_data_root, teacher_ckpt, attn_type='relu',
                   student_from_teacher=True, max_iters=12)
    cfg.model.head.loss = dict(type='CrossEntropyLoss', loss_weight=0.0)
    cfg.optim_wrapper.optimizer.lr = 1e-3
    _, recorder = run(cfg)
    distill = [loss['loss_distill'] for loss in recorder.losses]
    assert distill[0] > 0
    # batches differ from step to step: compare the first and last four steps
    assert sum(distill[-4:]) < 0.6 * sum(distill[:4]), distill


def test_teacher_frozen_and_never_saved(tmp_path, mini_data_root, teacher_ckpt):
    cfg = make_cfg(tmp_path, mini_data_root, teacher_ckpt, attn_type='relu', max_iters=3)
    cfg.custom_hooks.append(dict(type='EMAHook', momentum=0.5, priority='ABOVE_NORMAL'))
    snapshot = {}

    class Snapshot(Hook):
        priority = 'HIGHEST'

        def before_train_iter(self, runner, batch_idx, data_batch=None):
            if not snapshot:
                snapshot.update(copy.deepcopy(distill_hook(runner).teacher.state_dict()))

        def after_train(self, runner):
            teacher = distill_hook(runner).teacher
            snapshot['after'] = copy.deepcopy(teacher.state_dict())
            snapshot['training'] = teacher.training
            snapshot['in_optimizer'] = any(
                p is q for group in runner.optim_wrapper.optimizer.param_groups
                for p in group['params'] for q in teacher.parameters())

    runner, recorder = run(cfg, extra_hooks=[Snapshot()])
    after = snapshot.pop('after')
    assert not snapshot.pop('training') and not snapshot.pop('in_optimizer')
    for name, value in snapshot.items():
        assert torch.equal(after[name], value), name
    assert all('loss_distill' in loss for loss in recorder.losses)

    ckpt = torch.load(tmp_path / 'iter_3.pth', map_location='cpu', weights_only=False)
    student_keys = set(runner.model.state_dict())
    assert set(ckpt['state_dict']) == student_keys
    assert not any('teacher' in key for key in ckpt['state_dict'])
    ema_keys = {k[len('module.'):] for k in ckpt['ema_state_dict'] if k.startswith('module.')}
    assert ema_keys == student_keys


def test_resume_rebuilds_the_teacher(tmp_path, mini_data_root, teacher_ckpt):
    run(make_cfg(tmp_path, mini_data_root, teacher_ckpt, attn_type='relu'))
    cfg = make_cfg(tmp_path, mini_data_root, teacher_ckpt, attn_type='relu', max_iters=3)
    cfg.resume = True
    runner, recorder = run(cfg)
    assert len(recorder.losses) == 1 and recorder.losses[0]['loss_distill'] > 0
    assert distill_hook(runner).teacher is None  # released after training


def test_teacher_sees_the_mixed_batch(tmp_path, mini_data_root, teacher_ckpt):
    cfg = make_cfg(tmp_path, mini_data_root, teacher_ckpt, attn_type='relu')
    cfg.model.train_cfg = dict(augments=dict(type='Mixup', alpha=0.8))
    held = []

    class HeldTensors(Hook):
        priority = 'LOWEST'

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            hook = distill_hook(runner)
            held.extend(name for name, value in vars(hook).items() if torch.is_tensor(value))
            held.extend(f'recorded {name}' for rec in (hook._student_rec, hook._teacher_rec)
                        for name in ('outputs', 'maps') if getattr(rec, name))

    _, recorder = run(cfg, extra_hooks=[HeldTensors()])
    assert not held  # no batch, output or map outlives its iteration
    assert len(recorder.teacher_inputs) == 2
    for student_input, teacher_input, unmixed in zip(
            recorder.student_inputs, recorder.teacher_inputs, recorder.unmixed_inputs):
        assert torch.equal(student_input, teacher_input)
        assert teacher_input.shape == unmixed.shape
        assert not torch.allclose(teacher_input, unmixed)


@pytest.mark.parametrize('attn_type', ['relu', 'elu', 'inline'])
def test_map_target(tmp_path, mini_data_root, teacher_ckpt, attn_type):
    cfg = make_cfg(tmp_path, mini_data_root, teacher_ckpt, attn_type=attn_type, target='map',
                   max_iters=1)
    _, recorder = run(cfg)
    assert recorder.losses[0]['loss_distill'] > 0


@pytest.mark.parametrize('attn_type', ['mhla', 'ttt'])
def test_map_target_refused_without_a_map(tmp_path, mini_data_root, teacher_ckpt, attn_type):
    cfg = make_cfg(tmp_path, mini_data_root, teacher_ckpt, attn_type=attn_type, target='map',
                   max_iters=1)
    with pytest.raises(ValueError, match=f"target='map' needs attention maps.*{attn_type}"):
        run(cfg)


@pytest.mark.parametrize('attn_type', ['mhla', 'ttt'])
def test_students_without_class_token_match_patch_tokens(tmp_path, mini_data_root,
                                                         teacher_ckpt, attn_type):
    cfg = make_cfg(tmp_path, mini_data_root, teacher_ckpt, attn_type=attn_type, max_iters=1)
    runner, recorder = run(cfg)
    assert distill_hook(runner).patch_tokens_only
    assert recorder.losses[0]['loss_distill'] > 0


def test_stop_iter_and_layer_selection(tmp_path, mini_data_root, teacher_ckpt):
    cfg = make_cfg(tmp_path, mini_data_root, teacher_ckpt, attn_type='relu', max_iters=3,
                   stop_iter=2, layers=[1])
    runner, recorder = run(cfg)
    assert ['loss_distill' in loss for loss in recorder.losses] == [True, True, False]
    assert distill_hook(runner).layers == [1]


def test_amp_with_distillation(tmp_path, mini_data_root, teacher_ckpt):
    cfg = make_cfg(tmp_path, mini_data_root, teacher_ckpt, attn_type='relu')
    cfg.optim_wrapper.type = 'CPUAmpOptimWrapper'
    _, recorder = run(cfg)
    assert all(torch.isfinite(torch.tensor(loss['loss_distill'])) for loss in recorder.losses)


def test_validation_costs_no_teacher_forward(tmp_path, mini_data_root, teacher_ckpt):
    calls = []

    class CountTeacherCalls(Hook):
        priority = 'LOWEST'

        def before_train(self, runner):
            distill_hook(runner).teacher.register_forward_hook(
                lambda *args: calls.append(runner.iter))

        def before_val(self, runner):
            calls.append('val')

    cfg = make_cfg(tmp_path, mini_data_root, teacher_ckpt, attn_type='relu')
    run(cfg, extra_hooks=[CountTeacherCalls()])
    assert calls == [0, 1, 'val']


def test_bad_configuration_is_refused(teacher_ckpt):
    from linvit_mm.engine import AttentionDistillHook
    with pytest.raises(ValueError, match='unknown distillation target'):
        AttentionDistillHook(teacher=teacher_cfg(teacher_ckpt), target='logits')
    with pytest.raises(TypeError, match='model config dict'):
        AttentionDistillHook(teacher='deit_small.pth')


@pytest.mark.parametrize('loss_weight, error, message', [
    (float('nan'), ValueError, 'finite number >= 0.*nan'),
    (float('inf'), ValueError, 'finite number >= 0.*inf'),
    (-1.0, ValueError, 'finite number >= 0.*-1.0'),
    ('50', TypeError, "must be a number.*'50' of type str"),
    (None, TypeError, 'must be a number.*None'),
    (True, TypeError, 'must be a number.*True'),
])
def test_loss_weight_must_be_a_finite_non_negative_number(teacher_ckpt, loss_weight, error,
                                                          message):
    from linvit_mm.engine import AttentionDistillHook
    with pytest.raises(error, match=message):
        AttentionDistillHook(teacher=teacher_cfg(teacher_ckpt), loss_weight=loss_weight)


def test_loss_weight_zero_and_integers_are_accepted(teacher_ckpt):
    from linvit_mm.engine import AttentionDistillHook
    assert AttentionDistillHook(teacher=teacher_cfg(teacher_ckpt), loss_weight=0).loss_weight == 0
    assert AttentionDistillHook(teacher=teacher_cfg(teacher_ckpt), loss_weight=50).loss_weight == 50


@pytest.mark.parametrize('kwargs, error, message', [
    (dict(layers=[]), ValueError, r'layers=\[\] selects no block.*leave layers unset'),
    (dict(layers='01'), TypeError, 'list of block indices'),
    (dict(layers=[0, 1.0]), TypeError, r'block indices \(ints\), got \[1.0\]'),
    (dict(stop_iter=-1), ValueError, 'stop_iter must be None .* or an int >= 0.*got -1'),
    (dict(stop_iter=2.5), ValueError, 'stop_iter must be .*got 2.5'),
    (dict(stop_iter='2'), ValueError, "stop_iter must be .*got '2'"),
    (dict(stop_epoch=-3), ValueError, 'stop_epoch must be None .* or an int >= 0.*got -3'),
    (dict(stop_epoch=True), ValueError, 'stop_epoch must be .*got True'),
    (dict(patch_tokens_only='yes'), TypeError, 'patch_tokens_only must be None'),
    (dict(allow_non_softmax_teacher='yes'), TypeError, 'allow_non_softmax_teacher must be'),
    (dict(student=''), TypeError, 'student must be the path of a module'),
])
def test_bad_arguments_are_refused_at_construction(teacher_ckpt, kwargs, error, message):
    from linvit_mm.engine import AttentionDistillHook
    with pytest.raises(error, match=message):
        AttentionDistillHook(teacher=teacher_cfg(teacher_ckpt), **kwargs)


class CountIterations(Hook):
    priority = 'LOWEST'

    def __init__(self):
        self.count = 0

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self.count += 1


@pytest.mark.parametrize('attn_type, teacher, hook_kwargs, message', [
    ('relu', dict(arch=dict(ARCH, embed_dims=64, feedforward_channels=128)), {},
     r"teacher's width \(embed_dims\) differs.*block 0: 32 vs 64; block 1: 32 vs 64"),
    ('relu', dict(arch=dict(ARCH, num_heads=4)), dict(layers=[1]),
     r"teacher's head count \(num_heads\) differs.*\(student vs teacher: block 1: 2 vs 4\)"),
    ('relu', dict(patch_size=16), {},
     r'teacher cuts \(16, 16\) patches, the student \(8, 8\).*patch_size'),
    ('relu', dict(attn_type='relu'), {},
     r"teacher's attention is \['relu'\], not Softmax.*allow_non_softmax_teacher=True"),
    ('relu', dict(attn_type='ttt'), dict(target='map', allow_non_softmax_teacher=True),
     r"target='map' needs attention maps, which the \['ttt'\] operator\(s\) of the teacher"),
    ('relu', dict(arch=dict(ARCH, num_layers=3)), {},
     'teacher has 3 attention blocks, the student 2'),
    ('mhla', {}, dict(layers=[2]), r'layers \[2\] are outside the 2 blocks'),
])
def test_teacher_that_does_not_fit_is_refused_before_iteration_one(
        tmp_path, mini_data_root, attn_type, teacher, hook_kwargs, message):
    cfg = make_cfg(tmp_path, mini_data_root, None, attn_type=attn_type, max_iters=1,
                   teacher=teacher_cfg(None, **teacher), **hook_kwargs)
    iterations = CountIterations()
    with pytest.raises(ValueError, match=message):
        run(cfg, extra_hooks=[iterations])
    assert iterations.count == 0
    assert not list(tmp_path.glob('*.pth'))


def test_every_mismatch_is_named_in_one_error(tmp_path, mini_data_root):
    teacher = teacher_cfg(None, attn_type='elu', patch_size=16,
                          arch=dict(ARCH, embed_dims=64, num_heads=4, feedforward_channels=128))
    cfg = make_cfg(tmp_path, mini_data_root, None, max_iters=1, teacher=teacher)
    with pytest.raises(ValueError) as error:
        run(cfg)
    assert all(part in str(error.value) for part in (
        'not Softmax', 'width (embed_dims)', 'head count (num_heads)', 'patch_size'))


def test_non_softmax_teacher_when_allowed_trains_and_warns(tmp_path, mini_data_root,
                                                          teacher_ckpt):
    cfg = make_cfg(tmp_path, mini_data_root, None, attn_type='relu', max_iters=1,
                   teacher=teacher_cfg(teacher_ckpt, attn_type='elu'),
                   allow_non_softmax_teacher=True)
    _, recorder = run(cfg)
    assert recorder.losses[0]['loss_distill'] > 0
    log = next(tmp_path.glob('*/*.log')).read_text()
    assert re.search(r"WARNING - AttentionDistillHook: distilling from a non-Softmax teacher "
                     r"\(\['elu'\] attention\), allowed by allow_non_softmax_teacher=True", log)


def test_softmax_teacher_logs_no_warning(tmp_path, mini_data_root, teacher_ckpt):
    cfg = make_cfg(tmp_path, mini_data_root, teacher_ckpt, attn_type='relu', max_iters=1,
                   allow_non_softmax_teacher=True)
    run(cfg)
    assert 'non-Softmax teacher' not in next(tmp_path.glob('*/*.log')).read_text()


def test_dist_train_with_the_hook_logs_loss_distill(tmp_path, mini_data_root, teacher_ckpt):
    root = mini_data_root / 'imagenet'
    options = [f'{loader}.dataset.data_root={root}'
               for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    config = tmp_path / 'distill.py'
    config.write_text(
        f"_base_ = ['{TINY_CONFIG}']\n"
        "model = dict(backbone=dict(attn_type='relu'))\n"
        "custom_hooks = [dict(type='AttentionDistillHook', "
        f"teacher={teacher_cfg(teacher_ckpt)!r})]\n"
        "custom_imports = dict(imports=['linvit_mm.models', 'linvit_mm.engine'])\n")
    proc = subprocess.run(
        ['bash', 'tools/dist_train.sh', str(config), '2', '--work-dir', str(tmp_path / 'wd'),
         '--cfg-options', *options],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, 'PYTHON': sys.executable, 'PORT': '29527'})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert 'gloo process group, rank 0 of 2' in log
    assert len(re.findall(r'Iter\(train\) \[\s*\d+/2\].*loss_distill: [\d.]+', log)) == 2


def test_a_hybrid_student_skips_its_softmax_blocks_unless_listed(tmp_path, mini_data_root,
                                                                 teacher_ckpt):
    # The teacher's weights in a [relu, softmax] hybrid: block 1 is the teacher's own block,
    # but its input differs from the teacher's by what relu changed in block 0.
    hybrid = ['relu', 'softmax']
    skipped = make_cfg(tmp_path / 'default', mini_data_root, teacher_ckpt, attn_type=hybrid,
                       student_from_teacher=True, max_iters=1)
    runner, recorder = run(skipped)
    default = recorder.losses[0]
    assert distill_hook(runner)._student_rec.layer_ids == [0]
    log = next((tmp_path / 'default').glob('*/*.log')).read_text()
    assert re.search(r'the student is a hybrid; its Softmax blocks \[1\] run the teacher\'s '
                     r'operator and are not matched', log)
    listed = make_cfg(tmp_path / 'listed', mini_data_root, teacher_ckpt, attn_type=hybrid,
                      student_from_teacher=True, max_iters=1, layers=[0, 1])
    runner, recorder = run(listed)
    matched = recorder.losses[0]
    assert distill_hook(runner)._student_rec.layer_ids == [0, 1]
    assert 'not matched' not in next((tmp_path / 'listed').glob('*/*.log')).read_text()
    # same weights, same batch: listing block 1 adds its (nonzero) term
    assert default['loss_task'] == pytest.approx(matched['loss_task'])
    assert 0 < default['loss_distill'] < matched['loss_distill']


def test_a_softmax_student_still_matches_every_block(tmp_path, mini_data_root, teacher_ckpt):
    runner, _ = run(make_cfg(tmp_path, mini_data_root, teacher_ckpt, max_iters=1))
    assert distill_hook(runner)._student_rec.layer_ids == [0, 1]
