"""LinearViTAdapter (ViT-Adapter around LinearViT): shapes, gradients, zero-init injection,
strict checkpoint loading, the CPU deformable-attention path, checkpointing and norms."""
import logging
import math
import re

import pytest
import torch
import torch.utils.checkpoint
from mmcv.ops import MultiScaleDeformableAttention
from mmcv.ops import multi_scale_deform_attn as msda_module
from mmengine.logging import MMLogger
from mmpretrain.models.utils import resize_pos_embed
from torch import nn

from linvit_mm.models import LinearViT, LinearViTAdapter
from linvit_mm.models.attention import attention_class, attention_types
from linvit_mm.models.adapters.multi_scale import deformable_inputs, flatten_maps, split_maps
from linvit_mm.testing import assert_rel_close

OPERATORS = ['softmax', 'elu', 'relu', 'inline', 'mhla', 'ttt']
ARCH = dict(embed_dims=64, num_layers=4, num_heads=2, feedforward_channels=128)
# Four interactions of one block each: every piece of the real layout, at a third of its depth.
INTERACTIONS = [[0, 0], [1, 1], [2, 2], [3, 3]]
STRIDES = (4, 8, 16, 32)


def size_id(hw):
    return f'{hw[0]}x{hw[1]}'


def make_adapter(attn_type, seed=0, dtype=torch.float32, vit=None, **kwargs):
    torch.manual_seed(seed)
    vit_cfg = dict(arch=ARCH, attn_type=attn_type, img_size=64)
    vit_cfg.update(vit or {})
    cfg = dict(vit=vit_cfg, interaction_indexes=INTERACTIONS, conv_inplane=16,
               deform_num_heads=2, deform_ratio=1.0)
    cfg.update(kwargs)
    model = LinearViTAdapter(**cfg)
    model.init_weights()
    return model.to(dtype)


def images(hw, batch=1, dtype=torch.float32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, *hw, generator=generator, dtype=dtype)


@pytest.mark.parametrize('hw', [(100, 75), (64, 64), (64, 96)], ids=size_id)
@pytest.mark.parametrize('attn_type', OPERATORS)
def test_four_maps_at_strides_4_to_32_for_any_size(attn_type, hw):
    model = make_adapter(attn_type).eval()
    with torch.no_grad():
        outs = model(images(hw))
    assert isinstance(outs, tuple) and len(outs) == 4
    for out, stride in zip(outs, STRIDES):
        assert out.shape == (1, ARCH['embed_dims'], math.ceil(hw[0] / stride),
                             math.ceil(hw[1] / stride)), f'stride {stride}'
        assert torch.isfinite(out).all()


def test_crop_keeps_the_padded_run_on_the_original_area():
    """An image padded by hand to 128x96 gives the same maps, cropped, as the 100x75 one."""
    model = make_adapter('softmax', dtype=torch.float64).eval()
    image = images((100, 75), dtype=torch.float64)
    padded = nn.functional.pad(image, (0, 96 - 75, 0, 128 - 100))
    with torch.no_grad():
        outs, padded_outs = model(image), model(padded)
    for out, padded_out in zip(outs, padded_outs):
        assert_rel_close(out, padded_out[..., :out.shape[-2], :out.shape[-1]], 1e-12)


def test_per_interaction_vit_features():
    model = make_adapter('relu', vit_feature_mode='per_interaction').eval()
    with torch.no_grad():
        outs = model(images((64, 96)))
    assert [tuple(o.shape[-2:]) for o in outs] == [(16, 24), (8, 12), (4, 6), (2, 3)]


@pytest.mark.parametrize('attn_type', OPERATORS)
def test_backward_reaches_every_parameter(attn_type):
    """Every trainable parameter gets a gradient (DDP would stall on an unused one), and the
    ViT, spatial prior, injector scale, extractors and output path get non-zero ones."""
    model = make_adapter(attn_type).train()
    outs = model(images((64, 48), batch=2))
    generator = torch.Generator().manual_seed(2)
    loss = sum((out * torch.randn(out.shape, generator=generator)).sum() for out in outs)
    loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not no_grad, f'parameters without gradient: {no_grad}'
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    nonzero = ['vit.patch_embed.projection.weight', 'vit.layers.0.attn.qkv.weight',
               'vit.layers.3.ffn.layers.1.weight', 'spm.stem.0.weight', 'level_embed',
               'interactions.0.injector.gamma', 'interactions.0.extractor.attn.value_proj.weight',
               'interactions.3.extra_extractors.1.ffn.fc1.weight', 'up.weight']
    params = dict(model.named_parameters())
    for name in nonzero:
        assert params[name].grad.abs().sum() > 0, name
    if model.vit.with_cls_token:
        assert params['vit.cls_token'].grad.abs().sum() > 0


def vit_tokens_seen_by_extractors(model, image):
    """Patch tokens each interaction hands to its extractor (its ViT tokens after its blocks)."""
    seen = []
    hooks = [block.extractor.register_forward_pre_hook(lambda m, args: seen.append(args[1]))
             for block in model.interactions]
    try:
        model(image)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def plain_vit_tokens(vit, image, groups):
    tokens, hw_shape = vit.embed(image)
    after_groups = []
    for first, last in groups:
        for layer in vit.layers[first:last + 1]:
            tokens = layer(tokens, hw_shape)
        after_groups.append(tokens[:, vit.num_extra_tokens:])
    return after_groups


@pytest.mark.parametrize('hw', [(64, 64), (64, 96)], ids=size_id)
@pytest.mark.parametrize('attn_type', OPERATORS)
def test_zero_gamma_injector_leaves_the_vit_unchanged(attn_type, hw):
    """With gamma = 0 the ViT inside the adapter computes exactly the plain ViT (class token
    carried past injector and extractor); with gamma != 0 it does not."""
    model = make_adapter(attn_type, dtype=torch.float64).eval()
    image = images(hw, dtype=torch.float64)
    with torch.no_grad():
        expected = plain_vit_tokens(model.vit, image, INTERACTIONS)
        seen = vit_tokens_seen_by_extractors(model, image)
        for i, (got, want) in enumerate(zip(seen, expected)):
            assert_rel_close(got, want, 1e-12, name=f'ViT tokens after interaction {i}')
        for block in model.interactions:
            block.injector.gamma.fill_(0.1)
        injected = vit_tokens_seen_by_extractors(model, image)
    assert (injected[-1] - expected[-1]).abs().max() > 1e-3


# ---------------------------------------------------------------------------- loading
def classifier_checkpoint(tmp_path, attn_type, img_size=32, seed=3, edit=None):
    """An mmpretrain-ImageClassifier-style checkpoint of a LinearViT (final norm included)."""
    torch.manual_seed(seed)
    vit = LinearViT(arch=ARCH, attn_type=attn_type, img_size=img_size)
    vit.init_weights()
    with torch.no_grad():
        for param in vit.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    state_dict = {f'backbone.{k}': v for k, v in vit.state_dict().items()}
    state_dict['head.layers.head.weight'] = torch.randn(10, ARCH['embed_dims'])
    state_dict['head.layers.head.bias'] = torch.zeros(10)
    if edit is not None:
        edit(state_dict)
    path = tmp_path / f'{attn_type}_cls.pth'
    torch.save({'state_dict': state_dict, 'meta': {}}, path)
    return path, state_dict


class ListHandler(logging.Handler):

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def log_messages(request):
    # A fresh instance is the current one, which the adapter logs to.
    logger = MMLogger.get_instance(f'test_adapter_{request.node.name}', log_level='INFO')
    handler = ListHandler()
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


@pytest.mark.parametrize('attn_type', ['softmax', 'mhla'])
def test_strict_load_of_a_classification_checkpoint(tmp_path, log_messages, attn_type):
    path, state_dict = classifier_checkpoint(tmp_path, attn_type)
    model = make_adapter(attn_type, pretrained=str(path))
    loaded = model.vit.state_dict()
    for key, value in loaded.items():
        source = state_dict[f'backbone.{key}']
        if key == 'pos_embed':  # stored for a 2x2 grid, the adapter's ViT holds 4x4
            source = resize_pos_embed(source, (2, 2), (4, 4), 'bicubic', 1)
        assert torch.equal(value, source), key
    log = '\n'.join(log_messages)
    assert 'backbone.ln1.weight' in log  # the final norm, skipped
    assert 'head.layers.head.weight' in log  # outside the backbone, ignored
    assert 'spm.stem.0.weight' in log and 'interactions.3.extra_extractors.1.ffn.fc2.bias' in log
    with torch.no_grad():
        model.eval()(images((64, 48)))


def test_init_cfg_pretrained_is_the_same_load(tmp_path):
    path, _ = classifier_checkpoint(tmp_path, 'relu')
    by_arg = make_adapter('relu', pretrained=str(path))
    by_init_cfg = make_adapter('relu', init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    for (key, a), b in zip(by_arg.vit.state_dict().items(), by_init_cfg.vit.state_dict().values()):
        assert torch.equal(a, b), key


def _reshape(key, shape):
    return lambda sd: sd.__setitem__(key, torch.zeros(shape))


@pytest.mark.parametrize('edit, key', [
    (_reshape('backbone.layers.1.attn.qkv.weight', (192, 32)), 'backbone.layers.1.attn.qkv.weight'),
    (lambda sd: sd.pop('backbone.layers.2.ln2.bias'), 'backbone.layers.2.ln2.bias'),
    (_reshape('backbone.layers.7.ln1.weight', (64, )), 'backbone.layers.7.ln1.weight'),
    (_reshape('backbone.pos_embed', (1, 5, 32)), 'backbone.pos_embed'),
], ids=['wrong-shape', 'missing', 'unexpected', 'pos-embed-width'])
def test_load_errors_name_the_key(tmp_path, edit, key):
    path, _ = classifier_checkpoint(tmp_path, 'softmax', edit=edit)
    model = make_adapter('softmax')
    with pytest.raises(ValueError, match=re.escape(key)):
        model.load_vit_checkpoint(str(path))


def test_checkpoint_without_the_prefix_is_refused(tmp_path):
    path = tmp_path / 'bare.pth'
    torch.save({'state_dict': {'layers.0.ln1.weight': torch.ones(64)}, 'meta': {}}, path)
    with pytest.raises(ValueError, match="no keys starting with 'backbone.'"):
        make_adapter('softmax').load_vit_checkpoint(str(path))


# ---------------------------------------------------------------------------- deformable attn
def identity_msda(embed_dims, num_levels):
    """One head, one point, zero offsets, identity projections: samples the value at the
    reference point itself, so the output shows where the reference points fall."""
    attn = MultiScaleDeformableAttention(embed_dims=embed_dims, num_heads=1,
                                         num_levels=num_levels, num_points=1, dropout=0.,
                                         batch_first=True).double()
    with torch.no_grad():
        attn.sampling_offsets.bias.zero_()
        for proj in (attn.value_proj, attn.output_proj):
            proj.weight.copy_(torch.eye(embed_dims))
            proj.bias.zero_()
    return attn


def test_deformable_attention_runs_the_pytorch_path_on_cpu(monkeypatch):
    """The CPU fallback is used, and the reference points sit on cell centres: a grid
    sampling itself gets its own values back, a 2x coarser grid gets 2x2 means."""
    calls = []
    fallback = msda_module.multi_scale_deformable_attn_pytorch

    def spy(*args, **kwargs):
        calls.append(1)
        return fallback(*args, **kwargs)

    monkeypatch.setattr(msda_module, 'multi_scale_deformable_attn_pytorch', spy)
    dims = 4
    fine = torch.randn(2, dims, 4, 6, dtype=torch.float64)
    value = flatten_maps([fine])
    attn = identity_msda(dims, num_levels=1)

    inputs = deformable_inputs([(4, 6)], [(4, 6)], like=value)
    same = attn(query=value, value=value, identity=value.new_zeros(()), **inputs._asdict())
    assert_rel_close(same, value, 1e-12, name='same-grid sampling')

    coarse_query = torch.zeros(2, 2 * 3, dims, dtype=torch.float64)
    inputs = deformable_inputs([(2, 3)], [(4, 6)], like=value)
    coarse = attn(query=coarse_query, value=value, identity=coarse_query.new_zeros(()),
                  **inputs._asdict())
    expected = flatten_maps([nn.functional.avg_pool2d(fine, 2)])
    assert_rel_close(coarse, expected, 1e-12, name='2x coarser queries')
    assert len(calls) == 2

    model = make_adapter('elu').train()
    calls.clear()
    sum(o.sum() for o in model(images((64, 64)))).backward()
    # 4 injectors + 4 extractors + 2 extra extractors
    assert len(calls) == 10
    assert model.interactions[0].extractor.attn.sampling_offsets.weight.grad.abs().sum() > 0


def test_split_and_flatten_maps_are_inverse():
    maps = [torch.randn(2, 3, h, w) for h, w in [(4, 6), (2, 3), (1, 2)]]
    tokens = flatten_maps(maps)
    assert tokens.shape == (2, 24 + 6 + 2, 3)
    for got, want in zip(split_maps(tokens, [(4, 6), (2, 3), (1, 2)]), maps):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match='do not hold'):
        split_maps(tokens, [(4, 6)])


@pytest.mark.parametrize('vit_feature_mode', ['last', 'per_interaction', 'none'])
def test_roi_align_after_a_neck_conv_reads_the_maps_right(vit_feature_mode):
    """A detector's RoI features from the adapter's maps match torchvision's RoIAlign.

    mmcv's CPU RoIAlign indexes its input's memory as (B, C, h, w) whatever its strides;
    maps in channels-last layout (which a neck's convolution keeps) were read scrambled,
    and the second stage of Mask R-CNN trained on noise.
    """
    from mmcv.ops import roi_align as mmcv_roi_align
    from torchvision.ops import roi_align as torchvision_roi_align
    options = (dict(add_vit_feature=False) if vit_feature_mode == 'none'
               else dict(vit_feature_mode=vit_feature_mode))
    model = make_adapter('relu', **options).eval()
    torch.manual_seed(2)
    neck_conv = nn.Conv2d(ARCH['embed_dims'], 8, 3, padding=1)
    rois = torch.tensor([[0, 4.0, 6.0, 40.0, 50.0], [1, 20.5, 3.0, 90.0, 60.5]])
    with torch.no_grad():
        outs = model(images((64, 96), batch=2))
        for out, stride in zip(outs, STRIDES):
            assert out.is_contiguous(), f'stride {stride}'
            feature_map = neck_conv(out)
            got = mmcv_roi_align(feature_map, rois, (7, 7), 1.0 / stride, 0, 'avg', True)
            want = torchvision_roi_align(feature_map, rois, (7, 7), 1.0 / stride, 0, True)
            assert_rel_close(got, want, 1e-5)


def test_split_maps_gives_the_standard_layout():
    maps = split_maps(torch.randn(2, 4 * 6 + 2 * 3, 5), [(4, 6), (2, 3)])
    assert all(m.is_contiguous() for m in maps)


# ---------------------------------------------------------------------------- options
@pytest.mark.parametrize('attn_type', ['softmax', 'ttt'])
def test_with_cp_gives_the_same_output_and_gradients(attn_type, monkeypatch):
    vit = dict(drop_path_rate=0.1)  # drop-path masks must also replay identically
    plain = make_adapter(attn_type, dtype=torch.float64, vit=vit).train()
    checkpointed = make_adapter(attn_type, dtype=torch.float64, vit=vit, with_cp=True).train()
    checkpointed.load_state_dict(plain.state_dict())

    calls = []
    original = torch.utils.checkpoint.checkpoint

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, 'checkpoint', counting)
    image = images((64, 48), batch=2, dtype=torch.float64)
    results = []
    for model in (plain, checkpointed):
        torch.manual_seed(5)
        outs = model(image)
        sum((out * out).mean() for out in outs).backward()
        results.append((outs, {n: p.grad for n, p in model.named_parameters()}))
    # 4 injectors + 6 extractors + 4 ViT blocks, all in the checkpointed model only
    assert len(calls) == 14
    (outs_a, grads_a), (outs_b, grads_b) = results
    for i, (a, b) in enumerate(zip(outs_a, outs_b)):
        assert_rel_close(b, a, 1e-12, name=f'output {i}')
    for name, grad in grads_a.items():
        assert_rel_close(grads_b[name], grad, 1e-10, name=name)


def test_cpu_bf16_autocast_runs_close_to_float32():
    """The CPU ``--amp`` path (bf16 autocast) runs forward and backward through the adapter."""
    model = make_adapter('softmax').train()
    with torch.no_grad():
        for block in model.interactions:
            block.injector.gamma.fill_(0.1)
    image = images((64, 48), batch=2)
    reference = model(image)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        outs = model(image)
    sum(out.float().sum() for out in outs).backward()
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert_rel_close(out.float(), ref, 0.05, name=f'bf16 output {i}')
    assert torch.isfinite(model.interactions[0].injector.gamma.grad).all()


@pytest.mark.parametrize('norm_cfg, norm_type', [
    (dict(type='BN', requires_grad=True), nn.BatchNorm2d),
    (dict(type='GN', num_groups=8, requires_grad=True), nn.GroupNorm),
    (dict(type='SyncBN', requires_grad=True), nn.SyncBatchNorm),
], ids=['BN', 'GN', 'SyncBN'])
def test_norm_layers_come_from_norm_cfg(norm_cfg, norm_type):
    model = make_adapter('inline', norm_cfg=norm_cfg)
    assert all(isinstance(norm, norm_type) for norm in model.out_norms)
    assert isinstance(model.spm.stem[1], norm_type) and isinstance(model.spm.conv4[1], norm_type)
    assert isinstance(model.interactions[0].injector.query_norm, nn.LayerNorm)
    if norm_type is not nn.SyncBatchNorm:  # SyncBN needs a process group to run in training
        outs = model.train()(images((64, 64), batch=2))
        assert outs[0].shape == (2, 64, 16, 16)


def test_layer_depth_for_layerwise_decay():
    model = make_adapter('relu')
    num_depths = ARCH['num_layers'] + 2
    assert model.get_layer_depth('backbone.vit.patch_embed.projection.weight',
                                 'backbone.') == (0, num_depths)
    assert model.get_layer_depth('backbone.vit.pos_embed', 'backbone.') == (0, num_depths)
    assert model.get_layer_depth('backbone.vit.layers.2.attn.qkv.weight',
                                 'backbone.') == (3, num_depths)
    for adapter_param in ('spm.stem.0.weight', 'interactions.0.injector.gamma', 'level_embed',
                          'out_norms.0.weight', 'up.weight'):
        assert model.get_layer_depth(adapter_param) == (num_depths - 1, num_depths)
    assert not hasattr(model.vit, 'ln1')


@pytest.mark.parametrize('kwargs, message', [
    (dict(vit=dict(final_norm=True)), 'final_norm'),
    (dict(interaction_indexes=[[0, 1], [3, 3]]), 'follow one another'),
    (dict(interaction_indexes=[[0, 1], [2, 2]]), 'cover all 4'),
    (dict(deform_num_heads=3), 'must divide'),
    (dict(interaction_indexes=[[0, 1], [2, 3]], vit_feature_mode='per_interaction'),
     'needs 4 interactions'),
    (dict(vit_feature_mode='mean'), 'vit_feature_mode'),
    (dict(init_cfg=dict(type='Kaiming')), "type='Pretrained'"),
], ids=['final-norm', 'gap', 'short', 'heads', 'per-interaction', 'feature-mode', 'init-cfg'])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_adapter('softmax', **kwargs)


def test_defaults_follow_vit_adapter():
    """Deformable heads / ratio by ViT width (12 / 0.5 at 768) and four equal groups."""
    wide = dict(embed_dims=768, num_layers=4, num_heads=12, feedforward_channels=64)
    model = LinearViTAdapter(vit=dict(arch=wide, attn_type='relu', img_size=32), conv_inplane=8)
    assert (model.deform_num_heads, model.deform_ratio) == (12, 0.5)
    assert model.interactions[0].injector.attn.value_proj.out_features == 384
    deep = dict(ARCH, num_layers=12)
    model = LinearViTAdapter(vit=dict(arch=deep, attn_type='relu'), conv_inplane=8,
                             deform_num_heads=2, deform_ratio=1.0)
    assert model.interaction_indexes == [[0, 2], [3, 5], [6, 8], [9, 11]]
    assert [len(block.extra_extractors) for block in model.interactions] == [0, 0, 0, 2]
    with pytest.raises(ValueError, match='no ViT-Adapter default for embed_dims=64'):
        LinearViTAdapter(vit=dict(arch=ARCH, attn_type='relu'), interaction_indexes=INTERACTIONS)


@pytest.mark.parametrize('scope', ['mmdet', 'mmseg'])
def test_builds_from_downstream_registries(scope):
    """``type='mmpretrain.LinearViTAdapter'`` resolves from mmdet's and mmseg's MODELS."""
    registry = pytest.importorskip(f'{scope}.registry').MODELS
    model = registry.build(dict(
        type='mmpretrain.LinearViTAdapter', vit=dict(arch=ARCH, attn_type='mhla'),
        interaction_indexes=INTERACTIONS, conv_inplane=16, deform_num_heads=2,
        deform_ratio=1.0))
    assert isinstance(model, LinearViTAdapter)


# ---------------------------------------------------------------------------- hybrids
HYBRID = 'hedgehog+softmax@0,3'


def test_a_hybrid_vit_loads_its_classification_checkpoint_and_trains(tmp_path):
    """The adapter drives a hybrid's blocks, each with its own operator, loads the hybrid's
    checkpoint strictly (hedgehog's feature maps in blocks 1 and 2, none in 0 and 3) and
    every parameter gets a gradient."""
    path, state_dict = classifier_checkpoint(tmp_path, HYBRID)
    model = make_adapter(HYBRID, pretrained=str(path)).train()
    assert model.vit.attn_types == ['softmax', 'hedgehog', 'hedgehog', 'softmax']
    for key, value in model.vit.state_dict().items():
        if key != 'pos_embed':  # resized from the checkpoint's 2x2 grid
            assert torch.equal(value, state_dict[f'backbone.{key}']), key
    outs = model(images((64, 48), batch=2))
    assert [out.shape[-2:] for out in outs] == [(16, 12), (8, 6), (4, 3), (2, 2)]
    sum(out.square().mean() for out in outs).backward()
    no_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not no_grad, f'parameters without gradient: {no_grad}'
    assert model.vit.layers[1].attn.feature_proj.grad.abs().sum() > 0


def test_a_checkpoint_of_another_layout_is_refused_by_key(tmp_path):
    path, _ = classifier_checkpoint(tmp_path, 'softmax')
    with pytest.raises(ValueError, match=r'missing keys \(the model has them, the checkpoint '
                                         r'not\): backbone\.layers\.1\.attn\.feature_proj'):
        make_adapter(HYBRID, pretrained=str(path))


# ---------------------------------------------------------------------------- sources
# Each source's switches (patch size, registers, LayerScale, RoPE) at a test width and depth.
# word -> (patch size, registers)
SOURCES = {
    'dinov2-small': (14, 0),
    'dinov2-reg-small': (14, 4),
    'dinov3-small': (16, 4),  # and RoPE
}
# Neither a multiple of 14 nor of 32, and not square: the ViT grid of patch 14 tiles 98 x 70
# pixels of the 96 x 64 the levels tile.
ODD_SIZE = (90, 61)


def source_adapter(word, attn_type, dtype=torch.float32, **kwargs):
    return make_adapter(attn_type, dtype=dtype,
                        vit=dict(arch=dict(LinearViT.arch_zoo[word], **ARCH)), **kwargs)


@pytest.mark.parametrize('hw', [ODD_SIZE, (64, 112)], ids=size_id)
@pytest.mark.parametrize('attn_type', ['relu', 'ttt'])
@pytest.mark.parametrize('word', SOURCES)
def test_sources_give_four_maps_at_strides_4_to_32(word, attn_type, hw):
    """Patch 14 or 16, registers and RoPE: the maps FPN and UperNet expect, ceil(H / s) x
    ceil(W / s) at s = 4, 8, 16, 32, and every parameter trains."""
    model = source_adapter(word, attn_type).train()
    patch, registers = SOURCES[word]
    # ttt pools the patch tokens and has no class token; the registers stay
    with_cls_token = attention_class(attn_type).uses_cls_token
    assert (model.vit.patch_size, model.vit.num_extra_tokens) == (
        patch, registers + with_cls_token)
    outs = model(images(hw, batch=2))
    assert [tuple(out.shape) for out in outs] == [
        (2, ARCH['embed_dims'], math.ceil(hw[0] / s), math.ceil(hw[1] / s)) for s in STRIDES]
    sum(out.square().mean() for out in outs).backward()
    no_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not no_grad, f'parameters without gradient: {no_grad}'
    assert model.vit.register_tokens is None or model.vit.register_tokens.grad.abs().sum() > 0


@pytest.mark.parametrize('attn_type', attention_types())
@pytest.mark.parametrize('word', ['dinov2-reg-small', 'dinov3-small'])
def test_every_operator_builds_from_the_sources(word, attn_type):
    """Every operator runs in the adapter at patch 14 with registers; with RoPE, those that
    do not carry it are refused when built, naming the reason."""
    operator = attention_class(attn_type)
    if LinearViT.arch_zoo[word].get('rope') and not operator.supports_rope:
        with pytest.raises(ValueError, match='does not carry RoPE'):
            source_adapter(word, attn_type)
        return
    model = source_adapter(word, attn_type).eval()
    with torch.no_grad():
        outs = model(images(ODD_SIZE))
    assert [tuple(out.shape[-2:]) for out in outs] == [(23, 16), (12, 8), (6, 4), (3, 2)]
    assert all(torch.isfinite(out).all() for out in outs)


@pytest.mark.parametrize('word', SOURCES)
def test_zero_gamma_injector_leaves_a_source_vit_unchanged(word):
    """Registers ride with the class token past injectors and extractors, and the blocks get
    the ViT's own grid (RoPE's rotations, patch 14's ceil(H' / 14) cells): with gamma = 0
    the adapter's ViT computes the plain ViT on the 32-padded image."""
    model = source_adapter(word, 'relu', dtype=torch.float64).eval()
    image = images(ODD_SIZE, dtype=torch.float64)
    padded = nn.functional.pad(image, (0, 64 - 61, 0, 96 - 90))
    with torch.no_grad():
        expected = plain_vit_tokens(model.vit, padded, INTERACTIONS)
        seen = vit_tokens_seen_by_extractors(model, image)
    patch = model.vit.patch_size
    assert expected[0].shape[1] == math.ceil(96 / patch) * math.ceil(64 / patch)
    for i, (got, want) in enumerate(zip(seen, expected)):
        assert_rel_close(got, want, 1e-12, name=f'ViT tokens after interaction {i}')


def pixel_grid(shape, cell):
    """``(1, 2, h, w)``: the (y, x) pixel position of each cell centre of a grid of ``cell``
    pixels. Bilinear sampling reproduces a linear function exactly between cell centres, so
    sampling this map at a point returns that point's position in pixels."""
    ys = (torch.arange(shape[0], dtype=torch.float64) + 0.5) * cell
    xs = (torch.arange(shape[1], dtype=torch.float64) + 0.5) * cell
    grid_y, grid_x = torch.meshgrid(ys, xs, indexing='ij')
    return torch.stack((grid_y, grid_x))[None]


@pytest.mark.parametrize('query_cell, value_cell', [(14, 8), (8, 14), (16, 8), (8, 16)],
                         ids=['vit14-to-stride8', 'stride8-to-vit14', 'vit16-to-stride8',
                              'stride8-to-vit16'])
def test_reference_points_match_positions_in_pixels(query_cell, value_cell):
    """Queries on one grid sample the values at their own cell centres, in pixels, when the
    two grids tile different areas of the same 96 x 64 image (patch 14 tiles 98 x 70). A
    query lying between value cell centres gets back its pixel position exactly; with the
    areas ignored (both taken as the unit square) patch 14's would be off by up to 2 px."""
    image_hw = (96, 64)
    query_shape, value_shape = ([math.ceil(s / cell) for s in image_hw]
                                for cell in (query_cell, value_cell))
    query_extent, value_extent = ([n * cell for n in shape] for shape, cell in (
        (query_shape, query_cell), (value_shape, value_cell)))
    value = flatten_maps([pixel_grid(value_shape, value_cell)])
    queries = pixel_grid(query_shape, query_cell)
    attn = identity_msda(2, num_levels=1)
    inputs = deformable_inputs([query_shape], [value_shape], like=value,
                               query_extent=query_extent, value_extent=value_extent)
    sampled = attn(query=torch.zeros_like(flatten_maps([queries])), value=value,
                   identity=value.new_zeros(()), **inputs._asdict())
    sampled = split_maps(sampled, [query_shape])[0]
    # the queries whose centres lie within the value centres' span (elsewhere zero padding)
    lo, hi = value_cell / 2, [(n - 0.5) * value_cell for n in value_shape]
    inside = ((queries[:, 0] >= lo) & (queries[:, 0] <= hi[0])
              & (queries[:, 1] >= lo) & (queries[:, 1] <= hi[1]))[:, None].expand_as(queries)
    assert inside.sum() >= 2 * 0.6 * queries[0, 0].numel()
    assert_rel_close(sampled[inside], queries[inside], 1e-12, name='sampled pixel positions')
    if query_extent != value_extent:
        with pytest.raises(ValueError, match='give both'):
            deformable_inputs([query_shape], [value_shape], like=value, query_extent=query_extent)
    else:
        plain = deformable_inputs([query_shape], [value_shape], like=value)
        assert torch.equal(plain.reference_points, inputs.reference_points)


def captured_reference_points(model, image):
    """The reference points of the first injector's and extractor's deformable attention."""
    captured = {}

    def capture(name):
        def hook(module, args, kwargs):
            captured.setdefault(name, kwargs['reference_points'])
        return hook

    block = model.interactions[0]
    hooks = [part.attn.register_forward_pre_hook(capture(name), with_kwargs=True)
             for name, part in (('inject', block.injector), ('extract', block.extractor))]
    try:
        with torch.no_grad():
            model(image)
    finally:
        for hook in hooks:
            hook.remove()
    return captured['inject'][0, :, 0], captured['extract'][0, :, 0]


@pytest.mark.parametrize('word', ['dinov2-reg-small', 'dinov3-small'])
def test_adapter_reference_points_are_cell_centres_in_pixels(word):
    """The injector's ViT-cell queries point at their centres in the levels' 96 x 64 area;
    the extractor's level-cell queries at theirs in the area the ViT grid tiles (98 x 70 at
    patch 14). At patch 16 both areas are one: the points are the plain cell centres."""
    model = source_adapter(word, 'relu').eval()
    inject, extract = captured_reference_points(model, images(ODD_SIZE))
    patch = model.vit.patch_size
    vit_shape = (math.ceil(96 / patch), math.ceil(64 / patch))
    vit_centres = pixel_grid(vit_shape, patch).flatten(2)[0].T.flip(-1)  # (x, y) in pixels
    assert_rel_close(inject * inject.new_tensor([64, 96]), vit_centres.float(), 1e-6,
                     name='injector reference points')
    level_centres = torch.cat([pixel_grid((96 // s, 64 // s), s).flatten(2)[0].T.flip(-1)
                               for s in (8, 16, 32)])
    vit_extent = [vit_shape[1] * patch, vit_shape[0] * patch]
    assert_rel_close(extract * extract.new_tensor(vit_extent), level_centres.float(), 1e-6,
                     name='extractor reference points')
    if patch == 16:
        plain = deformable_inputs([vit_shape], [(12, 8), (6, 4), (3, 2)], like=inject)
        assert torch.equal(inject, plain.reference_points[0, :, 0])


@pytest.mark.parametrize('stride', STRIDES)
@pytest.mark.parametrize('patch', [14, 16])
def test_vit_map_is_resampled_in_pixels(patch, stride):
    """add_vit_feature: the ViT map on a level's grid holds, at each level cell, the ViT
    features at that cell's centre (a map of pixel positions comes back as the level's
    pixel positions between ViT cell centres); at patch 16 it is the plain resize of the
    ViT map to the level's size."""
    model = source_adapter('dinov2-small' if patch == 14 else 'dinov3-small', 'relu')
    vit_shape = (math.ceil(96 / patch), math.ceil(64 / patch))
    level_shape = (96 // stride, 64 // stride)
    resampled = model.resample_vit_map(pixel_grid(vit_shape, patch), stride, level_shape)
    assert resampled.shape[-2:] == level_shape
    level = pixel_grid(level_shape, stride)
    lo, hi = patch / 2, [(n - 0.5) * patch for n in vit_shape]
    inside = ((level[:, 0] >= lo) & (level[:, 0] <= hi[0])
              & (level[:, 1] >= lo) & (level[:, 1] <= hi[1]))[:, None].expand_as(level)
    assert inside.any()
    assert_rel_close(resampled[inside], level[inside], 1e-12, name='resampled positions')
    if patch == 16:
        plain = nn.functional.interpolate(pixel_grid(vit_shape, patch), size=level_shape,
                                          mode='bilinear', align_corners=False)
        assert torch.equal(resampled, plain)


def test_patch_embedding_must_pad_at_the_corner():
    """A patch embedding that drops the remainder (or pads all round) would not tile the
    image from its top-left corner, where the levels are matched to it."""
    vit = dict(arch=dict(LinearViT.arch_zoo['dinov2-small'], **ARCH), patch_cfg=dict(padding=0))
    with pytest.raises(ValueError, match="padding='corner'.*got 0"):
        make_adapter('relu', vit=vit)
