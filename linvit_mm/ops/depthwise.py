"""3x3 depthwise convolutions on ``(B, H*W, C)`` token grids, with a C++ kernel for the CPU.

ViT^3 (the ``ttt`` operator) runs three small depthwise 3x3 convolutions per block: its
conditional position encoding and the fit and read of its conv inner model, whose kernel is
different for every image. At 224 px oneDNN spends more time setting these calls up (and in
its weight-gradient path) than computing them; ``csrc/depthwise3x3.cpp`` covers all of them,
forward and backward (see ``extension.py`` for the build and the fallback).

* ``conv_tokens(tokens, weight, hw_shape, flip)``: ``out[p] = sum_t tokens[p + s_t] w[t]``
  with zero padding, weight ``(B or 1, 9, C)`` (tap ``t = 3 * (dy + 1) + (dx + 1)``);
  ``flip`` mirrors the taps (the transposed convolution);
* ``correlate_tokens(a, g, hw_shape)``: ``out[t] = sum_p a[p + s_t] g[p]``, ``(B, 9, C)``:
  the kernel gradient of the first, and the one-step fit of ViT^3's conv inner model;
* ``depthwise3x3``: ``conv_tokens`` with autograd (the conditional position encoding).

Token tensors need a channel stride of 1 only, so column slices of a fused qkv projection
are used in place.
"""
import torch.nn.functional as F
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from .extension import cpu_kernels, use_cpu_kernels


# ---- F.conv2d forms: the fallback and the tests' oracle ---------------------------------

def _image(tokens, hw_shape):
    """``(B, H*W, C)`` -> ``(1, B*C, H, W)``: images and channels as one grouped conv."""
    B, _, C = tokens.shape
    return tokens.transpose(1, 2).reshape(1, B * C, *hw_shape)


def depthwise3x3_reference(tokens, weight, hw_shape):
    B, N, C = tokens.shape
    kernel = weight.expand(B, 9, C).transpose(1, 2).reshape(B * C, 1, 3, 3)
    out = F.conv2d(_image(tokens, hw_shape), kernel, padding=1, groups=B * C)
    return out.reshape(B, C, N).transpose(1, 2)


def correlate3x3_reference(a, g, hw_shape):
    B, _, C = a.shape
    out = F.conv2d(_image(a, hw_shape), _image(g, hw_shape).transpose(0, 1), padding=1,
                   groups=B * C)
    return out.reshape(B, C, 9).transpose(1, 2)


def conv_tokens(tokens, weight, hw_shape, flip=False):
    """``depthwise3x3`` without autograd (C++ where it applies); ``flip`` mirrors the taps,
    which makes it the transposed convolution."""
    if use_cpu_kernels(tokens, weight):
        return cpu_kernels().depthwise3x3(tokens, weight, *hw_shape, flip)
    return depthwise3x3_reference(tokens, weight.flip(1) if flip else weight, hw_shape)


def correlate_tokens(a, g, hw_shape):
    """``correlate3x3`` without autograd (C++ where it applies)."""
    if use_cpu_kernels(a, g):
        return cpu_kernels().correlate3x3(a, g, *hw_shape)
    return correlate3x3_reference(a, g, hw_shape)


# ---- with autograd ----------------------------------------------------------------------

class _Depthwise3x3(Function):

    @staticmethod
    def forward(ctx, tokens, weight, H, W):
        ctx.save_for_backward(tokens, weight)
        ctx.hw = H, W
        return conv_tokens(tokens, weight, (H, W))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        tokens, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_tokens = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_tokens = conv_tokens(grad_out, weight, ctx.hw, flip=True)
        if ctx.needs_input_grad[1]:
            grad_weight = correlate_tokens(tokens, grad_out, ctx.hw)
            if weight.shape[0] == 1:
                grad_weight = grad_weight.sum(0, keepdim=True)
        return grad_tokens, grad_weight, None, None


def _check(tokens, hw_shape, name='tokens'):
    H, W = hw_shape
    if tokens.dim() != 3 or tokens.shape[1] != H * W:
        raise ValueError(f'{name} must be (B, H*W, C) for the grid {H}x{W}, got '
                         f'{tuple(tokens.shape)}')


def depthwise3x3(tokens, weight, hw_shape):
    """Zero-padded 3x3 depthwise conv of ``(B, H*W, C)`` tokens; weight ``(B or 1, 9, C)``."""
    _check(tokens, hw_shape)
    if weight.dim() != 3 or weight.shape[1:] != (9, tokens.shape[2]) or \
            weight.shape[0] not in (1, tokens.shape[0]):
        raise ValueError(f'weight must be (1 or {tokens.shape[0]}, 9, {tokens.shape[2]}), got '
                         f'{tuple(weight.shape)}')
    if use_cpu_kernels(tokens, weight) and tokens.dtype == weight.dtype:
        return _Depthwise3x3.apply(tokens, weight, *hw_shape)
    return depthwise3x3_reference(tokens, weight, hw_shape)
