"""load_softmax_checkpoint: every known layout to the same tensors in mmpretrain names, and the
head count a caller states."""
import argparse
from collections import OrderedDict

import pytest
import torch

from linvit_mm.transfer import SoftmaxCheckpoint, load_softmax_checkpoint
from linvit_mm.transfer.checkpoint import KNOWN_FORMATS


def prefixed(prefix, state):
    return OrderedDict((prefix + k, v) for k, v in state.items())


def perturbed(state):
    return OrderedDict((key, value + 1.0) for key, value in state.items())


@pytest.fixture(scope='module')
def layouts(timm_sd, expected, timm_sd_fc_norm):
    return _layouts(timm_sd, expected, timm_sd_fc_norm)


def _layouts(sd, mm, fc_norm):
    backbone_only = OrderedDict((k, v) for k, v in sd.items() if not k.startswith('head.'))
    projection_mlp = {'head.0.weight': torch.randn(16, 192), 'head.1.weight': torch.ones(16),
                      'head.1.running_mean': torch.zeros(16)}
    dino_head = {'head.mlp.0.weight': torch.randn(16, 192),
                 'head.last_layer.weight_g': torch.ones(32, 1),
                 'head.last_layer.weight_v': torch.randn(32, 16)}
    decoder = {'mask_token': torch.zeros(1, 1, 16), 'decoder_embed.weight': torch.randn(16, 192),
               'decoder_pos_embed': torch.zeros(1, 197, 16),
               'decoder_blocks.0.attn.qkv.weight': torch.randn(48, 16),
               'decoder_norm.weight': torch.ones(16), 'decoder_pred.weight': torch.randn(768, 16)}
    return {
        'deit-official': (
            {'model': sd, 'model_ema': perturbed(sd), 'epoch': 299,
             'args': argparse.Namespace(model='deit_tiny_patch16_224', lr=5e-4)},
            'deit-official', {}, 3),
        'timm-bare': (sd, 'timm', {}, None),
        'timm-train': (
            {'state_dict': prefixed('module.', sd), 'arch': 'deit_tiny_patch16_224',
             'version': 2, 'metric': 72.2},
            'timm', {}, 3),
        'mmpretrain': (
            {'state_dict': OrderedDict(
                mm, **{'data_preprocessor.mean': torch.zeros(3),
                       'neck.weight': torch.ones(3)}),
             'meta': {'cfg': "model = dict(backbone=dict(type='VisionTransformer', "
                             "arch='deit-tiny'))", 'epoch': 300}},
            'mmpretrain', {"mmpretrain 'data_preprocessor'": 1, "mmpretrain 'neck'": 1}, 3),
        'dino-full': (
            {'teacher': OrderedDict(prefixed('backbone.', backbone_only), **dino_head),
             'student': prefixed('module.backbone.', perturbed(backbone_only)),
             'optimizer': {'state': {}, 'param_groups': []}, 'epoch': 100,
             'args': argparse.Namespace(arch='vit_tiny', patch_size=16),
             'dino_loss': {'center': torch.zeros(1, 32)}},
            'dino', {'self-supervised projection head': 3}, 3),
        'dino-ddp-teacher': (
            {'teacher': OrderedDict(prefixed('module.backbone.', backbone_only),
                                    **prefixed('module.', dino_head)),
             'student': prefixed('module.backbone.', perturbed(backbone_only)),
             'dino_loss': {'center': torch.zeros(1, 32)}},
            'dino', {'self-supervised projection head': 3}, None),
        'mocov3': (
            {'epoch': 300, 'arch': 'vit_small',  # MoCo v3's vit_small is 384-d: no heads
             'state_dict': OrderedDict(
                 prefixed('module.base_encoder.', OrderedDict(backbone_only, **projection_mlp)),
                 **prefixed('module.momentum_encoder.', perturbed(backbone_only)),
                 **{'module.predictor.0.weight': torch.randn(16, 16)}),
             'optimizer': {'state': {}, 'param_groups': []}},
            'mocov3', {'MoCo v3 momentum encoder': len(backbone_only),
                       'MoCo v3 predictor MLP': 1,
                       'head that is not a linear classifier (projection MLP)': 3}, None),
        'ibot-release': ({'state_dict': backbone_only}, 'ibot', {}, None),
        'ibot-release-prefixed': (
            {'state_dict': OrderedDict(prefixed('backbone.', backbone_only), **dino_head)},
            'ibot', {'self-supervised projection head': 3}, None),
        'ibot-full': (
            {'teacher': OrderedDict(prefixed('backbone.', backbone_only),
                                    **{'head.last_layer2.weight': torch.randn(8, 4)}),
             'student': prefixed('module.backbone.', perturbed(backbone_only)),
             'ibot_loss': {'center': torch.zeros(1, 8)}},
            'ibot', {'self-supervised projection head': 1}, None),
        'mae-pretrain': (
            {'model': OrderedDict(backbone_only, **decoder), 'epoch': 1599,
             'args': argparse.Namespace(model='mae_vit_base_patch16')},
            'mae', {'MAE decoder': len(decoder)}, None),
        'mae-finetuned': ({'model': fc_norm}, 'mae', {}, None),
    }


LAYOUT_IDS = ['deit-official', 'timm-bare', 'timm-train', 'mmpretrain', 'dino-full',
              'dino-ddp-teacher', 'mocov3', 'ibot-release', 'ibot-release-prefixed',
              'ibot-full', 'mae-pretrain', 'mae-finetuned']
LAYOUTS_WITH_CLASSIFIER = ('deit-official', 'timm-bare', 'timm-train', 'mmpretrain',
                           'mae-finetuned')


@pytest.mark.parametrize('layout', LAYOUT_IDS, ids=LAYOUT_IDS)
@pytest.mark.parametrize('from_file', [True, False], ids=['file', 'in-memory'])
def test_every_layout_maps_to_the_same_tensors(layout, from_file, layouts, expected,
                                                tmp_path):
    raw, source_format, unused_counts, num_heads = layouts[layout]
    if from_file:
        path = tmp_path / f'{layout}.pth'
        torch.save(raw, path)
        ckpt = load_softmax_checkpoint(path)
    else:
        ckpt = load_softmax_checkpoint(raw)

    assert ckpt.source_format == source_format
    assert source_format in KNOWN_FORMATS
    want = OrderedDict(expected)
    if layout == 'mae-finetuned':
        want = OrderedDict((k.replace('backbone.ln1.', 'backbone.ln2.'), v)
                           for k, v in want.items())
    if layout not in LAYOUTS_WITH_CLASSIFIER:
        want = OrderedDict((k, v) for k, v in want.items() if not k.startswith('head.'))
    assert set(ckpt.state_dict) == set(want)
    for key, value in want.items():
        assert torch.equal(ckpt.state_dict[key], value), key
    assert {group: len(keys) for group, keys in ckpt.unused_groups.items()} == unused_counts
    assert sorted(ckpt.unused_keys) == sorted(k for keys in ckpt.unused_groups.values()
                                              for k in keys)
    assert (ckpt.embed_dims, ckpt.depth, ckpt.patch_size) == (192, 12, (16, 16))
    assert (ckpt.pos_grid, ckpt.num_extra_tokens) == ((14, 14), 1)
    assert ckpt.num_heads == num_heads


# ------------------------------------------------------------------ stated head count


def test_a_stated_head_count_fills_what_the_checkpoint_does_not_say(timm_sd, tmp_path):
    path = tmp_path / 'deit.pth'
    torch.save({'model': timm_sd}, path)
    assert load_softmax_checkpoint(path).num_heads is None
    ckpt = load_softmax_checkpoint(path, num_heads=3)
    assert (ckpt.num_heads, ckpt.num_heads_from) == (3, 'given as num_heads=3')
    assert 'num_heads       : 3 (given as num_heads=3)' in ckpt.summary()
    # agreeing with the checkpoint's own statement is fine
    stated = {'model': timm_sd, 'args': argparse.Namespace(model='deit_tiny_patch16_224')}
    ckpt = load_softmax_checkpoint(stated, num_heads=3)
    assert ckpt.num_heads_from == "args['model']='deit_tiny_patch16_224'"


@pytest.mark.parametrize('num_heads,match', [
    (5, r'num_heads=5 does not divide the checkpoint\'s width embed_dims=192'),
    (6, r"num_heads=6 was given, but the checkpoint states num_heads=3 "
        r"\(args\['model'\]='deit_tiny_patch16_224'\)"),
    (0, 'num_heads must be a positive integer'),
    ('3', 'num_heads must be a positive integer'),
], ids=['not-a-divisor', 'contradicts-metadata', 'zero', 'string'])
def test_a_stated_head_count_that_does_not_fit_is_refused(timm_sd, num_heads, match):
    stated = {'model': timm_sd, 'args': argparse.Namespace(model='deit_tiny_patch16_224')}
    with pytest.raises(ValueError, match=match):
        load_softmax_checkpoint(stated, num_heads=num_heads)


def test_with_num_heads_returns_a_checked_copy(timm_sd):
    ckpt = load_softmax_checkpoint(timm_sd)
    assert isinstance(ckpt, SoftmaxCheckpoint)
    stated = ckpt.with_num_heads(3)
    assert stated is not ckpt and ckpt.num_heads is None and stated.num_heads == 3
    assert stated.state_dict is ckpt.state_dict
    assert ckpt.with_num_heads(None) is ckpt and stated.with_num_heads(3) is stated
    with pytest.raises(ValueError, match='checkpoint states num_heads=3'):
        stated.with_num_heads(6)
    with pytest.raises(ValueError, match='does not divide'):
        ckpt.with_num_heads(7)
    assert 'not recorded in the checkpoint; state it with num_heads' in ckpt.summary()


def deit3_like(width):
    """A checkpoint read as DeiT III from its tensors (LayerScale, a position embedding
    without class slot), which DINOv2's tensors would fit as well."""
    return SoftmaxCheckpoint(state_dict={'backbone.pos_embed': torch.zeros(1, 4, width)},
                             source_format='timm', embed_dims=width, num_extra_tokens=0,
                             layer_scale=True, family='deit3', family_from='its tensors')


def test_with_family_restates_the_family_and_what_it_fixes():
    ckpt = deit3_like(1536)  # a width DINOv2 released (ViT-g, 24 heads), DeiT III did not
    assert ckpt.with_family(None) is ckpt and ckpt.with_family('deit3') is ckpt
    dinov2 = ckpt.with_family('dinov2')
    assert (dinov2.family, dinov2.family_from, dinov2.rope) == (
        'dinov2', "given as family='dinov2'", None)
    assert (dinov2.num_heads, dinov2.num_heads_from) == (24, 'the dinov2 family at width 1536')
    assert dinov2.state_dict is ckpt.state_dict
    assert (ckpt.family, ckpt.num_heads) == ('deit3', None)
    # a head count the checkpoint already states stays
    stated = ckpt.with_num_heads(16).with_family('dinov2')
    assert (stated.num_heads, stated.num_heads_from) == (16, 'given as num_heads=16')
    # a width the family did not release leaves it unknown
    assert deit3_like(64).with_family('dinov2').num_heads is None


def test_with_family_checks_the_tensors_and_the_release():
    ckpt = deit3_like(384)
    with pytest.raises(ValueError, match=r"family='clip' was given, but the checkpoint cannot be "
                                         r'a CLIP .* it has pre_norm=False, layer_scale=True;'):
        ckpt.with_family('clip')
    # the position embedding is what makes it DINOv2-like
    without_pos = SoftmaxCheckpoint(**dict(vars(ckpt), state_dict={}))
    with pytest.raises(ValueError, match=r'it has pos_embed=False; drop family='):
        without_pos.with_family('dinov2')
    release = SoftmaxCheckpoint(**dict(vars(ckpt), source_format='dinov2', family='dinov2'))
    with pytest.raises(ValueError, match=r"family='deit3' was given, but the checkpoint is a "
                                         r"'dinov2' release"):
        release.with_family('deit3')


def test_a_checkpoint_built_by_hand_reads_as_a_plain_vit():
    ckpt = SoftmaxCheckpoint(state_dict={}, source_format='timm')
    assert (ckpt.num_register_tokens, ckpt.layer_scale, ckpt.ffn_type, ckpt.ffn_norm,
            ckpt.pre_norm, ckpt.qkv_bias) == (0, False, 'mlp', False, False, True)
    assert (ckpt.unused_keys, ckpt.unused_groups, ckpt.notes) == ([], {}, [])


def test_the_summary_lists_each_unused_group_with_three_examples_at_most():
    groups = {'head': ['h0', 'h1', 'h2', 'h3'], 'decoder': ['d0', 'd1', 'd2'], 'mask': ['m0']}
    ckpt = SoftmaxCheckpoint(state_dict={}, source_format='timm',
                             unused_keys=[k for keys in groups.values() for k in keys],
                             unused_groups=groups)
    lines = ckpt.summary().splitlines()
    start = lines.index('unused tensors  : 8')
    assert lines[start + 1:start + 4] == ['  - head: 4 (h0, h1, h2, ...)',
                                          '  - decoder: 3 (d0, d1, d2)',
                                          '  - mask: 1 (m0)']


def test_a_head_count_that_cannot_fit_is_refused_before_the_file_is_read(tmp_path):
    # a missing file would be a FileNotFoundError: the head count is checked first
    with pytest.raises(ValueError, match='num_heads must be a positive integer'):
        load_softmax_checkpoint(tmp_path / 'missing.pth', num_heads=0)


def test_a_head_count_taken_from_the_family_is_noted(timm_source):
    state = timm_source('deit3-small', embed_dim=192, num_heads=3).state_dict()
    ckpt = load_softmax_checkpoint(state)
    assert (ckpt.family, ckpt.num_heads) == ('deit3', 3)
    assert ckpt.num_heads_from == 'the deit3 family at width 192'
    assert 'num_heads=3 from the deit3 family at width 192' in ckpt.notes


def test_reading_refuses_a_linear_source(timm_sd):
    inline = OrderedDict(timm_sd, **{'blocks.0.attn.residual.0.weight': torch.zeros(192, 64, 1)})
    with pytest.raises(ValueError, match=r'this is a InLine attention .* not a Softmax ViT'):
        load_softmax_checkpoint({'model': inline})


def test_reading_refuses_integer_weights(timm_sd):
    integer = OrderedDict(timm_sd)
    integer['blocks.2.attn.proj.bias'] = torch.zeros(192, dtype=torch.int64)
    with pytest.raises(ValueError, match=r'1 weight tensor\(s\) are not floating point:\n  '
                                         r'backbone\.layers\.2\.attn\.proj\.bias '
                                         r'\(blocks\.2\.attn\.proj\.bias\): torch\.int64'):
        load_softmax_checkpoint(integer)
