"""Softmax attention: fused and eager forms against the oracle written from the definition,
the map, attention dropout."""
import math

import pytest
import torch

from linvit_mm.models.attention import SoftmaxAttention
from linvit_mm.models.attention.softmax import naive_softmax_attention
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


@pytest.mark.parametrize('hw', GRIDS.values(), ids=GRIDS)
@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
@pytest.mark.parametrize('config', CONFIGS.values(), ids=CONFIGS)
@pytest.mark.parametrize('fused', [True, False], ids=['fused', 'eager'])
def test_fast_form_matches_naive_reference(fused, config, num_extra, hw, make_attention, tokens,
                                           assert_fast_matches_naive):
    """Output and the gradients of the input and of every parameter, in float64."""
    module = make_attention('softmax', fused=fused, **config)
    assert_fast_matches_naive(module, tokens(hw, num_extra, dims=module.embed_dims), hw)


@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
@pytest.mark.parametrize('config', ['plain', 'rope_eva', 'rope_dinov3', 'four_heads'])
def test_attention_map_matches_naive_map(config, num_extra, make_attention, tokens,
                                        assert_map_matches_naive):
    module = make_attention('softmax', **CONFIGS[config])
    hw = (7, 9)
    assert_map_matches_naive(module, tokens(hw, num_extra, dims=module.embed_dims), hw)


@pytest.mark.parametrize('rotated', [False, True], ids=['no_rope', 'rotated'])
def test_naive_form_is_the_definition_token_by_token(rotated):
    """``out_i = sum_j exp(s q_i^T k_j) v_j / sum_l exp(s q_i^T k_l)`` per head, ``s = d^-1/2``,
    with ``q, k`` rotated by per-token matrices ``R`` first (any ``R``) and head ``h`` in
    channels ``h d .. (h+1) d`` of each of q, k, v and of the output."""
    generator = torch.Generator().manual_seed(0)
    heads, d, n = 2, 4, 5
    C, s = heads * d, 4**-0.5
    qkv = torch.randn(1, n, 3 * C, generator=generator, dtype=torch.float64)
    rotations = torch.linalg.qr(torch.randn(n, d, d, generator=generator,
                                            dtype=torch.float64))[0] if rotated else None
    out, attn = naive_softmax_attention(qkv, heads, rotations)
    for h in range(heads):
        def part(p, i):
            t = qkv[0, i, p * C + h * d:p * C + (h + 1) * d]
            return t if rotations is None or p == 2 else rotations[i] @ t

        for i in range(n):
            scores = [math.exp(s * float(part(0, i) @ part(1, j))) for j in range(n)]
            weights = [score / sum(scores) for score in scores]
            expected = sum(w * part(2, j) for j, w in enumerate(weights))
            assert_rel_close(attn[0, h, i], torch.tensor(weights, dtype=torch.float64), 1e-12,
                             f'map row {i}')
            assert_rel_close(out[0, i, h * d:(h + 1) * d], expected, 1e-12, f'output {i}')


def test_reference_shares_no_helper_with_the_fast_forms(make_attention, tokens,
                                                        fast_helpers_broken):
    module = make_attention('softmax', rope=ROPES['eva'])
    hw = (4, 5)
    x = tokens(hw, 1)
    with torch.no_grad():
        expected = module.forward_reference(x, hw)
        with fast_helpers_broken((SoftmaxAttention, '_heads'), (SoftmaxAttention, '_eager'),
                                 (SoftmaxAttention, '_fused'), (SoftmaxAttention, '_softmax_map'),
                                 (module, 'scale')):
            assert torch.equal(module.forward_reference(x, hw), expected)


def test_map_rows_are_distributions(make_attention, tokens):
    module = make_attention('softmax')
    hw = (7, 9)
    with torch.no_grad():
        attn = module.attention_map(tokens(hw, 1), hw)
    assert attn.min() >= 0
    assert_rel_close(attn.sum(dim=-1), torch.ones(attn.shape[:-1], dtype=attn.dtype), 1e-12,
                     'row sums')


@pytest.mark.parametrize('training', [True, False], ids=['train', 'eval'])
def test_fused_matches_eager_float32(training, make_attention, tokens, output_and_grads):
    module = make_attention('softmax', dtype=torch.float32)
    module.train(training)
    hw = (7, 9)
    x = tokens(hw, 1, dtype=torch.float32)
    module.fused = True
    fused, fused_grads = output_and_grads(module, lambda t: module(t, hw), x)
    module.fused = False
    eager, eager_grads = output_and_grads(module, lambda t: module(t, hw), x)
    assert_rel_close(fused, eager, 1e-5, 'output')
    for name, grad in fused_grads.items():
        assert_rel_close(grad, eager_grads[name], 1e-5, f'grad of {name}')


@pytest.mark.parametrize('fused', [True, False], ids=['fused', 'eager'])
def test_attention_dropout_only_in_training(fused, make_attention, tokens):
    module = make_attention('softmax', dtype=torch.float32, attn_drop=0.5, fused=fused)
    hw = (5, 3)
    x = tokens(hw, 1, dtype=torch.float32)
    module.eval()
    first, second = module(x, hw), module(x, hw)
    assert torch.equal(first, second)
    module.train()
    torch.manual_seed(3)
    dropped = module(x, hw)
    assert rel_error(dropped, first) > 1e-2
    # the map is the attention distribution before dropout, in training too
    assert torch.equal(module.attention_map(x, hw), module.eval().attention_map(x, hw))


def test_documented_defaults(assert_common_defaults):
    assert_common_defaults('softmax', fused=True, has_map=True, supports_attn_drop=True)


def test_naive_form_ignores_autocast(assert_oracle_ignores_autocast):
    qkv = torch.randn(2, 13, 3 * 24, generator=torch.Generator().manual_seed(0))
    assert_oracle_ignores_autocast(naive_softmax_attention, qkv, 3)
