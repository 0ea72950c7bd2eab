"""Source families: what a checkpoint's tensors say (registers, LayerScale, MLP, pre-norm,
qkv bias), the family and what it fixes (RoPE, head counts), and the refusals when checkpoint
and model differ in any of it."""
import re
from collections import OrderedDict

import pytest
import timm
import torch

from linvit_mm.models import LinearViT
from linvit_mm.transfer import (SoftmaxTransferInit, load_softmax_checkpoint,
                                transfer_softmax_weights)
from linvit_mm.transfer.families import FAMILIES, _implied, read_architecture

# word -> (family, rope, registers, layer scale, MLP, MLP hidden norm, pre-norm, qkv bias)
EXPECTED = {
    'dinov2-small': ('dinov2', None, 0, True, 'mlp', False, False, True),
    'dinov2-reg-small': ('dinov2', None, 4, True, 'mlp', False, False, True),
    'dinov3-small': ('dinov3', 'dinov3', 4, True, 'mlp', False, False, False),
    'deit3-small': ('deit3', None, 0, True, 'mlp', False, False, True),
    'clip-base': ('clip', None, 0, False, 'mlp', False, True, True),
    'eva02-tiny': ('eva02', 'eva', 0, False, 'swiglu', False, False, True),
    'eva02-base': ('eva02', 'eva', 0, False, 'swiglu', True, False, True),
}
FIELDS = ('family', 'rope', 'num_register_tokens', 'layer_scale', 'ffn_type', 'ffn_norm',
          'pre_norm', 'qkv_bias')


def patch(word):
    return LinearViT.arch_zoo[word]['patch_size']


@pytest.mark.parametrize('layout', ['timm', 'release'])
@pytest.mark.parametrize('word', EXPECTED)
def test_what_a_checkpoint_says_about_its_architecture(word, layout, timm_source, release):
    checkpoint = timm_source(word, img_size=4 * patch(word)).state_dict()
    if layout == 'release':
        checkpoint = release(word, checkpoint)
    ckpt = load_softmax_checkpoint(checkpoint)
    assert tuple(getattr(ckpt, field) for field in FIELDS) == EXPECTED[word]
    assert ckpt.family_from == ('its tensors' if layout == 'timm' or word.startswith('deit3')
                                else f'its {ckpt.family} release layout')
    # width 64 is no released model of the family: the head count stays unknown
    assert ckpt.num_heads is None and ckpt.patch_size == (patch(word), ) * 2
    summary = ckpt.summary()
    assert f'family          : {ckpt.family} ({ckpt.family_from})' in summary
    assert f'registers       : {ckpt.num_register_tokens}' in summary


def test_a_plain_vit_is_the_vit_family(timm_sd):
    ckpt = load_softmax_checkpoint(timm_sd)
    assert (ckpt.family, ckpt.rope, ckpt.num_register_tokens, ckpt.layer_scale) == (
        'vit', None, 0, False)


def test_released_widths_give_the_head_count():
    """The DINOv2 ViT-S width (384) means 6 heads: no metadata needed, and a model with
    another count is refused (the q/k/v rows would be regrouped)."""
    torch.manual_seed(0)
    source = timm.create_model('vit_small_patch14_dinov2', pretrained=False, img_size=56,
                               depth=1)
    ckpt = load_softmax_checkpoint(source.state_dict())
    assert (ckpt.num_heads, ckpt.num_heads_from) == (6, 'the dinov2 family at width 384')
    arch = dict(LinearViT.arch_zoo['dinov2-small'], num_layers=1)
    twelve = LinearViT(arch=dict(arch, num_heads=12), img_size=56)
    with pytest.raises(ValueError, match=r'the checkpoint has 6 attention heads \(the dinov2 '
                                         r'family at width 384\).*have 12 heads'):
        SoftmaxTransferInit(checkpoint=source.state_dict(), setting='fullcopy')(twelve)
    with pytest.raises(ValueError, match='num_heads=12 was given, but the checkpoint states '
                                         'num_heads=6'):
        load_softmax_checkpoint(source.state_dict(), num_heads=12)


def test_an_unknown_family_lists_the_known_ones(timm_sd):
    message = f'unknown source family {"dinov4"!r}; known families are: '
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        load_softmax_checkpoint(timm_sd, family='dinov4')
    for name in FAMILIES:
        assert f'{name}: ' in str(info.value)
    with pytest.raises(ValueError, match=re.escape('SoftmaxTransfer: ' + message)):
        SoftmaxTransferInit(checkpoint='x.pth', setting='fullcopy', family='dinov4')


def test_a_stated_family_is_checked_against_the_tensors(timm_sd, timm_source, release):
    with pytest.raises(ValueError, match=r"family='dinov3' was given, but the checkpoint cannot "
                                         r'be a DINOv3 .* it has layer_scale=False, '
                                         r'num_register_tokens=0, pos_embed=True'):
        load_softmax_checkpoint(timm_sd, family='dinov3')
    dinov2 = release('dinov2-small', timm_source('dinov2-small').state_dict())
    with pytest.raises(ValueError, match="family='deit3' was given, but the checkpoint is a "
                                         "'dinov2' release"):
        load_softmax_checkpoint(dinov2, family='deit3')
    assert load_softmax_checkpoint(dinov2, family='dinov2').family_from == \
        "given as family='dinov2'"


def unknown_family_checkpoint(timm_source):
    """SwiGLU with LayerScale, neither registers nor position embedding: no known family."""
    state = OrderedDict(timm_source('eva02-tiny').state_dict())
    del state['pos_embed']
    for index in range(2):
        for gamma in ('gamma_1', 'gamma_2'):
            state[f'blocks.{index}.{gamma}'] = torch.rand(64, dtype=torch.float64)
    return state


def test_a_checkpoint_of_no_known_family(timm_source, refuses):
    state = unknown_family_checkpoint(timm_source)
    ckpt = load_softmax_checkpoint(state, num_heads=4)
    assert ckpt.family is None and ckpt.rope is None
    assert any('the source family is unknown' in note for note in ckpt.notes)
    arch = dict(LinearViT.arch_zoo['eva02-tiny'], embed_dims=64, num_layers=2, num_heads=4,
                feedforward_channels=170, layer_scale_init_value=.1, pos_embed_type='none')
    # its attention may have been trained with or without RoPE: refused by a RoPE model...
    refuses(LinearViT(arch=arch, img_size=56), ckpt, setting='copy',
            match=r'rope: checkpoint unknown \(its source family is unknown\), model \'eva\'')
    # ... and copied into one without, with a warning; stating the family settles it
    plain = LinearViT(arch=dict(arch, rope=None), img_size=56)
    report = transfer_softmax_weights(plain, ckpt, setting='copy')
    assert any('whether its attention was trained with RoPE' in text
               for text in report['warnings'])


def build(word, source, **changes):
    blocks = source.blocks
    hidden = blocks[0].mlp.fc2.in_features
    arch = dict(LinearViT.arch_zoo[word], embed_dims=64, num_layers=2, num_heads=4,
                feedforward_channels=hidden)
    arch.update(changes)
    torch.manual_seed(0)
    return LinearViT(arch=arch, img_size=source.patch_embed.img_size)


# (source word, what the model changes, selected setting, the field and both values)
MISMATCHES = [
    ('dinov2-small', dict(patch_size=16), 'fullcopy', 'patch_size: checkpoint 14, model 16'),
    ('dinov2-reg-small', dict(num_register_tokens=0, no_embed_class=False), 'fullcopy',
     'num_register_tokens: checkpoint 4, model 0'),
    ('dinov2-small', dict(num_register_tokens=4), 'fullcopy',
     'num_register_tokens: checkpoint 0, model 4'),
    ('dinov3-small', dict(rope=None), 'copy', "rope: checkpoint 'dinov3', model None"),
    ('dinov3-small', dict(rope=dict(type='eva')), 'copy',
     "rope: checkpoint 'dinov3', model 'eva'"),
    ('deit3-small', dict(rope=dict(type='dinov3')), 'copy',
     "rope: checkpoint None, model 'dinov3'"),
    ('dinov2-small', dict(layer_scale_init_value=0.), 'mlpcopy',
     'layer_scale: checkpoint True, model False'),
    ('clip-base', dict(layer_scale_init_value=.1), 'copy',
     'layer_scale: checkpoint False, model True'),
    ('dinov3-small', dict(qkv_bias=True), 'copy', 'qkv_bias: checkpoint False, model True'),
    ('eva02-tiny', dict(ffn_norm=True), 'mlpcopy', 'ffn_norm: checkpoint False, model True'),
    ('clip-base', dict(pre_norm=False), 'fullcopy', 'pre_norm: checkpoint True, model False'),
]


@pytest.mark.parametrize('word,changes,setting,message', MISMATCHES,
                         ids=[m[-1].split(':')[0] + f'-{i}' for i, m in enumerate(MISMATCHES)])
def test_an_architecture_mismatch_is_refused_by_field(word, changes, setting, message,
                                                      timm_source, refuses):
    source = timm_source(word, img_size=4 * patch(word))
    model = build(word, source, **changes)
    text = refuses(model, source.state_dict(), setting=setting, num_heads=4)
    assert message in text
    assert 'Nothing was copied' in text
    assert f"arch='{word}'" not in text  # a test-size checkpoint has no arch word


def test_the_refusal_names_the_arch_word_of_a_released_checkpoint(refuses):
    torch.manual_seed(0)
    source = timm.create_model('vit_small_patch16_dinov3', pretrained=False, img_size=64)
    model = LinearViT(arch=dict(LinearViT.arch_zoo['dinov3-small'], rope=None), img_size=64)
    text = refuses(model, source.state_dict(), setting='fullcopy')
    assert "rope: checkpoint 'dinov3', model None" in text
    assert "Build the model with arch='dinov3-small'" in text


def test_fields_a_setting_does_not_copy_do_not_matter(timm_source):
    """RoPE concerns the attention only: a DINOv3 MLP copies into a model without RoPE."""
    source = timm_source('dinov3-small', img_size=64)
    model = build('dinov3-small', source, rope=None)
    report = transfer_softmax_weights(model, source.state_dict(), setting='mlpcopy',
                                      num_heads=4)
    assert report['counts']['mlp']['copied'] > 0


def test_a_whole_classifier_is_checked_through_its_backbone(timm_source, refuses):
    """prefix='': the RoPE and patch size are the backbone's attributes."""
    from mmpretrain.models import ImageClassifier
    source = timm_source('dinov3-small', img_size=64)
    arch = dict(LinearViT.arch_zoo['dinov3-small'], embed_dims=64, num_layers=2, num_heads=4,
                feedforward_channels=256)
    classifier = ImageClassifier(
        backbone=dict(type='LinearViT', arch=arch, img_size=64, out_type='avg_featmap'),
        head=dict(type='LinearClsHead', num_classes=3, in_channels=64))
    report = transfer_softmax_weights(classifier, source.state_dict(), components=['attention'],
                                      prefix='', num_heads=4)
    assert report['counts']['attention']['copied'] > 0
    classifier.backbone.rope = None
    for layer in classifier.backbone.layers:
        layer.attn.rope = None
    refuses(classifier, source.state_dict(), components=['attention'], prefix='', num_heads=4,
            match="rope: checkpoint 'dinov3', model None")


@pytest.mark.parametrize('keys', [('attn.gamma1.weight',), ('ffn.gamma2.weight',)],
                         ids=['attention-branch-only', 'mlp-branch-only'])
def test_layer_scale_on_either_branch_is_layer_scale(keys):
    state = {f'backbone.layers.0.{key}': torch.ones(4) for key in keys}
    assert read_architecture(state, None).layer_scale


@pytest.mark.parametrize('family_registers', [1, 4])
def test_a_register_family_accepts_any_positive_register_count(family_registers):
    accepts = _implied(dict(num_register_tokens=family_registers))['num_register_tokens']
    assert callable(accepts)
    assert [accepts(n) for n in (0, 1, 4)] == [False, True, True]
