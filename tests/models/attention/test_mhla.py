"""MHLA: the fast block form against its O(N^2) reference, padding, layout and numerics."""
import math

import pytest
import torch
import torch.nn.functional as F

from linvit_mm.models.attention import MultiHeadLinearAttention, build_attention
from linvit_mm.models.attention.mhla import distance_mixing_matrix
from linvit_mm.testing import assert_rel_close, rel_error

EMBED_DIMS, NUM_HEADS = 24, 3


def make(dtype=torch.float64, seed=0, randomise_mixing=True, device='cpu', embed_dims=EMBED_DIMS,
         num_heads=NUM_HEADS, **kwargs):
    """An MHLA module; the mixing matrix is made asymmetric and dense so that a wrong
    block index or transposed mixing cannot hide behind the symmetric initialisation."""
    torch.manual_seed(seed)
    module = MultiHeadLinearAttention(embed_dims, num_heads, **kwargs)
    module.to(device=device, dtype=dtype)
    if randomise_mixing:
        with torch.no_grad():
            module.block_mixing.uniform_(0.1, 1.)
    return module


def heads(t, num_heads):
    B, N, C = t.shape
    return t.reshape(B, N, num_heads, C // num_heads).transpose(1, 2)


def features(module, x):
    """Per-head ``phi(q), phi(k), v`` and the raw values, computed outside the module."""
    q, k, v = module.qkv(x).chunk(3, dim=-1)
    phi_q, phi_k = (F.relu(heads(t, module.num_heads)) + module.feature_floor for t in (q, k))
    return phi_q, phi_k, heads(v, module.num_heads), v


def finish(module, out_heads, values, hw, num_extra=0):
    """Merge heads, add the value convolution of the patch tokens, project."""
    B, h, N, d = out_heads.shape
    out = out_heads.transpose(1, 2).reshape(B, N, h * d)
    patches = values[:, num_extra:].transpose(1, 2).reshape(B, -1, *hw)
    local = module.value_conv(patches).flatten(2).transpose(1, 2)
    out = out + F.pad(local, (0, 0, num_extra, 0))
    return module.proj(out)


# ---------------------------------------------------------------- fast == reference

CASES = [((14, 14), 8, 2), ((7, 9), 8, 2), ((3, 1), 8, 2), ((1, 1), 8, 2), ((50, 84), 4, 1)]


@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
@pytest.mark.parametrize('hw,dims,num_heads', CASES)
def test_fast_matches_reference(hw, dims, num_heads, num_extra, device, tokens,
                                assert_matches_reference):
    module = make(embed_dims=dims, num_heads=num_heads, device=device)
    x = tokens(hw, num_extra, batch=1 if hw[0] * hw[1] > 1000 else 2, dims=dims, device=device)
    grads = assert_matches_reference(module, x, hw)
    assert all(grad is not None for grad in grads.values()), 'a parameter gets no gradient'


OPTIONS = {
    'qk_norm': dict(qk_norm=True),
    'plain_relu_cos_3x3': dict(feature_floor=0., mixing_init='cos', num_blocks=(3, 3)),
    'rect_1x3_kernel3': dict(num_blocks=(1, 3), value_kernel_size=3, qkv_bias=False),
    'two_extra': dict(),
}


@pytest.mark.parametrize('option', list(OPTIONS))
def test_fast_matches_reference_options(option, tokens, assert_matches_reference):
    module = make(**OPTIONS[option])
    hw = (10, 7)
    x = tokens(hw, 2 if option == 'two_extra' else 0)
    grads = assert_matches_reference(module, x, hw)
    assert all(grad is not None for grad in grads.values()), 'a parameter gets no gradient'


def test_fast_form_never_builds_token_pairs(tokens, largest_intermediate):
    module = make()
    hw = (40, 40)
    x = tokens(hw, 1, batch=1)
    num_tokens = x.shape[1]
    with torch.no_grad():
        assert largest_intermediate(lambda: module(x, hw)) < num_tokens * num_tokens / 8
        # the probe does see N x N tensors
        reference = largest_intermediate(lambda: module.forward_reference(x, hw))
    assert reference >= num_tokens * num_tokens


# ---------------------------------------------------------------- padding and layout

@pytest.mark.parametrize('hw', [(7, 9), (5, 3), (3, 1)])
def test_non_divisible_grid_equals_padded_grid_with_masked_keys(hw, tokens):
    """Oracle built on the padded (divisible) grid, with padded tokens' keys and
    values zeroed after the feature map and padded queries dropped."""
    module = make()
    x = tokens(hw, 0)
    H, W = hw
    layout = module.block_layout(hw)
    Hp, Wp = layout.padded_h, layout.padded_w
    assert (Hp % module.num_blocks[0], Wp % module.num_blocks[1]) == (0, 0)

    with torch.no_grad():
        phi_q, phi_k, v, values = features(module, x)
        real = torch.zeros(Hp, Wp, dtype=torch.bool)
        real[:H, :W] = True
        real = real.flatten()

        def scatter(t):
            padded = t.new_zeros(*t.shape[:2], Hp * Wp, t.shape[-1])
            padded[:, :, real] = t
            return padded

        rows = torch.arange(Hp)[:, None] // (Hp // module.num_blocks[0])
        cols = torch.arange(Wp)[None, :] // (Wp // module.num_blocks[1])
        block = (rows * module.num_blocks[1] + cols).flatten()
        mixing = module.block_mixing[block[:, None], block[None, :]]

        def padded_oracle(phi_k_padded, v_padded):
            scores = mixing * (scatter(phi_q) @ phi_k_padded.transpose(-2, -1))
            out = (scores @ v_padded) / (scores.sum(-1, keepdim=True) + module.eps)
            return finish(module, out[:, :, real], values, hw)

        expected = padded_oracle(scatter(phi_k), scatter(v))
        out = module(x, hw)
        assert_rel_close(out, expected, 1e-10, 'output')

        # The masking matters: padded tokens fed through qkv as zero inputs carry the
        # bias and the feature floor, and change the result.
        _, phi_k_zero_input, v_zero_input, _ = features(module, x.new_zeros(2, Hp * Wp,
                                                                            EMBED_DIMS))
        phi_k_unmasked = torch.where(real[:, None], scatter(phi_k), phi_k_zero_input)
        v_unmasked = torch.where(real[:, None], scatter(v), v_zero_input)
        assert rel_error(padded_oracle(phi_k_unmasked, v_unmasked), expected) > 1e-3


@pytest.mark.parametrize('hw,block', [((14, 14), (7, 7)), ((28, 28), (14, 14)),
                                      ((50, 84), (25, 42)), ((7, 9), (4, 5)),
                                      ((3, 1), (2, 1)), ((1, 1), (1, 1))])
def test_block_count_fixed_block_size_follows_grid(hw, block, tokens):
    module = make(embed_dims=8, num_heads=2)
    layout = module.block_layout(hw)
    assert (layout.rows, layout.cols) == (2, 2)
    assert (layout.block_h, layout.block_w) == block
    assert module.block_mixing.shape == (4, 4)
    x = tokens(hw, 0, batch=1, dims=8)
    with torch.no_grad():
        assert_rel_close(module(x, hw), module.forward_reference(x, hw), 1e-10, 'output')


def test_same_parameters_serve_every_resolution(tokens):
    module = make(embed_dims=8, num_heads=2)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    for hw in [(14, 14), (28, 28), (50, 84)]:
        x = tokens(hw, 0, batch=1, dims=8)
        with torch.no_grad():
            out = module(x, hw)
        assert out.shape == x.shape and torch.isfinite(out).all()
    assert all(torch.equal(state[k], v) for k, v in module.state_dict().items())


def test_blocks_are_the_summary_boundaries(tokens):
    """With identity mixing and no value convolution a token only influences the
    outputs of its own block, which at 28x28 is a 14x14 quarter (not a 7x7 one)."""
    module = make(randomise_mixing=False)
    with torch.no_grad():
        module.block_mixing.copy_(torch.eye(4))
        module.value_conv.weight.zero_()
        module.value_conv.bias.zero_()
    hw = (28, 28)
    x = tokens(hw, 0, batch=1)
    x_moved = x.clone()
    x_moved[0, 13 * 28 + 13] += 3.
    with torch.no_grad():
        delta = (module(x_moved, hw) - module(x, hw)).abs().amax(-1).reshape(28, 28)
    changed = delta > 1e-12
    own_block = torch.zeros(28, 28, dtype=torch.bool)
    own_block[:14, :14] = True
    assert torch.equal(changed, own_block)


# ---------------------------------------------------------------- semantics

@pytest.mark.parametrize('num_extra', [1, 2], ids=['one_extra', 'two_extra'])
def test_extra_tokens_are_global(num_extra, tokens):
    """Extra queries read plain (unmixed) linear attention over all tokens; patch
    queries see the extra keys with weight 1 on top of their mixed block summary."""
    module = make()
    hw = (6, 5)
    x = tokens(hw, num_extra)
    with torch.no_grad():
        phi_q, phi_k, v, values = features(module, x)
        kv = phi_k.transpose(-2, -1) @ v
        out_heads = (phi_q @ kv) / (phi_q @ phi_k.sum(-2).unsqueeze(-1) + module.eps)
        expected = finish(module, out_heads, values, hw, num_extra)[:, :num_extra]
        out = module(x, hw)
    assert_rel_close(out[:, :num_extra], expected, 1e-10, 'extra-token output')
    weights = module.reference_mixing_weights(hw, num_extra)
    assert torch.equal(weights[:num_extra], torch.ones_like(weights[:num_extra]))
    assert torch.equal(weights[:, :num_extra], torch.ones_like(weights[:, :num_extra]))


def test_value_convolution_skips_extra_tokens(tokens):
    """Changing only the conv bias moves patch outputs by proj(bias), not the class token."""
    module = make()
    hw = (4, 4)
    x = tokens(hw, 1)
    with torch.no_grad():
        before = module(x, hw)
        module.value_conv.bias.add_(1.)
        after = module(x, hw)
        shift = module.proj.weight @ torch.ones(EMBED_DIMS, dtype=torch.float64)
    assert torch.allclose(after[:, 0], before[:, 0], rtol=0, atol=1e-12)
    assert_rel_close(after[:, 1:] - before[:, 1:], shift.expand_as(before[:, 1:]), 1e-10,
                     'patch shift')


def test_normaliser_uses_the_queries_of_the_numerator(tokens):
    """Equal values everywhere: every output row is a convex combination of them, so
    MHLA returns that value exactly. The public code's normaliser, which pairs block
    j's normaliser with the query at the same position of block j instead of the
    reading query, fails this (checked below, so the test can tell them apart)."""
    module = make(eps=1e-30)
    dims = EMBED_DIMS
    value = torch.linspace(-1., 2., dims, dtype=torch.float64)
    with torch.no_grad():
        module.qkv.weight[2 * dims:].zero_()
        module.qkv.bias[2 * dims:].copy_(value)
        module.value_conv.weight.zero_()
        module.value_conv.bias.zero_()
        module.proj.weight.copy_(torch.eye(dims))
        module.proj.bias.zero_()
    hw = (14, 14)
    x = tokens(hw, 0)
    with torch.no_grad():
        out = module(x, hw)
        reference = module.forward_reference(x, hw)
    assert_rel_close(out, value.expand_as(out), 1e-12, 'fast output')
    assert_rel_close(reference, value.expand_as(out), 1e-12, 'reference output')

    # Public-code normaliser on the same tensors: query at position p of block i is
    # divided by sum_j W_ij phi(q_{j,p})^T z_j.
    with torch.no_grad():
        phi_q, phi_k, _, _ = features(module, x)
        layout = module.block_layout(hw)
        to_blocks = module._to_blocks
        q_blocks, k_blocks = to_blocks(phi_q, hw, layout), to_blocks(phi_k, hw, layout)
        z = k_blocks.sum(-2)                                            # (B, h, M, d)
        W = module.block_mixing
        numerator = q_blocks @ torch.einsum('ij,bhjd->bhid', W, z).unsqueeze(-1)
        own_block_normaliser = q_blocks @ z.unsqueeze(-1)              # phi(q_{j,p}) . z_j
        public_normaliser = torch.einsum('ij,bhjpo->bhipo', W, own_block_normaliser)
        ratio = numerator / public_normaliser
    assert (ratio - 1).abs().max() > 1e-2


# ---------------------------------------------------------------- mixing initialisation

@pytest.mark.parametrize('mode', ['linear', 'cos'])
@pytest.mark.parametrize('num_blocks', [(2, 2), (3, 4), (1, 3), (4, 4)])
def test_mixing_init_columns_normalised_nearer_heavier(num_blocks, mode):
    weights = distance_mixing_matrix(num_blocks, mode).double()
    M = num_blocks[0] * num_blocks[1]
    assert weights.shape == (M, M)
    assert torch.allclose(weights.sum(0), torch.ones(M, dtype=torch.float64), atol=1e-6)
    assert (weights >= 0).all()
    centres = torch.tensor([(r, c) for r in range(num_blocks[0]) for c in range(num_blocks[1])],
                           dtype=torch.float64)
    distance = torch.cdist(centres, centres)
    for j in range(M):
        for a in range(M):
            for b in range(M):
                if distance[a, j] < distance[b, j] - 1e-9:
                    assert weights[a, j] > weights[b, j] or (
                        mode == 'linear' and weights[b, j] == 0 and weights[a, j] > 0)


def test_mixing_init_values_on_the_paper_layout():
    linear = distance_mixing_matrix((2, 2), 'linear').double()
    near = 1 - 1 / math.sqrt(2)
    assert linear[0, 0].item() == pytest.approx(1 / (1 + 2 * near), rel=1e-6)
    assert linear[1, 0].item() == pytest.approx(near / (1 + 2 * near), rel=1e-6)
    assert linear[3, 0].item() == 0.
    cos = distance_mixing_matrix((2, 2), 'cos').double()
    column = torch.tensor([1., math.cos(math.pi / 4 / math.sqrt(2)),
                           math.cos(math.pi / 4 / math.sqrt(2)), math.cos(math.pi / 4)])
    assert torch.allclose(cos[:, 0], (column / column.sum()).double(), atol=1e-6)
    assert torch.equal(distance_mixing_matrix((1, 1)), torch.ones(1, 1))
    module = MultiHeadLinearAttention(EMBED_DIMS, NUM_HEADS)
    assert torch.equal(module.block_mixing.detach(), distance_mixing_matrix((2, 2), 'linear'))
    assert module.block_mixing.requires_grad


# ---------------------------------------------------------------- numerics

def test_bf16_autocast_long_sequence_finite(tokens, autocast_output):
    dims, hw = 32, (128, 128)
    module = make(dtype=torch.float32, embed_dims=dims, num_heads=2, randomise_mixing=False)
    x = tokens(hw, 0, batch=1, dims=dims, dtype=torch.float32, scale=4.)
    out, exact = autocast_output(module, x, hw, torch.bfloat16)
    assert x.shape[1] == 16384
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert rel_error(out, exact) < 3e-2


def test_state_is_float32_for_half_inputs(tokens):
    """fp16 module, no autocast: the summaries of large keys/values overflow fp16
    (65504) but not the float32 state, so the output stays finite."""
    module = make(dtype=torch.float16, randomise_mixing=False)
    hw = (16, 16)
    x = tokens(hw, 1, dtype=torch.float32) * 30.
    with torch.no_grad():
        out = module(x.half(), hw)
    assert out.dtype == torch.float16
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------- interface and errors

def test_interface_flags_and_parameter_names(tokens):
    module = build_attention('mhla', embed_dims=EMBED_DIMS, num_heads=NUM_HEADS)
    assert isinstance(module, MultiHeadLinearAttention)
    assert module.uses_cls_token is False and module.has_map is False
    names = set(dict(module.named_parameters()))
    assert {'qkv.weight', 'qkv.bias', 'proj.weight', 'proj.bias', 'block_mixing',
            'value_conv.weight', 'value_conv.bias'} == names
    assert module.value_conv.weight.shape == (EMBED_DIMS, 1, 5, 5)
    x = tokens((4, 4), 0, dtype=torch.float32)
    with pytest.raises(TypeError, match='no attention map'):
        module.attention_map(x, (4, 4))


@pytest.mark.parametrize('kwargs,match', [
    (dict(attn_drop=0.1), 'attn_drop'),
    (dict(num_blocks=(2, 0)), 'num_blocks'),
    (dict(num_blocks=(2, 2, 2)), 'num_blocks'),
    (dict(mixing_init='gaussian'), 'mixing_init'),
    (dict(value_kernel_size=4), 'value_kernel_size'),
    (dict(eps=0.), 'eps'),
    (dict(feature_floor=-1.), 'feature_floor'),
], ids=['attn_drop', 'zero_blocks', 'three_axes', 'mixing_init', 'even_kernel', 'eps',
        'floor'])
def test_bad_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadLinearAttention(EMBED_DIMS, NUM_HEADS, **kwargs)


def test_bad_grid_is_rejected(tokens):
    module = make(dtype=torch.float32)
    with pytest.raises(ValueError, match='cannot hold'):
        module(tokens((4, 4), 0, dtype=torch.float32), (5, 4))
    with pytest.raises(ValueError, match='at least 1x1'):
        module(tokens((1, 1), 0, dtype=torch.float32)[:, :0], (0, 3))
