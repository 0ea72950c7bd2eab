"""MHLA's block layout: how the patch grid is cut into blocks, the tokens' moves between
sequence and block-major layout (zero-padded where the grid does not fill the blocks), and
the initial block-mixing matrix."""
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ....utils.tracing import is_tracing

MIXING_INITS = ('linear', 'cos')


class BlockLayout(NamedTuple):
    """How an ``H x W`` grid is cut into ``rows x cols`` blocks of ``block_h x block_w``.

    The block count is fixed by the module and the block size follows the grid
    (``ceil(H / rows) x ceil(W / cols)``), so the mixing matrix keeps its meaning at any
    resolution, unless the module fixes the block size too. The grid is zero-padded at the
    bottom and right up to ``padded_h x padded_w``.
    """

    rows: int
    cols: int
    block_h: int
    block_w: int

    @property
    def num_blocks(self):
        return self.rows * self.cols

    @property
    def padded_h(self):
        return self.rows * self.block_h

    @property
    def padded_w(self):
        return self.cols * self.block_w

    def pads(self, hw_shape):
        """Whether the ``hw_shape`` grid needs padding to fill the blocks. Always, while
        tracing: padding by zero rows is the identity, and a branch on the grid would tie a
        traced graph to the example's grid."""
        return is_tracing() or (self.padded_h, self.padded_w) != tuple(hw_shape)


def distance_mixing_matrix(num_blocks, mode='linear', dtype=None):
    """Initial ``M x M`` block-mixing weights: nearer blocks weigh more, columns sum to 1.

    Block centres sit on the block lattice (one unit per block, whatever the block
    size in tokens); ``d`` is the Euclidean distance between centres and ``d_max`` its
    largest value. ``'linear'``: ``1 - d / d_max`` (the farthest pair starts at 0);
    ``'cos'``: ``cos(pi/4 * d / d_max)``. Column ``j`` holds how block ``j``'s summary
    is shared among the blocks that read it, normalised to total 1 (MHLA paper and
    its public code). A single block gets weight 1. Computed in float64, returned in
    ``dtype`` (default: torch's default dtype, that of the module's other parameters).
    """
    if mode not in MIXING_INITS:
        raise ValueError(f'unknown mixing_init {mode!r}; valid choices are: '
                         f'{", ".join(MIXING_INITS)}')
    rows, cols = num_blocks
    # on the CPU whatever the default device: a model built on the meta device (to read its
    # structure) still gets its values, and the M x M matrix is small
    grid = torch.stack(torch.meshgrid(torch.arange(rows, dtype=torch.float64, device='cpu'),
                                      torch.arange(cols, dtype=torch.float64, device='cpu'),
                                      indexing='ij'), dim=-1).reshape(-1, 2)
    distance = torch.cdist(grid, grid)
    max_distance = distance.max()
    if max_distance == 0:
        weights = torch.ones_like(distance)
    elif mode == 'linear':
        weights = 1. - distance / max_distance
    else:
        weights = torch.cos(distance / max_distance * (math.pi / 4))
    weights = weights / weights.sum(dim=0, keepdim=True)
    return weights.to(torch.get_default_dtype() if dtype is None else dtype)


def _dense(t):
    """``t`` laid out contiguously: eager, ``contiguous()`` (a copy only where needed, as a
    ``reshape`` would make); traced, always a copy, because asking whether a crop of the
    padded grid is contiguous would tie the graph to the example's grid."""
    return t.clone(memory_format=torch.contiguous_format) if is_tracing() else t.contiguous()


def _pair(value, name='num_blocks', axes='(rows, cols)'):
    if isinstance(value, int):
        value = (value, value)
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                       for n in value)):
        raise ValueError(f'{name} must be a positive int or a pair {axes} of positive '
                         f'ints, got {value!r}')
    return tuple(value)


def to_blocks(t, hw_shape, layout):
    """``(..., H*W, d)`` -> ``(..., M, block_h*block_w, d)``, zero-padded, one copy."""
    *lead, _, d = t.shape
    H, W = hw_shape
    t = t.reshape(*lead, H, W, d)
    if layout.pads(hw_shape):
        t = F.pad(t, (0, 0, 0, layout.padded_w - W, 0, layout.padded_h - H))
    t = t.reshape(*lead, layout.rows, layout.block_h, layout.cols, layout.block_w, d)
    t = t.transpose(-4, -3)
    return t.reshape(*lead, layout.num_blocks, layout.block_h * layout.block_w, d)


def blocks_to_tokens(t, hw_shape, layout):
    """``(B, h, M, block_h*block_w, d)`` -> ``(B, H*W, h*d)``: padded queries dropped,
    heads merged, in one copy (two when the grid was padded)."""
    B, h, _, _, d = t.shape
    H, W = hw_shape
    t = t.reshape(B, h, layout.rows, layout.cols, layout.block_h, layout.block_w, d)
    t = t.permute(0, 2, 4, 3, 5, 1, 6)                      # (B, rows, bh, cols, bw, h, d)
    if layout.pads(hw_shape):
        # the real tokens gathered, not cropped: a crop of a grid of symbolic size would
        # tie a traced graph to the example's grid
        rows = torch.arange(H, device=t.device)[:, None] * layout.padded_w
        real = (rows + torch.arange(W, device=t.device)).flatten()
        padded = _dense(t).view(B, layout.padded_h * layout.padded_w, h * d)
        return padded.index_select(1, real)
    return _dense(t).view(B, H * W, h * d)


def padding_mask(hw_shape, layout, device, dtype):
    """``(M, block_h*block_w, 1)``: 1 for real tokens, 0 for the padding."""
    # compared, not sliced: a slice assignment would tie a traced graph to the grid
    rows = torch.arange(layout.padded_h, device=device) < hw_shape[0]
    cols = torch.arange(layout.padded_w, device=device) < hw_shape[1]
    real = (rows[:, None] & cols[None, :]).to(dtype)
    return to_blocks(real.reshape(-1, 1), (layout.padded_h, layout.padded_w), layout)
