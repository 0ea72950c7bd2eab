"""Multi-Head Linear Attention (MHLA; Zhang et al., ICLR 2026, "MHLA: Restoring
Expressivity of Linear Attention via Token-Level Multi-Head").

The patch grid is cut into ``M`` non-overlapping spatial blocks, the "token-level
heads". Each block ``b`` sums its own key-value state and normaliser,
``S_b = sum phi(k) v^T`` and ``z_b = sum phi(k)``; a learned ``M x M`` matrix ``W``
mixes them, and a query ``t`` in block ``i`` reads

    out_t = phi(q_t)^T (sum_j W_ij S_j) / (phi(q_t)^T sum_j W_ij z_j + eps)

(``normaliser='consistent'``, the default), so different regions see differently weighted
summaries of the image while the cost stays O(N C d + M^2 C d). A 5 x 5 depthwise
convolution of the values, in image layout, is added before the output projection.

The authors' code (``MHLA_Normed_Torch`` of DAGroup-PKU/MHLA), which produced the paper's
MHLA results, divides instead by ``sum_j W_ij phi(q_{j,p})^T z_j + eps``, where
``q_{j,p}`` is the query at the reading query's in-block position ``p`` of block ``j``
(``normaliser='official'``): each block's normaliser is paired with another block's
query, so the weights of a query's keys do not sum to one. The default keeps the form
whose numerator and normaliser come from the same query, a weighted mean of the values
for positive mixing weights (equal values in, that value out), which a Softmax
initialisation relies on; ``'official'`` reproduces the authors' module (with
``attn_norm``, ``qk_norm``, their block layout (:data:`OFFICIAL_IMAGENET`) and
``qkv_bias=False``).
"""
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ...ops import depthwise_conv2d
from ...utils.tracing import is_tracing
from .base import BaseAttention, float32_state, register_attention

MIXING_INITS = ('linear', 'cos')
NORMALISERS = ('consistent', 'official')

# The operator arguments of the authors' ImageNet ViTs (``deit_*_pla_1d_v6_6`` with the
# training script's ``piece_size=4 transform=linear``): 16 blocks of 4 x 4 patches on the
# 16 x 16 grid of a 256 px input (their ViT zero-pads 224 px images to 256), a LayerNorm
# of the operator's own, RMSNorm of queries and keys, no qkv bias, the shifted
# normaliser. ``relu(x) + 1e-6`` features and ``eps=1e-6`` are this module's defaults;
# ``qkv_bias=False`` is given beside (in a LinearViT it is the arch's ``qkv_bias``).
# ``block_size`` is left to follow the grid, so the same model runs at other resolutions
# (dense tasks); on the 16 x 16 grid the blocks are 4 x 4 either way.
OFFICIAL_IMAGENET = dict(num_blocks=(4, 4), mixing_init='linear', normaliser='official',
                         attn_norm=True, qk_norm=True)


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
    grid = torch.stack(torch.meshgrid(torch.arange(rows, dtype=torch.float64),
                                      torch.arange(cols, dtype=torch.float64),
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


@register_attention('mhla')
class MultiHeadLinearAttention(BaseAttention):
    """Multi-Head Linear Attention over a fixed layout of spatial token blocks.

    Grids of any size work. When a side does not divide by its block count the
    grid is zero-padded at the bottom/right: padded keys and values are zero after
    the feature map, so they add nothing to any summary or normaliser, and padded
    queries are cropped. Grids smaller than the layout (e.g. 1 x 1 or 3 x 1 under
    2 x 2 blocks) leave some blocks empty; an empty block's summary is zero, so it
    contributes nothing whatever its mixing weight.

    Extra tokens (a class token leading the sequence; MHLA models have none, the
    interface allows it) are global: their key-value pairs are added, with weight 1
    and unmixed, to the summary every block reads, and their queries read the
    unmixed sum over all tokens, i.e. plain linear attention. The value convolution
    touches patch tokens only.

    Under autocast the features, block summaries, mixing, normalisers and division
    run in float32 with autocast disabled; the result returns to the projections'
    dtype before the value convolution is added. Queries and keys are not scaled:
    the normaliser cancels any positive query scale.

    RoPE, as for the kernel operators (RoFormer Sec. 3.4.3): the features of the patch
    tokens are rotated in the numerator only, so a block's summary is
    ``S_b = sum (R phi(k)) v^T`` while its normaliser ``z_b = sum phi(k)`` and the query's
    normaliser read ``phi(q)^T sum_j W_ij z_j`` stay un-rotated (and positive); the query
    reads the numerator with ``R_t phi(q_t)``. Extra tokens are not rotated.

    Args:
        num_blocks (int | tuple[int, int]): block layout ``(rows, cols)``, fixed for
            every resolution (the mixing matrix is ``M x M``). The authors' ImageNet
            models use 16 blocks of 4 x 4 patches, ``(4, 4)``, on the 16 x 16 grid of a
            224 px image zero-padded to 256 px (:data:`OFFICIAL_IMAGENET`); the default
            ``(2, 2)`` is four 7 x 7 blocks on the 14 x 14 grid of a 224 px image.
        block_size (int | tuple[int, int], optional): ``None`` (default): the blocks'
            size follows the grid, ``ceil(H / rows) x ceil(W / cols)``. A pair
            ``(block_h, block_w)`` fixes it, as the authors' module does (their
            ``window_size``): the layout then covers ``rows * block_h x cols * block_w``
            tokens, a smaller grid is zero-padded to it and a larger one is refused.
        mixing_init (str): distance transform for the initial mixing matrix, see
            :func:`distance_mixing_matrix`. ``'linear'`` is what the public ImageNet
            training recipe uses.
        value_kernel_size (int): side of the depthwise value convolution (5 in the
            paper); odd, so ``same`` padding keeps the grid.
        eps (float): added to the mixed normaliser, so a query whose features are
            all zero reads zero instead of ``0 / 0``.
        feature_floor (float): ``phi(x) = relu(x) + feature_floor`` for queries and
            keys; the public code uses 1e-6, which keeps every real key's weight
            positive. 0 gives plain relu.
        qk_norm (bool): RMSNorm (``q_norm``, ``k_norm``: PyTorch's, over all ``C``
            channels, before the head split) of queries and keys before the feature map,
            as in the authors' ViTs. Off by default so weights copied from a Softmax
            checkpoint keep their meaning.
        attn_norm (bool): a LayerNorm of the operator's own (``norm``, PyTorch's default
            eps 1e-5) applied to its input before ``qkv``, as in the authors' module,
            whose blocks therefore normalise twice (the block's ``ln1``, then ``norm``).
            The values the convolution reads come from the normalised input too.
        normaliser (str): ``'consistent'`` (default) or ``'official'``, see the module
            docstring. Under ``'official'`` a position that is padding in block ``j``
            (a grid that does not fill the layout) holds no query and adds nothing to
            the normaliser of the queries at that position in other blocks; the authors'
            module never pads (its grid is fixed). Extra tokens are global under both:
            a patch query adds ``phi(q_t)^T z_extra`` to its normaliser.

    A Softmax checkpoint carries neither norm: ``norm``, ``q_norm`` and ``k_norm`` then keep
    their init, weight 1 and bias 0 (the identity affine; the normalisation itself stays).
    With ``qk_norm`` the query's RMS scale cancels between numerator and normaliser (up to
    the feature floor); the key's rescales each key's weight.
    """

    uses_cls_token = False
    bound_fraction_target = .75

    options = BaseAttention.options + ('num_blocks', 'block_size', 'mixing_init',
                                       'value_kernel_size', 'eps', 'feature_floor', 'qk_norm',
                                       'attn_norm', 'normaliser')

    def __init__(self, embed_dims, num_heads, qkv_bias=True, attn_drop=0., proj_drop=0.,
                 rope=None, layer_scale_init_value=0., num_blocks=(2, 2), block_size=None,
                 mixing_init='linear', value_kernel_size=5, eps=1e-6, feature_floor=1e-6,
                 qk_norm=False, attn_norm=False, normaliser='consistent'):
        super().__init__(embed_dims, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop, rope=rope,
                         layer_scale_init_value=layer_scale_init_value)
        if not (isinstance(value_kernel_size, int) and value_kernel_size > 0
                and value_kernel_size % 2 == 1):
            raise ValueError(f'value_kernel_size must be a positive odd int (same padding), '
                             f'got {value_kernel_size!r}')
        if not eps > 0:
            raise ValueError(f'eps must be positive (it keeps all-zero relu rows finite), '
                             f'got {eps}')
        if not feature_floor >= 0:
            raise ValueError(f'feature_floor must be >= 0, got {feature_floor}')
        if normaliser not in NORMALISERS:
            raise ValueError(f'unknown normaliser {normaliser!r}; valid choices are: '
                             f'{", ".join(NORMALISERS)}')
        self.num_blocks = _pair(num_blocks)
        self.block_size = (None if block_size is None
                           else _pair(block_size, 'block_size', '(block_h, block_w)'))
        self.normaliser = normaliser
        self.mixing_init = mixing_init
        self.eps = eps
        self.feature_floor = feature_floor

        self.norm = nn.LayerNorm(embed_dims) if attn_norm else nn.Identity()
        self.qkv = nn.Linear(embed_dims, embed_dims * 3, bias=qkv_bias)
        self.q_norm = nn.RMSNorm(embed_dims) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(embed_dims) if qk_norm else nn.Identity()
        # block_mixing[i, j]: how much of block j's summary block i reads.
        self.block_mixing = nn.Parameter(distance_mixing_matrix(self.num_blocks, mixing_init))
        self.value_conv = nn.Conv2d(embed_dims, embed_dims, value_kernel_size,
                                    padding=value_kernel_size // 2, groups=embed_dims)
        self.proj = nn.Linear(embed_dims, embed_dims)

    def block_layout(self, hw_shape):
        H, W = hw_shape
        if H < 1 or W < 1:
            raise ValueError(f'the patch grid must be at least 1x1, got {H}x{W}')
        rows, cols = self.num_blocks
        if self.block_size is not None:
            block_h, block_w = self.block_size
            if H > rows * block_h or W > cols * block_w:
                raise ValueError(f'a {H}x{W} grid does not fit the fixed layout of {rows}x{cols} '
                                 f'blocks of {block_h}x{block_w} tokens (at most '
                                 f'{rows * block_h}x{cols * block_w}); use block_size=None to '
                                 f'let the blocks grow with the grid')
            return BlockLayout(rows, cols, block_h, block_w)
        # ceil division on non-negative operands: ONNX divides integers towards zero, so
        # the -(-H // rows) form would floor instead in an exported graph
        return BlockLayout(rows, cols, (H + rows - 1) // rows, (W + cols - 1) // cols)

    def _stacked_features(self, qk):
        """``phi`` of a tensor holding queries and keys, in one pass plus an in-place add.

        ``threshold(x, 0, 0)`` is relu, but autograd saves its input rather than its
        output, so the floor can be added in place.
        """
        phi = F.threshold(qk, 0., 0.)
        return phi.add_(self.feature_floor) if self.feature_floor else phi

    def _local_values(self, patch_values, hw_shape):
        """Depthwise convolution of ``(B, H*W, C)`` patch values -> ``(B, H*W, C)``.

        The token-major values are already an ``H x W x C`` image: read as a
        channels-last NCHW view they need no transposing copy, and oneDNN's
        channels-last depthwise kernel is several times faster than the NCHW one; the
        output, channels-last too, reads back as tokens without a copy.
        """
        B, _, C = patch_values.shape
        image = patch_values.reshape(B, *hw_shape, C).permute(0, 3, 1, 2)
        conv = self.value_conv
        local = depthwise_conv2d(image, conv.weight, conv.bias, conv.padding[0])
        return local.permute(0, 2, 3, 1).reshape(B, -1, C)

    @staticmethod
    def _to_blocks(t, hw_shape, layout):
        """``(..., H*W, d)`` -> ``(..., M, block_h*block_w, d)``, zero-padded, one copy."""
        *lead, _, d = t.shape
        H, W = hw_shape
        t = t.reshape(*lead, H, W, d)
        if layout.pads(hw_shape):
            t = F.pad(t, (0, 0, 0, layout.padded_w - W, 0, layout.padded_h - H))
        t = t.reshape(*lead, layout.rows, layout.block_h, layout.cols, layout.block_w, d)
        t = t.transpose(-4, -3)
        return t.reshape(*lead, layout.num_blocks, layout.block_h * layout.block_w, d)

    @staticmethod
    def _blocks_to_tokens(t, hw_shape, layout):
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

    def _padding_mask(self, hw_shape, layout, device, dtype):
        """``(M, block_h*block_w, 1)``: 1 for real tokens, 0 for the padding."""
        # compared, not sliced: a slice assignment would tie a traced graph to the grid
        rows = torch.arange(layout.padded_h, device=device) < hw_shape[0]
        cols = torch.arange(layout.padded_w, device=device) < hw_shape[1]
        real = (rows[:, None] & cols[None, :]).to(dtype)
        return self._to_blocks(real.reshape(-1, 1), (layout.padded_h, layout.padded_w), layout)

    def _block_rotation(self, hw_shape, layout, like):
        """The RoPE rotation of the patch grid in block layout (``None`` without RoPE): its
        tables are ``(M, block_h*block_w, d)``, zero on the padding."""
        rotation = self.rotation(hw_shape, 0, like)
        if rotation is None:
            return None
        return rotation._replace(sin=self._to_blocks(rotation.sin, hw_shape, layout),
                                 cos=self._to_blocks(rotation.cos, hw_shape, layout))

    def _mixed_linear(self, qk, v, hw_shape, layout, num_extra):
        """Queries and keys ``(B, N, 2C)``, values ``(B, N, C)`` -> attention outputs of the
        patch tokens ``(B, H*W, C)`` and of the extra tokens ``(B, num_extra, C)`` (``None``
        if none).

        ``layout`` is :meth:`block_layout` of ``hw_shape``. One copy each takes the patch
        queries with keys, and the values, to block-major head layout. Under the consistent
        normaliser it rides along with the numerator: ``z_b = phi(K_b)^T 1`` is appended to
        ``S_b`` as an extra column, so one ``M x M`` mixing and one query product produce
        both ``phi(q)^T sum_j W_ij S_j`` and ``phi(q)^T sum_j W_ij z_j``. With RoPE the
        summary column is built from rotated keys and read by the rotated query, the
        normaliser column by the plain one (two query products). The official normaliser
        reads ``phi(q_{j,p})^T z_j`` in every block first and mixes those ``(M, T)`` numbers.
        """
        B = v.shape[0]
        h, d = self.num_heads, self.head_dims
        out_dtype = v.dtype
        consistent = self.normaliser == 'consistent'

        def heads(t, tokens, parts):
            """``(B, N, parts*C)`` -> ``(parts, B, h, tokens, d)`` view of those tokens."""
            return t[:, tokens].reshape(B, -1, parts, h, d).permute(2, 0, 3, 1, 4)

        def summaries(keys, summary_keys, values):
            """``S`` ``(..., d, d)`` and ``z`` ``(..., d)``; under the consistent normaliser
            one ``(..., d, d + 1)`` state with ``z`` as its last column."""
            summary, z = summary_keys.transpose(-2, -1) @ values, keys.sum(dim=-2)
            return torch.cat([summary, z.unsqueeze(-1)], dim=-1) if consistent else summary, z

        patches = slice(num_extra, None)
        with torch.autocast(device_type=v.device.type, enabled=False):
            qk_blocks, v_blocks, mixing = float32_state(
                self._to_blocks(heads(qk, patches, 2), hw_shape, layout),
                self._to_blocks(heads(v, patches, 1), hw_shape, layout).squeeze(0),
                self.block_mixing)                                          # v: (B, h, M, T, d)
            q_blocks, k_blocks = self._stacked_features(qk_blocks).unbind(0)
            padded = layout.pads(hw_shape)
            if padded:
                # Padded keys would add the feature floor to the normalisers.
                real = self._padding_mask(hw_shape, layout, k_blocks.device, k_blocks.dtype)
                k_blocks = k_blocks * real
            rotation = self._block_rotation(hw_shape, layout, k_blocks)
            summary_keys = k_blocks if rotation is None else rotation.rotate(k_blocks)
            state, z = summaries(k_blocks, summary_keys, v_blocks)  # (B, h, M, d, d[+1])
            # A batched (M x M) @ (M x d(d+1)) product; a plain 2-D @ would be run
            # transposed, with copies in and out.
            mixing = mixing.expand(B, h, *mixing.shape)
            mixed = (mixing @ state.flatten(-2)).unflatten(-1, state.shape[-2:])
            if num_extra:
                extras = slice(0, num_extra)
                qk_extra, v_extra = float32_state(heads(qk, extras, 2),
                                                  heads(v, extras, 1).squeeze(0))
                q_extra, k_extra = self._stacked_features(qk_extra).unbind(0)
                extra_state, extra_z = summaries(k_extra, k_extra, v_extra)
                # Extra tokens are global: added unmixed to what every block reads.
                mixed = mixed + extra_state.unsqueeze(2)
            read_q = q_blocks if rotation is None else rotation.rotate(q_blocks)
            if consistent and rotation is None:
                numerator, normaliser = (q_blocks @ mixed).split([d, 1], dim=-1)
            elif consistent:
                numerator = read_q @ mixed[..., :d]
                normaliser = q_blocks @ mixed[..., d:]
            else:
                numerator = read_q @ mixed
                own = (q_blocks @ z.unsqueeze(-1)).squeeze(-1)             # (B, h, M, T)
                if padded:
                    # a padded position holds no query to pair with other blocks
                    own = own * real.squeeze(-1)
                normaliser = (mixing @ own).unsqueeze(-1)
                if num_extra:
                    normaliser = normaliser + q_blocks @ extra_z[:, :, None, :, None]
            # one reciprocal per query, then a product: the backward of a division by a
            # broadcast denominator costs three more passes over the numerator
            out = self._blocks_to_tokens(numerator * (normaliser + self.eps).reciprocal(),
                                         hw_shape, layout)
            if num_extra:
                # Extra queries read the unmixed sum over every token.
                total = state.sum(dim=2) + extra_state
                if consistent:
                    numerator, normaliser = (q_extra @ total).split([d, 1], dim=-1)
                else:
                    numerator = q_extra @ total
                    normaliser = q_extra @ (z.sum(dim=2) + extra_z).unsqueeze(-1)
                out_extra = self.merge_heads(numerator / (normaliser + self.eps))
        return out.to(out_dtype), out_extra.to(out_dtype) if num_extra else None

    def forward(self, x, hw_shape):
        num_extra = self.num_extra_tokens(x, hw_shape)
        layout = self.block_layout(hw_shape)  # rejects an empty grid before any work
        x = self.norm(x)
        # split rather than slicing: its backward concatenates the gradients instead of
        # zero-filling a qkv-sized one per slice
        qk, values = self.qkv(x).split([2 * self.embed_dims, self.embed_dims], dim=-1)
        if not (isinstance(self.q_norm, nn.Identity) and isinstance(self.k_norm, nn.Identity)):
            q, k = qk.chunk(2, dim=-1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=-1)
        out, out_extra = self._mixed_linear(qk, values, hw_shape, layout, num_extra)
        out = out + self._local_values(values[:, num_extra:], hw_shape)
        if out_extra is not None:
            # The value convolution touches patch tokens only.
            out = torch.cat([out_extra, out], dim=1)
        return self.project(out)

    # ------------------------------------------------------------ the O(N^2) reference
    # Written apart from the fast form above, as the tests' oracle: it shares the
    # projections and the parameters with it, nothing else (no block layout, padding,
    # block reshaping, feature helper or convolution kernel), so a fault in one form
    # shows up as a disagreement with the other.

    def _reference_block_shape(self, hw_shape):
        """``(block_h, block_w)`` for ``hw_shape``; refuses a grid the fixed layout cannot hold."""
        H, W = hw_shape
        rows, cols = self.num_blocks
        if self.block_size is None:
            return -(-H // rows), -(-W // cols)
        if H > rows * self.block_size[0] or W > cols * self.block_size[1]:
            raise ValueError(f'a {H}x{W} grid does not fit the fixed layout of {rows}x{cols} '
                             f'blocks of {self.block_size[0]}x{self.block_size[1]} tokens')
        return self.block_size

    def _reference_positions(self, hw_shape, num_extra):
        """Per token: whether it is a patch, its row, column and block (blocks row-major)."""
        H, W = hw_shape
        block_h, block_w = self._reference_block_shape(hw_shape)
        token = torch.arange(num_extra + H * W, device=self.block_mixing.device)
        patch = token >= num_extra
        position = (token - num_extra).clamp(min=0)
        row, col = position // W, position % W
        return patch, row, col, (row // block_h) * self.num_blocks[1] + col // block_w

    def reference_mixing_weights(self, hw_shape, num_extra=0):
        """``(N, N)`` factor on ``phi(q_t)^T phi(k_s)``: ``W[block(t), block(s)]`` between
        patch tokens, 1 wherever an extra token is involved.

        A patch token at row ``r`` and column ``c`` lies in block
        ``(r // block_h) * cols + c // block_w`` (blocks row-major, the last row or column
        of blocks shorter, or empty, when a side does not fill the layout), with
        ``block_h x block_w`` the fixed ``block_size`` or ``ceil(H / rows) x ceil(W / cols)``.
        """
        patch, _, _, block = self._reference_positions(hw_shape, num_extra)
        both_patches = patch[:, None] & patch[None, :]
        mixed = self.block_mixing[block[:, None], block[None, :]]
        return torch.where(both_patches, mixed, torch.ones_like(mixed))

    def reference_partners(self, hw_shape, num_extra=0):
        """``(N, N)`` index of the query the official normaliser pairs with key ``s`` for
        query ``t``: the token of ``s``'s block at ``t``'s in-block position when both are
        patches (``-1`` where that position is off the grid), else ``t`` itself.

        Query ``t`` at ``(r, c)`` and a key in block ``(I, J)`` of ``block_h x block_w``
        tokens pair with the token at ``(I * block_h + r % block_h, J * block_w + c % block_w)``.
        """
        H, W = hw_shape
        block_h, block_w = self._reference_block_shape(hw_shape)
        patch, row, col, block = self._reference_positions(hw_shape, num_extra)
        cols = self.num_blocks[1]
        partner_row = (block[None, :] // cols) * block_h + (row % block_h)[:, None]
        partner_col = (block[None, :] % cols) * block_w + (col % block_w)[:, None]
        partner = num_extra + partner_row * W + partner_col
        on_grid = (partner_row < H) & (partner_col < W)
        partner = torch.where(on_grid, partner, torch.full_like(partner, -1))
        both_patches = patch[:, None] & patch[None, :]
        own = torch.arange(len(patch), device=patch.device)[:, None].expand_as(partner)
        return torch.where(both_patches, partner, own)

    def _reference_norms(self, x):
        """``attn_norm``'s LayerNorm by its formula, ``(x - mean) / sqrt(var + eps) * w + b``
        (biased variance over the channels); ``x`` unchanged without it."""
        if not isinstance(self.norm, nn.LayerNorm):
            return x
        mean = x.mean(dim=-1, keepdim=True)
        variance = ((x - mean)**2).mean(dim=-1, keepdim=True)
        return (x - mean) / torch.sqrt(variance + self.norm.eps) * self.norm.weight + self.norm.bias

    @staticmethod
    def _reference_rms(norm, t):
        """RMSNorm by its formula, ``t / sqrt(mean(t^2) + eps) * w`` (PyTorch's eps ``None``
        is the dtype's machine epsilon); ``t`` unchanged for an identity."""
        if not isinstance(norm, nn.RMSNorm):
            return t
        eps = torch.finfo(t.dtype).eps if norm.eps is None else norm.eps
        return t / torch.sqrt((t * t).mean(dim=-1, keepdim=True) + eps) * norm.weight

    def _reference_value_conv(self, values, hw_shape, num_extra):
        """The depthwise value convolution as a sum over the kernel's taps, zero for the
        extra tokens: patch ``(r, c)`` of channel ``ch`` gets
        ``bias[ch] + sum_ij weight[ch, i, j] * v[r + i - p, c + j - p, ch]``, with positions
        off the grid reading zero (``p`` is half the kernel side)."""
        B, _, C = values.shape
        H, W = hw_shape
        weight, bias = self.value_conv.weight[:, 0], self.value_conv.bias   # (C, K, K), (C,)
        K = weight.shape[-1]
        p = K // 2
        image = values[:, num_extra:].reshape(B, H, W, C)
        framed = image.new_zeros(B, H + 2 * p, W + 2 * p, C)
        framed[:, p:p + H, p:p + W] = image
        local = bias.expand(B, H, W, C)
        for i in range(K):
            for j in range(K):
                local = local + weight[:, i, j] * framed[:, i:i + H, j:j + W]
        return torch.cat([local.new_zeros(B, num_extra, C), local.reshape(B, H * W, C)], dim=1)

    def forward_reference(self, x, hw_shape):
        """The same operator as explicit sums over every pair of tokens, O(N^2):

            out_t = sum_s A_ts v_s / (sum_s W_ts phi(q_u)^T phi(k_s) + eps),
            A_ts = W_ts (R_t phi(q_t))^T (R_s phi(k_s)),

        with ``W`` from :meth:`reference_mixing_weights`, ``phi(x) = relu(x) +
        feature_floor``, ``R_t`` the token's RoPE matrix (identity without RoPE and for
        extra tokens) and ``u = t`` under the consistent normaliser, ``u`` the partner of
        :meth:`reference_partners` under the official one (a missing partner reads zero);
        then the value convolution and the output projection. ``attn_norm`` and ``qk_norm``
        are applied by their formulas.
        """
        B, N, C = x.shape
        H, W = hw_shape
        num_extra = N - H * W
        if num_extra < 0:
            raise ValueError(f'{N} tokens cannot hold a {H}x{W} grid')
        if H < 1 or W < 1:
            raise ValueError(f'the patch grid must be at least 1x1, got {H}x{W}')
        h, d = self.num_heads, self.head_dims
        q, k, values = self.qkv(self._reference_norms(x)).chunk(3, dim=-1)
        q, k = self._reference_rms(self.q_norm, q), self._reference_rms(self.k_norm, k)
        out_dtype = values.dtype
        # the state sums of the fast form run in float32 at least; so does this form
        compute_dtype = torch.promote_types(out_dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            q, k, v = (t.to(compute_dtype).reshape(B, N, h, d).transpose(1, 2)
                       for t in (q, k, values))                             # (B, h, N, d)
            phi_q, phi_k = (torch.where(t > 0, t, 0.) + self.feature_floor for t in (q, k))
            weights = self.reference_mixing_weights(hw_shape, num_extra).to(compute_dtype)
            if self.normaliser == 'official':
                # index -1 (no partner) reads an appended zero query
                padded_q = torch.cat([phi_q, phi_q.new_zeros(B, h, 1, d)], dim=2)
                paired = padded_q[:, :, self.reference_partners(hw_shape, num_extra)]
                normaliser = torch.einsum('ts,bhtsc,bhsc->bht', weights, paired, phi_k)
            else:
                normaliser = torch.einsum('ts,bhtc,bhsc->bht', weights, phi_q, phi_k)
            if self.rope is None:
                rot_q, rot_k = phi_q, phi_k
            else:
                rotation = self.rope(hw_shape, num_extra, phi_q).as_reference()
                rot_q, rot_k = rotation.rotate(phi_q), rotation.rotate(phi_k)
            scores = weights * torch.einsum('bhtc,bhsc->bhts', rot_q, rot_k)
            numerator = torch.einsum('bhts,bhsc->bhtc', scores, v)
            out = numerator / (normaliser.unsqueeze(-1) + self.eps)
        out = out.to(out_dtype).transpose(1, 2).reshape(B, N, C)
        out = out + self._reference_value_conv(values, hw_shape, num_extra)
        return self.project(out)

    def core_macs(self, num_tokens, hw_shape):
        # per padded token: its key-value outer product and the query read-out (d^2 per
        # head each), the normaliser sum and read; the M x M mixing of every block's state;
        # RoPE on the (padded) patch tokens' features. The official normaliser mixes the
        # per-block products (M x M by M x T per head) instead of a (d + 1)-th state column.
        C, d = self.embed_dims, self.head_dims
        layout = self.block_layout(hw_shape)
        num_extra = num_tokens - hw_shape[0] * hw_shape[1]
        padded_patches = layout.num_blocks * layout.block_h * layout.block_w
        padded = num_extra + padded_patches
        if self.normaliser == 'official':
            mixing = (layout.num_blocks**2 * C * d
                      + layout.num_blocks * padded_patches * self.num_heads)
        else:
            mixing = layout.num_blocks**2 * C * (d + 1)
        return 2 * padded * C * d + 2 * padded * C + mixing + self.rotation_macs(padded_patches)

    def extra_repr(self):
        block_size = '' if self.block_size is None else f', block_size={self.block_size}'
        return (f'{super().extra_repr()}, num_blocks={self.num_blocks}{block_size}, '
                f'mixing_init={self.mixing_init!r}, normaliser={self.normaliser!r}, '
                f'eps={self.eps}, feature_floor={self.feature_floor}')
