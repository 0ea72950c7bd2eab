"""Every operator under bf16 autocast against its float32 O(N^2) oracle, outputs and input
gradients, with the bounds stated here.

Measured (CPU autocast, width 128, 2 heads, 257 tokens, worst of 3 seeds; the fast forms keep
bf16 q, k, v and states, products accumulating in float32): outputs 4.7-6.9e-3 of their
largest value; input gradients 4.9e-3-1.4e-2 (hedgehog 1.1e-2, mhla 1.4e-2), relu 6.1e-2; at
4097 tokens elu, hedgehog and inline stay there (4.2-5.1e-3, 6.0e-3-1.0e-2). The bounds leave
about 2x. relu's gradient is not a fault: bf16 rounds the q and k entries near 0 to the other
side of relu's kink on about 1 % of them, and there relu's derivative jumps from 0 to 1, so
those entries' gradients differ by their whole size from the float32 model's; a ReLU network
trained in bf16 sees the same. mhla's normaliser divides by block sums that bf16 rounds to
about 3 digits.
"""
import pytest
import torch

from linvit_mm.models.attention import attention_class, attention_types, build_attention

OUTPUT_BOUND = 1.5e-2
GRAD_BOUNDS = {'relu': 1.2e-1, 'mhla': 3e-2}
GRAD_BOUND = 2.5e-2


def relative(a, b):
    return ((a.float() - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize('attn_type', attention_types())
def test_bf16_autocast_stays_within_its_bound_of_the_float32_oracle(attn_type):
    torch.manual_seed(0)
    attention = build_attention(attn_type, embed_dims=128, num_heads=2)
    tokens = int(attention_class(attn_type).uses_cls_token) + 16 * 16
    x = torch.randn(2, tokens, 128, requires_grad=True)
    expected = attention.forward_reference(x, (16, 16))
    grad_out = torch.randn_like(expected)
    (expected_grad, ) = torch.autograd.grad(expected, x, grad_out)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = attention(x, (16, 16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    (grad, ) = torch.autograd.grad(out.float(), x, grad_out)
    assert relative(out, expected) < OUTPUT_BOUND
    assert relative(grad, expected_grad) < GRAD_BOUNDS.get(attn_type, GRAD_BOUND)
