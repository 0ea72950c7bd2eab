"""2-D RoPE tables and rotations against timm's EVA-02 and DINOv3 implementations."""
import pytest
import torch
from timm.layers.pos_embed_sincos import (RotaryEmbeddingCat, RotaryEmbeddingDinoV3,
                                          apply_rot_embed_cat)

from linvit_mm.models.utils import RotaryPositionEmbedding2D, build_rope
from linvit_mm.testing import assert_rel_close

GRIDS = [(16, 16), (7, 11), (1, 3)]


def grid_id(hw):
    return f'{hw[0]}x{hw[1]}'


def timm_embed(rope_type, head_dims, hw, ref_grid=None):
    """timm's (H*W, 2d) [sin | cos] table and its rotate-half flag."""
    if rope_type == 'eva':
        # what timm's Eva builds for EVA-02 (rope_type='cat', in_pixels=False)
        module = RotaryEmbeddingCat(head_dims, temperature=10000, in_pixels=False,
                                    feat_shape=list(hw), ref_feat_shape=ref_grid)
        return module.get_embed(), False
    # what timm's Eva builds for DINOv3 (rope_type='dinov3', rotate_half=True)
    module = RotaryEmbeddingDinoV3(head_dims, temperature=100, rotate_half=True)
    return module.get_embed(shape=list(hw)), True


CASES = [('eva', None), ('eva', (16, 16)), ('dinov3', None)]


@pytest.mark.parametrize('hw', GRIDS, ids=grid_id)
@pytest.mark.parametrize('rope_type,ref_grid', CASES, ids=['eva', 'eva-ref16', 'dinov3'])
def test_tables_and_rotation_match_timm(rope_type, ref_grid, hw):
    head_dims = 32
    rope = RotaryPositionEmbedding2D(head_dims, rope_type, ref_grid=ref_grid)
    expected, half = timm_embed(rope_type, head_dims, hw, ref_grid)
    sin, cos = expected.double().chunk(2, dim=-1)
    rotation = rope(hw, like=torch.empty(0, dtype=torch.float64))
    # timm builds the tables in float32: equal to rounding
    assert_rel_close(rotation.sin, sin, 1e-6, 'sin')
    assert_rel_close(rotation.cos, cos, 1e-6, 'cos')
    assert rotation.interleaved is (not half)

    tokens = torch.randn(2, 3, hw[0] * hw[1], head_dims, dtype=torch.float64)
    reference = apply_rot_embed_cat(tokens, expected.double(), half=half)
    assert_rel_close(rotation.rotate(tokens), reference, 1e-6, 'rotated tokens')
    assert_rel_close(rotation.as_reference().rotate(tokens), reference, 1e-6,
                     'rotated through the matrices')


@pytest.mark.parametrize('rope_type', ['eva', 'dinov3'])
def test_extra_tokens_are_not_rotated(rope_type):
    rope = RotaryPositionEmbedding2D(16, rope_type)
    rotation = rope((3, 4), num_extra=5, like=torch.empty(0))
    assert rotation.sin.shape == rotation.cos.shape == (5 + 12, 16)
    tokens = torch.randn(2, 5 + 12, 16)
    for rotate in (rotation.rotate, rotation.as_reference().rotate):
        rotated = rotate(tokens)
        assert torch.equal(rotated[:, :5], tokens[:, :5])
        assert not torch.allclose(rotated[:, 5:], tokens[:, 5:])
    patches_only = rope((3, 4), like=torch.empty(0)).rotate(tokens[:, 5:])
    torch.testing.assert_close(rotation.rotate(tokens)[:, 5:], patches_only, rtol=0, atol=0)


@pytest.mark.parametrize('rope_type', ['eva', 'dinov3'])
def test_rotations_are_orthogonal_and_relative(rope_type):
    rope = RotaryPositionEmbedding2D(8, rope_type, temperature=7.)
    hw = (5, 6)
    matrices = rope(hw, like=torch.empty(0, dtype=torch.float64)).matrices()
    eye = torch.eye(8, dtype=torch.float64).expand_as(matrices)
    torch.testing.assert_close(matrices.transpose(-2, -1) @ matrices, eye)
    grid = matrices.reshape(*hw, 8, 8)
    # q_i^T R_i^T R_j k_j depends on the offset j - i only (EVA: grid steps are equal
    # everywhere; DINOv3: its coordinates are an affine map of the indices, so also true)
    relative = grid[:-1, :-2].transpose(-2, -1) @ grid[1:, 2:]
    torch.testing.assert_close(relative, relative[:1, :1].expand_as(relative))


def test_tables_are_cached_per_grid_device_and_dtype():
    rope = RotaryPositionEmbedding2D(16, 'eva')
    first = rope((4, 5), like=torch.empty(0))
    assert rope((4, 5), like=torch.empty(0)).sin is first.sin
    assert first.sin.dtype == torch.float32
    assert rope((4, 5), like=torch.empty(0, dtype=torch.bfloat16)).sin.dtype == torch.float32
    assert rope((4, 5), like=torch.empty(0, dtype=torch.float64)).sin.dtype == torch.float64
    assert rope((5, 4), like=torch.empty(0)).sin is not first.sin
    # another module with the same settings shares the tables
    assert RotaryPositionEmbedding2D(16, 'eva')((4, 5), like=torch.empty(0)).sin is first.sin


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown rope type 'cat'; valid types are: eva, dinov3"):
        RotaryPositionEmbedding2D(16, 'cat')
    with pytest.raises(ValueError, match='divisible by 4.*head_dims=18'):
        RotaryPositionEmbedding2D(18, 'eva')
    with pytest.raises(ValueError, match='ref_grid is an EVA-02 setting'):
        RotaryPositionEmbedding2D(16, 'dinov3', ref_grid=(16, 16))
    with pytest.raises(ValueError, match='temperature must be positive'):
        RotaryPositionEmbedding2D(16, 'eva', temperature=0)
    with pytest.raises(TypeError, match="a dict with a 'type'"):
        build_rope('eva', 16)
    with pytest.raises(ValueError, match='built for heads of 16 channels, the operator has 32'):
        build_rope(RotaryPositionEmbedding2D(16, 'eva'), 32)
    built = build_rope(dict(type='dinov3', temperature=50), 32)
    assert built.config == ('dinov3', 32, 50., None)
