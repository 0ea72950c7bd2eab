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

from .base import float32_state, register_attention
from .map_attention import LinearMapAttention


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

    def core_macs(self, num_tokens, hw_shape):
        # K^T V and its read-out (N d^2 per head each); key and value means, q^T k_mean and
        # the mean-value term (N d per head each); RoPE on the patch queries and keys
        C, d = self.embed_dims, self.head_dims
        return (2 * num_tokens * C * d + 4 * num_tokens * C
                + self.rotation_macs(hw_shape[0] * hw_shape[1]))
