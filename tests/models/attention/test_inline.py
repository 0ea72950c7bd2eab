"""InLine attention: its signed map over every token, and its float32 state."""
import torch

from linvit_mm.testing import assert_rel_close, rel_error


def test_map_rows_sum_to_one_and_are_signed(make_attention, tokens):
    module = make_attention('inline')
    hw = (7, 9)
    with torch.no_grad():
        attn = module.attention_map(tokens(hw, 1), hw)
    assert attn.min() < 0, 'InLine maps are signed; this one has no negative entry'
    assert_rel_close(attn.sum(dim=-1), torch.ones(attn.shape[:-1], dtype=attn.dtype), 1e-12,
                     'row sums')


def test_inline_counts_the_class_token(make_attention, tokens):
    """N and the key/value means span every token, class token included (official DeiT model)."""
    module = make_attention('inline')
    hw = (4, 4)
    x = tokens(hw, 1)
    with torch.no_grad():
        attn = module.attention_map(x, hw)
        q, k, _ = module.split_heads(module.qkv(x))
        n = x.shape[1]
        expected = (module.scale / n) * (q @ k.transpose(-2, -1)) \
            + (1 - module.scale * q @ k.mean(dim=2, keepdim=True).transpose(-2, -1)) / n
    assert_rel_close(attn, expected, 1e-12, 'InLine map')


def test_state_is_float32_under_fp16_autocast(make_attention, tokens, autocast_output):
    """``K^T V`` over 16k tokens of scale 10 (it grows like sqrt(N) |k||v|) overflows fp16
    (max 65504) while the true output fits it; the float32 state does not overflow."""
    module = make_attention('inline', dtype=torch.float32, embed_dims=64, num_heads=2)
    hw = (128, 128)
    x = tokens(hw, 0, batch=1, dims=64, dtype=torch.float32, scale=10.)
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.float16):
        _, k, v = module.split_heads(module.qkv(x))
    assert k.dtype == torch.float16
    assert torch.isfinite(k).all() and not torch.isfinite(k.transpose(-2, -1) @ v).all()
    out, exact = autocast_output(module, x, hw, torch.float16)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert rel_error(out, exact) < 1e-2
