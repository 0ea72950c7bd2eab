"""Kernelised linear attention (Katharopoulos et al., ICML 2020, "Transformers are RNNs").

``out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j) + eps)``: the
``d x d`` key-value state and the ``d`` normaliser are summed once over the tokens, so
the cost is O(N d^2) and no N x N map is formed. ``elu`` and ``relu`` differ only in
the feature map ``phi``.
"""
import torch
import torch.nn.functional as F

from ...ops.linear_attention import fused_applies, normalised_linear_attention
from .base import (autocast_disabled, float32_state, naive_heads, naive_merge_heads,
                   naive_precision, naive_rotate, register_attention, state_inputs)
from .map_attention import LinearMapAttention


def elu_feature_map(x):
    """``elu(x) + 1``: strictly positive, so every normaliser is positive.

    Computed as ``relu(x) + exp(x - relu(x))``, the same function (``x + 1`` above 0,
    ``exp(x)`` below) with the same gradient everywhere, 1 at 0 included. PyTorch's CPU
    elu evaluates ``expm1`` without vectorisation, about 15x slower than ``exp``; at 4096
    tokens it cost a ViT-S as much as its whole attention core. ``threshold`` is relu
    with a backward that reads its input, and no backward here reads an output, so the
    updates are in place. Mixed-layout elementwise ops are slow, so a strided head view
    is made contiguous first.
    """
    x = x.contiguous()
    positive = F.threshold(x, 0., 0.)
    return positive.add_((x - positive).exp_())


def relu_feature_map(x):
    return F.relu(x)


FEATURE_MAPS = {'elu': elu_feature_map, 'relu': relu_feature_map}

# The oracle's feature maps, written from their definitions (``exp`` is clamped so that the
# branch ``where`` discards cannot overflow and poison the gradient with ``0 * inf``).
NAIVE_FEATURE_MAPS = {
    'elu': lambda x: torch.where(x > 0, x + 1, torch.exp(x.clamp_max(0))),
    'relu': lambda x: x.clamp_min(0),
}


def naive_kernel_attention(qkv, num_heads, feature_map, eps, rotations=None):
    """Kernel attention written out from its definition (the O(N^2) oracle of the tests).

    ``A_ij = (R_i phi(q_i))^T (R_j phi(k_j)) / (sum_l phi(q_i)^T phi(k_l) + eps)`` and
    ``out_i = sum_j A_ij v_j``, with the whole N x N map formed and the normaliser of each
    query summed over every key from the unrotated scores. It shares no code with
    :class:`KernelAttention`'s fast form: its own head split, feature maps and rotation.

    Args:
        qkv (Tensor): ``(B, N, 3C)`` output of the ``qkv`` projection.
        num_heads (int): heads; ``d = C / num_heads``.
        feature_map (str): ``'elu'`` (``elu(x) + 1``) or ``'relu'``.
        eps (float): added to each normaliser.
        rotations (Tensor, optional): ``(N, d, d)`` RoPE matrix of every token.

    Returns:
        tuple[Tensor, Tensor]: the output heads merged, ``(B, N, C)`` (before ``proj``), and
        the map ``(B, heads, N, N)``, both in float32 at least.
    """
    phi = NAIVE_FEATURE_MAPS[feature_map]
    with autocast_disabled(qkv):
        q, k, v = naive_heads(naive_precision(qkv), num_heads)
        phi_q, phi_k = phi(q), phi(k)
        normaliser = (phi_q @ phi_k.transpose(-2, -1)).sum(dim=-1, keepdim=True) + eps
        if rotations is not None:
            phi_q, phi_k = naive_rotate(rotations, phi_q), naive_rotate(rotations, phi_k)
        attn = (phi_q @ phi_k.transpose(-2, -1)) / normaliser
        return naive_merge_heads(attn @ v), attn


class KernelAttention(LinearMapAttention):
    """Linear attention ``phi(Q) (phi(K)^T V)`` with a row normaliser.

    Weight shapes equal Softmax attention, so Softmax checkpoints load by name.
    Queries and keys are not scaled by ``d^-1/2``: the normaliser cancels any
    positive scale of ``phi(q)``, and relu is positively homogeneous so a key scale
    cancels too; Softmax's temperature has no counterpart here.

    Under autocast the fast form runs with autocast disabled, in bf16 as the projections give it
    (products and sums accumulate in float32; only the stored state rounds to bf16) or in
    float32 for fp16 (a sum over N tokens overflows fp16); the result returns to the dtype of
    the projections' output before ``proj``.

    RoPE (RoFormer, Su et al., Sec. 3.4.3): the rotation acts on the features, in the
    numerator only,
    ``out_i = (R_i phi(q_i))^T sum_j (R_j phi(k_j)) v_j^T / (phi(q_i)^T sum_j phi(k_j) + eps)``.
    Rotating ``q``, ``k`` before ``phi`` would not be a rotation of the scores at all (phi is
    not equivariant), and a rotated normaliser could vanish or turn negative; the
    un-rotated one stays positive, so a row is still a weighted sum with positive total
    weight in its denominator. Still O(N d^2): ``sum_j (R_j phi(k_j)) v_j^T`` is one
    ``d x d`` state. The map (``attention_map``) is ``A_ij = (R_i phi(q_i))^T (R_j phi(k_j))
    / (phi(q_i)^T sum_l phi(k_l) + eps)``; its rows no longer sum to one.

    On CUDA (without RoPE) the core runs as the fused Triton kernels of
    :mod:`linvit_mm.ops.linear_attention`: q, k and v read once per pass in their dtype (bf16
    under autocast), products accumulated and the state kept in float32; ``fused=False`` (or
    ``LINVIT_MM_FUSED=0``) keeps the PyTorch form, the same function.

    Args:
        feature_map (str): ``'elu'`` (``elu(x) + 1``) or ``'relu'``.
        eps (float): added to the normaliser. relu can zero a whole query (all its
            components negative) or every key in a head, making ``0 / 0``; with
            ``eps`` such a row reads zero instead of NaN. 1e-6 is far below the
            typical normaliser (a sum of N positive products, O(N)) and is
            representable in bf16 and float32 alike.
        fused (bool): use the fused kernels where they apply (CUDA, no RoPE).
    """

    options = LinearMapAttention.options + ('feature_map', 'eps', 'fused')
    # the fused kernels compute the same function
    options_outside_the_function = LinearMapAttention.options_outside_the_function + (
        'fused', )

    def __init__(self, embed_dims, num_heads, qkv_bias=True, attn_drop=0., proj_drop=0.,
                 rope=None, layer_scale_init_value=0., feature_map='relu', eps=1e-6,
                 fused=True):
        super().__init__(embed_dims, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop, rope=rope,
                         layer_scale_init_value=layer_scale_init_value)
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f'unknown feature_map {feature_map!r}; valid feature maps are: '
                             f'{", ".join(sorted(FEATURE_MAPS))}')
        if not eps > 0:
            raise ValueError(f'eps must be positive (it keeps all-zero relu rows finite), '
                             f'got {eps}')
        self.feature_map = feature_map
        self.eps = eps
        self.fused = fused

    def _features(self, q, k):
        phi = FEATURE_MAPS[self.feature_map]
        return phi(q), phi(k)

    def _linear(self, q, k, v, rotation=None):
        if rotation is None and self.fused and fused_applies(q, k, v):
            # one Triton kernel per pass, in the heads' dtype with float32 accumulation
            return normalised_linear_attention(q, k, v, self.eps, self.feature_map, fused=True)
        out_dtype = v.dtype
        with autocast_disabled(v):
            q, k, v = state_inputs(q, k, v)
            q, k = self._features(q, k)
            normaliser = q @ k.sum(dim=-2).unsqueeze(-1)        # (B, h, N, 1)
            if rotation is not None:
                q, k = rotation.rotate(q), rotation.rotate(k)
            kv_state = k.transpose(-2, -1) @ v                  # (B, h, d, d)
            out = (q @ kv_state) / (normaliser + self.eps)
        return out.to(out_dtype)

    def _map(self, q, k, rotation=None):
        """Row-normalised ``phi(q) phi(k)^T`` (numerator rotated by RoPE, if any), in float32:
        the map the distillation reads."""
        with autocast_disabled(q):
            q, k = float32_state(q, k)
            q, k = self._features(q, k)
            scores = q @ k.transpose(-2, -1)
            normaliser = scores.sum(dim=-1, keepdim=True) + self.eps
            if rotation is not None:
                scores = rotation.rotate(q) @ rotation.rotate(k).transpose(-2, -1)
            return scores / normaliser

    def naive_forward(self, x, hw_shape):
        """:func:`naive_kernel_attention` of ``x``: the output heads merged (before ``proj``, in
        the projections' dtype) and the map (float32 at least)."""
        num_extra = self.num_extra_tokens(x, hw_shape)
        qkv = self.qkv(x)
        out, attn = naive_kernel_attention(qkv, self.num_heads, self.feature_map, self.eps,
                                           self.rotation_matrices(hw_shape, num_extra, qkv))
        return out.to(qkv.dtype), attn

    def forward_reference(self, x, hw_shape):
        return self.project(self.naive_forward(x, hw_shape)[0])

    def core_macs(self, num_tokens, hw_shape):
        # the d x d state and its read-out: N d^2 per head each; normaliser sum and read;
        # RoPE on the patch tokens' features
        C, d = self.embed_dims, self.head_dims
        return (2 * num_tokens * C * d + 2 * num_tokens * C
                + self.rotation_macs(hw_shape[0] * hw_shape[1]))

    def extra_repr(self):
        return f'{super().extra_repr()}, feature_map={self.feature_map!r}, eps={self.eps}'


@register_attention('elu')
class ELUAttention(KernelAttention):
    """Linear attention with ``phi = elu(x) + 1`` (Katharopoulos et al. 2020)."""

    options = LinearMapAttention.options + ('eps', 'fused')

    def __init__(self, embed_dims, num_heads, qkv_bias=True, attn_drop=0., proj_drop=0.,
                 rope=None, layer_scale_init_value=0., eps=1e-6, fused=True):
        super().__init__(embed_dims, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop, rope=rope,
                         layer_scale_init_value=layer_scale_init_value, feature_map='elu',
                         eps=eps, fused=fused)


@register_attention('relu')
class ReLUAttention(KernelAttention):
    """Linear attention with ``phi = relu(x)``."""

    options = LinearMapAttention.options + ('eps', 'fused')

    def __init__(self, embed_dims, num_heads, qkv_bias=True, attn_drop=0., proj_drop=0.,
                 rope=None, layer_scale_init_value=0., eps=1e-6, fused=True):
        super().__init__(embed_dims, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop, rope=rope,
                         layer_scale_init_value=layer_scale_init_value, feature_map='relu',
                         eps=eps, fused=fused)
