"""Standard multi-head Softmax attention: the teacher and the reference row."""
import torch
import torch.nn.functional as F
from torch import nn

from .base import (BaseAttention, autocast_disabled, naive_heads, naive_merge_heads,
                   naive_precision, naive_rotate, register_attention)


def naive_softmax_attention(qkv, num_heads, rotations=None, dropout_p=0., training=False):
    """Softmax attention written out from its definition (the O(N^2) oracle of the tests).

    ``A_ij = exp(s q_i^T k_j) / sum_l exp(s q_i^T k_l)`` with ``s = d^-1/2`` (each row
    shifted by its maximum, which cancels), ``out_i = sum_j A_ij v_j``; with RoPE, ``q`` and
    ``k`` are rotated first. No code is shared with :class:`SoftmaxAttention`'s forms (own
    head split, scale, softmax and rotation).

    Args:
        qkv (Tensor): ``(B, N, 3C)`` output of the ``qkv`` projection.
        num_heads (int): heads; ``d = C / num_heads``.
        rotations (Tensor, optional): ``(N, d, d)`` RoPE matrix of every token.
        dropout_p (float): attention dropout on the map, applied when ``training``.

    Returns:
        tuple[Tensor, Tensor]: the output heads merged, ``(B, N, C)`` (before ``proj``), and
        the map before dropout ``(B, heads, N, N)``, both in float32 at least.
    """
    with autocast_disabled(qkv):
        q, k, v = naive_heads(naive_precision(qkv), num_heads)
        if rotations is not None:
            q, k = naive_rotate(rotations, q), naive_rotate(rotations, k)
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1]**-0.5
        weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        attn = weights / weights.sum(dim=-1, keepdim=True)
        dropped = F.dropout(attn, dropout_p, training) if dropout_p else attn
        return naive_merge_heads(dropped @ v), attn


@register_attention('softmax')
class SoftmaxAttention(BaseAttention):
    """``softmax(Q K^T * d^-1/2) V`` per head.

    Parameter names (``qkv``, ``proj``) match mmpretrain's ``MultiheadAttention``
    so DeiT checkpoints load by name.

    RoPE: the patch tokens' queries and keys are rotated before the scores, as in EVA-02
    and DINOv3 (timm rotates in float32 and returns to the values' dtype; so does this).

    Args:
        fused (bool): run ``F.scaled_dot_product_attention`` (flash / memory
            efficient kernels, no N x N map kept). ``False`` selects the explicit
            eager form (``attention_map`` always forms the map).
    """

    has_map = True
    supports_attn_drop = True

    options = BaseAttention.options + ('fused', )
    # SDPA or the explicit product: the same function
    options_outside_the_function = BaseAttention.options_outside_the_function + ('fused', )

    def __init__(self, embed_dims, num_heads, qkv_bias=True, attn_drop=0., proj_drop=0.,
                 rope=None, layer_scale_init_value=0., fused=True):
        super().__init__(embed_dims, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop, rope=rope,
                         layer_scale_init_value=layer_scale_init_value)
        self.qkv = nn.Linear(embed_dims, embed_dims * 3, bias=qkv_bias)
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.fused = fused

    def _softmax_map(self, q, k):
        return ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)

    def _eager(self, q, k, v):
        attn = self._softmax_map(q, k)
        # The returned map is the attention distribution before dropout: that is
        # what map matching compares, and dropout only perturbs training.
        dropped = F.dropout(attn, self.attn_drop, self.training)
        return dropped @ v, attn

    def _fused(self, q, k, v):
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_drop if self.training else 0., scale=self.scale)

    def _heads(self, x, hw_shape):
        """``q, k, v`` heads, queries and keys rotated by RoPE if the operator has it."""
        num_extra = self.num_extra_tokens(x, hw_shape)
        q, k, v = self.split_heads(self.qkv(x))
        rotation = self.rotation(hw_shape, num_extra, q)
        if rotation is not None:
            q, k = rotation.rotate(q).to(v.dtype), rotation.rotate(k).to(v.dtype)
        return q, k, v

    def forward(self, x, hw_shape):
        q, k, v = self._heads(x, hw_shape)
        out = self._fused(q, k, v) if self.fused else self._eager(q, k, v)[0]
        return self.project(self.merge_heads(out))

    def naive_forward(self, x, hw_shape):
        """:func:`naive_softmax_attention` of ``x``: the output heads merged (before ``proj``,
        in the projections' dtype) and the map (float32 at least)."""
        num_extra = self.num_extra_tokens(x, hw_shape)
        qkv = self.qkv(x)
        out, attn = naive_softmax_attention(qkv, self.num_heads,
                                            self.rotation_matrices(hw_shape, num_extra, qkv),
                                            self.attn_drop, self.training)
        return out.to(qkv.dtype), attn

    def forward_reference(self, x, hw_shape):
        return self.project(self.naive_forward(x, hw_shape)[0])

    def attention_map(self, x, hw_shape):
        q, k, _ = self._heads(x, hw_shape)
        return self._softmax_map(q, k)

    def core_macs(self, num_tokens, hw_shape):
        # Q K^T and the map times V: N^2 d per head each; RoPE on the patch queries and keys
        return (2 * num_tokens**2 * self.embed_dims
                + self.rotation_macs(hw_shape[0] * hw_shape[1]))

    def extra_repr(self):
        return f'{super().extra_repr()}, fused={self.fused}'
