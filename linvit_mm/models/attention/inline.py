"""InLine attention (Han et al., NeurIPS 2024, "Bridging the Divide: Reconsidering Softmax
and Linear Attention"), attention-only form.

Identity kernel with subtraction normalisation, ``s = d^-1/2``::

    A_ij  = s/N * q_i^T k_j + 1/N * (1 - s * q_i^T k_mean)      (rows sum to 1)
    out_i = s/N * q_i^T (K^T V) + (1 - s * q_i^T k_mean) * v_mean

Entries of ``A`` may be negative. The official blocks add a local 3x3 residual branch
on the values; the paper's comparison uses the attention alone, and so does this
operator (weight shapes equal Softmax attention).
"""
import torch

from .base import (float32_state, naive_heads, naive_merge_heads, naive_precision, naive_rotate,
                   register_attention)
from .map_attention import LinearMapAttention


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
    with torch.autocast(device_type=qkv.device.type, enabled=False):
        q, k, v = naive_heads(naive_precision(qkv), num_heads)
        if rotations is not None:
            q, k = naive_rotate(rotations, q), naive_rotate(rotations, k)
        num_tokens, head_dims = q.shape[-2], q.shape[-1]
        s = head_dims**-0.5
        k_mean = k.sum(dim=-2, keepdim=True) / num_tokens                  # (B, h, 1, d)
        query_offset = 1 - s * (q * k_mean).sum(dim=-1, keepdim=True)      # (B, h, N, 1)
        attn = (s / num_tokens) * (q @ k.transpose(-2, -1)) + query_offset / num_tokens
        return naive_merge_heads(attn @ v), attn


@register_attention('inline')
class InLineAttention(LinearMapAttention):
    """InLine attention in O(N d^2).

    ``N`` counts every token, the class token included, and the means run over all
    of them, as in the official DeiT model (there ``n`` is the full sequence length
    and ``k.mean`` spans the class token).

    Under autocast the ``d x d`` state ``K^T V``, the token means and the output run
    in float32 with autocast disabled: ``K^T V`` is a sum over N tokens that
    overflows fp16, and ``1 - s * q^T k_mean`` cancels badly in bf16. The result
    returns to the dtype of the projections' output before ``proj``.

    RoPE: queries and keys are rotated before everything else, as in Softmax attention,
    and the map is formed from the rotated ones (``k_mean`` is the mean of the rotated
    keys). InLine has no feature map whose positivity a rotation could break, and its rows
    sum to one by construction for any ``q``, ``k``, so they still do.
    """

    def _linear(self, q, k, v, rotation=None):
        out_dtype = v.dtype
        num_tokens = q.shape[-2]
        with torch.autocast(device_type=v.device.type, enabled=False):
            q, k, v = float32_state(q, k, v)
            if rotation is not None:
                q, k = rotation.rotate(q), rotation.rotate(k)
            kv_state = (k.transpose(-2, -1) @ v) * (self.scale / num_tokens)   # (B, h, d, d)
            k_mean = k.mean(dim=-2).unsqueeze(-1)                              # (B, h, d, 1)
            v_mean = v.mean(dim=-2, keepdim=True)                              # (B, h, 1, d)
            out = q @ kv_state + (1 - self.scale * (q @ k_mean)) * v_mean
        return out.to(out_dtype)

    def _map(self, q, k, rotation=None):
        num_tokens = q.shape[-2]
        with torch.autocast(device_type=q.device.type, enabled=False):
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
        return self.project(self.naive_forward(x, hw_shape)[0])

    def core_macs(self, num_tokens, hw_shape):
        # K^T V and its read-out (N d^2 per head each); key and value means, q^T k_mean and
        # the mean-value term (N d per head each); RoPE on the patch queries and keys
        C, d = self.embed_dims, self.head_dims
        return (2 * num_tokens * C * d + 4 * num_tokens * C
                + self.rotation_macs(hw_shape[0] * hw_shape[1]))
