"""InLine attention (Han et al., NeurIPS 2024, "Bridging the Divide: Reconsidering Softmax
and Linear Attention"), attention-only form.

Identity kernel with subtraction normalisation, ``s = d^-1/2``::

    A_ij  = s/N * q_i^T k_j + 1/N * (1 - s * q_i^T k_mean)      (rows sum to 1)
    out_i = s/N * q_i^T (K^T V) + (1 - s * q_i^T k_mean) * v_mean

Entries of ``A`` may be negative. The official DeiT blocks add a local residual branch on
the values (``residual=True`` here, off by default): the paper's comparison with the other
linear attentions uses the attention alone, and so does this operator by default (weight
shapes equal Softmax attention).
"""
import torch
import torch.nn.functional as F
from torch import nn

from ...ops.depthwise import depthwise3x3_tokens
from ...ops.linear_attention import MAX_HEAD_DIMS, fused_applies, normalised_linear_attention
from .base import (autocast_disabled, float32_state, naive_heads, naive_merge_heads,
                   naive_precision, naive_rotate, register_attention, state_inputs)
from .map_attention import LinearMapAttention
from .ttt import naive_depthwise3x3


def naive_inline_attention(qkv, num_heads, rotations=None):
    """InLine attention written out from its definition (the O(N^2) oracle of the tests).

    ``A_ij = s/N q_i^T k_j + (1 - s q_i^T k_mean) / N`` with ``s = d^-1/2``, ``k_mean`` the
    mean key over all ``N`` tokens, and ``out_i = sum_j A_ij v_j``; with RoPE, ``q`` and ``k``
    are rotated first. The whole map is formed; no code is shared with
    :class:`InLineAttention`'s fast form (own head split, scale and rotation).

    Args:
        qkv (Tensor): ``(B, N, 3C)`` output of the ``qkv`` projection.
        num_heads (int): heads; ``d = C / num_heads``.
        rotations (Tensor, optional): ``(N, d, d)`` RoPE matrix of every token.

    Returns:
        tuple[Tensor, Tensor]: the output heads merged, ``(B, N, C)`` (before ``proj``), and
        the map ``(B, heads, N, N)``, both in float32 at least.
    """
    with autocast_disabled(qkv):
        q, k, v = naive_heads(naive_precision(qkv), num_heads)
        if rotations is not None:
            q, k = naive_rotate(rotations, q), naive_rotate(rotations, k)
        num_tokens, head_dims = q.shape[-2], q.shape[-1]
        s = head_dims**-0.5
        k_mean = k.sum(dim=-2, keepdim=True) / num_tokens                  # (B, h, 1, d)
        query_offset = 1 - s * (q * k_mean).sum(dim=-1, keepdim=True)      # (B, h, N, 1)
        attn = (s / num_tokens) * (q @ k.transpose(-2, -1)) + query_offset / num_tokens
        return naive_merge_heads(attn @ v), attn


def naive_inline_residual(x, qkv, residual, num_heads, hw_shape):
    """The local residual branch written out (the test oracle): for every image, the ``3x3``
    kernel of channel ``c`` is entries ``[9c, 9c + 9)`` of ``residual(mean_n x_n)`` (the
    two grouped 1x1 convolutions of the mean input token, laid out ``(C, 3, 3)`` row by
    row), and the branch is the zero-padded 3x3 depthwise convolution of the patch values
    (channel ``h d + j`` of value head ``h``) with it, from :func:`naive_depthwise3x3`;
    extra tokens get nothing. Returns ``(B, N, C)`` in float32 at least."""
    with autocast_disabled(qkv):
        _, _, v = naive_heads(naive_precision(qkv), num_heads)
        values = naive_merge_heads(v)                                            # (B, N, C)
        C = values.shape[-1]
        num_extra = values.shape[1] - hw_shape[0] * hw_shape[1]
        out = torch.zeros_like(values)
        for b in range(values.shape[0]):
            mean_token = naive_precision(x[b]).mean(dim=0)
            kernel_entries = residual(mean_token.to(residual[0].weight.dtype)[:, None])
            kernel = naive_precision(kernel_entries[:, 0]).reshape(C, 3, 3)
            out[b, num_extra:] = naive_depthwise3x3(values[b, num_extra:], kernel, hw_shape)
        return out


def grouped_pointwise(conv, rows):
    """``conv(rows[..., None])[..., 0]``: a grouped 1x1 ``Conv1d`` of ``(B, C_in)`` rows as one
    batched product: one matrix product instead of a grouped convolution of length 1, which
    oneDNN spends about 0.2 ms setting up, a hundred times its arithmetic."""
    groups = conv.groups
    weight = conv.weight.view(groups, conv.out_channels // groups, conv.in_channels // groups)
    # explicit sizes: a batch of 0 images leaves -1 undetermined
    out = rows.view(rows.shape[0], groups, 1, conv.in_channels // groups) @ weight.transpose(1, 2)
    out = out.view(rows.shape[0], conv.out_channels)
    return out if conv.bias is None else out + conv.bias


@register_attention('inline')
class InLineAttention(LinearMapAttention):
    """InLine attention in O(N d^2).

    ``N`` counts every token, the class token included, and the means run over all
    of them, as in the official DeiT model (there ``n`` is the full sequence length
    and ``k.mean`` spans the class token).

    Under autocast the fast form runs with autocast disabled, in bf16 as the projections give it
    (products and sums accumulate in float32; only the stored state rounds to bf16) or in
    float32 for fp16 (a sum over N tokens overflows fp16). The result returns to the dtype of
    the projections' output before ``proj``.

    On CUDA the core runs as the fused Triton kernels of :mod:`linvit_mm.ops.linear_attention`
    (the normalised core with identity features): InLine's row is
    ``out_i = 1/N sum_j (s q_i^T (k_j - k_mean) + 1) v_j``, that core on the features
    ``[s q_i, 1]`` and ``[k_j - k_mean, 1]``, whose normaliser is exactly ``N`` (the centred
    keys sum to zero), so it needs no eps. ``fused=False`` (or ``LINVIT_MM_FUSED=0``) keeps the
    PyTorch form, the same function.

    RoPE: queries and keys are rotated before everything else, as in Softmax attention,
    and the map is formed from the rotated ones (``k_mean`` is the mean of the rotated
    keys). InLine has no feature map whose positivity a rotation could break, and its rows
    sum to one by construction for any ``q``, ``k``, so they still do.

    **Local residual** (``residual=True``, the official InLine-DeiT block's
    ``attn.residual``): a per-image 3x3 depthwise convolution of the patch values, added
    to the attention output before ``proj``; its kernels are predicted from the mean input
    token (over every token, the class token included, as the official model takes it) by
    ``residual = Sequential(Conv1d(C, C, 1, groups=heads), GELU, Conv1d(C, 9C, 1,
    groups=heads))``, channel ``c``'s kernel being outputs ``[9c, 9c + 9)`` row by row.
    The patches are the tokens after the extra ones, on the given grid (the official model
    assumes one class token and a square grid; any grid works here), with zero padding;
    extra tokens get no residual. The branch is operator-specific (a Softmax transfer
    leaves it at its init, PyTorch's default for ``Conv1d``, as in the official model), and
    ``attention_map`` stays the map of the attention alone: with the branch on, the output
    is that map times the values plus the branch, no longer ``A V``.

    Args:
        residual (bool): add the local residual branch (False).
        fused (bool): use the fused kernels where they apply (CUDA, heads up to 127 wide).
    """

    options = LinearMapAttention.options + ('residual', 'fused')
    # the fused kernels compute the same function
    options_outside_the_function = LinearMapAttention.options_outside_the_function + (
        'fused', )

    def __init__(self, embed_dims, num_heads, qkv_bias=True, attn_drop=0., proj_drop=0.,
                 rope=None, layer_scale_init_value=0., residual=False, fused=True):
        super().__init__(embed_dims, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop, rope=rope,
                         layer_scale_init_value=layer_scale_init_value)
        self.fused = fused
        self.residual = (nn.Sequential(
            nn.Conv1d(embed_dims, embed_dims, kernel_size=1, groups=num_heads), nn.GELU(),
            nn.Conv1d(embed_dims, 9 * embed_dims, kernel_size=1, groups=num_heads))
            if residual else None)

    def local_residual(self, x, v, hw_shape):
        """The residual branch ``(B, N, C)`` of the operator input ``x`` and the value heads
        ``v`` ``(B, heads, N, d)``: every image's ``C`` kernels applied to its patch values in
        token layout (``ops.depthwise3x3_tokens``)."""
        B, N, C = x.shape
        H, W = hw_shape
        num_extra = N - H * W
        first, activation, second = self.residual
        hidden = activation(grouped_pointwise(first, x.mean(dim=1)))
        # kernel entries 9c .. 9c + 8 of channel c, row-major: the taps' order
        kernels = grouped_pointwise(second, hidden).reshape(B, C, 9)
        # the heads' view of the fused qkv is token-major already: no copy
        patches = v[:, :, num_extra:].transpose(1, 2).reshape(B, H * W, C)
        with autocast_disabled(x):
            patches, kernels = state_inputs(patches, kernels)
            taps = kernels.to(patches.dtype).transpose(1, 2).contiguous()
            local = depthwise3x3_tokens(patches, taps, hw_shape)
        return F.pad(local, (0, 0, num_extra, 0))

    def forward(self, x, hw_shape):
        if x.shape[0] == 0 or x.shape[1] == 0:
            # nothing to attend: no image, or no token to average over (a 0 x 0 grid)
            return self.project(x * 0)  # empty; x * 0 keeps the graph to x
        q, k, v, rotation = self._heads(x, hw_shape)
        out = self.merge_heads(self._linear(q, k, v, rotation))
        if self.residual is not None:
            out = out + self.local_residual(x, v, hw_shape).to(out.dtype)
        return self.project(out)

    def _fused_linear(self, q, k, v, rotation=None):
        """The core on the fused kernels, from the features ``[s q, 1]`` and
        ``[k - k_mean, 1]`` of the rotated queries and keys (the class docstring), in the
        values' dtype."""
        if rotation is not None:
            q, k = rotation.rotate(q), rotation.rotate(k)  # in the tables' precision
        ones = q.new_ones(*q.shape[:-1], 1)
        query_features = torch.cat([q * self.scale, ones], dim=-1).to(v.dtype)
        key_features = torch.cat([k - k.mean(dim=-2, keepdim=True), ones], dim=-1).to(v.dtype)
        return normalised_linear_attention(query_features, key_features, v, 0., 'identity',
                                           fused=True)

    def _linear(self, q, k, v, rotation=None):
        if self.fused and self.head_dims < MAX_HEAD_DIMS and fused_applies(q, k, v):
            return self._fused_linear(q, k, v, rotation)
        out_dtype = v.dtype
        num_tokens = q.shape[-2]
        with autocast_disabled(v):
            q, k, v = state_inputs(q, k, v)
            if rotation is not None:
                q, k = rotation.rotate(q), rotation.rotate(k)
            kv_state = (k.transpose(-2, -1) @ v) * (self.scale / num_tokens)   # (B, h, d, d)
            k_mean = k.mean(dim=-2).unsqueeze(-1)                              # (B, h, d, 1)
            v_mean = v.mean(dim=-2, keepdim=True)                              # (B, h, 1, d)
            out = q @ kv_state + (1 - self.scale * (q @ k_mean)) * v_mean
        return out.to(out_dtype)

    def _map(self, q, k, rotation=None):
        num_tokens = q.shape[-2]
        with autocast_disabled(q):
            q, k = float32_state(q, k)
            if rotation is not None:
                q, k = rotation.rotate(q), rotation.rotate(k)
            k_mean = k.mean(dim=-2).unsqueeze(-1)
            offset = (1 - self.scale * (q @ k_mean)) / num_tokens             # (B, h, N, 1)
            return (self.scale / num_tokens) * (q @ k.transpose(-2, -1)) + offset

    def naive_forward(self, x, hw_shape):
        """:func:`naive_inline_attention` of ``x``: the output heads merged (before ``proj``, in
        the projections' dtype) and the map (float32 at least)."""
        num_extra = self.num_extra_tokens(x, hw_shape)
        qkv = self.qkv(x)
        out, attn = naive_inline_attention(qkv, self.num_heads,
                                           self.rotation_matrices(hw_shape, num_extra, qkv))
        return out.to(qkv.dtype), attn

    def forward_reference(self, x, hw_shape):
        out = self.naive_forward(x, hw_shape)[0]
        if self.residual is not None:
            out = out + naive_inline_residual(x, self.qkv(x), self.residual, self.num_heads,
                                              hw_shape).to(out.dtype)
        return self.project(out)

    def core_macs(self, num_tokens, hw_shape):
        # K^T V and its read-out (N d^2 per head each); key and value means, q^T k_mean and
        # the mean-value term (N d per head each); RoPE on the patch queries and keys; the
        # residual branch: the mean input token, its two grouped 1x1 convs (C d and 9 C d:
        # Conv1d is not among the layers counted from their shapes) and the 3x3 depthwise
        # conv of the patch values
        C, d = self.embed_dims, self.head_dims
        num_patches = hw_shape[0] * hw_shape[1]
        macs = (2 * num_tokens * C * d + 4 * num_tokens * C
                + self.rotation_macs(num_patches))
        if self.residual is not None:
            macs += num_tokens * C + 10 * C * d + 9 * num_patches * C
        return macs

    def extra_repr(self):
        return f'{super().extra_repr()}, residual={self.residual is not None}'
