"""Key maps: timm / release names to mmpretrain names, checked against mmpretrain itself."""
import dataclasses
from collections import OrderedDict

import pytest
import timm
import torch

from linvit_mm.testing import assert_rel_close
from linvit_mm.transfer import load_softmax_checkpoint
from linvit_mm.transfer.key_maps import (KEY_MAPS, TIMM_KEYS, TIMM_SWIGLU_KEYS, KeyMap, map_keys,
                                        timm_key_map)


@pytest.fixture(scope='module')
def mmpretrain_modules():
    from mmpretrain.models.backbones import VisionTransformer
    from mmpretrain.models.heads import VisionTransformerClsHead
    torch.manual_seed(1)
    backbone = VisionTransformer(arch='deit-tiny', img_size=224, patch_size=16)
    head = VisionTransformerClsHead(num_classes=1000, in_channels=192)
    backbone.eval()  # mmpretrain's train() override returns None: no chaining
    head.eval()
    return backbone, head


def _mmpretrain_shapes(backbone, head):
    shapes = {f'backbone.{k}': tuple(v.shape) for k, v in backbone.state_dict().items()}
    shapes.update({f'head.{k}': tuple(v.shape) for k, v in head.state_dict().items()})
    return shapes


def test_own_mapping_matches_mmpretrain_names_and_shapes(timm_sd, expected,
                                                         mmpretrain_modules):
    reference = _mmpretrain_shapes(*mmpretrain_modules)
    assert {k: tuple(v.shape) for k, v in expected.items()} == reference
    mapped = load_softmax_checkpoint({'model': timm_sd}).state_dict
    assert {k: tuple(v.shape) for k, v in mapped.items()} == reference


def test_layer_scale_names_match_mmpretrain():
    from mmpretrain.models.backbones import VisionTransformer
    from mmpretrain.models.heads import VisionTransformerClsHead
    torch.manual_seed(0)
    sd = timm.create_model('deit_tiny_patch16_224', pretrained=False,
                           init_values=1e-5).state_dict()
    assert 'blocks.0.ls1.gamma' in sd
    backbone = VisionTransformer(arch='deit-tiny', layer_scale_init_value=1e-5)
    head = VisionTransformerClsHead(num_classes=1000, in_channels=192)
    mapped = load_softmax_checkpoint(sd)
    assert mapped.unused_keys == []
    assert ({k: tuple(v.shape) for k, v in mapped.state_dict.items()}
            == _mmpretrain_shapes(backbone, head))


def test_mapped_deit_computes_the_same_logits_in_mmpretrain():
    from mmpretrain.models.backbones import VisionTransformer
    from mmpretrain.models.heads import VisionTransformerClsHead
    # A 64-pixel DeiT-Tiny (4x4 grid) keeps the float64 forward cheap; the names and
    # shapes at 224 are checked above.
    torch.manual_seed(3)
    deit = timm.create_model('deit_tiny_patch16_224', pretrained=False, img_size=64)
    with torch.no_grad():
        for param in deit.parameters():
            param.add_(0.05 * torch.randn_like(param))
    backbone = VisionTransformer(arch='deit-tiny', img_size=64, patch_size=16)
    head = VisionTransformerClsHead(num_classes=1000, in_channels=192)
    ckpt = load_softmax_checkpoint({'model': deit.state_dict()})
    assert ckpt.pos_grid == (4, 4)
    backbone.load_state_dict({k[len('backbone.'):]: v for k, v in ckpt.state_dict.items()
                              if k.startswith('backbone.')}, strict=True)
    head.load_state_dict({k[len('head.'):]: v for k, v in ckpt.state_dict.items()
                          if k.startswith('head.')}, strict=True)
    for module in (deit, backbone, head):
        module.double()
        module.eval()
    image = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        reference = deit(image)
        logits = head(backbone(image))
    assert_rel_close(logits, reference, 1e-12, 'logits')


def test_fc_norm_goes_to_the_pooled_norm_or_on_request_the_final_norm(timm_sd, timm_sd_fc_norm):
    raw = {'model': timm_sd_fc_norm}
    pooled = load_softmax_checkpoint(raw)
    assert torch.equal(pooled.state_dict['backbone.ln2.weight'], timm_sd['norm.weight'])
    assert 'backbone.ln1.weight' not in pooled.state_dict
    assert any(note.startswith('the norm of the average-pooled patch tokens (timm/MAE fc_norm) '
                               'is backbone.ln2') for note in pooled.notes)

    final = load_softmax_checkpoint(raw, fc_norm_target='ln1')
    assert torch.equal(final.state_dict['backbone.ln1.bias'], timm_sd['norm.bias'])
    assert not any(k.startswith('backbone.ln2.') for k in final.state_dict)
    assert any('final norm' in note for note in final.notes)

    mm = load_softmax_checkpoint({'state_dict': pooled.state_dict}, fc_norm_target='ln1')
    assert torch.equal(mm.state_dict['backbone.ln1.weight'], timm_sd['norm.weight'])

    both = OrderedDict(timm_sd, **{'fc_norm.weight': torch.ones(192)})
    with pytest.raises(ValueError, match='both a final norm'):
        load_softmax_checkpoint(both, fc_norm_target='ln1')
    with pytest.raises(ValueError, match="'ln1' or 'ln2'"):
        load_softmax_checkpoint(raw, fc_norm_target='fc_norm')


def test_mmpretrain_linear_cls_head_is_the_classifier(expected):
    mm = OrderedDict((k.replace('head.layers.head.', 'head.fc.'), v)
                     for k, v in expected.items())
    ckpt = load_softmax_checkpoint({'state_dict': mm})
    assert torch.equal(ckpt.state_dict['head.layers.head.weight'],
                       expected['head.layers.head.weight'])
    assert ckpt.unused_keys == []


def test_layer_scale_of_deit3_maps_to_mmpretrain_gamma(timm_sd):
    sd = OrderedDict(timm_sd)
    sd['blocks.0.gamma_1'] = torch.full((192,), 0.1)
    sd['blocks.0.ls2.gamma'] = torch.full((192,), 0.2)
    sd['blocks.0.attn.q_norm.weight'] = torch.ones(64)
    ckpt = load_softmax_checkpoint(sd)
    assert torch.equal(ckpt.state_dict['backbone.layers.0.attn.gamma1.weight'],
                       sd['blocks.0.gamma_1'])
    assert torch.equal(ckpt.state_dict['backbone.layers.0.ffn.gamma2.weight'],
                       sd['blocks.0.ls2.gamma'])
    assert ckpt.unused_groups == {'no counterpart in mmpretrain VisionTransformer':
                                  ['blocks.0.attn.q_norm.weight']}


def test_bare_conv_patch_embedding_is_the_projection(timm_sd, expected):
    # Home-trained ViTs often hold the patch embedding as a bare nn.Conv2d.
    sd = OrderedDict((k.replace('patch_embed.proj.', 'patch_embed.'), v)
                     for k, v in timm_sd.items())
    assert 'patch_embed.weight' in sd and 'patch_embed.proj.weight' not in sd
    ckpt = load_softmax_checkpoint(sd)
    assert ckpt.unused_keys == []
    assert set(ckpt.state_dict) == set(expected)
    for name in ('backbone.patch_embed.projection.weight', 'backbone.patch_embed.projection.bias'):
        assert torch.equal(ckpt.state_dict[name], expected[name])
    assert (ckpt.embed_dims, ckpt.patch_size) == (192, (16, 16))
    assert any('bare conv' in note for note in ckpt.notes)


def test_two_spellings_of_one_tensor_are_refused(timm_sd):
    sd = OrderedDict(timm_sd)
    sd['blocks.2.gamma_1'] = torch.full((192,), 0.1)
    sd['blocks.2.ls1.gamma'] = torch.full((192,), 0.2)
    with pytest.raises(ValueError, match=r"both 'blocks\.2\.gamma_1' and 'blocks\.2\.ls1\.gamma'"
                                         r".*backbone\.layers\.2\.attn\.gamma1\.weight"):
        load_softmax_checkpoint(sd)


def test_a_key_map_is_data():
    # Another family is a KeyMap: names outside and inside the blocks, and why the rest is
    # unused.
    family = KeyMap(name='toy', top={'embed.w': 'backbone.patch_embed.projection.weight'},
                    block_pattern=r'^trunk\.(\d+)\.(.+)$', block={'mix.w': 'attn.qkv.weight'},
                    unused=((r'^aux\.(\w+)', 'auxiliary {1}'), ))
    state = OrderedDict([('embed.w', torch.zeros(1)), ('trunk.4.mix.w', torch.ones(1)),
                         ('trunk.4.gate', torch.ones(1)), ('aux.loss.scale', torch.ones(1))])
    mapped, origins, unused, notes = map_keys(state, family)
    assert list(mapped) == ['backbone.patch_embed.projection.weight',
                            'backbone.layers.4.attn.qkv.weight']
    assert origins['backbone.layers.4.attn.qkv.weight'] == 'trunk.4.mix.w'
    assert unused == {'no counterpart in mmpretrain VisionTransformer': ['trunk.4.gate'],
                      'auxiliary loss': ['aux.loss.scale']}
    assert notes == []
    assert family.has_blocks(state) and not TIMM_KEYS.has_blocks(state)
    assert KEY_MAPS['timm'] is TIMM_KEYS
    # shared by every load: a change to one would reach all that follow
    with pytest.raises(dataclasses.FrozenInstanceError):
        TIMM_KEYS.block = {}


def _mlp(hidden_rows, hidden, width=8, dim=2):
    fc1, fc2 = torch.zeros(hidden_rows, width), torch.zeros(width, hidden)
    if dim == 4:  # a 1x1-conv MLP
        fc1, fc2 = fc1[..., None, None], fc2[..., None, None]
    return {'blocks.0.mlp.fc1.weight': fc1, 'blocks.0.mlp.fc2.weight': fc2}


@pytest.mark.parametrize('state,key_map', [
    (_mlp(hidden_rows=2 * 12, hidden=12), TIMM_SWIGLU_KEYS),  # gate and value rows packed
    (_mlp(hidden_rows=12, hidden=12), TIMM_KEYS),
    (_mlp(hidden_rows=2 * 12, hidden=12, dim=4), TIMM_KEYS),
    ({'blocks.0.mlp.fc1.weight': torch.zeros(24, 8)}, TIMM_KEYS),
], ids=['packed-swiglu', 'plain-mlp', 'not-linear', 'no-fc2'])
def test_a_timm_swiglu_is_told_by_its_packed_first_layer(state, key_map):
    assert timm_key_map(state) is key_map


def test_the_swiglu_key_map_differs_from_the_plain_one_in_the_mlp_only():
    def outside_mlp(block):
        return {key: value for key, value in block.items() if not key.startswith('mlp.')}
    assert outside_mlp(TIMM_SWIGLU_KEYS.block) == outside_mlp(TIMM_KEYS.block)
    assert 'attn.qkv.weight' in outside_mlp(TIMM_SWIGLU_KEYS.block)
    assert TIMM_SWIGLU_KEYS.block['mlp.fc1.weight'] == 'ffn.w12.weight'
