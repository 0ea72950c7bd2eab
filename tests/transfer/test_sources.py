"""Parity is the spec: a Softmax LinearViT initialised with ``fullcopy`` from a DINOv2 (+reg),
DINOv3, DeiT III, CLIP or EVA-02 checkpoint - timm's state dict or the original release
layout - computes what the timm model does (patch tokens after the final norm, float64),
at square, non-square and resampled input sizes; every operator builds from every source
and trains; the real arch words read the timm checkpoints of their size."""
import pytest
import timm
import torch

from linvit_mm.models import LinearViT
from linvit_mm.models.attention import attention_class, attention_types
from linvit_mm.testing import assert_rel_close
from linvit_mm.transfer import load_softmax_checkpoint, transfer_softmax_weights

# test size: depth 2, width 64, 4 heads (conftest.SOURCE_TEST_SIZE)
HEADS = 4
WORDS = ['dinov2-small', 'dinov2-reg-small', 'dinov3-small', 'deit3-small', 'clip-base',
         'eva02-tiny', 'eva02-base']


def patch(word):
    return LinearViT.arch_zoo[word]['patch_size']


def grid_id(value):
    return 'x'.join(map(str, value)) if isinstance(value, tuple) else str(value)


def student(arch, img_size, attn_type='softmax', **kwargs):
    torch.manual_seed(0)
    return LinearViT(arch=arch, attn_type=attn_type, img_size=img_size, **kwargs)


def timm_patch_tokens(model, x):
    """timm's forward_features (after its final norm, if it has one), prefix tokens dropped."""
    with torch.no_grad():
        return model.forward_features(x)[:, model.num_prefix_tokens:]


def featmap_tokens(model, x):
    with torch.no_grad():
        out, = model(x)
    return out.flatten(2).transpose(1, 2)


@pytest.mark.parametrize('grid', [(4, 4), (4, 5)], ids=grid_id)
@pytest.mark.parametrize('layout', ['timm', 'release'])
@pytest.mark.parametrize('word', WORDS)
def test_fullcopy_reproduces_the_timm_model(word, layout, grid, timm_source, release, arch_of):
    img_size = (grid[0] * patch(word), grid[1] * patch(word))
    source = timm_source(word, img_size=img_size)
    checkpoint = source.state_dict()
    if layout == 'release':
        checkpoint = release(word, checkpoint)
    ours = student(arch_of(word, source), img_size, out_type='featmap').double().eval()
    report = transfer_softmax_weights(ours, checkpoint, setting='fullcopy', num_heads=HEADS)
    assert report['num_heads'] == {'checkpoint': HEADS, 'model': [HEADS]}
    x = torch.randn(2, 3, *img_size, dtype=torch.float64)
    assert_rel_close(featmap_tokens(ours, x), timm_patch_tokens(source, x), 1e-5,
                     f'{word} ({layout}) patch tokens')


@pytest.mark.parametrize('word', ['eva02-tiny', 'eva02-base'])
def test_eva02_pooled_features_are_timms(word, timm_source, arch_of):
    """EVA-02 has no final token norm: its pooled features are normed (fc_norm = ln2)."""
    source = timm_source(word, img_size=56)
    ours = student(arch_of(word, source), 56, out_type='avg_featmap').double().eval()
    report = transfer_softmax_weights(ours, source.state_dict(), setting='fullcopy',
                                      num_heads=HEADS)
    assert report['not in model'] == []
    x = torch.randn(2, 3, 56, 56, dtype=torch.float64)
    with torch.no_grad():
        expected = source.forward_head(source.forward_features(x), pre_logits=True)
        assert_rel_close(ours(x)[0], expected, 1e-5, 'pooled features')


@pytest.mark.parametrize('word', WORDS)
def test_other_input_sizes_match_timm_dynamic_size(word, timm_source, arch_of):
    """Trained on a 6 x 6 grid, run on 4 x 7: the position embedding resampled as timm does
    (patch part only, bicubic, antialiased where it shrinks), the RoPE tables rebuilt."""
    size = 6 * patch(word)
    dynamic = {} if word.startswith('dinov3') else dict(dynamic_img_size=True)
    source = timm_source(word, img_size=size, **dynamic)
    ours = student(arch_of(word, source), size, out_type='featmap').double().eval()
    transfer_softmax_weights(ours, source.state_dict(), setting='fullcopy', num_heads=HEADS)
    x = torch.randn(1, 3, 4 * patch(word), 7 * patch(word), dtype=torch.float64)
    assert_rel_close(featmap_tokens(ours, x), timm_patch_tokens(source, x), 1e-5, word)


@pytest.mark.parametrize('attn_type', attention_types())
@pytest.mark.parametrize('word', WORDS)
def test_every_operator_builds_from_every_source_and_trains(word, attn_type, timm_source,
                                                            arch_of):
    source = timm_source(word, img_size=4 * patch(word))
    arch = arch_of(word, source)
    if arch.get('rope') and not attention_class(attn_type).supports_rope:
        with pytest.raises(ValueError, match=f'the {attn_type!r} operator does not carry RoPE'):
            student(arch, 4 * patch(word), attn_type)
        return
    model = student(arch, 4 * patch(word), attn_type, out_type='featmap')
    report = transfer_softmax_weights(model, source.state_dict(), setting='fullcopy',
                                      num_heads=HEADS)
    assert report['counts']['mlp']['copied'] > 0 and report['counts']['attention']['copied'] > 0
    x = torch.randn(2, 3, 3 * patch(word), 5 * patch(word))
    out, = model(x)
    assert out.shape == (2, 64, 3, 5) and torch.isfinite(out).all()
    out.square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())


# timm model of each family at its real size, and what LinearViT's word must get from it
REAL = {
    'dinov2-small': ('vit_small_patch14_dinov2', {}),
    'dinov2-reg-small': ('vit_small_patch14_reg4_dinov2', {}),
    'dinov3-small': ('vit_small_patch16_dinov3', {}),
    'deit3-small': ('deit3_small_patch16_224', {}),
    'clip-base': ('vit_base_patch16_clip_quickgelu_224', {}),
    'eva02-tiny': ('eva02_tiny_patch14_224', dict(out_type='avg_featmap')),
}


@pytest.mark.parametrize('word', REAL)
def test_real_arch_words_read_the_timm_checkpoint_of_their_size(word):
    """No forward: every tensor found, shapes equal, family, heads, registers and RoPE read
    from the checkpoint alone (no num_heads given)."""
    name, kwargs = REAL[word]
    torch.manual_seed(0)
    source = timm.create_model(name, pretrained=False, img_size=224, num_classes=0)
    ckpt = load_softmax_checkpoint(source.state_dict())
    assert ckpt.family == word.split('-')[0]
    assert ckpt.num_heads == source.blocks[0].attn.num_heads
    assert ckpt.num_register_tokens == source.num_prefix_tokens - 1
    assert ckpt.rope == {'dinov3': 'dinov3', 'eva02': 'eva'}.get(ckpt.family)
    model = LinearViT(arch=word, attn_type='relu', img_size=224, **kwargs)
    report = transfer_softmax_weights(model, ckpt, setting='fullcopy')
    assert report['absent in checkpoint'] == [] and report['not in model'] == []
    assert report['copied in part'] == {} and report['unknown in checkpoint'] == []
    # a CLIP checkpoint's tensors do not show QuickGELU from GELU: said, never assumed
    assert [w.split(':')[0] for w in report['warnings']] == (
        ['a CLIP checkpoint does not show the activation its MLPs were trained with']
        if word == 'clip-base' else [])
    copied = sum(model.state_dict()[name].numel() for name in report['copied'])
    assert copied == sum(p.numel() for p in source.parameters()) + (
        # EVA-02's key bias, zero in the checkpoint, is a parameter here
        12 * 192 if word == 'eva02-tiny' else 0)
