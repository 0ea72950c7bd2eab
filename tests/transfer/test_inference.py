"""What a checkpoint's shapes and metadata say: width, depth, position layout, head count."""
import argparse
from collections import OrderedDict

import pytest
import timm
import torch

from linvit_mm.transfer import load_softmax_checkpoint
from linvit_mm.transfer.inference import check_num_heads


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
