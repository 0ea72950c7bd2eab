"""What every linear operator with an explicit map (``map_attention.py``) shares: Softmax-shaped
weights, a fast form that never forms the N x N map, float32 sums under autocast."""
import pytest
import torch

from linvit_mm.models.attention import LinearMapAttention, attention_class, attention_types
from linvit_mm.testing import assert_rel_close, rel_error

LINEAR_MAP_OPERATORS = [name for name in attention_types()
                        if issubclass(attention_class(name), LinearMapAttention)]


def test_the_family_is_not_empty():
    assert {'elu', 'relu', 'inline'} <= set(LINEAR_MAP_OPERATORS)


@pytest.mark.parametrize('attn_type', LINEAR_MAP_OPERATORS)
def test_weights_are_shaped_like_softmax_attention(attn_type, make_attention):
    module = make_attention(attn_type)
    C = module.embed_dims
    assert {'qkv.weight', 'qkv.bias', 'proj.weight', 'proj.bias'} <= set(module.state_dict())
    assert module.qkv.weight.shape == (3 * C, C) and module.proj.weight.shape == (C, C)
    assert make_attention(attn_type, qkv_bias=False).qkv.bias is None


@pytest.mark.parametrize('attn_type', LINEAR_MAP_OPERATORS)
def test_fast_path_never_forms_n_by_n(attn_type, make_attention, tokens, largest_intermediate):
    hw = (64, 64)
    num_tokens = hw[0] * hw[1]
    module = make_attention(attn_type, dtype=torch.float32, embed_dims=32, num_heads=2)
    x = tokens(hw, 0, batch=1, dims=32, dtype=torch.float32).requires_grad_(True)

    def fast():
        module(x, hw).sum().backward()

    # Largest legitimate tensors are (B, N, 3C) = 4096 * 96 elements; a map is 2 * 4096^2.
    assert largest_intermediate(fast) < num_tokens * num_tokens // 8

    small_hw = (16, 16)
    small_x = tokens(small_hw, 0, batch=1, dims=32, dtype=torch.float32)
    # The probe does see a map when one is formed.
    assert largest_intermediate(lambda: module.forward_reference(small_x, small_hw)) >= 256 * 256


@pytest.mark.parametrize('attn_type', LINEAR_MAP_OPERATORS)
def test_bf16_autocast_16k_tokens_is_finite_and_close(attn_type, make_attention, tokens,
                                                      autocast_output):
    module = make_attention(attn_type, dtype=torch.float32, embed_dims=64, num_heads=2)
    hw = (128, 128)
    x = tokens(hw, 0, batch=1, dims=64, dtype=torch.float32)
    out, exact = autocast_output(module, x, hw, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    # bf16 projections limit the accuracy to a few 1e-3; a bf16 state would add more.
    assert rel_error(out, exact) < 2e-2


@pytest.mark.parametrize('attn_type', LINEAR_MAP_OPERATORS)
def test_map_and_reference_run_in_float32_under_autocast(attn_type, make_attention, tokens):
    module = make_attention(attn_type, dtype=torch.float32)
    hw = (7, 9)
    x = tokens(hw, 1, dtype=torch.float32)
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):
        attn = module.attention_map(x, hw)
        reference, fast = module.forward_reference(x, hw), module(x, hw)
    assert attn.dtype == torch.float32
    # both return to the projections' dtype before proj
    assert reference.dtype == fast.dtype == torch.bfloat16
    assert_rel_close(reference, fast, 1e-2, 'reference vs fast under bf16 autocast')
