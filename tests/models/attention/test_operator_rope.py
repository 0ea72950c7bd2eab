"""2-D RoPE in every operator that carries it: fast forms against their O(N^2) oracles (which
rotate through explicit per-token matrices), Softmax against timm's EVA attention, and the
form each linear operator gives the rotation (numerator only for the kernelised ones)."""
import pytest
import torch
from timm.layers.pos_embed_sincos import RotaryEmbeddingCat, RotaryEmbeddingDinoV3
from timm.models.eva import EvaAttention

from linvit_mm.models.attention import attention_class, attention_types
from linvit_mm.testing import assert_rel_close

ROPE_OPERATORS = [name for name in attention_types() if attention_class(name).supports_rope]
ROPES = {'eva': dict(type='eva', ref_grid=(4, 4)), 'dinov3': dict(type='dinov3')}
GRIDS = [(7, 9), (4, 4), (5, 3)]


def grid_id(hw):
    return f'{hw[0]}x{hw[1]}'


def timm_rope(rope_type, head_dims, hw):
    """timm's ``[sin | cos]`` table of the grid and its rotate-half flag."""
    if rope_type == 'eva':
        module = RotaryEmbeddingCat(head_dims, temperature=10000, in_pixels=False,
                                    feat_shape=list(hw), ref_feat_shape=[4, 4])
        return module.get_embed().double(), False
    module = RotaryEmbeddingDinoV3(head_dims, temperature=100, rotate_half=True)
    return module.get_embed(shape=list(hw)).double(), True


def explicit_rotation(rope_type, head_dims, hw, num_extra):
    """``(N, d, d)`` rotation matrices built in the test from timm's tables (identity for the
    extra tokens): independent of the operators' own tables and their two rotation forms."""
    embed, half = timm_rope(rope_type, head_dims, hw)
    sin, cos = embed.chunk(2, dim=-1)
    index = torch.arange(head_dims)
    first, second = (index[:head_dims // 2], index[head_dims // 2:]) if half else \
        (index[0::2], index[1::2])
    matrices = torch.eye(head_dims, dtype=torch.float64).repeat(num_extra + len(sin), 1, 1)
    patches = matrices[num_extra:]
    patches[:, first, first] = cos[:, first]
    patches[:, second, second] = cos[:, second]
    patches[:, first, second] = -sin[:, first]
    patches[:, second, first] = sin[:, second]
    return matrices


def rotate(matrices, t):
    return torch.einsum('nij,bhnj->bhni', matrices, t)


@pytest.mark.parametrize('hw', GRIDS, ids=grid_id)
@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
@pytest.mark.parametrize('rope_type', ROPES)
@pytest.mark.parametrize('attn_type', ROPE_OPERATORS)
def test_fast_form_matches_reference(attn_type, rope_type, num_extra, hw, make_attention,
                                     tokens, assert_matches_reference):
    """Outputs and the gradients of the input and of every parameter, in float64."""
    module = make_attention(attn_type, rope=ROPES[rope_type])
    x = tokens(hw, num_extra)
    assert_matches_reference(module, x, hw)
    plain = make_attention(attn_type)
    with torch.no_grad():
        assert (module(x, hw) - plain(x, hw)).abs().max() > 1e-3, 'RoPE changed nothing'


@pytest.mark.parametrize('num_extra', [0, 5], ids=['no_prefix', 'cls+4_registers'])
@pytest.mark.parametrize('rope_type', ROPES)
def test_softmax_matches_timm_eva_attention(rope_type, num_extra, make_attention, tokens):
    """timm's EvaAttention (EVA-02, DINOv3) with the same weights: query and key bias, the
    key bias fixed at zero as EVA has it, prefix tokens left unrotated."""
    hw = (5, 6)
    ours = make_attention('softmax', rope=ROPES[rope_type])
    dims, heads = ours.embed_dims, ours.num_heads
    embed, half = timm_rope(rope_type, dims // heads, hw)
    theirs = EvaAttention(dims, heads, qkv_bias=True, num_prefix_tokens=num_extra,
                          scale_norm=False, rotate_half=half).double()
    with torch.no_grad():
        theirs.qkv.weight.copy_(ours.qkv.weight)
        theirs.q_bias.copy_(torch.randn(dims))
        theirs.v_bias.copy_(torch.randn(dims))
        ours.qkv.bias.copy_(torch.cat([theirs.q_bias, torch.zeros(dims), theirs.v_bias]))
        theirs.proj.load_state_dict(ours.proj.state_dict())
        x = tokens(hw, num_extra)
        assert_rel_close(ours(x, hw), theirs(x, rope=embed), 1e-6, 'output vs timm')


@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
@pytest.mark.parametrize('rope_type', ROPES)
@pytest.mark.parametrize('attn_type', ['elu', 'relu'])
def test_kernel_rotates_the_numerator_only(attn_type, rope_type, num_extra, make_attention,
                                           tokens):
    """``A_ij = (R_i phi(q_i))^T (R_j phi(k_j)) / (phi(q_i)^T sum_l phi(k_l) + eps)``, with the
    rotations built here from timm's tables."""
    hw = (4, 5)
    module = make_attention(attn_type, rope=ROPES[rope_type])
    x = tokens(hw, num_extra)
    with torch.no_grad():
        q, k, _ = module.split_heads(module.qkv(x))
        phi_q, phi_k = module._features(q, k)
        rotation = explicit_rotation(rope_type, module.head_dims, hw, num_extra)
        numerator = rotate(rotation, phi_q) @ rotate(rotation, phi_k).transpose(-2, -1)
        normaliser = phi_q @ phi_k.sum(dim=-2, keepdim=True).transpose(-2, -1) + module.eps
        assert normaliser.min() > 0
        assert_rel_close(module.attention_map(x, hw), numerator / normaliser, 1e-6, 'map')


@pytest.mark.parametrize('rope_type', ROPES)
def test_inline_rotates_queries_and_keys_and_rows_still_sum_to_one(rope_type, make_attention,
                                                                   tokens):
    hw = (4, 5)
    module = make_attention('inline', rope=ROPES[rope_type])
    x = tokens(hw, 1)
    with torch.no_grad():
        q, k, _ = module.split_heads(module.qkv(x))
        rotation = explicit_rotation(rope_type, module.head_dims, hw, 1)
        q, k = rotate(rotation, q), rotate(rotation, k)
        n = q.shape[-2]
        expected = (module.scale / n) * (q @ k.transpose(-2, -1)) + (
            1 - module.scale * (q @ k.mean(dim=-2, keepdim=True).transpose(-2, -1))) / n
        attn = module.attention_map(x, hw)
    assert_rel_close(attn, expected, 1e-6, 'map')
    assert_rel_close(attn.sum(dim=-1), torch.ones_like(attn[..., 0]), 1e-12, 'row sums')


@pytest.mark.parametrize('rope_type', ROPES)
def test_mhla_with_one_block_is_kernel_attention_with_rope(rope_type, make_attention, tokens):
    """One block (mixing weight 1), no feature floor and a zero value convolution leave
    relu linear attention: the two operators' RoPE forms must agree."""
    hw = (5, 6)
    mhla = make_attention('mhla', rope=ROPES[rope_type], num_blocks=1, feature_floor=0.)
    relu = make_attention('relu', rope=ROPES[rope_type])
    with torch.no_grad():
        mhla.value_conv.weight.zero_()
        mhla.value_conv.bias.zero_()
        relu.qkv.load_state_dict(mhla.qkv.state_dict())
        relu.proj.load_state_dict(mhla.proj.state_dict())
        for num_extra in (0, 1):
            x = tokens(hw, num_extra)
            assert_rel_close(mhla(x, hw), relu(x, hw), 1e-10, f'{num_extra} extra tokens')


@pytest.mark.parametrize('rope_type', ROPES)
def test_ttt_rotates_the_swiglu_heads_only(rope_type, make_attention, tokens):
    hw = (5, 6)
    x = tokens(hw, 0)
    rotated = make_attention('ttt', rope=ROPES[rope_type])
    plain = make_attention('ttt')
    C = plain.embed_dims
    with torch.no_grad():
        # read the conv branch only: RoPE must not change it
        for module in (rotated, plain):
            module.proj.weight[:, :C] = 0
        assert_rel_close(rotated(x, hw), plain(x, hw), 1e-12, 'conv branch')
        # read the SwiGLU heads only: RoPE changes them
        for module in (rotated, plain):
            module.proj.weight.normal_()
            module.proj.weight[:, C:] = 0
        assert (rotated(x, hw) - plain(x, hw)).abs().max() > 1e-3


@pytest.mark.parametrize('attn_type', ROPE_OPERATORS)
def test_core_macs_count_the_rotation(attn_type, make_attention):
    """Two multiply-accumulates per element of the rotated patch queries and keys (MHLA
    rotates its padded block layout)."""
    hw = (5, 7)
    plain, rotated = make_attention(attn_type), make_attention(attn_type, rope=ROPES['eva'])
    rotated_tokens = hw[0] * hw[1]
    if attn_type == 'mhla':
        layout = plain.block_layout(hw)
        rotated_tokens = layout.num_blocks * layout.block_h * layout.block_w
    extra = rotated.core_macs(1 + 35, hw) - plain.core_macs(1 + 35, hw)
    assert extra == 2 * 2 * rotated_tokens * plain.embed_dims


@pytest.mark.parametrize('attn_type', [name for name in attention_types()
                                       if not attention_class(name).supports_rope])
def test_operators_without_rope_refuse_it(attn_type, make_attention):
    reason = attention_class(attn_type).rope_absent_because
    assert isinstance(reason, str) and reason
    with pytest.raises(ValueError, match=f'the {attn_type!r} operator does not carry RoPE'):
        make_attention(attn_type, rope=ROPES['eva'])


def test_rope_needs_head_width_divisible_by_four(make_attention):
    with pytest.raises(ValueError, match='divisible by 4.*head_dims=6'):
        make_attention('relu', embed_dims=18, num_heads=3, rope=ROPES['eva'])
