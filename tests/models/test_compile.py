"""torch.compile as a supported path: every operator, LinearViT and the plain pyramid compile
with fullgraph=True (no graph break), forward and backward, and compute what eager computes.

``aot_eager`` traces exactly what inductor would receive (dynamo's graph, AOTAutograd's joint
forward + backward) without generating code, which on 2 CPU cores takes minutes per model;
the inductor case is under ``slow``."""
import pytest
import torch
from mmpretrain.registry import MODELS

import linvit_mm.models  # noqa: F401
from linvit_mm.models.attention import attention_class, attention_types, build_attention

TINY = dict(embed_dims=32, num_layers=2, num_heads=2, feedforward_channels=64)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def assert_compiled_equals_eager(model, compiled, inputs, tolerance=1e-5):
    outputs = compiled(*inputs)
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs, )
    expected = model(*inputs)
    expected = expected if isinstance(expected, (tuple, list)) else (expected, )
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(out, ref, rtol=tolerance, atol=tolerance)
    params = [p for p in model.parameters() if p.requires_grad]
    # allow_unused: ttt's position convolution runs in the block, before the operator
    grads = torch.autograd.grad(sum(o.square().mean() for o in outputs), params,
                                allow_unused=True)
    eager_grads = torch.autograd.grad(sum(o.square().mean() for o in expected), params,
                                      allow_unused=True)
    assert [g is None for g in grads] == [g is None for g in eager_grads]
    for grad, ref in zip(grads, eager_grads):
        if ref is not None:
            torch.testing.assert_close(grad, ref, rtol=10 * tolerance, atol=10 * tolerance)


@pytest.mark.parametrize('attn_type', attention_types())
def test_every_operator_compiles_whole(attn_type):
    torch.manual_seed(0)
    attention = build_attention(attn_type, embed_dims=64, num_heads=2)
    tokens = int(attention_class(attn_type).uses_cls_token) + 6 * 7
    x = torch.randn(2, tokens, 64)
    compiled = torch.compile(attention, fullgraph=True, backend='aot_eager')
    assert_compiled_equals_eager(attention, compiled, (x, (6, 7)))


@pytest.mark.slow  # 10-60 s per operator: three grid sizes, symbolic
@pytest.mark.parametrize('attn_type', attention_types())
def test_linear_vit_compiles_whole_for_any_grid(attn_type):
    torch.manual_seed(0)
    vit = MODELS.build(dict(type='LinearViT', attn_type=attn_type, img_size=32, patch_size=8,
                            out_type='featmap', arch=TINY))
    compiled = torch.compile(vit, fullgraph=True, backend='aot_eager', dynamic=True)
    for size in [(32, 32), (48, 40), (64, 32)]:
        assert_compiled_equals_eager(vit, compiled, (torch.randn(2, 3, *size), ))


@pytest.mark.slow
def test_the_plain_pyramid_compiles_whole_for_any_grid():
    torch.manual_seed(0)
    pyramid = MODELS.build(dict(
        type='LinearViTPlainPyramid', norm_cfg=dict(type='BN'),
        vit=dict(attn_type='relu', img_size=64, arch=dict(TINY, embed_dims=64, num_layers=4))))
    pyramid.init_weights()
    compiled = torch.compile(pyramid, fullgraph=True, backend='aot_eager', dynamic=True)
    for size in [(64, 64), (96, 64)]:
        assert_compiled_equals_eager(pyramid, compiled, (torch.randn(2, 3, *size), ))


@pytest.mark.slow  # inductor's C++ code generation: about a minute per model on 2 cores
@pytest.mark.parametrize('attn_type', ['relu', 'ttt'])
def test_linear_vit_under_inductor(attn_type):
    torch.manual_seed(0)
    vit = MODELS.build(dict(type='LinearViT', attn_type=attn_type, img_size=32, patch_size=8,
                            arch=TINY))
    compiled = torch.compile(vit, fullgraph=True)
    assert_compiled_equals_eager(vit, compiled, (torch.randn(2, 3, 32, 32), ), 1e-4)
