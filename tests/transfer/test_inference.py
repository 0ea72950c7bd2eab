"""What a checkpoint's shapes and metadata say: width, depth, position layout, head count."""
import argparse
import functools
import re
from collections import OrderedDict

import pytest
import timm
import torch
from mmpretrain.models import VisionTransformer

from linvit_mm.transfer import load_softmax_checkpoint
from linvit_mm.transfer.inference import _ARCH_HEADS, Layout, check_num_heads, infer_layout


def test_arch_names_give_heads_only_in_their_own_code_base(timm_sd):
    # timm's train.py names timm models and writes 'version'; the same layout without
    # it (e.g. a MoCo v3 linear-probe checkpoint) may use another code base's names.
    timm_train = {'state_dict': timm_sd, 'arch': 'deit_tiny_patch16_224', 'version': 2}
    assert load_softmax_checkpoint(timm_train).num_heads == 3
    other = {'state_dict': timm_sd, 'arch': 'deit_tiny_patch16_224', 'best_acc1': 70.0}
    assert load_softmax_checkpoint(other).num_heads is None
    dino_name_on_deit = {'model': timm_sd, 'args': argparse.Namespace(model='vit_tiny')}
    assert load_softmax_checkpoint(dino_name_on_deit).num_heads is None
    explicit = {'model': timm_sd, 'args': argparse.Namespace(num_heads=4)}
    assert load_softmax_checkpoint(explicit).num_heads == 4
    impossible = {'model': timm_sd, 'args': argparse.Namespace(num_heads=5)}  # 192 % 5
    ckpt = load_softmax_checkpoint(impossible)
    assert ckpt.num_heads is None and any('does not fit' in note for note in ckpt.notes)


def test_where_the_head_count_comes_from_is_kept(timm_sd):
    ckpt = load_softmax_checkpoint({'state_dict': timm_sd, 'arch': 'deit_tiny_patch16_224',
                                    'version': 2})
    assert ckpt.num_heads_from == "checkpoint['arch']='deit_tiny_patch16_224'"
    assert load_softmax_checkpoint(timm_sd).num_heads_from is None


def test_distilled_deit_drops_the_distillation_slot(tmp_path):
    torch.manual_seed(0)
    model = timm.create_model('deit_tiny_distilled_patch16_224', pretrained=False)
    sd = model.state_dict()
    assert sd['pos_embed'].shape == (1, 198, 192)
    path = tmp_path / 'deit_distilled.pth'
    torch.save({'model': sd}, path)
    ckpt = load_softmax_checkpoint(path)

    pos = ckpt.state_dict['backbone.pos_embed']
    assert pos.shape == (1, 197, 192)
    assert torch.equal(pos[:, :1], sd['pos_embed'][:, :1])
    assert torch.equal(pos[:, 1:], sd['pos_embed'][:, 2:])
    assert (ckpt.num_extra_tokens, ckpt.pos_grid) == (1, (14, 14))
    assert sorted(ckpt.unused_groups['distillation token / head (DeiT distilled)']) == [
        'dist_token', 'head_dist.bias', 'head_dist.weight']
    assert torch.equal(ckpt.state_dict['head.layers.head.weight'], sd['head.weight'])
    assert any('distillation-token slot' in note for note in ckpt.notes)


def test_mmpretrain_distilled_layout_drops_the_slot_too(expected):
    mm = OrderedDict(expected)
    pos = mm['backbone.pos_embed']
    dist_slot = torch.full_like(pos[:, :1], 7.0)
    mm['backbone.pos_embed'] = torch.cat([pos[:, :1], dist_slot, pos[:, 1:]], 1)
    mm['backbone.dist_token'] = torch.zeros(1, 1, 192)
    mm['head.layers.head_dist.weight'] = torch.zeros(1000, 192)
    ckpt = load_softmax_checkpoint({'state_dict': mm})
    assert torch.equal(ckpt.state_dict['backbone.pos_embed'], pos)
    assert len(ckpt.unused_groups['distillation token / head (DeiT distilled)']) == 2


def test_pos_embed_without_class_slot(timm_sd):
    sd = OrderedDict(timm_sd)
    sd['pos_embed'] = timm_sd['pos_embed'][:, 1:]  # DeiT III / timm no_embed_class
    ckpt = load_softmax_checkpoint(sd)
    assert (ckpt.num_extra_tokens, ckpt.pos_grid) == (0, (14, 14))
    assert torch.equal(ckpt.state_dict['backbone.pos_embed'], sd['pos_embed'])
    assert any('no class-token slot' in note for note in ckpt.notes)


def test_non_square_pos_embed_leaves_grid_unknown(timm_sd):
    sd = OrderedDict(timm_sd)
    sd['pos_embed'] = torch.zeros(1, 1 + 14 * 10, 192)
    ckpt = load_softmax_checkpoint(sd)
    assert ckpt.pos_grid is None and ckpt.num_extra_tokens == 1


def test_a_given_head_count_is_checked():
    assert check_num_heads(6, 384) == 6
    assert check_num_heads(12, 384, stated=12, stated_from='meta') == 12
    for bad in (0, -3, 2.0, '6', True):
        with pytest.raises(ValueError, match='num_heads must be a positive integer'):
            check_num_heads(bad, 384)
    with pytest.raises(ValueError, match=r'num_heads=5 does not divide .* embed_dims=384'):
        check_num_heads(5, 384)
    with pytest.raises(ValueError, match=r"num_heads=6 was given, but the checkpoint states "
                                         r"num_heads=12 \(checkpoint\['arch'\]='vit_small'\)"):
        check_num_heads(6, 384, stated=12, stated_from="checkpoint['arch']='vit_small'")


@pytest.mark.parametrize('drop,embed_dims', [
    (r'patch_embed\.', 192), (r'patch_embed\.|blocks\.0\.attn\.qkv\.', None),
], ids=['width-from-qkv', 'width-unknown'])
def test_without_patch_embedding_the_width_comes_from_the_first_qkv(drop, embed_dims, timm_sd):
    sd = OrderedDict((k, v) for k, v in timm_sd.items() if not re.match(drop, k))
    ckpt = load_softmax_checkpoint(sd)
    assert (ckpt.embed_dims, ckpt.patch_size, ckpt.depth) == (embed_dims, None, 12)
    assert ('no patch embedding (backbone.patch_embed.projection) mapped; patch_size unknown'
            in ckpt.notes)


def test_missing_block_indices_are_noted(timm_sd):
    sd = OrderedDict((k, v) for k, v in timm_sd.items() if not k.startswith(('blocks.4.',
                                                                               'blocks.7.')))
    ckpt = load_softmax_checkpoint(sd)
    assert ckpt.depth == 12
    assert (f'layer indices are not contiguous: {[i for i in range(12) if i not in (4, 7)]}'
            in ckpt.notes)
    assert not any('not contiguous' in note for note in load_softmax_checkpoint(timm_sd).notes)


def test_a_state_without_blocks_has_no_depth():
    state = {'backbone.patch_embed.projection.weight': torch.zeros(32, 3, 8, 8),
             'head.layers.head.weight': torch.zeros(10, 32)}
    assert infer_layout(state, has_dist=False) == Layout(32, None, (8, 8), None, None, [])


@pytest.mark.parametrize('shape', [(197, 192), (1, 1, 197, 192), (2, 197, 96)],
                         ids=['2d', '4d', 'batch-of-two'])
def test_a_pos_embed_of_another_layout_is_refused(shape, timm_sd):
    sd = OrderedDict(timm_sd, pos_embed=timm_sd['pos_embed'].reshape(shape))
    with pytest.raises(ValueError, match=re.escape(
            f'pos_embed must have shape (1, tokens, C), got {shape}')):
        load_softmax_checkpoint(sd)


@pytest.mark.parametrize('cfg,num_heads,where', [
    ("model = dict(backbone=dict(type='VisionTransformer', num_heads=3, embed_dims=192))", 3,
     "meta['cfg']=3"),
    ('blocks = [dict(num_heads=3), dict(num_heads=6)]', None, None),
    ("model = dict(backbone=dict(arch='deit-tiny'))", 3, "meta['cfg'] arch='deit-tiny'"),
], ids=['one-count', 'two-counts', 'arch-only'])
def test_an_mmpretrain_config_text_gives_the_head_count(cfg, num_heads, where, expected):
    ckpt = load_softmax_checkpoint({'state_dict': expected, 'meta': {'cfg': cfg}})
    assert (ckpt.num_heads, ckpt.num_heads_from) == (num_heads, where)


# (code base, size word) -> the timm model of that size: DeiT, DINO / iBOT, MAE and MoCo v3
# define their ViTs with timm's widths and head counts, except MoCo v3's ViT-S (below).
_TIMM_MODEL_OF = {
    'tiny': 'vit_tiny_patch16_224', 'small': 'vit_small_patch16_224',
    'medium': 'vit_medium_patch16_gap_256', 'base': 'vit_base_patch16_224',
    'large': 'vit_large_patch16_224', 'huge': 'vit_huge_patch14_224'}
_DEIT_MODEL_OF = {'tiny': 'deit_tiny_patch16_224', 'small': 'deit_small_patch16_224',
                  'base': 'deit_base_patch16_224', 'medium': 'deit3_medium_patch16_224',
                  'large': 'deit3_large_patch16_224', 'huge': 'deit3_huge_patch14_224'}


@functools.lru_cache(maxsize=None)
def _timm_width_and_heads(name):
    with torch.device('meta'):
        model = timm.create_model(name, pretrained=False)
    return model.embed_dim, model.blocks[0].attn.num_heads


@pytest.mark.parametrize('code_base', ['timm', 'deit', 'dino', 'mae', 'mocov3'])
def test_the_head_count_of_every_architecture_name_is_its_code_bases(code_base):
    models = _DEIT_MODEL_OF if code_base == 'deit' else _TIMM_MODEL_OF
    for size, width_and_heads in _ARCH_HEADS[code_base].items():
        if code_base == 'mocov3' and size == 'small':
            # MoCo v3's vits.py: vit_small has 12 heads of 32 channels, not DeiT's 6
            assert width_and_heads == (384, 12)
            continue
        assert width_and_heads == _timm_width_and_heads(models[size]), (code_base, size)


def test_the_head_count_of_every_mmpretrain_arch_word_is_its_arch_zoos():
    for word, width_and_heads in _ARCH_HEADS['mmpretrain'].items():
        arch = VisionTransformer.arch_zoo[word]
        assert width_and_heads == (arch['embed_dims'], arch['num_heads']), word


def _layout_state(slots, cls_token=True, registers=0, width=4):
    """mmpretrain-named tensors of a ViT whose position embedding has ``slots`` slots."""
    state = {'backbone.patch_embed.projection.weight': torch.zeros(width, 3, 16, 8),
             'head.layers.head.weight': torch.zeros(10, width),
             'backbone.pos_embed': torch.arange(float(slots)).view(1, slots, 1).repeat(
                 1, 1, width)}
    if cls_token:
        state['backbone.cls_token'] = torch.zeros(1, 1, width)
    if registers:
        state['backbone.register_tokens'] = torch.zeros(1, registers, width)
    return state


def _not_prefix_note(extra, prefix):
    return (f'pos_embed has {extra} leading non-patch slot(s) but the checkpoint has {prefix} '
            'prefix token(s)')


@pytest.mark.parametrize('kwargs,has_dist,grid,extra,notes', [
    # class token: the usual layout, nothing to say
    (dict(slots=1 + 16), False, (4, 4), 1, []),
    # no class token (a patch-only model) and a patch-only embedding: nothing to say either
    (dict(slots=16, cls_token=False), False, (4, 4), 0, []),
    # DINOv2 with registers: one slot for each of the class token and the four registers
    (dict(slots=5 + 16, registers=4), False, (4, 4), 5, []),
    # registers without slots of their own
    (dict(slots=1 + 16, registers=4), False, (4, 4), 1, [_not_prefix_note(1, 5)]),
    # a distillation token without a slot: the class slot stays, nothing is dropped
    (dict(slots=1 + 16), True, (4, 4), 1, [_not_prefix_note(1, 2)]),
    # a distillation slot on a 1x1 grid
    (dict(slots=2 + 1), True, (1, 1), 1, None),
    # slots no token of the checkpoint has
    (dict(slots=1 + 16, cls_token=False), False, (4, 4), 1, [_not_prefix_note(1, 0)]),
    (dict(slots=2 + 16, cls_token=False), False, (4, 4), 2, [_not_prefix_note(2, 0)]),
    # one slot and a class token: the slot is the single patch's
    (dict(slots=1), False, (1, 1), 0, None),
    (dict(slots=1 + 12), False, None, 1,
     ['pos_embed has 13 slots, not 1 extra tokens plus a square grid; pos_grid left unknown']),
], ids=['cls', 'patches-only', 'registers-with-slots', 'registers-without-slots',
        'dist-without-slot', 'dist-slot-1x1', 'two-unknown-slots', 'one-unknown-slot',
        'a-single-slot', 'not-square'])
def test_the_position_embedding_layout_of_each_token_prefix(kwargs, has_dist, grid, extra,
                                                              notes):
    state = _layout_state(**kwargs)
    pos = state['backbone.pos_embed']
    layout = infer_layout(state, has_dist=has_dist)
    assert (layout.pos_grid, layout.num_extra_tokens) == (grid, extra)
    assert layout.patch_size == (16, 8)
    if notes is not None:
        assert layout.notes == notes
    if has_dist and kwargs['slots'] == 3:
        assert torch.equal(state['backbone.pos_embed'], pos[:, [0, 2]])
        assert any('dropped the distillation-token slot' in note for note in layout.notes)
    else:
        assert state['backbone.pos_embed'] is pos


def test_a_checkpoint_without_a_classifier_head_is_noted():
    state = _layout_state(slots=17)
    del state['head.layers.head.weight']
    assert infer_layout(state, has_dist=False).notes == [
        'no linear classifier head in the checkpoint (backbone-only or self-supervised weights)']


@pytest.mark.parametrize('stated,heads', [(1, 1), (0, None), (5, None)],
                         ids=['one-head', 'zero', 'not-a-divisor'])
def test_a_head_count_in_the_metadata_is_taken_only_if_it_fits(stated, heads, timm_sd):
    ckpt = load_softmax_checkpoint({'model': timm_sd,
                                    'args': argparse.Namespace(num_heads=stated)})
    assert ckpt.num_heads == heads
    if heads is None:
        assert (f"args['num_heads']={stated} does not fit embed_dims=192; num_heads left "
                'unknown') in ckpt.notes
    else:
        assert "num_heads=1 from args['num_heads']=1" in ckpt.notes
        assert check_num_heads(1, 192) == 1
