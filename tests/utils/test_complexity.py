"""linvit_mm.utils.complexity: MAC counts from module shapes, and mmengine's analysis of a
LinearViT agreeing with them for every registered operator."""
import pytest
import torch
import torch.nn.functional as F
from mmengine.analysis import ActivationAnalyzer, FlopAnalyzer
from mmpretrain.models import VisionTransformer
from torch import nn

from linvit_mm.models.attention import attention_types
from linvit_mm.models.backbones.linear_vit import LinearViT
from linvit_mm.utils.complexity import (activation_handles, count_macs, flop_handles,
                                        get_model_complexity_info, operator_leaves)

TINY_ARCH = dict(embed_dims=64, num_layers=2, num_heads=2, feedforward_channels=128)


def backbone(attn_type, img_size=64):
    model = LinearViT(arch=TINY_ARCH, attn_type=attn_type, img_size=img_size)
    model.eval()
    return model


def layer_norm_flops(model, images):
    """What mmengine counts for LayerNorm and the MAC count does not: 5 per element
    (4 without an affine transform), read off the norms' inputs during a forward."""
    flops = []

    def count(module, args):
        flops.append(args[0].numel() * (5 if module.elementwise_affine else 4))

    handles = [m.register_forward_pre_hook(count) for m in model.modules()
               if isinstance(m, nn.LayerNorm)]
    with torch.no_grad():
        model(images)
    for handle in handles:
        handle.remove()
    return sum(flops)


@pytest.mark.parametrize('attn_type', ['softmax', 'relu', 'inline', 'mhla', 'ttt'])
def test_mac_count_from_module_shapes(attn_type):
    """The walker finds every linear and conv, including TTT's wider qkv/proj and cpe."""
    size, C, h, layers, hidden = 128, 64, 2, 2, 128
    d, P = C // h, (size // 16)**2
    model = backbone(attn_type, size)
    N = P + model.num_extra_tokens
    qkv_out, proj_in = (3 * C + 3 * d, C + d) if attn_type == 'ttt' else (3 * C, C)
    linear = N * (C * qkv_out + proj_in * C + 2 * C * hidden)
    conv = {'mhla': 25 * P * C, 'ttt': 9 * P * C}.get(attn_type, 0)
    core = {'softmax': 2 * N * N * C,
            'relu': 2 * N * C * d + 2 * N * C,
            'inline': 2 * N * C * d + 4 * N * C,
            'mhla': 2 * N * C * d + 2 * N * C + 4**2 * C * (d + 1),
            'ttt': 6 * N * C * d + 2 * h * d * d + 18 * P * d + 9 * d}[attn_type]
    counts = count_macs(model, size)
    assert counts['linear'] == layers * linear
    assert counts['conv'] == layers * conv
    assert counts['attention_core'] == layers * core
    assert counts['total'] == layers * (linear + conv + core) + P * 3 * 16 * 16 * C


def test_partial_patches_count_as_padded():
    # mmcv's PatchEmbed pads a 50 x 70 image to a 4 x 5 grid of 16-px patches
    model = backbone('relu')
    assert count_macs(model, (50, 70)) == count_macs(model, (64, 80))


@pytest.mark.parametrize('attn_type', attention_types())
def test_mmengine_analysis_counts_what_count_macs_counts(attn_type):
    """Per operator type, over a batch of two non-square images: the analysis' linear, conv
    and attention-core FLOPs are the MAC count's; LayerNorm is the one documented extra."""
    model = backbone(attn_type)
    images = torch.randn(2, 3, 48, 80)
    macs = count_macs(model, (48, 80))
    with torch.no_grad(), operator_leaves(model):
        analyzer = FlopAnalyzer(model, (images, )).set_op_handle(**flop_handles())
        by_operator = analyzer.by_operator()
        total = analyzer.total()
    norms = layer_norm_flops(model, images)
    assert by_operator['attention_core'] == 2 * macs['attention_core'] > 0
    assert by_operator['linear'] == 2 * macs['linear']
    assert by_operator['conv'] == 2 * (macs['conv'] + macs['patch_embed'])
    assert by_operator['layer_norm'] == norms
    assert total == 2 * macs['total'] + norms


def test_softmax_counts_more_than_relu_at_long_sequences():
    """65 tokens of width 64 in heads of 32: softmax's N^2 core outweighs relu's N d^2."""
    flops = {op: get_model_complexity_info(backbone(op, 128), (3, 128, 128), show_table=False,
                                           show_arch=False)['flops']
             for op in ('softmax', 'relu')}
    macs = {op: count_macs(backbone(op, 128), 128)['total'] for op in flops}
    assert flops['softmax'] - flops['relu'] == macs['softmax'] - macs['relu'] > 0


def test_scaled_dot_product_attention_handle_matches_upstream_vit():
    """mmpretrain's VisionTransformer (fused attention) counts as LinearViT's softmax does."""
    upstream = VisionTransformer(arch=TINY_ARCH, img_size=64, patch_size=16)
    upstream.eval()
    assert upstream.layers[0].attn.scaled_dot_product_attention is F.scaled_dot_product_attention
    ours = backbone('softmax')
    info = {name: get_model_complexity_info(model, (3, 64, 64), show_table=False,
                                            show_arch=False)
            for name, model in (('upstream', upstream), ('ours', ours))}
    assert info['upstream']['flops'] == info['ours']['flops']
    assert info['upstream']['flops'] == (count_macs(ours, 64)['total']
                                         + layer_norm_flops(ours, torch.randn(1, 3, 64, 64)))
    assert info['upstream']['params'] == info['ours']['params']


def test_operator_activations_are_its_layer_outputs():
    model = backbone('ttt')
    tokens, C, d = 16, 64, 32  # no class token; TTT's qkv is 3C + 3d wide, proj C + d -> C
    with torch.no_grad(), operator_leaves(model):
        analyzer = ActivationAnalyzer(model, (torch.randn(1, 3, 64, 64), )).set_op_handle(
            **activation_handles())
        by_module = analyzer.by_module()
    assert by_module['layers.0.attn'] == tokens * (3 * C + 3 * d) + tokens * C + tokens * C


def test_leaves_compute_the_same_and_leave_nothing_behind():
    model = backbone('ttt')  # overrides encode_position as well as forward
    images = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = model(images)
        with operator_leaves(model):
            inside = model(images)
    torch.testing.assert_close(inside, expected, rtol=0, atol=0)
    assert not any({'forward', 'encode_position'} & set(vars(m)) for m in model.modules())
    with pytest.raises(ZeroDivisionError), operator_leaves(model):
        1 / 0
    assert not any({'forward', 'encode_position'} & set(vars(m)) for m in model.modules())


def test_leaves_refuse_a_backward():
    model = backbone('relu')
    with operator_leaves(model):
        out = model(torch.randn(1, 3, 64, 64))
    with pytest.raises(RuntimeError, match='complexity analysis only'):
        out[0].sum().backward()


def test_complexity_info_has_mmengine_fields():
    info = get_model_complexity_info(backbone('mhla'), (3, 64, 64))
    assert info['flops_str'].endswith('M') and info['params_str'].endswith('M')
    assert 'layers.0.attn' in info['out_table'] and 'MultiHeadLinearAttention' in info['out_arch']
    with pytest.raises(ValueError, match='exactly one of input_shape'):
        get_model_complexity_info(backbone('mhla'))
