"""AttentionDistillHook with the real mmengine Runner on the generated mini ImageNet set."""
import copy
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import types

import pytest
import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.logging import MMLogger
from mmengine.runner import Runner
from mmpretrain.models import ImageClassifier
from mmpretrain.registry import MODELS
from mmpretrain.structures import DataSample

import linvit_mm.engine  # noqa: F401
import linvit_mm.models  # noqa: F401
from linvit_mm.engine import AttentionDistillHook
from linvit_mm.models.pairing import patch_size_of as _patch_size
from linvit_mm.models import LinearViT
from linvit_mm.testing.staged import TINY_ARCH, tiny_vit_cfg, write_softmax_teacher
from linvit_mm.testing.staged import teacher_cfg as peaked_teacher_cfg

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


class CountIterations(Hook):
    priority = 'LOWEST'

    def __init__(self):
        self.count = 0

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self.count += 1


def test_a_teacher_that_does_not_fit_stops_the_run_before_iteration_one(tmp_path,
                                                                      mini_data_root):
    cfg = make_cfg(tmp_path, mini_data_root, None, attn_type='relu', max_iters=1,
                   teacher=teacher_cfg(None, arch=dict(ARCH, num_heads=4)))
    iterations = CountIterations()
    with pytest.raises(ValueError, match=r"teacher's head count \(num_heads\) differs"):
        run(cfg, extra_hooks=[iterations])
    assert iterations.count == 0
    assert not list(tmp_path.glob('*.pth'))


def test_bad_configuration_is_refused(teacher_ckpt):
    with pytest.raises(ValueError, match='unknown distillation target'):
        AttentionDistillHook(teacher=teacher_cfg(teacher_ckpt), target='logits')
    with pytest.raises(TypeError, match='model config dict'):
        AttentionDistillHook(teacher='deit_small.pth')
    # a dict is not enough: the registry needs its type
    untyped = teacher_cfg(teacher_ckpt)
    untyped.pop('type')
    with pytest.raises(TypeError, match='model config dict with a type'):
        AttentionDistillHook(teacher=untyped)


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
    with pytest.raises(error, match=message):
        AttentionDistillHook(teacher=teacher_cfg(teacher_ckpt), loss_weight=loss_weight)


def test_loss_weight_zero_and_integers_are_accepted(teacher_ckpt):
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
    with pytest.raises(error, match=message):
        AttentionDistillHook(teacher=teacher_cfg(teacher_ckpt), **kwargs)


@pytest.mark.slow
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


# ---------------------------------------------------------------------------------------
# The loss by value, and the set-up checks, on the hook alone (no Runner): the hook needs
# only the model, a logger and the loop counters of a runner.
#
# Each value case drives the hook's own training-time path (``before_train`` on the
# classifier, the pre-forward hook that runs the teacher, the forward hook that adds
# ``loss_distill``) and compares what it adds with a loss computed here without the hook's
# code: the attention outputs (or maps) of each block are read off the student and off an
# independently loaded copy of the teacher with plain forward hooks, the compared tokens
# are cut by hand, and the loss is ``loss_weight * sum over the listed blocks of
# mean((student - teacher) ** 2)``. The student's gradient is checked against autograd of
# that hand-computed loss, so a detached or mis-weighted term is seen too.

NUM_BLOCKS = TINY_ARCH['num_layers']
GRID = 4 * 4  # 32 px images, 8 px patches
WIDTH = TINY_ARCH['embed_dims']


@pytest.fixture(scope='module')
def peaked_teacher(tmp_path_factory):
    return write_softmax_teacher(tmp_path_factory.mktemp('distill_values') / 'teacher.pth')


def classifier(attn_type, seed=1, arch=TINY_ARCH, **backbone):
    """A tiny classifier whose backbone is a LinearViT of ``attn_type`` (random weights)."""
    torch.manual_seed(seed)
    model = MODELS.build(dict(
        type='ImageClassifier', backbone=tiny_vit_cfg(attn_type, arch=arch, **backbone),
        head=dict(type='LinearClsHead', num_classes=3, in_channels=WIDTH)))
    model.init_weights()
    return model.train()


def fake_runner(model, iteration=0, epoch=0):
    logger = MMLogger.get_instance('test_distill_loss_values')
    return types.SimpleNamespace(model=model, logger=logger, iter=iteration, epoch=epoch)


def batch(seed=0, size=2):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(size, 3, 32, 32, generator=generator)
    samples = [DataSample().set_gt_label(i % 3) for i in range(size)]
    return images, samples


def independent_teacher(peaked_teacher):
    """The teacher's checkpoint in a LinearViT built and loaded here, not by the hook."""
    cfg = tiny_vit_cfg('softmax')
    cfg.pop('type')
    teacher = LinearViT(**cfg)
    state = torch.load(str(peaked_teacher), map_location='cpu', weights_only=True)['state_dict']
    teacher.load_state_dict({k[len('backbone.'):]: v for k, v in state.items()}, strict=True)
    return teacher.eval().requires_grad_(False)


def capture(vit, what='output'):
    """Per block: what its attention module returns (``'output'``) or its map (``'map'``),
    recorded with ordinary forward hooks; the student's keep their autograd graph."""
    captured = {}
    handles = []
    for index, layer in enumerate(vit.layers):
        def record(module, args, output, index=index):
            if what == 'output':
                captured[index] = output
            else:
                captured[index] = module.attention_map(*args)
        handles.append(layer.attn.register_forward_hook(record))
    return captured, handles


def hand_loss(student, teacher, blocks, loss_weight, student_tokens, teacher_tokens,
              is_map=False):
    """``loss_weight * sum_b mean((s_b - t_b)**2)`` over the given token slices."""
    total = 0.
    for b in blocks:
        s, t = student[b], teacher[b]
        if is_map:
            s = s[..., student_tokens, student_tokens]
            t = t[..., teacher_tokens, teacher_tokens]
        else:
            s, t = s[:, student_tokens], t[:, teacher_tokens]
        assert s.shape == t.shape
        total = total + ((s - t) ** 2).mean()
    return loss_weight * total


def distil_once(attn_type, peaked_teacher, loss_weight=50., backbone=None, **hook_kwargs):
    """One training forward of a classifier with the hook; returns what the hook added,
    the hand-computed loss and the model, with the student's outputs/maps captured."""
    model = classifier(attn_type, **(backbone or {}))
    hook = AttentionDistillHook(teacher=peaked_teacher_cfg(peaked_teacher), loss_weight=loss_weight,
                                **hook_kwargs)
    runner = fake_runner(model)
    hook.before_train(runner)
    hook.before_train_iter(runner, 0)
    what = 'map' if hook.target == 'map' else 'output'
    student_values, handles = capture(model.backbone, what)
    images, samples = batch()
    losses = model(images, samples, mode='loss')
    for handle in handles:
        handle.remove()
    teacher = independent_teacher(peaked_teacher)
    teacher_values, handles = capture(teacher, what)
    with torch.no_grad():
        teacher(images)
    for handle in handles:
        handle.remove()
    hook.after_train_iter(runner, 0)
    return hook, model, losses, student_values, teacher_values


ALL = slice(None)
PATCHES = slice(-GRID, None)
TEACHER_PATCHES = slice(1, None)  # the teacher keeps a class token before its 16 patches


@pytest.mark.parametrize('attn_type, backbone, hook_kwargs, blocks, tokens', [
    pytest.param('relu', {}, {}, [0, 1, 2], (ALL, ALL), id='class-token-student'),
    pytest.param('elu', {}, dict(patch_tokens_only=True), [0, 1, 2], (PATCHES, TEACHER_PATCHES),
                 id='patch-tokens-only'),
    pytest.param('mhla', {}, {}, [0, 1, 2], (ALL, TEACHER_PATCHES), id='mhla-no-class-token'),
    pytest.param('ttt', {}, {}, [0, 1, 2], (ALL, TEACHER_PATCHES), id='ttt-no-class-token'),
    pytest.param('relu', {}, dict(layers=[2, 0]), [0, 2], (ALL, ALL), id='layers-listed'),
    pytest.param('relu', {}, dict(layers=[-1]), [2], (ALL, ALL), id='layers-negative'),
    pytest.param(['relu', 'softmax', 'elu'], {}, {}, [0, 2], (ALL, ALL), id='hybrid-default'),
    pytest.param(['relu', 'softmax', 'elu'], {}, dict(layers=[1]), [1], (ALL, ALL),
                 id='hybrid-softmax-block-listed'),
    pytest.param(['ttt', 'softmax', 'mhla'], dict(with_cls_token=False), {}, [0, 2],
                 (ALL, TEACHER_PATCHES), id='hybrid-without-class-token'),
])
def test_loss_distill_is_the_weighted_sum_of_block_mses(peaked_teacher, attn_type, backbone,
                                                       hook_kwargs, blocks, tokens):
    hook, model, losses, student, teacher = distil_once(attn_type, peaked_teacher,
                                                        loss_weight=7.5, backbone=backbone,
                                                        **hook_kwargs)
    assert hook._student_rec.layer_ids == blocks
    expected = hand_loss(student, teacher, blocks, 7.5, *tokens)
    torch.testing.assert_close(losses['loss_distill'], expected, rtol=1e-6, atol=0)
    assert expected > 0
    # the student's gradient is autograd's of the hand-computed loss
    params = [p for p in model.backbone.parameters() if p.requires_grad]
    got = torch.autograd.grad(losses['loss_distill'], params, retain_graph=True,
                              allow_unused=True)
    want = torch.autograd.grad(expected, params, allow_unused=True)
    for (name, _), g, w in zip(model.backbone.named_parameters(), got, want):
        if w is None:
            assert g is None or not g.any(), name
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-9, msg=name)


def test_the_loss_sums_over_blocks_rather_than_averaging(peaked_teacher):
    _, _, every, student, teacher = distil_once('relu', peaked_teacher, loss_weight=1.)
    per_block = [hand_loss(student, teacher, [b], 1., ALL, ALL) for b in range(NUM_BLOCKS)]
    torch.testing.assert_close(every['loss_distill'], sum(per_block), rtol=1e-6, atol=0)
    # and each block's term is a mean over batch, tokens and channels, not a sum
    s, t = student[0], teacher[0]
    assert float(per_block[0]) == pytest.approx(float(((s - t) ** 2).sum()) / s.numel(),
                                                rel=1e-6)


@pytest.mark.parametrize('loss_weight', [0., 1., 50.])
def test_loss_weight_scales_the_loss(peaked_teacher, loss_weight):
    _, _, losses, student, teacher = distil_once('relu', peaked_teacher, loss_weight=loss_weight)
    expected = hand_loss(student, teacher, range(NUM_BLOCKS), loss_weight, ALL, ALL)
    torch.testing.assert_close(losses['loss_distill'], expected, rtol=1e-6, atol=0)


def test_default_loss_weight_is_the_papers_fifty(peaked_teacher):
    model = classifier('relu')
    hook = AttentionDistillHook(teacher=peaked_teacher_cfg(peaked_teacher))
    assert hook.loss_weight == 50.


@pytest.mark.parametrize('attn_type', ['relu', 'inline'])
def test_map_target_compares_the_maps(peaked_teacher, attn_type):
    _, _, losses, student, teacher = distil_once(attn_type, peaked_teacher, loss_weight=3.,
                                                 target='map')
    assert student[0].shape == teacher[0].shape == (2, TINY_ARCH['num_heads'], 17, 17)
    expected = hand_loss(student, teacher, range(NUM_BLOCKS), 3., ALL, ALL, is_map=True)
    torch.testing.assert_close(losses['loss_distill'], expected, rtol=1e-6, atol=0)


def test_map_target_on_patch_tokens_cuts_both_axes(peaked_teacher):
    _, _, losses, student, teacher = distil_once('relu', peaked_teacher, loss_weight=3.,
                                                 target='map', patch_tokens_only=True)
    expected = hand_loss(student, teacher, range(NUM_BLOCKS), 3., PATCHES, TEACHER_PATCHES,
                         is_map=True)
    torch.testing.assert_close(losses['loss_distill'], expected, rtol=1e-6, atol=0)


def test_the_teacher_is_frozen_and_gets_no_gradient(peaked_teacher):
    hook, model, losses, _, _ = distil_once('relu', peaked_teacher)
    assert hook.teacher is not None and not hook.teacher.training
    assert not any(p.requires_grad for p in hook.teacher.parameters())
    total = losses['loss_distill'] + losses['loss_task']
    total.backward()
    assert all(p.grad is None for p in hook.teacher.parameters())
    assert any(p.grad is not None and p.grad.any() for p in model.backbone.parameters())


def test_the_teacher_loads_its_checkpoint(peaked_teacher):
    hook, *_ = distil_once('relu', peaked_teacher)
    reference = independent_teacher(peaked_teacher).state_dict()
    state = hook.teacher.state_dict()
    assert state.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(state[key], value), key


def test_the_task_loss_is_kept_beside_the_distillation_loss(peaked_teacher):
    model = classifier('relu')
    images, samples = batch()
    plain = model(images, samples, mode='loss')
    _, _, losses, _, _ = distil_once('relu', peaked_teacher)
    # the head's 'loss' is renamed so that parse_losses' total keeps the name 'loss'
    assert set(losses) == {'loss_task', 'loss_distill'} and set(plain) == {'loss'}
    torch.testing.assert_close(losses['loss_task'], plain['loss'])


@pytest.mark.parametrize('counters, distilling', [
    (dict(iteration=1), True), (dict(iteration=2), False), (dict(iteration=5), False)])
def test_stop_iter_switches_the_loss_off_from_that_iteration(peaked_teacher, counters,
                                                             distilling):
    model = classifier('relu')
    hook = AttentionDistillHook(teacher=peaked_teacher_cfg(peaked_teacher), stop_iter=2)
    runner = fake_runner(model, **counters)
    hook.before_train(runner)
    hook.before_train_iter(runner, 0)
    losses = model(*batch(), mode='loss')
    assert ('loss_distill' in losses) == distilling


@pytest.mark.parametrize('stop', ['stop_iter', 'stop_epoch'])
def test_stopping_at_zero_means_no_distillation_at_all(peaked_teacher, stop):
    model = classifier('relu')
    hook = AttentionDistillHook(teacher=peaked_teacher_cfg(peaked_teacher), **{stop: 0})
    assert getattr(hook, stop) == 0
    runner = fake_runner(model)
    hook.before_train(runner)
    hook.before_train_iter(runner, 0)
    assert 'loss_distill' not in model(*batch(), mode='loss')


def test_stop_epoch_switches_the_loss_off_from_that_epoch(peaked_teacher):
    model = classifier('relu')
    hook = AttentionDistillHook(teacher=peaked_teacher_cfg(peaked_teacher), stop_epoch=1)
    for epoch, distilling in ((0, True), (1, False)):
        runner = fake_runner(model, epoch=epoch)
        if hook.teacher is None:
            hook.before_train(runner)
        hook.before_train_iter(runner, 0)
        assert ('loss_distill' in model(*batch(), mode='loss')) == distilling
        hook.after_train_iter(runner, 0)


def test_no_loss_outside_training_forwards(peaked_teacher):
    model = classifier('relu')
    hook = AttentionDistillHook(teacher=peaked_teacher_cfg(peaked_teacher))
    runner = fake_runner(model)
    hook.before_train(runner)
    hook.before_train_iter(runner, 0)
    model.eval()
    assert 'loss_distill' not in model(*batch(), mode='loss')
    assert not hook._student_rec.outputs and not hook._teacher_rec.outputs
    model.train()
    hook.after_train_iter(runner, 0)
    # between iterations (e.g. a validation loop's forward) nothing is added or recorded
    assert 'loss_distill' not in model(*batch(), mode='loss')
    assert not hook._student_rec.outputs and not hook._teacher_rec.outputs
    hook.after_train(runner)
    assert hook.teacher is None
    # every hook the distillation registered is gone with it
    assert not model._forward_hooks and not model.backbone._forward_pre_hooks
    assert not any(layer.attn._forward_hooks for layer in model.backbone.layers)
    hook.before_train_iter(runner, 0)
    assert 'loss_distill' not in model(*batch(), mode='loss')


# --------------------------------------------------------------- set-up checks, no Runner
def set_up(attn_type, teacher, arch=ARCH, **hook_kwargs):
    """``before_train`` of a hook with ``teacher`` on a tiny classifier of ``attn_type``;
    returns the hook and the records the run's logger received."""
    model = classifier(attn_type, arch=arch)
    hook = AttentionDistillHook(teacher=teacher, **hook_kwargs)
    runner = fake_runner(model)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    runner.logger.addHandler(handler)
    try:
        hook.before_train(runner)
    finally:
        runner.logger.removeHandler(handler)
    return hook, records


@pytest.mark.parametrize('attn_type', ['mhla', 'ttt'])
def test_map_target_refused_without_a_map(teacher_ckpt, attn_type):
    with pytest.raises(ValueError, match=f"target='map' needs attention maps.*{attn_type}"):
        set_up(attn_type, teacher_cfg(teacher_ckpt), target='map')


@pytest.mark.parametrize('attn_type, teacher, hook_kwargs, message', [
    ('relu', dict(arch=dict(ARCH, embed_dims=64, feedforward_channels=128)), {},
     r"teacher's width \(embed_dims\) differs.*\(student vs teacher: blocks 0-1: 32 vs 64\)"),
    ('relu', dict(arch=dict(ARCH, num_heads=4)), dict(layers=[1]),
     r"teacher's head count \(num_heads\) differs.*\(student vs teacher: block 1: 2 vs 4\);"),
    ('relu', dict(patch_size=16), {},
     r'student cuts 8x8-pixel patches, the teacher 16x16-pixel patches.*patch_size'),
    ('relu', dict(attn_type='relu'), {},
     r"teacher's attention is \['relu'\], not Softmax.*allow_non_softmax_teacher=True"),
    ('relu', dict(attn_type='ttt'), dict(target='map', allow_non_softmax_teacher=True),
     r"target='map' needs attention maps, which the \['ttt'\] operator\(s\) of the teacher"),
    ('relu', dict(arch=dict(ARCH, num_layers=3)), {},
     'the student has 2 blocks, the teacher 3'),
    ('mhla', {}, dict(layers=[2]), r'layers \[2\] are outside the 2 blocks'),
    ('mhla', {}, dict(layers=[-3]), r'layers \[-3\] are outside the 2 blocks'),
])
def test_teacher_that_does_not_fit_is_refused(attn_type, teacher, hook_kwargs, message):
    with pytest.raises(ValueError, match=message):
        set_up(attn_type, teacher_cfg(None, **teacher), **hook_kwargs)


@pytest.mark.parametrize('layers, message', [
    ([0, 0], r'layers \[0, 0\] name block\(s\) \[0\] more than once'),
    ([1, -1, 0], r'layers \[1, -1, 0\] name block\(s\) \[1\] more than once \(negative '
                 r'indices count from the end of the 2 blocks\)'),
], ids=['repeated', 'negative-alias'])
def test_a_block_listed_twice_is_refused(layers, message):
    with pytest.raises(ValueError, match=message):
        set_up('relu', teacher_cfg(None), layers=layers)


def test_heads_are_checked_only_on_the_distilled_blocks():
    # the head count differs in every block; only block 1 is listed, only it is named
    with pytest.raises(ValueError) as error:
        set_up('relu', teacher_cfg(None, arch=dict(ARCH, num_heads=4)), layers=[1])
    assert 'block 0' not in str(error.value)


def test_every_mismatch_is_named_in_one_error():
    teacher = teacher_cfg(None, attn_type='elu', patch_size=16,
                          arch=dict(ARCH, embed_dims=64, num_heads=4, feedforward_channels=128))
    with pytest.raises(ValueError) as error:
        set_up('softmax', teacher)
    assert all(part in str(error.value) for part in (
        'not Softmax', 'width (embed_dims)', 'head count (num_heads)', 'patch_size'))


def test_a_student_without_the_named_module_or_attention_is_refused(teacher_ckpt):
    with pytest.raises(ValueError, match="the model has no module 'vit'"):
        set_up('relu', teacher_cfg(teacher_ckpt), student='vit')
    with pytest.raises(ValueError, match="'head' holds no attention operator"):
        set_up('relu', teacher_cfg(teacher_ckpt), student='head')


def test_non_softmax_teacher_when_allowed_warns(teacher_ckpt):
    _, records = set_up('relu', teacher_cfg(teacher_ckpt, attn_type='elu'),
                        allow_non_softmax_teacher=True)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert warnings == ["AttentionDistillHook: distilling from a non-Softmax teacher (['elu'] "
                        'attention), allowed by allow_non_softmax_teacher=True']


def test_softmax_teacher_logs_no_warning(teacher_ckpt):
    _, records = set_up('relu', teacher_cfg(teacher_ckpt), allow_non_softmax_teacher=True)
    assert not [r for r in records if r.levelno >= logging.WARNING]


def test_a_hybrid_student_says_which_softmax_blocks_it_skips(teacher_ckpt):
    hook, records = set_up(['relu', 'softmax'], teacher_cfg(teacher_ckpt))
    assert hook._student_rec.layer_ids == [0]
    infos = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert any(re.search(r"the student is a hybrid; its Softmax blocks \[1\] run the teacher's "
                         r'operator and are not matched', m) for m in infos), infos
    hook, records = set_up(['relu', 'softmax'], teacher_cfg(teacher_ckpt), layers=[0, 1])
    assert hook._student_rec.layer_ids == [0, 1]
    assert not any('not matched' in r.getMessage() for r in records)


def test_a_softmax_student_still_matches_every_block(teacher_ckpt):
    hook, _ = set_up('softmax', teacher_cfg(teacher_ckpt))
    assert hook._student_rec.layer_ids == [0, 1]


def test_the_teacher_is_built_frozen_in_eval_mode(teacher_ckpt):
    hook, _ = set_up('relu', teacher_cfg(teacher_ckpt, drop_path_rate=0.5))
    assert not hook.teacher.training
    assert not any(module.training for module in hook.teacher.modules())
    assert not any(p.requires_grad for p in hook.teacher.parameters())


@pytest.mark.parametrize('attn_type, patch_tokens_only, expected', [
    ('relu', None, False), ('relu', True, True), ('mhla', None, True), ('ttt', False, True)])
def test_patch_tokens_only_is_forced_for_students_without_class_token(
        teacher_ckpt, attn_type, patch_tokens_only, expected):
    hook, _ = set_up(attn_type, teacher_cfg(teacher_ckpt), patch_tokens_only=patch_tokens_only)
    assert hook.patch_tokens_only is expected


@pytest.mark.parametrize('target', ['output', 'map'])
def test_nothing_recorded_outlives_its_iteration(peaked_teacher, target):
    hook, *_ = distil_once('relu', peaked_teacher, target=target)
    for recorder in (hook._student_rec, hook._teacher_rec):
        assert not recorder.active and not recorder.outputs and not recorder.maps


def test_an_iteration_without_a_loss_forward_leaves_no_recorder_running(peaked_teacher):
    """A training forward that asks for no loss (``mode='tensor'``, e.g. a hook reading
    features) starts the recorders but never reaches the loss; the iteration's end stops them,
    so a later forward outside training records nothing."""
    model = classifier('relu')
    hook = AttentionDistillHook(teacher=peaked_teacher_cfg(peaked_teacher))
    runner = fake_runner(model)
    hook.before_train(runner)
    hook.before_train_iter(runner, 0)
    model(batch()[0], mode='tensor')
    assert hook._student_rec.active
    hook.after_train_iter(runner, 0)
    assert not hook._student_rec.active and not hook._teacher_rec.active
    model.eval()
    with torch.no_grad():
        model(batch()[0], mode='tensor')
    assert not hook._student_rec.outputs and not hook._teacher_rec.outputs


def test_the_teacher_is_back_in_eval_mode_at_every_iteration(peaked_teacher):
    """Something that switches every module to training (a user's hook calling
    ``.train()`` on what it finds) must not leave the teacher's dropout and drop-path on."""
    model = classifier('relu')
    hook = AttentionDistillHook(teacher=peaked_teacher_cfg(peaked_teacher))
    runner = fake_runner(model)
    hook.before_train(runner)
    hook.teacher.train()
    hook.before_train_iter(runner, 0)
    assert not any(module.training for module in hook.teacher.modules())


def test_the_set_up_is_reported_at_info(teacher_ckpt):
    hook, records = set_up('relu', teacher_cfg(teacher_ckpt), loss_weight=7.5)
    reports = [r.getMessage() for r in records
               if r.levelno == logging.INFO and r.getMessage().startswith('AttentionDistillHook')]
    assert reports == ['AttentionDistillHook: output distillation of blocks [0, 1] from a frozen '
                       'LinearViT teacher, loss_weight=7.5, patch_tokens_only=False']


# ----------------------------------------------------------- what the loss path refuses
class LossSumClassifier(ImageClassifier):
    """A classifier whose ``mode='loss'`` returns one tensor instead of a loss dict."""

    def forward(self, inputs, data_samples=None, mode='tensor'):
        out = super().forward(inputs, data_samples, mode)
        return sum(out.values()) if mode == 'loss' else out


class RenamedLossClassifier(ImageClassifier):
    """A classifier whose loss dict has no ``'loss'`` entry (only ``'loss_cls'``)."""

    def forward(self, inputs, data_samples=None, mode='tensor'):
        out = super().forward(inputs, data_samples, mode)
        return {'loss_cls': out['loss']} if mode == 'loss' else out


def distilling_model(model_class, peaked_teacher):
    torch.manual_seed(1)
    model = model_class(backbone=tiny_vit_cfg('relu'),
                        head=dict(type='LinearClsHead', num_classes=3, in_channels=WIDTH))
    model.init_weights()
    model.train()
    hook = AttentionDistillHook(teacher=peaked_teacher_cfg(peaked_teacher))
    runner = fake_runner(model)
    hook.before_train(runner)
    hook.before_train_iter(runner, 0)
    return model, hook


def test_a_model_that_returns_no_loss_dict_is_refused(peaked_teacher):
    model, _ = distilling_model(LossSumClassifier, peaked_teacher)
    with pytest.raises(TypeError, match='expects the model to return a loss dict'):
        model(*batch(), mode='loss')


def test_a_loss_dict_without_a_loss_entry_keeps_its_names(peaked_teacher):
    model, hook = distilling_model(RenamedLossClassifier, peaked_teacher)
    losses = model(*batch(), mode='loss')
    assert set(losses) == {'loss_cls', 'loss_distill'}
    assert losses['loss_distill'] > 0


def test_a_block_that_skips_its_attention_is_named(peaked_teacher):
    model, _ = distilling_model(ImageClassifier, peaked_teacher)
    model.backbone.layers[1].forward = lambda x, hw_shape: x
    with pytest.raises(RuntimeError, match=re.escape('no attention for blocks [1]')):
        model(*batch(), mode='loss')


def test_a_hook_that_never_set_up_ends_quietly(peaked_teacher):
    hook = AttentionDistillHook(teacher=peaked_teacher_cfg(peaked_teacher))
    runner = fake_runner(classifier('relu'))
    hook.after_train_iter(runner, 0)
    hook.after_train(runner)
    assert hook.teacher is None


def test_patch_size_is_read_from_the_outermost_module_that_declares_one():
    outer = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Identity())
    assert _patch_size(outer) is None
    outer.patch_size = None  # declared but unset: the search goes on to the children
    outer[1].patch_size = 14
    outer[1].add_module('inner', torch.nn.Identity())
    outer[1].inner.patch_size = 16
    assert _patch_size(outer) == (14, 14)
