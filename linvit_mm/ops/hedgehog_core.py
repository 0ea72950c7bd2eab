"""Hedgehog attention's fast form as one autograd node, run by C++ CPU kernels.

``hedgehog_attention(q, k, v, map_q, map_k, softmax_map)`` computes what
:class:`~linvit_mm.models.attention.HedgehogAttention`'s fast form computes from the
``(B, heads, N, d)`` heads and the feature maps ``W`` of the queries and of the keys
(``ops/csrc/hedgehog_core.cpp`` states the formulas and their gradients): as PyTorch
operations about twenty calls per block, which at 224 px made the operator about 1.15x
slower than softmax attention on a CPU. With the softmax map, a head whose features stay in
the type's range skips the log form's shift and its second round of exponentials (the
probability form, exact there); the others keep the log form.

The operator's own PyTorch form (``HedgehogAttention._linear``) serves everywhere else: on a
GPU, in fp16 / bf16, while tracing, where the kernels did not build and under
``set_cpu_kernels(False)``. The tests hold the two against each other, outputs and every
gradient, and the C++ form against finite differences.
"""
import torch
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from .extension import cpu_kernels


class _HedgehogAttention(Function):

    @staticmethod
    def forward(ctx, q, k, v, map_q, map_k, softmax_map):
        out, *saved = cpu_kernels().hedgehog_forward(q, k, v, map_q, map_k, softmax_map)
        ctx.save_for_backward(q, k, v, map_q, map_k, *saved)
        ctx.softmax_map = softmax_map
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, map_q, map_k, *saved = ctx.saved_tensors
        grads = cpu_kernels().hedgehog_backward(grad_out.contiguous(), saved, q, k, v, map_q,
                                                map_k, ctx.softmax_map)
        return (*grads, None)


def hedgehog_attention(q, k, v, map_q, map_k, softmax_map):
    """The output heads ``(B, heads, N, d)`` of Hedgehog attention on ``q, k, v`` heads with
    the queries' and keys' ``(heads, d, d)`` maps ``W`` (one tensor twice for tied maps);
    ``softmax_map``: each half of the log-features is a log-softmax (the ``'softmax'`` map,
    else ``'exp'``). Only where :func:`~linvit_mm.ops.extension.kernels_apply`; without grad
    mode no autograd node is made."""
    if not torch.is_grad_enabled():
        return cpu_kernels().hedgehog_forward(q, k, v, map_q, map_k, softmax_map)[0]
    return _HedgehogAttention.apply(q, k, v, map_q, map_k, softmax_map)
