"""elu / relu kernel attention: feature maps, the normalised map, the float32 state, eps."""
import pytest
import torch
import torch.nn.functional as F

from linvit_mm.models.attention import ELUAttention, KernelAttention, ReLUAttention
from linvit_mm.models.attention.kernel import elu_feature_map
from linvit_mm.testing import assert_rel_close, rel_error


def test_operators_fix_their_feature_map(make_attention):
    elu, relu = make_attention('elu'), make_attention('relu')
    assert type(elu) is ELUAttention and elu.feature_map == 'elu'
    assert type(relu) is ReLUAttention and relu.feature_map == 'relu'


def test_elu_feature_map_is_elu_plus_one_with_its_gradient():
    x = torch.cat([torch.linspace(-30., 30., 601, dtype=torch.float64),
                   torch.zeros(1, dtype=torch.float64)]).requires_grad_()
    out = elu_feature_map(x)
    expected = F.elu(x) + 1
    assert_rel_close(out, expected, 1e-15, 'elu(x) + 1')
    grad, = torch.autograd.grad(out.sum(), x)
    expected_grad, = torch.autograd.grad(expected.sum(), x)
    assert_rel_close(grad, expected_grad, 1e-15, 'gradient')
    assert grad[-1] == 1.  # at 0


@pytest.mark.parametrize('attn_type', ['elu', 'relu'])
def test_map_rows_are_normalised_and_non_negative(attn_type, make_attention, tokens):
    module = make_attention(attn_type)
    hw = (7, 9)
    with torch.no_grad():
        attn = module.attention_map(tokens(hw, 1), hw)
    row_sums = attn.sum(dim=-1)
    # eps = 1e-6 shrinks rows by eps / (raw row sum); an all-zero relu row stays zero.
    live = row_sums > 0
    assert live.float().mean() > 0.9 if attn_type == 'relu' else live.all()
    assert_rel_close(row_sums[live], torch.ones_like(row_sums[live]), 1e-5, 'row sums')
    assert attn.min() >= 0


@pytest.mark.parametrize('attn_type', ['elu', 'relu'])
def test_state_is_float32_under_fp16_autocast(attn_type, make_attention, tokens,
                                              autocast_output):
    """The normaliser sum_j phi(k_j) over 16k tokens of scale 30 (it grows like N |k|)
    overflows fp16 (max 65504) while the true output fits it; the float32 state does not."""
    module = make_attention(attn_type, dtype=torch.float32, embed_dims=64, num_heads=2)
    hw = (128, 128)
    x = tokens(hw, 0, batch=1, dims=64, dtype=torch.float32, scale=30.)
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.float16):
        q, k, _ = module.split_heads(module.qkv(x))
    phi_k = module._features(q, k)[1]
    assert phi_k.dtype == torch.float16
    assert torch.isfinite(phi_k).all() and not torch.isfinite(phi_k.sum(dim=-2)).all()
    out, exact = autocast_output(module, x, hw, torch.float16)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert rel_error(out, exact) < 1e-2


def test_relu_all_zero_rows_stay_finite(make_attention, tokens):
    module = make_attention('relu')
    hw = (3, 3)
    x = tokens(hw, 1)
    with torch.no_grad():
        # A query head whose every component is negative has phi(q) = 0: 0 / (0 + eps).
        module.qkv.weight[:module.head_dims].zero_()
        module.qkv.bias[:module.head_dims].fill_(-1.)
    x.requires_grad_(True)
    attn = module.attention_map(x, hw)
    fast = module(x, hw)
    fast.sum().backward()
    assert torch.isfinite(fast).all() and torch.isfinite(x.grad).all()
    assert torch.count_nonzero(attn[:, 0]) == 0
    assert_rel_close(module.forward_reference(x, hw), fast, 1e-10, 'reference vs fast output')


def test_kernel_rejects_bad_feature_map_and_eps():
    with pytest.raises(ValueError, match='elu, relu'):
        KernelAttention(24, 3, feature_map='gelu')
    with pytest.raises(ValueError, match='eps'):
        KernelAttention(24, 3, eps=0.)
