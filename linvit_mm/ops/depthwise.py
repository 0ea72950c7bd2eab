"""3x3 depthwise convolutions on ``(B, H*W, C)`` token grids, with a C++ kernel for the CPU.

ViT^3 (the ``ttt`` operator) runs three small depthwise 3x3 convolutions per block: its
conditional position encoding and the fit and read of its conv inner model, whose kernel is
different for every image. At 224 px oneDNN spends more time setting these calls up (and in
its weight-gradient path) than computing them; ``csrc/depthwise.cpp`` covers all of them,
forward and backward (see ``extension.py`` for the build and the fallback). Its loops take any
odd kernel size: MHLA's fused C++ form (``mhla_core.py``) runs its 5x5 value convolution
with them.

* ``conv_tokens(tokens, weight, hw_shape, flip)``: ``out[p] = sum_t tokens[p + s_t] w[t]``
  with zero padding, weight ``(B or 1, 9, C)`` (tap ``t = 3 * (dy + 1) + (dx + 1)``);
  ``flip`` mirrors the taps (the transposed convolution);
* ``correlate_tokens(a, g, hw_shape)``: ``out[t] = sum_p a[p + s_t] g[p]``, ``(B, 9, C)``:
  the kernel gradient of the first, and the one-step fit of ViT^3's conv inner model;
* ``depthwise3x3_tokens(tokens, taps, hw_shape)``: the first, with autograd for both (InLine's
  local residual branch, whose kernels differ per image);
* ``position_code(tokens, weight, bias, hw_shape)``: ``tokens + conv(tokens) + bias`` with
  autograd, one pass each way (the conditional position encoding; ``(C, 1, 3, 3)`` weight).

``depthwise_conv2d`` is MHLA's value convolution in image layout, for the operator's PyTorch
form (which runs wherever its fused C++ form does not); it has no C++ half, only a backward
made of forward convolutions.

Token tensors need a channel stride of 1 only, so column slices of a fused qkv projection
are used in place.

The two kernels are also PyTorch operators, ``torch.ops.linvit_mm.depthwise3x3`` and
``torch.ops.linvit_mm.correlate3x3`` (``torch.library.custom_op``), with a shape function
for tracing and, for the convolution, a backward: traced (``torch.export``,
``torch.compile``), the functions below call them, so each is one node instead of a trace
into the extension, which cannot run on the tensors tracing uses. Each runs its PyTorch form
where the kernels do not apply, and ``extension.torch_forms()`` maps it to that form for a
graph without linvit_mm operators.
"""
import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from ..utils.tracing import is_tracing
from .extension import cpu_kernels, kernels_apply, register_torch_form, use_cpu_kernels


def kernel_taps(weight):
    """A depthwise ``(C, 1, 3, 3)`` kernel as ``(1, 9, C)`` taps, channels contiguous."""
    return weight.reshape(-1, 9).t().contiguous().unsqueeze(0)


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


# ---- tap-by-tap forms: the operators' decompositions -------------------------------------
# The F.conv2d forms fold the batch into the group count, which ONNX needs to be a constant:
# with a symbolic batch they cannot be exported. A sum of nine shifted products is the same
# function for any batch (it is slower in eager, where the F.conv2d forms stay).

def _shifted(tokens, hw_shape):
    """The nine ``(B, H, W, C)`` views ``tokens[p + s_t]`` of the zero-padded grid, tap order."""
    B, _, C = tokens.shape
    H, W = hw_shape
    padded = F.pad(tokens.reshape(B, H, W, C), (0, 0, 1, 1, 1, 1))
    return [padded[:, dy:dy + H, dx:dx + W] for dy in range(3) for dx in range(3)]


def depthwise3x3_by_taps(tokens, weight, hw_shape):
    """:func:`depthwise3x3_reference` as ``sum_t tokens[p + s_t] w[t]``."""
    B, N, C = tokens.shape
    out = sum(view * weight[:, t, None, None] for t, view in enumerate(_shifted(tokens,
                                                                              hw_shape)))
    return out.reshape(B, N, C)


def correlate3x3_by_taps(a, g, hw_shape):
    """:func:`correlate3x3_reference` as nine products summed over the grid."""
    B, _, C = a.shape
    g = g.reshape(B, *hw_shape, C)
    return torch.stack([(view * g).sum((1, 2)) for view in _shifted(a, hw_shape)], dim=1)


def _depthwise3x3_torch(tokens, taps, bias, residual, H, W, flip, by_taps=False):
    """The PyTorch form of ``linvit_mm::depthwise3x3`` (``by_taps``: the decomposition)."""
    conv = depthwise3x3_by_taps if by_taps else depthwise3x3_reference
    out = conv(tokens, taps.flip(1) if flip else taps, (H, W))
    if residual:
        out = out + tokens
    return out if bias is None else out + bias


def _correlate3x3_torch(a, g, H, W, by_taps=False):
    """The PyTorch form of ``linvit_mm::correlate3x3`` (``by_taps``: the decomposition)."""
    return (correlate3x3_by_taps if by_taps else correlate3x3_reference)(a, g, (H, W))


# ---- the kernels as PyTorch operators ---------------------------------------------------

@torch.library.custom_op('linvit_mm::depthwise3x3', mutates_args=())
def depthwise3x3(tokens: Tensor, taps: Tensor, bias: Optional[Tensor], residual: bool, H: int,
                 W: int, flip: bool) -> Tensor:
    """``residual * tokens + conv(tokens) + bias``: the zero-padded depthwise 3x3 conv of
    ``(B, H*W, C)`` tokens with ``(B or 1, 9, C)`` taps (mirrored if ``flip``), C++ where it
    applies; a contiguous ``(B, H*W, C)`` result."""
    if use_cpu_kernels(tokens, taps) and taps.dtype == tokens.dtype and (
            bias is None or bias.dtype == tokens.dtype):
        return cpu_kernels().depthwise3x3(tokens, taps, bias, residual, H, W, flip)
    return _depthwise3x3_torch(tokens, taps, bias, residual, H, W, flip).contiguous()


@depthwise3x3.register_fake
def _depthwise3x3_shape(tokens, taps, bias, residual, H, W, flip):
    return tokens.new_empty(tokens.shape)


def _depthwise3x3_save(ctx, inputs, output):
    tokens, taps, bias, residual, H, W, flip = inputs
    ctx.save_for_backward(tokens, taps)
    ctx.config = residual, H, W, flip


def _depthwise3x3_backward(ctx, grad_out):
    tokens, taps = ctx.saved_tensors
    residual, H, W, flip = ctx.config
    grad_out = grad_out.contiguous()
    grad_tokens = grad_taps = grad_bias = None
    if ctx.needs_input_grad[0]:
        # the transposed convolution (mirrored taps), plus the residual's gradient, one pass
        grad_tokens = depthwise3x3(grad_out, taps, None, residual, H, W, not flip)
    if ctx.needs_input_grad[1]:
        grad_taps = correlate3x3(tokens, grad_out, H, W)
        if flip:
            grad_taps = grad_taps.flip(1)
        if taps.shape[0] == 1:
            # one kernel shared by every image
            grad_taps = grad_taps.sum(0, keepdim=True)
    if ctx.needs_input_grad[2]:
        grad_bias = grad_out.sum((0, 1))
    return grad_tokens, grad_taps, grad_bias, None, None, None, None


depthwise3x3.register_autograd(_depthwise3x3_backward, setup_context=_depthwise3x3_save)
register_torch_form(torch.ops.linvit_mm.depthwise3x3.default,
                    functools.partial(_depthwise3x3_torch, by_taps=True))


@torch.library.custom_op('linvit_mm::correlate3x3', mutates_args=())
def correlate3x3(a: Tensor, g: Tensor, H: int, W: int) -> Tensor:
    """``out[b, t, c] = sum_p a[b, p + s_t, c] g[b, p, c]``, a contiguous ``(B, 9, C)``, C++
    where it applies; no backward."""
    if use_cpu_kernels(a, g) and a.dtype == g.dtype:
        return cpu_kernels().correlate3x3(a, g, H, W)
    return _correlate3x3_torch(a, g, H, W).contiguous()


@correlate3x3.register_fake
def _correlate3x3_shape(a, g, H, W):
    return a.new_empty(a.shape[0], 9, a.shape[2])


register_torch_form(torch.ops.linvit_mm.correlate3x3.default,
                    functools.partial(_correlate3x3_torch, by_taps=True))


# ---- eager calls ------------------------------------------------------------------------
# Eager code calls the kernels directly, not through the operators: the dispatcher's Python
# layer costs about 0.1 ms per call (0.6 ms with autograd), about 2 % (forward) and 4 %
# (training step) of a ViT-S ttt backbone at 224 px on a CPU. Only traced code
# (``is_tracing``) takes the operators. Both run the same kernels and PyTorch forms.

def conv_tokens(tokens, weight, hw_shape, flip=False):
    """The zero-padded depthwise conv of ``(B, H*W, C)`` tokens with ``(B or 1, 9, C)`` taps,
    without autograd (C++ where it applies); ``flip`` mirrors the taps, which makes it the
    transposed convolution."""
    if is_tracing():
        return depthwise3x3(tokens, weight, None, False, *hw_shape, flip)
    if use_cpu_kernels(tokens, weight):
        return cpu_kernels().depthwise3x3(tokens, weight, None, False, *hw_shape, flip)
    return depthwise3x3_reference(tokens, weight.flip(1) if flip else weight, hw_shape)


def correlate_tokens(a, g, hw_shape):
    """``out[b, t, c] = sum_p a[b, p + s_t, c] g[b, p, c]``, ``(B, 9, C)``, without autograd
    (C++ where it applies)."""
    if is_tracing():
        return correlate3x3(a, g, *hw_shape)
    if use_cpu_kernels(a, g):
        return cpu_kernels().correlate3x3(a, g, *hw_shape)
    return correlate3x3_reference(a, g, hw_shape)


class _ConvTokens(Function):
    """The depthwise 3x3 conv of ``(B, H*W, C)`` tokens with ``(B or 1, 9, C)`` taps, both
    differentiable, in one pass of the C++ kernel each way."""

    @staticmethod
    def forward(ctx, tokens, taps, H, W):
        ctx.save_for_backward(tokens, taps)
        ctx.hw = H, W
        return cpu_kernels().depthwise3x3(tokens, taps, None, False, H, W, False)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        tokens, taps = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_tokens = grad_taps = None
        if ctx.needs_input_grad[0]:
            # the transposed convolution: mirrored taps
            grad_tokens = cpu_kernels().depthwise3x3(grad_out, taps, None, False, *ctx.hw, True)
        if ctx.needs_input_grad[1]:
            grad_taps = correlate_tokens(tokens, grad_out, ctx.hw)
            if taps.shape[0] == 1:
                grad_taps = grad_taps.sum(0, keepdim=True)
        return grad_tokens, grad_taps, None, None


def depthwise3x3_tokens(tokens, taps, hw_shape):
    """:func:`conv_tokens` with autograd for both the tokens and the taps (InLine's per-image
    kernels): one C++ pass each way where the kernels apply, the ``F.conv2d`` form
    elsewhere."""
    if is_tracing():
        return depthwise3x3(tokens, taps, None, False, *hw_shape, False)
    if kernels_apply(tokens, taps):
        return _ConvTokens.apply(tokens, taps, *hw_shape)
    return depthwise3x3_reference(tokens, taps, hw_shape)


class _PositionCode(Function):
    """``tokens + conv(tokens) + bias`` in one pass of the C++ kernel, and its gradients. The
    ``(C, 1, 3, 3)`` kernel is laid out as taps here, out of autograd's sight."""

    @staticmethod
    def forward(ctx, tokens, weight, bias, H, W):
        taps = kernel_taps(weight)
        ctx.save_for_backward(tokens, taps)
        ctx.hw = H, W
        return cpu_kernels().depthwise3x3(tokens, taps, bias, True, H, W, False)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        tokens, taps = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_tokens = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # the residual's gradient plus the transposed convolution's, in one pass
            grad_tokens = cpu_kernels().depthwise3x3(grad_out, taps, None, True, *ctx.hw, True)
        if ctx.needs_input_grad[1]:
            grad_weight = correlate_tokens(tokens, grad_out, ctx.hw).sum(0).t()
            grad_weight = grad_weight.reshape(-1, 1, 3, 3)
        if ctx.needs_input_grad[2]:
            grad_bias = grad_out.sum((0, 1))
        return grad_tokens, grad_weight, grad_bias, None, None


def position_code(tokens, weight, bias, hw_shape):
    """``tokens + dwconv3x3(tokens) + bias`` on a ``(B, H*W, C)`` grid: a conditional position
    encoding with a depthwise ``(C, 1, 3, 3)`` kernel ``weight`` and ``(C,)`` ``bias``, one
    pass of the C++ kernel each way where it applies."""
    H, W = hw_shape
    if tokens.dim() != 3 or tokens.shape[1] != H * W:
        raise ValueError(f'tokens must be (B, H*W, C) for the grid {H}x{W}, got '
                         f'{tuple(tokens.shape)}')
    C = tokens.shape[2]
    if weight.shape != (C, 1, 3, 3) or bias.shape != (C, ):
        raise ValueError(f'weight must be ({C}, 1, 3, 3) and bias ({C},), got '
                         f'{tuple(weight.shape)} and {tuple(bias.shape)}')
    if is_tracing():
        return depthwise3x3(tokens, kernel_taps(weight), bias, True, H, W, False)
    if kernels_apply(tokens, weight, bias):
        if torch.is_grad_enabled():
            return _PositionCode.apply(tokens, weight, bias, H, W)
        # inference: the kernel alone, no autograd node
        return cpu_kernels().depthwise3x3(tokens, kernel_taps(weight), bias, True, H, W, False)
    return tokens + depthwise3x3_reference(tokens, kernel_taps(weight), hw_shape) + bias


# ---- any odd kernel size, image layout (MHLA's value convolution) ----------------------

class _DepthwiseConv2d(Function):
    """Stride-1 depthwise convolution whose backward is made of forward convolutions.

    oneDNN's depthwise backward on CPU is slow for a 5 x 5 kernel (about 15x the forward
    at 14 x 14 x 384, 3x at 64 x 64). The input gradient is the correlation of the output
    gradient with the flipped kernel, and the weight gradient correlates each channel of
    the input with that channel of the output gradient (a grouped convolution whose
    kernel is the output gradient); both run as forward kernels, and being ordinary ops
    they differentiate again.
    """

    @staticmethod
    def forward(ctx, image, weight, bias, padding):
        ctx.save_for_backward(image, weight)
        ctx.padding = padding
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.conv2d(image, weight, bias, padding=padding, groups=image.shape[1])

    @staticmethod
    def backward(ctx, grad_out):
        image, weight = ctx.saved_tensors
        B, C, H, W = image.shape
        padding, kernel = ctx.padding, weight.shape[-1]
        # Under autocast the forward ran in the output's dtype whatever the parameters'
        # dtype; the backward (outside autocast) computes in that dtype and returns each
        # gradient in its input's dtype.
        dtype = grad_out.dtype
        grad_image = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_image = F.conv2d(grad_out, weight.to(dtype).flip(-2, -1),
                                  padding=kernel - 1 - padding, groups=C).to(image.dtype)
        if ctx.needs_input_grad[1]:
            # group c: input channels (c, b) for every image b, kernel grad_out[b, c]
            grad_weight = F.conv2d(image.to(dtype).transpose(0, 1).reshape(1, C * B, H, W),
                                   grad_out.transpose(0, 1), padding=padding, groups=C)
            grad_weight = grad_weight.view(weight.shape).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = grad_out.sum(dim=(0, 2, 3)).to(ctx.bias_dtype)
        return grad_image, grad_weight, grad_bias, None


def depthwise_conv2d(image, weight, bias, padding):
    """``F.conv2d(image, weight, bias, padding=padding, groups=C)`` (stride 1) whose backward
    runs as forward convolutions, see :class:`_DepthwiseConv2d`."""
    return _DepthwiseConv2d.apply(image, weight, bias, padding)
