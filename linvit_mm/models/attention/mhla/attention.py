"""The MHLA operator and its fast form (the docstring of :mod:`linvit_mm.models.attention.mhla`
says what it computes); the block layout is in ``blocks``, the O(N^2) oracle in
``reference``."""
import torch
import torch.nn.functional as F
from torch import nn

from ..base import BaseAttention, autocast_disabled, register_attention, state_inputs
from .blocks import (BlockLayout, _pair, blocks_to_tokens, distance_mixing_matrix, padding_mask,
                     to_blocks)
from .reference import MHLAReference

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


@register_attention('mhla')
class MultiHeadLinearAttention(MHLAReference, BaseAttention):
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

    Under autocast the fast form runs with autocast disabled, in bf16 as the projections give it
    (products and sums accumulate in float32; only the stored state rounds to bf16) or in
    float32 for fp16 (a sum over N tokens overflows fp16); the result returns to the
    projections' dtype before the value convolution is added. Queries and keys are not scaled:
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

    options = BaseAttention.options + ('num_blocks', 'block_size', 'mixing_init',
                                       'value_kernel_size', 'eps', 'feature_floor', 'qk_norm',
                                       'attn_norm', 'normaliser')
    # how the block mixing starts, not what it computes once trained
    options_outside_the_function = BaseAttention.options_outside_the_function + (
        'mixing_init', )

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
        channels-last NCHW view they need no transposing copy (cuDNN and oneDNN both have
        channels-last depthwise kernels); the output, channels-last too, reads back as
        tokens without a copy.
        """
        B, _, C = patch_values.shape
        image = patch_values.reshape(B, *hw_shape, C).permute(0, 3, 1, 2)
        local = self.value_conv(image)
        return local.permute(0, 2, 3, 1).reshape(B, -1, C)

    def _block_rotation(self, hw_shape, layout, like):
        """The RoPE rotation of the patch grid in block layout (``None`` without RoPE): its
        tables are ``(M, block_h*block_w, d)``, zero on the padding."""
        rotation = self.rotation(hw_shape, 0, like)
        if rotation is None:
            return None
        return rotation._replace(sin=to_blocks(rotation.sin, hw_shape, layout),
                                 cos=to_blocks(rotation.cos, hw_shape, layout))

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
            picked = t[:, tokens]
            # the token count given: a batch of 0 images leaves -1 undetermined
            return picked.reshape(B, picked.shape[1], parts, h, d).permute(2, 0, 3, 1, 4)

        def summaries(keys, summary_keys, values):
            """``S`` ``(..., d, d)`` and ``z`` ``(..., d)``; under the consistent normaliser
            one ``(..., d, d + 1)`` state with ``z`` as its last column."""
            summary, z = summary_keys.transpose(-2, -1) @ values, keys.sum(dim=-2)
            return torch.cat([summary, z.unsqueeze(-1)], dim=-1) if consistent else summary, z

        patches = slice(num_extra, None)
        with autocast_disabled(v):
            qk_blocks, v_blocks = state_inputs(
                to_blocks(heads(qk, patches, 2), hw_shape, layout),
                to_blocks(heads(v, patches, 1), hw_shape, layout).squeeze(0))  # v: (B, h, M, T, d)
            mixing = self.block_mixing.to(qk_blocks.dtype)
            q_blocks, k_blocks = self._stacked_features(qk_blocks).unbind(0)
            padded = layout.pads(hw_shape)
            if padded:
                # Padded keys would add the feature floor to the normalisers.
                real = padding_mask(hw_shape, layout, k_blocks.device, k_blocks.dtype)
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
                qk_extra, v_extra = state_inputs(heads(qk, extras, 2),
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
            out = blocks_to_tokens(numerator * (normaliser + self.eps).reciprocal(),
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
        if x.shape[0] == 0:  # no image: nothing to attend
            return self.project(x * 0)  # empty; x * 0 keeps the graph to x
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
