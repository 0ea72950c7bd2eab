"""elu / relu kernel attention: the fast form against the oracle written from the definition,
feature maps, the normalised map, the float32 state, eps."""
import pytest
import torch
import torch.nn.functional as F

from linvit_mm.models.attention import ELUAttention, KernelAttention, ReLUAttention, kernel
from linvit_mm.models.attention.kernel import elu_feature_map, naive_kernel_attention
from linvit_mm.testing import assert_rel_close, rel_error

ROPES = {'eva': dict(type='eva', ref_grid=(4, 4)), 'dinov3': dict(type='dinov3')}
CONFIGS = {
    'plain': {},
    'rope_eva': {'rope': ROPES['eva']},
    'rope_dinov3': {'rope': ROPES['dinov3']},
    # an eps of the normalisers' order makes a misplaced eps visible at any tolerance
    'eps_1': {'eps': 1.},
    'rope_eva_eps_1': {'rope': ROPES['eva'], 'eps': 1.},
    'no_qkv_bias_layer_scale': {'qkv_bias': False, 'layer_scale_init_value': .5},
    # as many heads as q, k, v parts (the default 3) hides a head split that swaps the two
    'four_heads': {'embed_dims': 32, 'num_heads': 4},
    'four_heads_rope_dinov3': {'embed_dims': 32, 'num_heads': 4, 'rope': ROPES['dinov3']},
}
GRIDS = {'7x9': (7, 9), '5x3': (5, 3)}
FEATURES = {'elu': lambda x: F.elu(x) + 1, 'relu': F.relu}


@pytest.mark.parametrize('hw', GRIDS.values(), ids=GRIDS)
@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
@pytest.mark.parametrize('config', CONFIGS.values(), ids=CONFIGS)
@pytest.mark.parametrize('attn_type', ['elu', 'relu'])
def test_fast_form_matches_naive_reference(attn_type, config, num_extra, hw, make_attention,
                                           tokens, assert_fast_matches_naive):
    """Output and the gradients of the input and of every parameter, in float64."""
    module = make_attention(attn_type, **config)
    assert_fast_matches_naive(module, tokens(hw, num_extra, dims=module.embed_dims), hw)


@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
@pytest.mark.parametrize('config', ['plain', 'rope_eva', 'rope_dinov3', 'four_heads'])
@pytest.mark.parametrize('attn_type', ['elu', 'relu'])
def test_attention_map_matches_naive_map(attn_type, config, num_extra, make_attention, tokens,
                                        assert_map_matches_naive):
    module = make_attention(attn_type, **CONFIGS[config])
    hw = (7, 9)
    assert_map_matches_naive(module, tokens(hw, num_extra, dims=module.embed_dims), hw)


@pytest.mark.parametrize('rotated', [False, True], ids=['no_rope', 'rotated'])
@pytest.mark.parametrize('attn_type', ['elu', 'relu'])
def test_naive_form_is_the_definition_token_by_token(attn_type, rotated):
    """``out_i = sum_j (R_i phi(q_i))^T (R_j phi(k_j)) v_j / (sum_l phi(q_i)^T phi(k_l) + eps)``
    per head, with head ``h`` in channels ``h d .. (h+1) d`` of each of q, k, v and of the
    output; torch's own elu and relu, any per-token matrices ``R``."""
    generator = torch.Generator().manual_seed(0)
    heads, d, n, eps = 2, 4, 5, .3
    C = heads * d
    qkv = torch.randn(1, n, 3 * C, generator=generator, dtype=torch.float64)
    rotations = torch.linalg.qr(torch.randn(n, d, d, generator=generator,
                                            dtype=torch.float64))[0] if rotated else None
    out, attn = naive_kernel_attention(qkv, heads, attn_type, eps, rotations)
    phi = FEATURES[attn_type]
    for h in range(heads):
        def part(p, i):
            return qkv[0, i, p * C + h * d:p * C + (h + 1) * d]

        def turn(i, t):
            return t if rotations is None else rotations[i] @ t

        for i in range(n):
            normaliser = sum(phi(part(0, i)) @ phi(part(1, j)) for j in range(n)) + eps
            weights = [turn(i, phi(part(0, i))) @ turn(j, phi(part(1, j))) / normaliser
                       for j in range(n)]
            expected = sum(w * part(2, j) for j, w in enumerate(weights))
            assert_rel_close(attn[0, h, i], torch.stack(weights), 1e-12, f'map row {i}')
            assert_rel_close(out[0, i, h * d:(h + 1) * d], expected, 1e-12, f'output {i}')


@pytest.mark.parametrize('attn_type', ['elu', 'relu'])
def test_reference_shares_no_helper_with_the_fast_form(attn_type, make_attention, tokens,
                                                       fast_helpers_broken):
    module = make_attention(attn_type, rope=ROPES['eva'])
    hw = (4, 5)
    x = tokens(hw, 1)
    with torch.no_grad():
        expected = module.forward_reference(x, hw)
        with fast_helpers_broken((kernel, 'FEATURE_MAPS'), (KernelAttention, '_features'),
                                 (KernelAttention, '_linear'), (KernelAttention, '_map')):
            assert torch.equal(module.forward_reference(x, hw), expected)


@pytest.mark.parametrize('rope', [None, 'eva'], ids=['no_rope', 'rope_eva'])
@pytest.mark.parametrize('attn_type', ['elu', 'relu'])
def test_map_is_float32_under_bf16_autocast(attn_type, rope, make_attention, tokens):
    """The map (the distillation target) is formed in float32 from the bf16 projections."""
    module = make_attention(attn_type, dtype=torch.float32, rope=ROPES.get(rope))
    hw = (7, 9)
    x = tokens(hw, 1, dtype=torch.float32)
    with torch.no_grad():
        with torch.autocast('cpu', dtype=torch.bfloat16):
            attn = module.attention_map(x, hw)
            qkv = module.qkv(x)
        naive = naive_kernel_attention(qkv.double(), module.num_heads, attn_type, module.eps,
                                       module.rotation_matrices(hw, 1, qkv.double()))[1]
    assert attn.dtype == torch.float32
    assert_rel_close(attn, naive, 1e-5, 'map from the bf16 projections')


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


@pytest.mark.parametrize('attn_type', ['elu', 'relu'])
def test_documented_defaults(attn_type, assert_common_defaults):
    assert_common_defaults(attn_type, feature_map=attn_type, eps=1e-6)
    assert_common_defaults(KernelAttention, feature_map='relu', eps=1e-6)


@pytest.mark.parametrize('feature_map', ['elu', 'relu'])
def test_naive_form_ignores_autocast(feature_map, assert_oracle_ignores_autocast):
    qkv = torch.randn(2, 13, 3 * 24, generator=torch.Generator().manual_seed(0))
    assert_oracle_ignores_autocast(naive_kernel_attention, qkv, 3, feature_map, 1e-6)
