"""Every operator on edge shapes and devices: a batch of no image, a grid of no patch, and the
meta device (where a model is run for its shapes only)."""
import pytest
import torch

from linvit_mm.models.attention import attention_class, attention_types, build_attention


def operators():
    cases = [pytest.param(name, {}, id=name) for name in attention_types()]
    return cases + [pytest.param('inline', dict(residual=True), id='inline-residual')]


@pytest.mark.parametrize('attn_type, options', operators())
@pytest.mark.parametrize('tokens, hw_shape', [((0, 17), (4, 4)), ((2, 1), (0, 0)),
                                              ((2, 0), (0, 0))],
                         ids=['batch-0', 'grid-0x0-class-token', 'no-token'])
def test_an_empty_batch_or_grid_gives_an_empty_or_refused_result(attn_type, options, tokens,
                                                                 hw_shape):
    attention = build_attention(attn_type, embed_dims=32, num_heads=2, **options)
    x = torch.randn(*tokens, 32, requires_grad=True)
    if attn_type in ('mhla', 'ttt') and hw_shape == (0, 0):  # their blocks / inner step
        with pytest.raises(ValueError, match='the patch grid must be at least 1x1, got 0x0'):
            attention(x, hw_shape)
        return
    out = attention(x, hw_shape)
    assert out.shape == x.shape and torch.isfinite(out).all()
    out.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize('attn_type, options', operators())
def test_every_operator_runs_on_the_meta_device(attn_type, options):
    with torch.device('meta'):
        attention = build_attention(attn_type, embed_dims=32, num_heads=2, **options)
        out = attention(torch.randn(2, 17 - (not attention_class(attn_type).uses_cls_token),
                                    32), (4, 4))
    assert out.device.type == 'meta' and out.shape[-1] == 32
