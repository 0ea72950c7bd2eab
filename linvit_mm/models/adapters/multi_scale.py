"""Token layout of multi-scale feature maps and the inputs of multi-scale deformable attention.

The adapter keeps feature maps of several strides as one token sequence (level after
level, each row-major) so that one deformable-attention call samples all of them. The
grid of every level is carried explicitly, never inferred from a token count: the
sequence lengths of the levels need not be in a fixed ratio.
"""
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

GridShape = Tuple[int, int]


class DeformableInputs(NamedTuple):
    """What ``mmcv.ops.MultiScaleDeformableAttention`` needs besides query and value.

    ``reference_points``: ``(1, num_queries, 1, 2)`` normalised ``(x, y)`` in [0, 1],
    one point per query shared by every value level (broadcast over batch and levels).
    ``spatial_shapes``: ``(num_levels, 2)`` long, ``(h, w)`` of each value level.
    ``level_start_index``: ``(num_levels,)`` long, first token of each value level.
    """
    reference_points: torch.Tensor
    spatial_shapes: torch.Tensor
    level_start_index: torch.Tensor


def build_deformable_attention(**kwargs):
    """mmcv's ``MultiScaleDeformableAttention(**kwargs)``, imported here rather than with the
    package: it is the one part of linvit_mm's models that needs mmcv's compiled ops, so the
    operators, LinearViT and the plain pyramid import and run with ``mmcv-lite`` too."""
    try:
        from mmcv.ops import MultiScaleDeformableAttention
    except ImportError as err:
        raise ImportError(
            f"the ViT-Adapter's multi-scale deformable attention needs mmcv's compiled ops, "
            f'which this mmcv lacks ({err}); install the full mmcv (bash tools/setup_env.sh, '
            f'or mim install "mmcv>=2.0.0,<2.2.0"), not mmcv-lite') from err
    return MultiScaleDeformableAttention(**kwargs)


def grid_reference_points(grid_shapes: Sequence[GridShape], like: torch.Tensor,
                          extent_ratio: Tuple[float, float] = (1., 1.)) -> torch.Tensor:
    """Cell centres of each grid in turn, normalised by the area the value maps tile.

    Every grid tiles an area from the image's top-left corner; ``extent_ratio`` is that
    area's ``(height, width)`` over the values' area. A query at the centre of cell
    ``(i, j)`` of an ``h x w`` grid sits at ``((j + 0.5) / w * rw, (i + 0.5) / h * rh)``:
    the same image location whatever the stride, so queries of one grid look at the
    matching place of value maps of another. With the same area (ratio 1) that is
    ``((j + 0.5) / w, (i + 0.5) / h)``.
    """
    # At least float32: in bf16 a point near 1 is off by up to 2**-8, a sixth of a
    # cell on an 84-wide grid (1333 / 16), and every sampling location would shift.
    dtype = torch.promote_types(like.dtype, torch.float32)
    ratio_h, ratio_w = extent_ratio
    points = []
    for h, w in grid_shapes:
        ys = (torch.arange(h, device=like.device, dtype=dtype) + 0.5) / h * ratio_h
        xs = (torch.arange(w, device=like.device, dtype=dtype) + 0.5) / w * ratio_w
        grid_y, grid_x = torch.meshgrid(ys, xs, indexing='ij')
        points.append(torch.stack((grid_x.reshape(-1), grid_y.reshape(-1)), dim=-1))
    return torch.cat(points)[None, :, None]


def deformable_inputs(query_shapes: Sequence[GridShape], value_shapes: Sequence[GridShape],
                      like: torch.Tensor, query_extent: Optional[Tuple[int, int]] = None,
                      value_extent: Optional[Tuple[int, int]] = None) -> DeformableInputs:
    """Inputs for queries laid out on ``query_shapes`` sampling values on ``value_shapes``.

    ``query_extent`` and ``value_extent``: the ``(height, width)`` in pixels that the
    query grids and the value grids tile, from the image's top-left corner (a ViT of
    patch 14 tiles a little more than the stride-32 maps of the same padded image). By
    default both tile the same area.
    """
    if (query_extent is None) != (value_extent is None):
        raise ValueError('give both query_extent and value_extent, or neither (same area)')
    extent_ratio = (1., 1.)
    if query_extent is not None:
        extent_ratio = (query_extent[0] / value_extent[0], query_extent[1] / value_extent[1])
    spatial_shapes = torch.as_tensor(value_shapes, dtype=torch.long, device=like.device)
    level_start_index = torch.cat(
        (spatial_shapes.new_zeros(1), spatial_shapes.prod(1).cumsum(0)[:-1]))
    return DeformableInputs(grid_reference_points(query_shapes, like, extent_ratio),
                            spatial_shapes, level_start_index)


def flatten_maps(maps: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(B, C, h_i, w_i)`` maps -> one ``(B, sum_i h_i*w_i, C)`` token sequence."""
    return torch.cat([m.flatten(2).transpose(1, 2) for m in maps], dim=1)


def split_maps(tokens: torch.Tensor, grid_shapes: Sequence[GridShape]) -> List[torch.Tensor]:
    """Inverse of :func:`flatten_maps`: ``(B, N, C)`` -> ``(B, C, h_i, w_i)`` maps.

    The maps are contiguous in the standard ``(B, C, h, w)`` layout. A plain reshape of
    the transposed tokens would give channels-last strides, which convolutions keep
    and pass on to every later map; mmcv's CPU ``RoIAlign`` reads its input's memory
    as ``(B, C, h, w)`` without checking, so a detector's RoI features would be
    scrambled.
    """
    sizes = [h * w for h, w in grid_shapes]
    if sum(sizes) != tokens.shape[1]:
        raise ValueError(f'{tokens.shape[1]} tokens do not hold the grids {list(grid_shapes)} '
                         f'({sum(sizes)} cells)')
    batch, _, channels = tokens.shape
    return [
        part.transpose(1, 2).reshape(batch, channels, h, w).contiguous()
        for part, (h, w) in zip(tokens.split(sizes, dim=1), grid_shapes)
    ]
