"""Windowed attention for any operator: the block-level switch of :class:`LinearViT`.

A windowed block runs its operator on non-overlapping ``h x w`` windows of the patch grid
instead of the whole grid (ViTDet, Li et al. 2022; ViT-Adapter's plain-ViT detectors use
14 x 14 windows in 8 of 12 blocks). The operator itself is unchanged: each window is handed
to it as an image of its own, ``attn(tokens, (h, w))``, so every operator (Softmax, the
kernel ones, MHLA, TTT, ...) windows the same way, batched over the windows of one shape.

**Border windows.** A side that does not divide by the window is covered by full windows
and one narrower band at the bottom / right. ViTDet pads the grid to whole windows, and
the padded positions then take part in every border window's attention (as zero tokens,
or zero keys after the projections in ViT-Adapter). Here the border band's windows are
simply smaller, which is what padding computes when the padded positions are masked out
of every sum: the result is exactly that of the real tokens, for every operator, without
each operator needing a mask. At most four shapes of window occur (full, bottom band,
right band, corner), one operator call each.

**What each operator does inside a window** is what it does on an image of that size:
MHLA cuts the window into its ``num_blocks`` token-level heads; TTT fits its inner models
on the window's tokens (the conv inner model with zero padding at the window's border); the
kernel operators and Softmax normalise over the window. Two things are not window-local:

* **Position.** RoPE rotates each token by its position in the *whole* grid: the window's
  rotation tables are the global ones gathered at the window's tokens. Scores of operators
  whose rotation acts only through relative position are then exactly those of the global
  block for the pairs inside the window, and for the rest (TTT's inner fit, DINOv3's and
  EVA-02's grid-normalised coordinates) the windowed block still sees the positions the
  pre-trained model knows. Operators' position encodings applied by the block before its
  norm (``encode_position``, TTT's 3x3 depthwise conv) stay on the whole grid: they are
  local convolutions, not attention, and cost O(N).
* **Extra tokens** (class token, registers) join every window, in front of its patches, so
  each patch token sees them as in the global block (registers exist to be attended to).
  Each extra token's own attention output is the mean of its outputs in the windows,
  weighted by the windows' patch counts (a plain mean when the windows are equal); with a
  single window it is the global output.

A window as large as the grid is the global operator, bit for bit up to the order of
sums. Forward hooks on a windowed operator would see one call per window shape instead of
the block's output, so a windowed block refuses to run with hooks on its operator (the
attention-distillation hook records global blocks).
"""
from contextlib import contextmanager

import torch
from mmengine.utils import to_2tuple
from torch import nn

from ..utils.rope import GridRotation


def normalise_window_size(window_size):
    """``0`` / ``None`` (global attention) or a ``(rows, cols)`` pair of positive ints."""
    if window_size is None or (isinstance(window_size, int) and not isinstance(window_size, bool)
                               and window_size == 0):
        return None
    size = to_2tuple(window_size) if isinstance(window_size, int) else window_size
    if (not isinstance(size, (tuple, list)) or len(size) != 2
            or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size)):
        raise ValueError(f'window_size must be 0 (global attention), a positive int or a pair '
                         f'(rows, cols) of positive ints, got {window_size!r}')
    return tuple(size)


def window_bands(length, window):
    """The bands covering ``length`` grid lines: ``(start, count, size)`` for the full
    windows of ``window`` lines, then one band of the remainder (smaller windows)."""
    full, rest = divmod(length, window)
    bands = [(0, full, window)] if full else []
    if rest:
        bands.append((full * window, 1, rest))
    return bands


def _partition(grid, rows, h, cols, w):
    """``(B, rows*h, cols*w, ...)`` -> ``(B*rows*cols, h*w, ...)``, windows row-major."""
    B, tail = grid.shape[0], grid.shape[3:]
    windows = grid.reshape(B, rows, h, cols, w, *tail).transpose(2, 3)
    return windows.reshape(B * rows * cols, h * w, *tail)


def _merge(windows, B, rows, h, cols, w):
    """The inverse of :func:`_partition`: ``(B*rows*cols, h*w, C)`` -> ``(B, rows*h, cols*w, C)``."""
    C = windows.shape[-1]
    return windows.reshape(B, rows, cols, h, w, C).transpose(2, 3).reshape(B, rows * h,
                                                                          cols * w, C)


class WindowRotation(nn.Module):
    """Stands in for an operator's RoPE module during one windowed call: it returns the
    global grid's rotation gathered at the tokens of each window of the batch, tables
    ``(windows, 1, h*w, d)``, plus unrotated rows for the extra tokens it is asked for."""

    def __init__(self, sin, cos, interleaved, window_shape, head_dims):
        super().__init__()
        self.sin, self.cos = sin, cos
        self.interleaved = interleaved
        self.window_shape = tuple(window_shape)
        self.head_dims = head_dims

    def forward(self, hw_shape, num_extra=0, like=None):
        if tuple(hw_shape) != self.window_shape:
            raise RuntimeError(f'the window rotation serves {self.window_shape} windows, '
                               f'asked for a {tuple(hw_shape)} grid')
        sin, cos = self.sin, self.cos
        if num_extra:
            lead = (*sin.shape[:-2], num_extra, sin.shape[-1])
            sin = torch.cat([sin.new_zeros(lead), sin], dim=-2)
            cos = torch.cat([cos.new_ones(lead), cos], dim=-2)
        return GridRotation(sin, cos, self.interleaved)


@contextmanager
def _rotation_of(attn, rotation):
    saved = attn.rope
    attn.rope = rotation
    try:
        yield
    finally:
        attn.rope = saved


def windowed_attention(attn, x, hw_shape, window_size):
    """``attn`` (a :class:`BaseAttention`) on the ``window_size`` windows of the patch grid
    of ``x`` ``(B, E + H*W, C)``; ``(B, E + H*W, C)`` out. See the module docstring."""
    if attn._forward_hooks or attn._forward_pre_hooks:
        raise RuntimeError(f'the {attn.attn_type!r} operator of a windowed block has forward '
                           f'hooks, which would each see one window shape rather than the '
                           f'block; record (or distil) global blocks, or set window_size=0')
    wh, ww = window_size
    H, W = hw_shape
    num_extra = attn.num_extra_tokens(x, hw_shape)
    B, _, C = x.shape
    extras = x[:, :num_extra]
    grid = x[:, num_extra:].reshape(B, H, W, C)
    tables = None
    if attn.rope is not None:
        # the rope decides the tables' precision from the tokens, as in a global call
        whole = attn.rope((H, W), 0, x)
        tables = (whole.sin.reshape(H, W, -1), whole.cos.reshape(H, W, -1), whole.interleaved)
    bands = []
    extra_sum = 0
    for r0, rows, h in window_bands(H, wh):
        band = []
        for c0, cols, w in window_bands(W, ww):
            region = (slice(r0, r0 + rows * h), slice(c0, c0 + cols * w))
            windows = _partition(grid[:, region[0], region[1]], rows, h, cols, w)
            count = rows * cols
            if num_extra:
                windows = torch.cat([extras.repeat_interleave(count, dim=0), windows], dim=1)
            if tables is None:
                y = attn(windows, (h, w))
            else:
                sin, cos = (_partition(t[region][None], rows, h, cols, w)
                            for t in tables[:2])                      # (count, h*w, d)
                sin, cos = (t.unsqueeze(1).repeat(B, 1, 1, 1) for t in (sin, cos))
                rotation = WindowRotation(sin, cos, tables[2], (h, w), attn.rope.head_dims)
                with _rotation_of(attn, rotation):
                    y = attn(windows, (h, w))
            band.append(_merge(y[:, num_extra:], B, rows, h, cols, w))
            if num_extra:
                extra_sum = extra_sum + y[:, :num_extra].reshape(B, count, num_extra,
                                                                  C).sum(1) * (h * w)
        bands.append(torch.cat(band, dim=2))
    out = torch.cat(bands, dim=1).reshape(B, H * W, C)
    if num_extra:
        out = torch.cat([(extra_sum / (H * W)).to(out.dtype), out], dim=1)
    return out
