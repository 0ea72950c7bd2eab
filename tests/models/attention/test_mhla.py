"""MHLA: the fast block form against its O(N^2) reference, the reference's own pieces against
hand-written tables, padding, layout, semantics and numerics."""
import math

import pytest
import torch
import torch.nn.functional as F

from linvit_mm.models.attention import MultiHeadLinearAttention, build_attention
from linvit_mm.models.attention.mhla import OFFICIAL_IMAGENET, distance_mixing_matrix
from linvit_mm.testing import assert_rel_close, rel_error

EMBED_DIMS, NUM_HEADS = 24, 3
ROPES = {'eva': dict(type='eva', ref_grid=(4, 4)), 'dinov3': dict(type='dinov3')}


def grid_id(hw):
    return f'{hw[0]}x{hw[1]}'


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
    """Merge heads, add the value convolution (PyTorch's) of the patch tokens, project."""
    B, h, N, d = out_heads.shape
    out = out_heads.transpose(1, 2).reshape(B, N, h * d)
    patches = values[:, num_extra:].transpose(1, 2).reshape(B, -1, *hw)
    local = module.value_conv(patches).flatten(2).transpose(1, 2)
    out = out + F.pad(local, (0, 0, num_extra, 0))
    return module.proj(out)


def assert_every_parameter_learns(grads):
    missing = [name for name, grad in grads.items() if grad is None or not grad.abs().max() > 0]
    assert not missing, f'no gradient for {missing}'


# ---------------------------------------------------------------- fast == reference

# divisible by the 2 x 2 layout; odd sides (padded); smaller than the layout (empty blocks)
GRIDS = [(14, 14), (7, 9), (5, 3), (3, 1), (1, 1)]


@pytest.mark.parametrize('normaliser', ['consistent', 'official'])
@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
@pytest.mark.parametrize('hw', GRIDS, ids=grid_id)
def test_fast_matches_reference(hw, num_extra, normaliser, device, tokens,
                                assert_matches_reference):
    """Output and the gradients of the input and of every parameter, in float64. MHLA
    models carry no class token; the operator accepts one (global), so both are checked.
    The grids smaller than the layout give blocks of one patch (a size-1 axis that a
    squeeze too many would drop)."""
    module = make(device=device, normaliser=normaliser)
    x = tokens(hw, num_extra, device=device)
    assert_every_parameter_learns(assert_matches_reference(module, x, hw))


@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
@pytest.mark.parametrize('hw', [(7, 9), (5, 3), (4, 4)], ids=grid_id)
@pytest.mark.parametrize('rope_type', ROPES)
def test_fast_matches_reference_with_rope(rope_type, hw, num_extra, tokens,
                                          assert_matches_reference):
    module = make(rope=ROPES[rope_type])
    x = tokens(hw, num_extra)
    assert_every_parameter_learns(assert_matches_reference(module, x, hw))
    with torch.no_grad():
        assert rel_error(module(x, hw), make()(x, hw)) > 1e-3, 'RoPE changed nothing'


OPTIONS = {
    'qk_norm': dict(qk_norm=True),
    'plain_relu_cos_3x3': dict(feature_floor=0., mixing_init='cos', num_blocks=(3, 3)),
    'rect_1x3_kernel3_no_bias': dict(num_blocks=(1, 3), value_kernel_size=3, qkv_bias=False),
    'rect_3x2_kernel1': dict(num_blocks=(3, 2), value_kernel_size=1),
    'one_block': dict(num_blocks=1),
    'two_extra': dict(),
    'attn_norm': dict(attn_norm=True),
    'official_normaliser': dict(normaliser='official'),
    'official_normaliser_two_extra': dict(normaliser='official'),
    'official_normaliser_rope': dict(normaliser='official', rope=ROPES['eva']),
    'official_all_switches_4x4': dict(OFFICIAL_IMAGENET, qkv_bias=False),
    'fixed_block_size_padded': dict(num_blocks=(3, 2), block_size=(4, 4)),
    'fixed_block_size_official': dict(num_blocks=(3, 2), block_size=(4, 5),
                                      normaliser='official'),
}


@pytest.mark.parametrize('option', list(OPTIONS))
def test_fast_matches_reference_options(option, tokens, assert_matches_reference):
    module = make(**OPTIONS[option])
    hw = (10, 7)
    x = tokens(hw, 2 if option.endswith('two_extra') else 0)
    assert_every_parameter_learns(assert_matches_reference(module, x, hw))


def test_fast_matches_reference_on_a_long_rectangular_grid(tokens, assert_matches_reference):
    hw = (30, 41)
    module = make(embed_dims=4, num_heads=1)
    assert_matches_reference(module, tokens(hw, 1, batch=1, dims=4), hw)


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


# ---------------------------------------------------------------- the reference's own pieces

# Block of each token of a 5 x 3 grid under 2 x 2 blocks of ceil(5/2) x ceil(3/2) = 3 x 2
# tokens (row-major blocks; the bottom and right ones are short).
BLOCKS_5x3 = [[0, 0, 1],
              [0, 0, 1],
              [0, 0, 1],
              [2, 2, 3],
              [2, 2, 3]]
# 4 x 5 grid: blocks of 2 x 3 tokens (an even side, where ceil and floor + 1 differ).
BLOCKS_4x5 = [[0, 0, 0, 1, 1],
              [0, 0, 0, 1, 1],
              [2, 2, 2, 3, 3],
              [2, 2, 2, 3, 3]]
# 3 x 1 grid under 2 x 2 blocks of 2 x 1: the right column of blocks is empty.
BLOCKS_3x1 = [[0], [0], [2]]


@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
@pytest.mark.parametrize('hw,table', [((5, 3), BLOCKS_5x3), ((4, 5), BLOCKS_4x5),
                                      ((3, 1), BLOCKS_3x1)], ids=['5x3', '4x5', '3x1'])
def test_reference_mixing_weights_follow_a_hand_written_block_table(hw, table, num_extra):
    module = make()
    block = torch.tensor(table).flatten()
    mixing = module.block_mixing.detach()
    expected = torch.ones(num_extra + len(block), num_extra + len(block), dtype=torch.float64)
    for t, block_t in enumerate(block):
        for s, block_s in enumerate(block):
            expected[num_extra + t, num_extra + s] = mixing[block_t, block_s]
    assert torch.equal(module.reference_mixing_weights(hw, num_extra).detach(), expected)


# Official-normaliser partners on the 5 x 3 grid of BLOCKS_5x3 (blocks of 3 x 2 tokens, the
# right and bottom ones short): for query t, the index of the query at t's in-block
# position in the block of each key s (-1: that position is off the grid).
PARTNERS_5x3 = {
    0: [0, 0, 2, 0, 0, 2, 0, 0, 2, 9, 9, 11, 9, 9, 11],          # (0, 0)
    7: [7, 7, -1, 7, 7, -1, 7, 7, -1, -1, -1, -1, -1, -1, -1],   # (2, 1)
    13: [4, 4, -1, 4, 4, -1, 4, 4, -1, 13, 13, -1, 13, 13, -1],  # (4, 1)
}


@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
def test_reference_partners_follow_a_hand_written_table(num_extra):
    module = make(num_blocks=(2, 2), normaliser='official')
    partners = module.reference_partners((5, 3), num_extra)
    n = num_extra + 15
    assert partners.shape == (n, n)
    for query, row in PARTNERS_5x3.items():
        expected = [num_extra + p if p >= 0 else -1 for p in row]
        assert partners[num_extra + query, num_extra:].tolist() == expected, query
    if num_extra:
        # pairs with the extra token pair with the reading query itself
        assert partners[0].tolist() == [0] * n
        assert partners[:, 0].tolist() == list(range(n))


@pytest.mark.parametrize('num_extra', [0, 2], ids=['no_cls', 'two_extra'])
@pytest.mark.parametrize('kernel', [5, 3], ids=['kernel5', 'kernel3'])
def test_reference_value_conv_is_pytorch_depthwise_conv(kernel, num_extra, tokens):
    module = make(value_kernel_size=kernel)
    hw = (4, 6)
    values = tokens(hw, num_extra)
    with torch.no_grad():
        patches = values[:, num_extra:].transpose(1, 2).reshape(2, EMBED_DIMS, *hw)
        expected = module.value_conv(patches).flatten(2).transpose(1, 2)
        local = module._reference_value_conv(values, hw, num_extra)
    assert torch.equal(local[:, :num_extra], torch.zeros_like(local[:, :num_extra]))
    assert_rel_close(local[:, num_extra:], expected, 1e-12, 'reference value conv')


# ---------------------------------------------------------------- padding and layout

@pytest.mark.parametrize('hw', [(7, 9), (5, 3), (3, 1)], ids=grid_id)
def test_non_divisible_grid_equals_padded_grid_with_masked_keys(hw, tokens):
    """Oracle built on the padded (divisible) grid, with padded tokens' keys and
    values zeroed after the feature map and padded queries dropped."""
    module = make()
    x = tokens(hw, 0)
    H, W = hw
    Hp, Wp = 2 * math.ceil(H / 2), 2 * math.ceil(W / 2)

    with torch.no_grad():
        phi_q, phi_k, v, values = features(module, x)
        real = torch.zeros(Hp, Wp, dtype=torch.bool)
        real[:H, :W] = True
        real = real.flatten()

        def scatter(t):
            padded = t.new_zeros(*t.shape[:2], Hp * Wp, t.shape[-1])
            padded[:, :, real] = t
            return padded

        rows = torch.arange(Hp)[:, None] // (Hp // 2)
        cols = torch.arange(Wp)[None, :] // (Wp // 2)
        block = (rows * 2 + cols).flatten()
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
                                      ((3, 1), (2, 1)), ((1, 1), (1, 1))], ids=grid_id)
def test_block_count_fixed_block_size_follows_grid(hw, block):
    module = make(embed_dims=8, num_heads=2)
    layout = module.block_layout(hw)
    assert (layout.rows, layout.cols) == (2, 2)
    assert (layout.block_h, layout.block_w) == block
    assert module.block_mixing.shape == (4, 4)


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

        def to_blocks(t):
            """(B, h, 14*14, d) -> (B, h, 4, 7*7, d): the four 7 x 7 quarters, row-major."""
            B, h, _, d = t.shape
            t = t.reshape(B, h, 2, 7, 2, 7, d).transpose(3, 4)
            return t.reshape(B, h, 4, 49, d)

        q_blocks, k_blocks = to_blocks(phi_q), to_blocks(phi_k)
        z = k_blocks.sum(-2)                                            # (B, h, M, d)
        W = module.block_mixing
        numerator = q_blocks @ torch.einsum('ij,bhjd->bhid', W, z).unsqueeze(-1)
        own_block_normaliser = q_blocks @ z.unsqueeze(-1)              # phi(q_{j,p}) . z_j
        public_normaliser = torch.einsum('ij,bhjpo->bhipo', W, own_block_normaliser)
        ratio = numerator / public_normaliser
    assert (ratio - 1).abs().max() > 1e-2


# ---------------------------------------------------------------- mixing initialisation

NEAR = 1 - 1 / math.sqrt(2)                    # linear, adjacent blocks of 2 x 2
COS_NEAR = math.cos(math.pi / 4 / math.sqrt(2))  # cos, adjacent blocks of 2 x 2
COS_8, COS_4 = math.cos(math.pi / 8), math.cos(math.pi / 4)
# [i][j]: how much of block j's summary block i reads, before the columns are scaled to sum
# to 1 (the 1 x 3 linear table is written scaled: it is not symmetric once scaled, so it
# also tells columns from rows).
MIXING_TABLES = {
    'linear_1x1': ((1, 1), 'linear', [[1.]]),
    'linear_1x2': ((1, 2), 'linear', [[1., 0.],
                                      [0., 1.]]),
    'linear_1x3': ((1, 3), 'linear', [[2 / 3, 1 / 4, 0.],
                                      [1 / 3, 1 / 2, 1 / 3],
                                      [0., 1 / 4, 2 / 3]]),
    'linear_2x2': ((2, 2), 'linear', [[1., NEAR, NEAR, 0.],
                                      [NEAR, 1., 0., NEAR],
                                      [NEAR, 0., 1., NEAR],
                                      [0., NEAR, NEAR, 1.]]),
    'cos_1x3': ((1, 3), 'cos', [[1., COS_8, COS_4],
                                [COS_8, 1., COS_8],
                                [COS_4, COS_8, 1.]]),
    'cos_2x2': ((2, 2), 'cos', [[1., COS_NEAR, COS_NEAR, COS_4],
                                [COS_NEAR, 1., COS_4, COS_NEAR],
                                [COS_NEAR, COS_4, 1., COS_NEAR],
                                [COS_4, COS_NEAR, COS_NEAR, 1.]]),
}


def normalised_columns(table):
    table = torch.tensor(table, dtype=torch.float64)
    return table / table.sum(dim=0, keepdim=True)


@pytest.mark.parametrize('name', list(MIXING_TABLES))
def test_mixing_init_matches_hand_written_table(name):
    num_blocks, mode, table = MIXING_TABLES[name]
    weights = distance_mixing_matrix(num_blocks, mode, dtype=torch.float64)
    assert weights.dtype == torch.float64
    assert_rel_close(weights, normalised_columns(table), 1e-15, name)


def test_mixing_init_orders_blocks_row_major():
    """Column 0 of the 2 x 3 layout: blocks (0,0) (0,1) (0,2) (1,0) (1,1) (1,2) lie at
    distances 0, 1, 2, 1, sqrt 2, sqrt 5 (the largest) from block (0,0)."""
    distance = torch.tensor([0., 1., 2., 1., math.sqrt(2), math.sqrt(5)], dtype=torch.float64)
    column = 1 - distance / math.sqrt(5)
    weights = distance_mixing_matrix((2, 3), 'linear', dtype=torch.float64)
    assert_rel_close(weights[:, 0], column / column.sum(), 1e-15, 'column 0')


@pytest.mark.parametrize('mode', ['linear', 'cos'])
@pytest.mark.parametrize('num_blocks', [(2, 2), (3, 4), (1, 3), (4, 4)], ids=grid_id)
def test_mixing_init_columns_normalised_nearer_heavier(num_blocks, mode):
    weights = distance_mixing_matrix(num_blocks, mode, dtype=torch.float64)
    M = num_blocks[0] * num_blocks[1]
    assert weights.shape == (M, M)
    assert torch.allclose(weights.sum(0), torch.ones(M, dtype=torch.float64), atol=1e-12)
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


def test_module_starts_from_the_distance_init():
    module = MultiHeadLinearAttention(EMBED_DIMS, NUM_HEADS, num_blocks=(1, 3))
    assert module.block_mixing.dtype == torch.float32
    assert_rel_close(module.block_mixing.detach(), normalised_columns(
        MIXING_TABLES['linear_1x3'][2]), 1e-7, 'initial mixing')
    assert module.block_mixing.requires_grad
    cos = MultiHeadLinearAttention(EMBED_DIMS, NUM_HEADS, num_blocks=(1, 3), mixing_init='cos')
    assert_rel_close(cos.block_mixing.detach(), normalised_columns(
        MIXING_TABLES['cos_1x3'][2]), 1e-7, 'initial cos mixing')


@pytest.fixture
def float64_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def test_module_built_with_float64_default_dtype(float64_default, tokens,
                                                 assert_matches_reference):
    """Every parameter, the mixing matrix included, takes the default dtype, so the module
    runs on float64 tokens without a ``.double()``."""
    torch.manual_seed(0)
    module = MultiHeadLinearAttention(EMBED_DIMS, NUM_HEADS)
    assert {param.dtype for param in module.parameters()} == {torch.float64}
    hw = (5, 3)
    assert_matches_reference(module, tokens(hw, 0), hw)


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


@pytest.mark.parametrize('normaliser', ['consistent', 'official'])
def test_float32_forms_compute_in_float32(normaliser, tokens,
                                          assert_float32_forms_compute_in_float32):
    module = make(dtype=torch.float32, normaliser=normaliser)
    hw = (7, 9)
    assert_float32_forms_compute_in_float32(module, tokens(hw, 1, dtype=torch.float32), hw,
                                            module.forward_reference)


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


@pytest.mark.parametrize('form', ['forward', 'forward_reference'])
def test_bad_grid_is_rejected(form, tokens):
    module = make(dtype=torch.float32)
    run = getattr(module, form)
    with pytest.raises(ValueError, match='cannot hold'):
        run(tokens((4, 4), 0, dtype=torch.float32), (5, 4))
    with pytest.raises(ValueError, match='at least 1x1'):
        run(tokens((1, 1), 0, dtype=torch.float32)[:, :0], (0, 3))


# ------------------------------------------------------------ survivors of the mutation run
@pytest.mark.parametrize('hw', [(4, 6), (5, 6), (4, 7), (5, 7), (1, 1)], ids=grid_id)
def test_oracle_refuses_exactly_the_grids_the_fixed_layout_refuses(hw):
    # non-square blocks, so a swapped block side is visible; one side over at a time
    module = make(num_blocks=(2, 2), block_size=(2, 3))
    fits = hw[0] <= 4 and hw[1] <= 6
    x = torch.randn(1, hw[0] * hw[1], EMBED_DIMS, dtype=torch.float64)
    for form in (module.block_layout, lambda hw: module.forward_reference(x, hw)):
        if fits:
            form(hw)
        else:
            with pytest.raises(ValueError, match='does not fit the fixed layout'):
                form(hw)


@pytest.mark.parametrize('hw', [(3, 0), (0, 3)], ids=grid_id)
def test_both_forms_refuse_an_empty_side(hw):
    module = make()
    x = torch.randn(1, 1, EMBED_DIMS, dtype=torch.float64)
    for form in (module.forward, module.forward_reference):
        with pytest.raises(ValueError, match='at least 1x1'):
            form(x, hw)


def test_reference_tables_default_to_no_extra_tokens():
    module = make()
    assert module.reference_mixing_weights((2, 3)).shape == (6, 6)
    assert module.reference_partners((2, 3)).shape == (6, 6)


def test_oracle_rms_norm_adds_its_eps():
    # a large eps on small queries and keys: subtracting it would take a negative root
    module = make(qk_norm=True)
    for norm in (module.q_norm, module.k_norm):
        norm.eps = 1.
    x = 0.01 * torch.randn(2, 12, EMBED_DIMS, dtype=torch.float64)
    assert_rel_close(module(x, (3, 4)), module.forward_reference(x, (3, 4)), 1e-9)


@pytest.mark.parametrize('normaliser, mixing', [('consistent', 4**2 * 8 * 5),
                                                ('official', 4**2 * 8 * 4 + 4 * 24 * 2)])
def test_core_macs_by_hand_on_a_non_square_grid(normaliser, mixing):
    # C = 8, 2 heads of d = 4; a 3x5 grid in 2x2 blocks of 2x3: 24 padded patches, 1 extra
    module = make(embed_dims=8, num_heads=2, normaliser=normaliser)
    padded = 1 + 24
    expected = 2 * padded * 8 * 4 + 2 * padded * 8 + mixing
    assert module.core_macs(16, (3, 5)) == expected
