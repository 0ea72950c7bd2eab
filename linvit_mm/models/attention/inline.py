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
from torch import nn

from .base import BaseAttention, float32_state, register_attention


@register_attention('inline')
class InLineAttention(BaseAttention):
    """InLine attention in O(N d^2).

    ``N`` counts every token, the class token included, and the means run over all
    of them, as in the official DeiT model (there ``n`` is the full sequence length
    and ``k.mean`` spans the class token).

    Under autocast the ``d x d`` state ``K^T V``, the token means and the output run
    in float32 with autocast disabled: ``K^T V`` is a sum over N tokens that
    overflows fp16, and ``1 - s * q^T k_mean`` cancels badly in bf16. The result
    returns to the dtype of the projections' output before ``proj``.
    """

    has_map = True

    def __init__(self, embed_dims, num_heads, qkv_bias=True, attn_drop=0., proj_drop=0.):
        super().__init__(embed_dims, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop)
        if attn_drop:
            raise ValueError(f'attn_drop={attn_drop}: InLine attention never forms the N x N '
                             f'map that attention dropout acts on; use attn_drop=0 (proj_drop '
                             f'is supported)')
        self.qkv = nn.Linear(embed_dims, embed_dims * 3, bias=qkv_bias)
        self.proj = nn.Linear(embed_dims, embed_dims)

    def _linear(self, q, k, v):
        out_dtype = v.dtype
        num_tokens = q.shape[-2]
        with torch.autocast(device_type=v.device.type, enabled=False):
            q, k, v = float32_state(q, k, v)
            kv_state = (k.transpose(-2, -1) @ v) * (self.scale / num_tokens)   # (B, h, d, d)
            k_mean = k.mean(dim=-2).unsqueeze(-1)                              # (B, h, d, 1)
            v_mean = v.mean(dim=-2, keepdim=True)                              # (B, h, 1, d)
            out = q @ kv_state + (1 - self.scale * (q @ k_mean)) * v_mean
        return out.to(out_dtype)

    def _inline_map(self, q, k):
        num_tokens = q.shape[-2]
        with torch.autocast(device_type=q.device.type, enabled=False):
            q, k = float32_state(q, k)
            k_mean = k.mean(dim=-2).unsqueeze(-1)
            offset = (1 - self.scale * (q @ k_mean)) / num_tokens             # (B, h, N, 1)
            return (self.scale / num_tokens) * (q @ k.transpose(-2, -1)) + offset

    def _with_map(self, q, k, v):
        attn = self._inline_map(q, k)
        with torch.autocast(device_type=v.device.type, enabled=False):
            out = attn @ float32_state(v)[0]
        return out.to(v.dtype), attn

    def forward(self, x, hw_shape, return_map=False):
        self.num_extra_tokens(x, hw_shape)
        q, k, v = self.split_heads(self.qkv(x))
        if return_map:
            out, attn = self._with_map(q, k, v)
        else:
            out = self._linear(q, k, v)
        out = self.proj_drop(self.proj(self.merge_heads(out)))
        return (out, attn) if return_map else out

    def forward_reference(self, x, hw_shape):
        self.num_extra_tokens(x, hw_shape)
        q, k, v = self.split_heads(self.qkv(x))
        out, _ = self._with_map(q, k, v)
        return self.proj_drop(self.proj(self.merge_heads(out)))

    def attention_map(self, x, hw_shape):
        self.num_extra_tokens(x, hw_shape)
        q, k, _ = self.split_heads(self.qkv(x))
        return self._inline_map(q, k)
