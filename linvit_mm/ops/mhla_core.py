"""MHLA's attention and value convolution as one autograd node, run by C++ CPU kernels.

``mhla_attention(qk, v, mixing, conv_weight, conv_bias, heads, hw_shape, layout, floor, eps,
official)`` computes what :class:`~linvit_mm.models.attention.MultiHeadLinearAttention`
computes between its ``qkv`` and ``proj`` layers without RoPE or extra tokens, under either
normaliser: the block summaries, their mixing, the normalised read-out and the
depthwise value convolution (``ops/csrc/mhla_core.cpp`` states the formulas and their
gradients). As PyTorch operations that is about twenty-five calls per block, and at 224 px
their per-call costs made the operator about 1.1x slower than softmax attention on a CPU.

The operator's own PyTorch form (``MultiHeadLinearAttention._mixed_linear`` and the value
convolution) is the one implementation everywhere else: on a GPU, in fp16 / bf16, with RoPE
or extra tokens, while tracing (``torch.export``, ``torch.compile``
and ONNX see plain PyTorch operations), where the kernels did not build, and under
``set_cpu_kernels(False)``. The tests hold the two against each other, outputs and every
gradient.
"""
import torch
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from .extension import cpu_kernels


class _MHLAAttention(Function):

    @staticmethod
    def forward(ctx, qk, v, mixing, conv_weight, conv_bias, heads, hw_shape, layout, floor,
                eps, official):
        H, W = hw_shape
        out, *saved = cpu_kernels().mhla_forward(qk, v, mixing, conv_weight, conv_bias, heads,
                                                 H, W, *layout, floor, eps, official)
        ctx.save_for_backward(qk, v, mixing, *saved)
        ctx.config = heads, H, W, *layout, official
        ctx.has_bias = conv_bias is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        qk, v, mixing, *saved = ctx.saved_tensors
        grad_qk, grad_v, grad_mixing, grad_weight, grad_bias = cpu_kernels().mhla_backward(
            grad_out, saved, qk, v, mixing, *ctx.config)
        return (grad_qk, grad_v, grad_mixing, grad_weight, grad_bias if ctx.has_bias else None,
                None, None, None, None, None, None)


def mhla_attention(qk, v, mixing, conv_weight, conv_bias, heads, hw_shape, layout, floor, eps,
                   official=False):
    """MHLA between ``qkv`` and ``proj``: queries and keys ``qk`` ``(B, H*W, 2C)``, values
    ``v`` ``(B, H*W, C)``, the ``(M, M)`` block ``mixing``, the depthwise value convolution's
    ``(C, 1, K, K)`` weight and ``(C,)`` bias (or None); ``layout`` is the operator's
    ``BlockLayout`` of ``hw_shape``; ``official``: the authors' normaliser (else the
    consistent one). Returns ``(B, H*W, C)``. Only where
    :func:`~linvit_mm.ops.extension.kernels_apply`; without grad mode no autograd node is
    made."""
    if not torch.is_grad_enabled():
        H, W = hw_shape
        return cpu_kernels().mhla_forward(qk, v, mixing, conv_weight, conv_bias, heads, H, W,
                                          *layout, floor, eps, official)[0]
    return _MHLAAttention.apply(qk, v, mixing, conv_weight, conv_bias, heads, tuple(hw_shape),
                                tuple(layout), floor, eps, official)
