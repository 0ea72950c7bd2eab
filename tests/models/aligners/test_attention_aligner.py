"""AttentionAligner (stage 1 of the staged recipe): block-wise attention alignment."""
import copy
import re
from pathlib import Path

import pytest
import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.runner import Runner
from mmpretrain.registry import MODELS

import linvit_mm.engine  # noqa: F401  (StagedRecordHook)
from linvit_mm.models.aligners import AttentionAligner
from linvit_mm.models.attention import attention_types
from linvit_mm.testing.staged import TINY_ARCH, teacher_cfg, tiny_vit_cfg, write_softmax_teacher

REPO = Path(__file__).resolve().parents[3]
TINY_ALIGN = REPO / 'tests' / 'data' / 'configs' / 'tiny_align_mini.py'
LINEAR_OPERATORS = [name for name in attention_types() if name != 'softmax']


@pytest.fixture(scope='module')
def teacher_path(tmp_path_factory):
    return write_softmax_teacher(tmp_path_factory.mktemp('align_teacher') / 'teacher.pth')


def build(teacher_path, attn_type='relu', student=None, teacher=None, **kwargs):
    model = MODELS.build(dict(
        type='AttentionAligner', backbone=student or tiny_vit_cfg(attn_type),
        teacher=teacher or teacher_cfg(teacher_path), **kwargs))
    model.init_weights()
    return model


def images(seed=0, batch=2):
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def run_cfg(work_dir, mini_data_root, teacher_path, attn_type='relu', max_iters=4, **model):
    cfg = Config.fromfile(str(TINY_ALIGN))
    cfg.train_dataloader.dataset.data_root = str(mini_data_root / 'imagenet')
    cfg.model.teacher.init_cfg.checkpoint = str(teacher_path)
    cfg.model.backbone.attn_type = attn_type
    cfg.model.update(model)
    cfg.work_dir = str(work_dir)
    cfg.train_cfg.max_iters = max_iters
    cfg.default_hooks.checkpoint.interval = max_iters
    return cfg


class FixedBatchLoss(Hook):
    """The alignment loss on the run's first batch before training and after it (the losses
    of the training iterations are on different batches, too noisy to compare)."""

    priority = 'LOWEST'

    def __init__(self):
        self.images = None
        self.before = self.after = None

    def _loss(self, runner):
        with torch.no_grad():
            return float(runner.model(self.images, mode='loss')['loss_align'])

    def before_train(self, runner):
        batch = next(iter(runner.train_dataloader))
        self.images = runner.model.data_preprocessor(batch, training=False)['inputs']
        self.before = self._loss(runner)

    def after_train(self, runner):
        self.after = self._loss(runner)


def train(cfg, *hooks):
    runner = Runner.from_cfg(cfg)
    for hook in hooks:
        runner.register_hook(hook)
    runner.train()
    return runner


# ---------------------------------------------------------------------- training with the Runner
@pytest.mark.parametrize('attn_type, with_cls_token', [(op, None) for op in LINEAR_OPERATORS]
                         + [('relu', False), ('ttt', True)])
def test_align_loss_decreases_for_every_operator(attn_type, with_cls_token, tmp_path,
                                                 mini_data_root, teacher_path):
    cfg = run_cfg(tmp_path, mini_data_root, teacher_path, attn_type, max_iters=8)
    if with_cls_token is not None:
        cfg.model.backbone.with_cls_token = with_cls_token
    probe = FixedBatchLoss()
    train(cfg, probe)
    assert probe.before > 0 and probe.after < 0.9 * probe.before, (probe.before, probe.after)


def test_align_trains_attention_only_frozen_parameters_bit_identical(tmp_path, mini_data_root,
                                                                      teacher_path):
    cfg = run_cfg(tmp_path, mini_data_root, teacher_path, 'ttt', layers=[0, 2])
    before = {}

    class Snapshot(Hook):
        priority = 'HIGHEST'

        def before_train(self, runner):
            before.update({k: v.clone() for k, v in runner.model.state_dict().items()})

    runner = train(cfg, Snapshot())
    after = runner.model.state_dict()
    assert set(after) == set(before)
    trained = [k for k in after if re.match(r'backbone\.layers\.[02]\.attn\.', k)]
    # qkv, proj, the inner weights and the position encoding of TTT all train
    assert {k.split('.', 4)[-1] for k in trained} >= {'qkv.weight', 'proj.weight', 'w1',
                                                       'cpe.weight'}
    for key in after:
        if key in trained:
            assert not torch.equal(after[key], before[key]), key
        else:
            assert torch.equal(after[key], before[key]), key
    optimized = {id(p) for group in runner.optim_wrapper.optimizer.param_groups
                 for p in group['params'] if p.requires_grad}
    assert optimized == {id(p) for n, p in runner.model.named_parameters()
                         if n in trained}


def test_align_teacher_not_in_checkpoint_optimizer_or_ema(tmp_path, mini_data_root,
                                                          teacher_path):
    cfg = run_cfg(tmp_path, mini_data_root, teacher_path)
    cfg.custom_hooks.append(dict(type='EMAHook', momentum=0.5, priority='ABOVE_NORMAL'))
    runner = train(cfg)
    model = runner.model
    teacher_params = {id(p) for p in model.teacher.parameters()}
    assert not teacher_params & {id(p) for p in model.parameters()}
    assert not teacher_params & {id(p) for group in runner.optim_wrapper.optimizer.param_groups
                                 for p in group['params']}
    ema = next(h for h in runner.hooks if type(h).__name__ == 'EMAHook').ema_model
    assert not teacher_params & {id(p) for p in ema.parameters()}
    assert ema.module.teacher is model.teacher  # shared, not copied
    checkpoint = torch.load(tmp_path / 'iter_4.pth', map_location='cpu', weights_only=False)
    student_keys = {f'backbone.{k}' for k in model.backbone.state_dict()}
    assert set(checkpoint['state_dict']) == student_keys
    assert set(checkpoint['ema_state_dict']) == {'steps'} | {f'module.{k}' for k in student_keys}
    record = checkpoint['meta']['linvit_mm']
    assert record['stage'] == 'align-attn' and record['trained_layers'] == [0, 1, 2]


def test_align_block_subsets_merged_equal_one_job(tmp_path, mini_data_root, teacher_path):
    from linvit_mm.staged import merge_aligned_blocks
    from linvit_mm.utils.checkpoint import load_checkpoint_file
    runs = {}
    for name, layers in (('all', None), ('first', [0, 2]), ('second', [1])):
        cfg = run_cfg(tmp_path / name, mini_data_root, teacher_path, 'mhla', layers=layers)
        train(cfg)
        runs[name] = load_checkpoint_file(tmp_path / name / 'iter_4.pth')
    merged = merge_aligned_blocks({'first': runs['first'], 'second': runs['second']})
    whole = runs['all']['state_dict']
    assert set(merged['state_dict']) == set(whole)
    for key, value in whole.items():
        torch.testing.assert_close(merged["state_dict"][key], value, rtol=0, atol=0,
                                   msg=key)
    assert merged['meta']['linvit_mm']['trained_layers'] == [0, 1, 2]


# ---------------------------------------------------------------------- what each block sees
@pytest.mark.parametrize('attn_type', ['relu', 'hedgehog', 'ttt'])
def test_align_student_attention_gets_teachers_normalised_block_input(attn_type,
                                                                       teacher_path):
    model = build(teacher_path, attn_type)
    seen = {}
    for role, vit in (('student', model.backbone), ('teacher', model.teacher)):
        for index, layer in enumerate(vit.layers):
            layer.attn.register_forward_pre_hook(
                lambda module, args, key=(role, index): seen.__setitem__(key, args[0].detach()))
    block_inputs = {}
    for index, layer in enumerate(model.teacher.layers):
        layer.register_forward_pre_hook(
            lambda module, args, index=index: block_inputs.__setitem__(index, args[0].detach()))
    model.block_pairs(images())
    for index, layer in enumerate(model.backbone.layers):
        teacher_normed = seen['teacher', index]
        if attn_type == 'ttt':  # its own position encoding first (trained), then ln1
            x = block_inputs[index][:, 1:]  # a ttt student has no class token
            expected = layer.ln1(layer.attn.encode_position(x, (4, 4)))
            torch.testing.assert_close(seen['student', index], expected)
        else:
            assert torch.equal(seen['student', index], teacher_normed)


def test_align_no_backward_through_another_block(teacher_path):
    model = build(teacher_path, 'mhla')
    pairs = model.block_pairs(images())
    torch.nn.functional.mse_loss(*pairs[1]).backward()
    for index, layer in enumerate(model.backbone.layers):
        grads = [p.grad for p in layer.attn.parameters()]
        if index == 1:
            assert all(g is not None and g.abs().sum() > 0 for g in grads)
        else:
            assert all(g is None for g in grads), index
    assert all(p.grad is None for p in model.teacher.parameters())


def test_align_loss_is_weighted_sum_of_block_mses(teacher_path):
    model = build(teacher_path, 'relu', loss_weight=3.0, layers=[0, -1])
    x = images()
    pairs = model.block_pairs(x)
    assert len(pairs) == 2
    expected = 3.0 * sum(torch.nn.functional.mse_loss(s, t) for s, t in pairs)
    torch.testing.assert_close(model(x, mode='loss')['loss_align'], expected)
    assert [s.shape for s in model(x, mode='tensor')] == [(2, 17, 32)] * 2


@pytest.mark.parametrize('attn_type', ['relu', 'ttt'])
def test_align_recomputed_attention_gives_the_same_loss_and_gradients(attn_type,
                                                                      teacher_path):
    x = images()
    results = []
    for with_cp in (True, False):
        torch.manual_seed(0)  # the operator's own tensors (ttt's) start equal
        model = build(teacher_path, attn_type, with_cp=with_cp)
        loss = model(x, mode='loss')['loss_align']
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()
                                         if p.grad is not None}))
    (loss_cp, grads_cp), (loss_plain, grads_plain) = results
    assert torch.equal(loss_cp, loss_plain)
    assert grads_cp.keys() == grads_plain.keys() and grads_cp
    for name in grads_cp:
        torch.testing.assert_close(grads_cp[name], grads_plain[name], rtol=0, atol=0,
                                   msg=name)


def test_align_patch_tokens_compared_without_class_token(teacher_path):
    pairs = build(teacher_path, 'ttt').block_pairs(images())
    assert all(s.shape == t.shape == (2, 16, 32) for s, t in pairs)
    pairs = build(teacher_path, 'relu', patch_tokens_only=True).block_pairs(images())
    assert all(s.shape == t.shape == (2, 16, 32) for s, t in pairs)


def test_align_student_copied_from_teacher(teacher_path):
    model = build(teacher_path, 'relu')
    teacher = model.teacher.state_dict()
    for key, value in model.backbone.state_dict().items():
        assert torch.equal(value, teacher[key]), key


def test_align_teacher_moves_with_model_and_stays_in_eval(teacher_path):
    model = build(teacher_path, 'relu')
    model.train()
    assert model.backbone.training and not model.teacher.training
    model.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in model.teacher.parameters())
    assert model.staged_record() == dict(stage='align-attn', trained_layers=[0, 1, 2])
    with pytest.raises(ValueError, match="no mode 'predict'"):
        model(images().double(), mode='predict')


def test_align_hybrid_student_aligns_its_linear_blocks(teacher_path):
    hybrid = tiny_vit_cfg(dict(default='relu', softmax=[0]))
    model = build(teacher_path, student=hybrid)
    assert model.layer_ids == [1, 2]
    assert not any(p.requires_grad for p in model.backbone.layers[0].parameters())
    assert build(teacher_path, student=hybrid, layers=[0, 2]).layer_ids == [0, 2]
    with pytest.raises(ValueError, match='no linear-attention block to align'):
        build(teacher_path, student=tiny_vit_cfg('softmax'))


# ---------------------------------------------------------------------- refused set-ups
@pytest.mark.parametrize('layers, error, match', [
    ([], ValueError, r'layers=\[\] selects no block'),
    ([0, 3, -4], ValueError, r'layers \[3, -4\] are outside the 3 blocks'),
    ([0.5], TypeError, 'block indices'),
    ('0', TypeError, 'list of block indices'),
])
def test_align_refuses_bad_layers(layers, error, match, teacher_path):
    with pytest.raises(error, match=match):
        build(teacher_path, layers=layers)


def test_align_refuses_mismatched_teacher(teacher_path):
    deeper = dict(TINY_ARCH, num_layers=4)
    with pytest.raises(ValueError) as info:
        build(teacher_path, teacher=teacher_cfg(teacher_path, arch=dict(deeper, embed_dims=64)))
    message = str(info.value)
    assert 'student has 3 blocks, the teacher 4' in message
    assert "teacher's width (embed_dims) differs from the student's (student vs teacher: " \
        'blocks 0-2: 32 vs 64)' in message
    with pytest.raises(ValueError,
                       match=r'head count \(num_heads\) differs .*blocks 0-2: 2 vs 4'):
        build(teacher_path, teacher=teacher_cfg(teacher_path, arch=dict(TINY_ARCH, num_heads=4)))
    with pytest.raises(ValueError, match='student cuts 8x8-pixel patches, the teacher 4x4-pixel'):
        build(teacher_path, teacher=teacher_cfg(teacher_path, patch_size=4))
    with pytest.raises(ValueError, match=r"attention is \['relu'\], not Softmax"):
        build(teacher_path, teacher=dict(teacher_cfg(teacher_path), attn_type='relu'))
    with pytest.raises(ValueError, match='teacher has no init_cfg'):
        build(teacher_path, teacher=tiny_vit_cfg('softmax'))
    with pytest.raises(ValueError, match='1 extra tokens .* the teacher with 0'):
        build(teacher_path, teacher=dict(teacher_cfg(teacher_path), with_cls_token=False))


def test_align_refuses_student_init_cfg_frozen_stages_and_bad_loss_weight(teacher_path):
    student = tiny_vit_cfg('relu', init_cfg=dict(type='Pretrained', checkpoint='x.pth'))
    with pytest.raises(ValueError, match='takes no init_cfg'):
        build(teacher_path, student=student)
    with pytest.raises(TypeError, match='with_cp must be True or False'):
        build(teacher_path, with_cp=1)
    with pytest.raises(ValueError, match='frozen_stages=1'):
        build(teacher_path, student=tiny_vit_cfg('relu', frozen_stages=1))
    for weight in (0, -1.0, float('nan'), float('inf')):
        with pytest.raises(ValueError, match=f'loss_weight must be a finite number > 0.*{weight}'):
            build(teacher_path, loss_weight=weight)
    for weight in (True, '1'):
        with pytest.raises(TypeError, match='loss_weight must be a number'):
            build(teacher_path, loss_weight=weight)


def test_align_documented_defaults_and_what_frozen_stages_accepts(teacher_path):
    model = build(teacher_path)
    assert model.loss_weight == 1. and model.with_cp is True
    assert model.layer_ids == [0, 1, 2]  # every block of the tiny student
    # 0 and -1 freeze nothing (LinearViT's meaning): nothing to refuse
    for frozen_stages in (0, -1):
        build(teacher_path, student=tiny_vit_cfg('relu', frozen_stages=frozen_stages))


def test_align_recomputes_only_with_cp_and_only_where_a_graph_is_built(teacher_path,
                                                                         monkeypatch):
    from linvit_mm.models.aligners import attention_aligner
    calls = []

    def counting_checkpoint(fn, *args, **kwargs):
        calls.append(1)
        return fn(*args)

    monkeypatch.setattr(attention_aligner, 'checkpoint', counting_checkpoint)
    x = images()
    for with_cp, grad, expected in ((True, True, 3), (True, False, 0), (False, True, 0)):
        calls.clear()
        model = build(teacher_path, with_cp=with_cp)
        with torch.set_grad_enabled(grad):
            model.loss(x)
        assert len(calls) == expected, (with_cp, grad)


def test_align_checkpoint_of_another_operator_refused_by_next_stage(teacher_path, tmp_path):
    from linvit_mm.staged import load_linear_vit_checkpoint
    from linvit_mm.testing.staged import write_recorded_checkpoint
    model = build(teacher_path, 'relu')
    path = write_recorded_checkpoint(tmp_path / 'relu.pth', model.backbone,
                                     **model.staged_record())
    elu = MODELS.build(tiny_vit_cfg('elu'))
    before = copy.deepcopy(elu.state_dict())
    with pytest.raises(ValueError, match=r"operator of blocks 0-2: checkpoint 'relu', "
                                         r"model 'elu'"):
        load_linear_vit_checkpoint(elu, str(path))
    assert all(torch.equal(v, before[k]) for k, v in elu.state_dict().items())
    assert isinstance(model, AttentionAligner)


@pytest.mark.parametrize('attn_type, patch_tokens_only', [
    ('relu', None), ('relu', True), ('ttt', None), (['relu', 'softmax', 'elu'], None)],
    ids=['class-token', 'patch-tokens-only', 'no-class-token', 'hybrid'])
def test_align_loss_by_hand(attn_type, patch_tokens_only, teacher_path):
    """``loss_weight * sum over the trained blocks of mean((s_b - t_b) ** 2)``, where ``t_b`` is
    the teacher's block-``b`` attention output and ``s_b`` the student block's attention on
    the teacher's own input to block ``b``; computed here with plain hooks on the teacher."""
    model = build(teacher_path, attn_type, loss_weight=3.0, with_cp=False,
                  patch_tokens_only=patch_tokens_only)
    x = images()
    inputs, outputs = {}, {}
    handles = []
    for b, layer in enumerate(model.teacher.layers):
        handles.append(layer.register_forward_pre_hook(
            lambda module, args, b=b: inputs.__setitem__(b, args[0])))
        handles.append(layer.attn.register_forward_hook(
            lambda module, args, out, b=b: outputs.__setitem__(b, out)))
    with torch.no_grad():
        model.teacher(x)
    for handle in handles:
        handle.remove()
    student_has_cls = model.backbone.with_cls_token
    compare_patches = patch_tokens_only or not student_has_cls
    expected = 0.
    for b in model.layer_ids:
        block_input = inputs[b] if student_has_cls else inputs[b][:, 1:]
        block = model.backbone.layers[b]
        s = block.attn(block.ln1(block.attn.encode_position(block_input, (4, 4))), (4, 4))
        t = outputs[b]
        if compare_patches:
            s, t = s[:, -16:], t[:, 1:]
        expected = expected + ((s - t) ** 2).mean()
    expected = 3.0 * expected
    loss = model(x, mode='loss')['loss_align']
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    params = [p for p in model.backbone.parameters() if p.requires_grad]
    for got, want in zip(torch.autograd.grad(loss, params), torch.autograd.grad(expected, params)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
