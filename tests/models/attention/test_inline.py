"""InLine attention: the fast form against the oracle written from the definition, its signed
map over every token, and its float32 state."""
import pytest
import torch

from linvit_mm.models.attention import InLineAttention
from linvit_mm.models.attention.inline import naive_inline_attention
from linvit_mm.testing import assert_rel_close, rel_error

ROPES = {'eva': dict(type='eva', ref_grid=(4, 4)), 'dinov3': dict(type='dinov3')}
CONFIGS = {
    'plain': {},
    'rope_eva': {'rope': ROPES['eva']},
    'rope_dinov3': {'rope': ROPES['dinov3']},
    'no_qkv_bias_layer_scale': {'qkv_bias': False, 'layer_scale_init_value': .5},
    # as many heads as q, k, v parts (the default 3) hides a head split that swaps the two
    'four_heads': {'embed_dims': 32, 'num_heads': 4},
    'four_heads_rope_dinov3': {'embed_dims': 32, 'num_heads': 4, 'rope': ROPES['dinov3']},
}
GRIDS = {'7x9': (7, 9), '5x3': (5, 3)}


def channel_heads(module, x):
    """``q, k`` heads ``(B, heads, N, d)`` read from the ``qkv`` output's channels by hand."""
    qkv = module.qkv(x)
    C, d = module.embed_dims, module.head_dims
    return [torch.stack([qkv[..., p * C + h * d:p * C + (h + 1) * d]
                         for h in range(module.num_heads)], dim=1) for p in range(2)]


@pytest.mark.parametrize('hw', GRIDS.values(), ids=GRIDS)
@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
@pytest.mark.parametrize('config', CONFIGS.values(), ids=CONFIGS)
def test_fast_form_matches_naive_reference(config, num_extra, hw, make_attention, tokens,
                                           assert_fast_matches_naive):
    """Output and the gradients of the input and of every parameter, in float64."""
    module = make_attention('inline', **config)
    assert_fast_matches_naive(module, tokens(hw, num_extra, dims=module.embed_dims), hw)


@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
@pytest.mark.parametrize('config', ['plain', 'rope_eva', 'rope_dinov3', 'four_heads'])
def test_attention_map_matches_naive_map(config, num_extra, make_attention, tokens,
                                        assert_map_matches_naive):
    module = make_attention('inline', **CONFIGS[config])
    hw = (7, 9)
    assert_map_matches_naive(module, tokens(hw, num_extra, dims=module.embed_dims), hw)


@pytest.mark.parametrize('rotated', [False, True], ids=['no_rope', 'rotated'])
def test_naive_form_is_the_definition_token_by_token(rotated):
    """``out_i = sum_j (s/N q_i^T k_j + (1 - s q_i^T k_mean) / N) v_j`` per head, ``s = d^-1/2``,
    with ``q, k`` rotated by per-token matrices ``R`` first (any ``R``) and head ``h`` in
    channels ``h d .. (h+1) d`` of each of q, k, v and of the output."""
    generator = torch.Generator().manual_seed(0)
    heads, d, n = 2, 4, 5
    C, s = heads * d, 4**-0.5
    qkv = torch.randn(1, n, 3 * C, generator=generator, dtype=torch.float64)
    rotations = torch.linalg.qr(torch.randn(n, d, d, generator=generator,
                                            dtype=torch.float64))[0] if rotated else None
    out, attn = naive_inline_attention(qkv, heads, rotations)
    for h in range(heads):
        def part(p, i):
            t = qkv[0, i, p * C + h * d:p * C + (h + 1) * d]
            return t if rotations is None or p == 2 else rotations[i] @ t

        k_mean = sum(part(1, j) for j in range(n)) / n
        for i in range(n):
            weights = [s / n * (part(0, i) @ part(1, j)) + (1 - s * (part(0, i) @ k_mean)) / n
                       for j in range(n)]
            expected = sum(w * part(2, j) for j, w in enumerate(weights))
            assert_rel_close(attn[0, h, i], torch.stack(weights), 1e-12, f'map row {i}')
            assert_rel_close(out[0, i, h * d:(h + 1) * d], expected, 1e-12, f'output {i}')


def test_reference_shares_no_helper_with_the_fast_form(make_attention, tokens,
                                                       fast_helpers_broken):
    module = make_attention('inline', rope=ROPES['eva'])
    hw = (4, 5)
    x = tokens(hw, 1)
    with torch.no_grad():
        expected = module.forward_reference(x, hw)
        with fast_helpers_broken((InLineAttention, '_linear'), (InLineAttention, '_map'),
                                 (module, 'scale')):
            assert torch.equal(module.forward_reference(x, hw), expected)


@pytest.mark.parametrize('rope', [None, 'eva'], ids=['no_rope', 'rope_eva'])
def test_map_is_float32_under_bf16_autocast(rope, make_attention, tokens):
    """The map (the distillation target) is formed in float32 from the bf16 projections (the
    rotation returns float32 and would upcast a rotated map anyway; an unrotated one shows it)."""
    module = make_attention('inline', dtype=torch.float32, rope=ROPES.get(rope))
    hw = (7, 9)
    x = tokens(hw, 1, dtype=torch.float32)
    with torch.no_grad():
        with torch.autocast('cpu', dtype=torch.bfloat16):
            attn = module.attention_map(x, hw)
            qkv = module.qkv(x)
        naive = naive_inline_attention(qkv.double(), module.num_heads,
                                       module.rotation_matrices(hw, 1, qkv.double()))[1]
    assert attn.dtype == torch.float32
    assert_rel_close(attn, naive, 1e-5, 'map from the bf16 projections')


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
        q, k = channel_heads(module, x)
        n, s = x.shape[1], module.head_dims**-0.5
        expected = (s / n) * (q @ k.transpose(-2, -1)) \
            + (1 - s * q @ k.mean(dim=2, keepdim=True).transpose(-2, -1)) / n
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
