"""2-D rotary position embedding (RoPE) of the patch grid, in the layouts of EVA-02 and DINOv3.

RoPE rotates every query and key of a patch token by angles that depend on its position, so
that the product of a rotated query and a rotated key depends on their relative position
(Su et al., "RoFormer"). Each head's ``d`` channels form ``d / 2`` pairs, each pair turned by
one angle; in 2-D, half of the pairs follow the token's row and half its column. Leading
non-patch tokens (class token, registers) are not rotated.

The two families differ in the angles and in which channels pair up; both are reproduced
exactly as timm builds them (``timm/layers/pos_embed_sincos.py``) so that a Softmax ViT with
copied weights computes the source model's function:

``'eva'`` (EVA-02; timm ``RotaryEmbeddingCat``, ``rope_type='cat'``, ``in_pixels=False``)
    ``d / 4`` frequencies ``f_k = temperature ** (-k / (d / 4))``; a token at row ``i`` and
    column ``j`` of an ``H x W`` grid has coordinates ``(i, j)``, rescaled to
    ``(i * ref_h / H, j * ref_w / W)`` when a reference grid is set (EVA-02 sets its
    pre-training grid, so the angles span the same range at every resolution). Angles are
    ``[i f_0 .. i f_{d/4-1}, j f_0 .. j f_{d/4-1}]``; pairs are adjacent channels
    ``(2p, 2p + 1)``.
``'dinov3'`` (timm ``RotaryEmbeddingDinoV3``, ``rope_type='dinov3'``, ``rotate_half=True``)
    periods ``P_k = temperature ** (k / (d / 4))``; coordinates are pixel centres normalised
    per axis to ``[-1, 1]``: ``2 (i + 0.5) / H - 1``, ``2 (j + 0.5) / W - 1``; angles are
    ``2 pi c / P_k`` in the same row-then-column order; pairs are ``(p, p + d / 2)``
    (rotate-half layout). DINOv3's training-time coordinate augmentations are not applied.
"""
import math
from typing import NamedTuple

import torch
from torch import nn

from ...utils.tracing import eager_cache

ROPE_TYPES = ('eva', 'dinov3')
DEFAULT_TEMPERATURE = {'eva': 10000., 'dinov3': 100.}


class GridRotation(NamedTuple):
    """The rotation of one token sequence: ``num_extra`` unrotated tokens, then the grid.

    ``sin`` and ``cos`` are ``(num_extra + H*W, d)`` (or any ``(..., T, d)`` that broadcasts
    against the tokens) and already expanded to the channel layout, so rotating is two
    elementwise products: ``t * cos + partner(t) * sin``, where ``partner`` maps each pair
    ``(a, b)`` to ``(-b, a)``. The leading rows of extra tokens hold ``cos = 1, sin = 0``,
    which leaves those tokens bit-identical. A ``reference`` rotation multiplies every token
    by its explicit ``d x d`` rotation matrix instead (the operators' O(N^2) oracles use it,
    so the tests check the elementwise form against the matrix form).
    """

    sin: torch.Tensor
    cos: torch.Tensor
    interleaved: bool
    reference: bool = False

    def as_reference(self):
        return self._replace(reference=True)

    def partner(self, t):
        if self.interleaved:
            return torch.stack([-t[..., 1::2], t[..., 0::2]], dim=-1).flatten(-2)
        first, second = t.chunk(2, dim=-1)
        return torch.cat([-second, first], dim=-1)

    def rotate(self, t):
        """Rotate ``(..., T, d)`` tokens; the result has the tables' precision at least."""
        if self.reference:
            matrices = self.matrices()
            dtype = torch.promote_types(matrices.dtype, t.dtype)
            return torch.einsum('tij,...tj->...ti', matrices.to(dtype), t.to(dtype))
        return t * self.cos + self.partner(t) * self.sin

    def matrices(self):
        """The explicit ``(T, d, d)`` rotation matrix of every token (the tests' oracle form)."""
        *lead, tokens, d = self.cos.shape
        index = torch.arange(d, device=self.cos.device)
        if self.interleaved:
            first, second = index[0::2], index[1::2]
        else:
            first, second = index[:d // 2], index[d // 2:]
        cos, sin = self.cos.reshape(tokens, d), self.sin.reshape(tokens, d)
        matrices = cos.new_zeros(tokens, d, d)
        matrices[:, first, first] = cos[:, first]
        matrices[:, second, second] = cos[:, second]
        # a pair (a, b) turns into (a cos - b sin, a sin + b cos)
        matrices[:, first, second] = -sin[:, first]
        matrices[:, second, first] = sin[:, second]
        return matrices


class RotaryPositionEmbedding2D(nn.Module):
    """2-D RoPE tables for any patch grid; parameter-free (nothing to load or train).

    One instance can serve every block of a model: the tables depend only on the grid, and
    are computed once per (grid, extra tokens, device, dtype) and cached. They are built in
    float64 and kept in float64 for float64 tokens, float32 otherwise (rotating in half
    precision would lose the angles' accuracy; timm rotates in float32 too).

    Args:
        head_dims (int): channels per head ``d``; divisible by 4 (two axes, pairs).
        rope_type (str): ``'eva'`` or ``'dinov3'`` (see the module docstring).
        temperature (float, optional): frequency base; 10000 for ``'eva'`` and 100 for
            ``'dinov3'`` by default (the sources' values).
        ref_grid (tuple[int, int], optional): ``'eva'`` only: the grid whose coordinate
            range every grid is rescaled to (EVA-02: its pre-training grid, 16 x 16).
    """

    def __init__(self, head_dims, rope_type='eva', temperature=None, ref_grid=None):
        super().__init__()
        if rope_type not in ROPE_TYPES:
            raise ValueError(f'unknown rope type {rope_type!r}; valid types are: '
                             f'{", ".join(ROPE_TYPES)}')
        if not (isinstance(head_dims, int) and head_dims > 0 and head_dims % 4 == 0):
            raise ValueError(f'2-D RoPE needs a head width divisible by 4 (a pair of channels '
                             f'per angle, half of the pairs per axis), got head_dims={head_dims}')
        if ref_grid is not None:
            if rope_type != 'eva':
                raise ValueError(f'ref_grid is an EVA-02 setting; the {rope_type!r} RoPE '
                                 f'normalises coordinates by the grid itself')
            ref_grid = tuple(int(side) for side in ref_grid)
            if len(ref_grid) != 2 or min(ref_grid) < 1:
                raise ValueError(f'ref_grid must be (rows, cols) >= 1, got {ref_grid}')
        self.head_dims = head_dims
        self.rope_type = rope_type
        self.temperature = float(DEFAULT_TEMPERATURE[rope_type]
                                 if temperature is None else temperature)
        if not self.temperature > 0:
            raise ValueError(f'temperature must be positive, got {temperature}')
        self.ref_grid = ref_grid

    @property
    def interleaved(self):
        return self.rope_type == 'eva'

    @property
    def config(self):
        """Everything that defines the tables (hashable): compared when checkpoints load."""
        return (self.rope_type, self.head_dims, self.temperature, self.ref_grid)

    def angles(self, hw_shape):
        """``(H*W, d/2)`` float64 angles, rows then columns, tokens in row-major order."""
        return _angles(self.config, tuple(hw_shape))

    def forward(self, hw_shape, num_extra=0, like=None):
        """The :class:`GridRotation` of ``num_extra`` leading tokens plus the ``hw_shape`` grid.

        ``like`` (a tensor) gives the device and the precision (float64 or float32).
        """
        device = like.device if like is not None else torch.device('cpu')
        dtype = torch.float64 if like is not None and like.dtype == torch.float64 \
            else torch.float32
        sin, cos = _tables(self.config, tuple(hw_shape), int(num_extra), device, dtype)
        return GridRotation(sin, cos, self.interleaved)

    def extra_repr(self):
        ref = f', ref_grid={self.ref_grid}' if self.ref_grid else ''
        return (f'rope_type={self.rope_type!r}, head_dims={self.head_dims}, '
                f'temperature={self.temperature:g}{ref}')


@eager_cache(maxsize=64)
def _angles(config, hw_shape):
    rope_type, head_dims, temperature, ref_grid = config
    height, width = hw_shape
    num_bands = head_dims // 4
    exponents = torch.arange(num_bands, dtype=torch.float64) / num_bands
    rows = torch.arange(height, dtype=torch.float64)
    cols = torch.arange(width, dtype=torch.float64)
    if rope_type == 'eva':
        frequencies = temperature**-exponents
        if ref_grid is not None:
            rows, cols = rows / height * ref_grid[0], cols / width * ref_grid[1]
    else:
        frequencies = 2 * math.pi / temperature**exponents
        rows, cols = 2 * (rows + .5) / height - 1, 2 * (cols + .5) / width - 1
    row_angles = (rows[:, None] * frequencies).repeat_interleave(width, dim=0)
    col_angles = (cols[:, None] * frequencies).repeat(height, 1)
    return torch.cat([row_angles, col_angles], dim=1)


@eager_cache(maxsize=64)
def _tables(config, hw_shape, num_extra, device, dtype):
    # Computed once per grid and shared by every block and forward; callers only read them.
    angles = _angles(config, hw_shape)
    rope_type = config[0]
    # Expand the d/2 angles to d channels in the family's pairing layout.
    angles = (angles.repeat_interleave(2, dim=1) if rope_type == 'eva'
              else torch.cat([angles, angles], dim=1))
    sin, cos = angles.sin(), angles.cos()
    if num_extra:
        sin = torch.cat([sin.new_zeros(num_extra, sin.shape[1]), sin])
        cos = torch.cat([cos.new_ones(num_extra, cos.shape[1]), cos])
    return sin.to(device=device, dtype=dtype), cos.to(device=device, dtype=dtype)


def build_rope(cfg, head_dims):
    """``None``, a :class:`RotaryPositionEmbedding2D`, or its config dict (``type`` is the
    rope type) -> a module (or ``None``) for heads of ``head_dims`` channels."""
    if cfg is None or isinstance(cfg, RotaryPositionEmbedding2D):
        if cfg is not None and cfg.head_dims != head_dims:
            raise ValueError(f'the RoPE module was built for heads of {cfg.head_dims} channels, '
                             f'the operator has {head_dims}')
        return cfg
    if not isinstance(cfg, dict) or 'type' not in cfg:
        raise TypeError(f'rope must be None, a RotaryPositionEmbedding2D or a dict with a '
                        f"'type' ({', '.join(ROPE_TYPES)}), got {cfg!r}")
    kwargs = {key: value for key, value in cfg.items() if key != 'type'}
    return RotaryPositionEmbedding2D(head_dims, rope_type=cfg['type'], **kwargs)
