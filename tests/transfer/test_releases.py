"""The original releases of DINOv2, DINOv3, EVA-02, DeiT III and CLIP read to the same tensors
as timm's state dict of the same weights; what they carry beyond them is reported; timm's EVA
attention and SwiGLU layers fold into a plain ViT's names."""
from collections import OrderedDict

import pytest
import torch

from linvit_mm.transfer import load_softmax_checkpoint
from linvit_mm.transfer.key_maps import TIMM_KEYS, TIMM_SWIGLU_KEYS, timm_key_map
from linvit_mm.transfer.releases import (FIXED_ROPE_GROUP, PRETRAINING_GROUP, find_release,
                                         merge_timm_variants)

# word -> (source_format of its release, unused groups it must report)
RELEASES = {
    'dinov2-small': ('dinov2', {PRETRAINING_GROUP}),
    'dinov2-reg-small': ('dinov2', {PRETRAINING_GROUP}),
    'dinov3-small': ('dinov3', {PRETRAINING_GROUP, FIXED_ROPE_GROUP}),
    'eva02-tiny': ('eva02', {PRETRAINING_GROUP, FIXED_ROPE_GROUP}),
    'eva02-base': ('eva02', {PRETRAINING_GROUP, FIXED_ROPE_GROUP}),
    'deit3-small': ('deit-official', set()),
    'clip-base': ('clip', {'CLIP text tower',
                           'CLIP image projection (image-text embedding, not a classifier)'}),
}


def patch(word):
    return 14 if word.startswith(('dinov2', 'eva02')) else 16


@pytest.mark.parametrize('word', RELEASES)
def test_a_release_reads_like_the_timm_state_dict(word, timm_source, release):
    timm_state = timm_source(word, img_size=4 * patch(word)).state_dict()
    from_timm = load_softmax_checkpoint(timm_state)
    from_release = load_softmax_checkpoint(release(word, timm_state))
    layout, groups = RELEASES[word]
    assert from_release.source_format == layout
    assert sorted(from_release.state_dict) == sorted(from_timm.state_dict)
    for name, tensor in from_timm.state_dict.items():
        # DINOv2-reg's class token comes back as (cls - slot) + slot: equal to rounding
        torch.testing.assert_close(from_release.state_dict[name], tensor, rtol=1e-15,
                                   atol=1e-15, msg=name)
    assert groups <= set(from_release.unused_groups)
    assert (from_release.embed_dims, from_release.depth, from_release.pos_grid) == (
        from_timm.embed_dims, from_timm.depth, from_timm.pos_grid)


def test_clip_release_under_a_data_parallel_prefix(timm_source, release):
    state = release('clip-base', timm_source('clip-base', img_size=64).state_dict())
    wrapped = OrderedDict(('module.' + key, value) for key, value in state.items())
    ckpt = load_softmax_checkpoint({'state_dict': wrapped})
    assert ckpt.source_format == 'clip' and ckpt.pre_norm
    # the text tower's blocks share the image tower's names: none is read
    assert ckpt.depth == 2 and 'transformer.resblocks.0.attn.in_proj_weight' in \
        ckpt.unused_groups['CLIP text tower']


def test_dinov3_bias_is_masked_and_an_all_zero_one_dropped(timm_source, release):
    state = release('dinov3-small', timm_source('dinov3-small', img_size=64).state_dict())
    ckpt = load_softmax_checkpoint(state)
    assert not ckpt.qkv_bias
    assert 'DINOv3: 2 all-zero qkv bias(es) left out (timm\'s vit_*_dinov3 has no qkv bias)' \
        in ckpt.notes
    assert ckpt.unused_groups['all-zero qkv bias (DINOv3 distilled ViTs; timm builds them '
                              'without one)'] == ['blocks.0.attn.qkv.bias',
                                                  'blocks.1.attn.qkv.bias']
    # DINOv3 ..._qkvb: a real bias, whose key rows the mask zeroes
    for key in [k for k in state if k.endswith('.attn.qkv.bias')]:
        state[key] = torch.arange(1., 1 + 3 * 64, dtype=torch.float64)
    ckpt = load_softmax_checkpoint(state)
    bias = ckpt.state_dict['backbone.layers.0.attn.qkv.bias']
    assert ckpt.qkv_bias and torch.equal(bias[64:128], torch.zeros(64, dtype=torch.float64))
    assert torch.equal(bias[:64], torch.arange(1., 65, dtype=torch.float64))


def test_eva_attention_and_swiglu_fold_into_plain_names():
    q_bias, v_bias = torch.randn(8), torch.randn(8)
    weights = {part: torch.randn(8, 8) for part in 'qkv'}
    gate, value = torch.randn(6, 8), torch.randn(6, 8)
    state, notes = merge_timm_variants(OrderedDict([
        ('blocks.0.attn.q_bias', q_bias), ('blocks.0.attn.v_bias', v_bias),
        ('blocks.1.attn.q_proj.weight', weights['q']),
        ('blocks.1.attn.k_proj.weight', weights['k']),
        ('blocks.1.attn.v_proj.weight', weights['v']), ('blocks.1.attn.q_proj.bias', q_bias),
        ('blocks.1.attn.v_proj.bias', v_bias),
        ('blocks.0.mlp.fc1_g.weight', gate), ('blocks.0.mlp.fc1_x.weight', value),
        ('blocks.0.mlp.fc2.weight', torch.randn(8, 6))]))
    expected_bias = torch.cat([q_bias, torch.zeros(8), v_bias])
    assert torch.equal(state['blocks.0.attn.qkv.bias'], expected_bias)
    assert torch.equal(state['blocks.1.attn.qkv.bias'], expected_bias)
    assert torch.equal(state['blocks.1.attn.qkv.weight'],
                       torch.cat([weights['q'], weights['k'], weights['v']]))
    assert torch.equal(state['blocks.0.mlp.fc1.weight'], torch.cat([gate, value]))
    assert not any(key.endswith(('q_bias', 'v_bias', '_proj.weight', 'fc1_g.weight'))
                   for key in state)
    assert len(notes) == 3
    assert timm_key_map(state) is TIMM_SWIGLU_KEYS
    plain = {'blocks.0.mlp.fc1.weight': torch.randn(12, 8),
             'blocks.0.mlp.fc2.weight': torch.randn(8, 12)}
    assert timm_key_map(plain) is TIMM_KEYS


def test_timm_state_dicts_are_no_release(timm_source):
    for word in ('dinov2-reg-small', 'dinov3-small', 'eva02-tiny', 'clip-base'):
        assert find_release(timm_source(word, img_size=4 * patch(word)).state_dict()) is None


def test_dinov3_masks_without_a_bias_are_set_aside(timm_source, release):
    state = release('dinov3-small', timm_source('dinov3-small', img_size=64).state_dict())
    masks = [key for key in state if key.endswith('.attn.qkv.bias_mask')]
    for key in masks:
        del state[key[:-len('_mask')]]
    ckpt = load_softmax_checkpoint(state)
    assert ckpt.unused_groups['qkv bias mask (applied)'] == masks
    assert not ckpt.qkv_bias
    assert not any('all-zero qkv bias' in note for note in ckpt.notes)


@pytest.mark.parametrize('final_norm', ['norm', 'fc_norm'])
def test_eva02_pre_training_norm_becomes_the_pooled_norm(final_norm, timm_source, release):
    """The MIM release's final ``norm`` is read as timm's ``fc_norm``, as timm does; a release
    that already names it ``fc_norm`` is read as it is."""
    state = release('eva02-tiny', timm_source('eva02-tiny').state_dict())
    if final_norm == 'fc_norm':
        state = OrderedDict((key.replace('norm.', 'fc_norm.') if key.startswith('norm.')
                             else key, value) for key, value in state.items())
    ckpt = load_softmax_checkpoint(state)
    assert ckpt.source_format == 'eva02'
    for name in ('weight', 'bias'):
        assert torch.equal(ckpt.state_dict[f'backbone.ln2.{name}'], state[f'{final_norm}.{name}'])
    moved = 'EVA-02: the pre-training final norm is read as the pooled-feature norm (fc_norm), ' \
            'as timm does for fine-tuning'
    assert (moved in ckpt.notes) == (final_norm == 'norm')


def test_separate_qkv_projections_without_biases_fold_into_one_weight():
    weights = {part: torch.randn(8, 8) for part in 'qkv'}
    state, notes = merge_timm_variants(OrderedDict(
        (f'blocks.0.attn.{part}_proj.weight', weight) for part, weight in weights.items()))
    assert list(state) == ['blocks.0.attn.qkv.weight']
    assert torch.equal(state['blocks.0.attn.qkv.weight'],
                       torch.cat([weights['q'], weights['k'], weights['v']]))
    assert notes == ['EVA attention: the separate q/k/v projections are read as one qkv']


@pytest.mark.parametrize('word,note', [
    ('clip-base', "CLIP: read the image tower ('visual.*')"),
    ('dinov2-reg-small', 'DINOv2 with registers: the class-token slot of pos_embed is added to '
                         "cls_token and dropped (timm's no_embed_class layout, the same "
                         'function)'),
])
def test_what_a_release_reading_changes_is_noted(word, note, timm_source, release):
    timm_state = timm_source(word, img_size=4 * patch(word)).state_dict()
    assert note in load_softmax_checkpoint(release(word, timm_state)).notes


_QV_NOTE = ("EVA attention: the query and value biases (the key's fixed at zero) are read as "
            'one qkv bias with zero key rows')
_PROJ_NOTE = 'EVA attention: the separate q/k/v projections are read as one qkv'
_SWIGLU_NOTE = ('SwiGLU: the gate (fc1_g) and value (fc1_x) layers are read as one packed '
                'layer, gate rows first')


@pytest.mark.parametrize('keys,notes', [
    (('attn.q_bias', 'attn.v_bias'), [_QV_NOTE]),
    (('attn.q_proj.weight', 'attn.k_proj.weight', 'attn.v_proj.weight', 'attn.q_proj.bias',
      'attn.v_proj.bias'), [_QV_NOTE, _PROJ_NOTE]),
    (('mlp.fc1_g.weight', 'mlp.fc1_x.weight'), [_SWIGLU_NOTE]),
    (('attn.qkv.weight', 'mlp.fc1.weight'), []),
], ids=['eva-biases', 'eva-projections', 'swiglu', 'plain'])
def test_each_fold_is_noted_and_only_a_fold(keys, notes):
    state = OrderedDict((f'blocks.0.{key}', torch.zeros(4, 4)) for key in keys)
    assert merge_timm_variants(state)[1] == notes


@pytest.mark.parametrize('alone', ['q_proj', 'v_proj'])
def test_separate_projections_with_one_bias_are_refused(alone):
    state = OrderedDict((f'blocks.0.attn.{part}_proj.weight', torch.zeros(4, 4)) for part in 'qkv')
    state[f'blocks.0.attn.{alone}.bias'] = torch.zeros(4)
    with pytest.raises(ValueError, match=r'blocks\.0\.attn\.q_proj and blocks\.0\.attn\.v_proj: '
                                         'only one of them has a bias'):
        merge_timm_variants(state)
