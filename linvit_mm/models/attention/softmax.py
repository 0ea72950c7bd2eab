"""Standard multi-head Softmax attention: the teacher and the reference row."""
import torch.nn.functional as F
from torch import nn

from .base import BaseAttention, register_attention


@register_attention('softmax')
class SoftmaxAttention(BaseAttention):
    """``softmax(Q K^T * d^-1/2) V`` per head.

    Parameter names (``qkv``, ``proj``) match mmpretrain's ``MultiheadAttention``
    so DeiT checkpoints load by name.

    Args:
        fused (bool): run ``F.scaled_dot_product_attention`` (flash / memory
            efficient kernels, no N x N map kept). ``False`` selects the explicit
            eager form (``attention_map`` always forms the map).
    """

    has_map = True
    supports_attn_drop = True

    def __init__(self, embed_dims, num_heads, qkv_bias=True, attn_drop=0., proj_drop=0.,
                 fused=True):
        super().__init__(embed_dims, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop)
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

    def forward(self, x, hw_shape):
        self.num_extra_tokens(x, hw_shape)
        q, k, v = self.split_heads(self.qkv(x))
        out = self._fused(q, k, v) if self.fused else self._eager(q, k, v)[0]
        return self.proj_drop(self.proj(self.merge_heads(out)))

    def forward_reference(self, x, hw_shape):
        self.num_extra_tokens(x, hw_shape)
        q, k, v = self.split_heads(self.qkv(x))
        out, _ = self._eager(q, k, v)
        return self.proj_drop(self.proj(self.merge_heads(out)))

    def attention_map(self, x, hw_shape):
        self.num_extra_tokens(x, hw_shape)
        q, k, _ = self.split_heads(self.qkv(x))
        return self._softmax_map(q, k)

    def core_macs(self, num_tokens, hw_shape):
        # Q K^T and the map times V: N^2 d per head each
        return 2 * num_tokens**2 * self.embed_dims

    def extra_repr(self):
        return f'{super().extra_repr()}, fused={self.fused}'
