"""3x3 depthwise convolutions on ``(B, H*W, C)`` token grids.

ViT^3 (the ``ttt`` operator) runs three small depthwise 3x3 convolutions per block: its
conditional position encoding and the fit and read of its conv inner model, whose kernel is
different for every image; InLine's local residual branch convolves every image with kernels
of its own.

* ``depthwise3x3_tokens(tokens, taps, hw_shape)``: ``out[p] = sum_t tokens[p + s_t] w[t]``
  with zero padding, taps ``(B or 1, 9, C)`` (tap ``t = 3 * (dy + 1) + (dx + 1)``), with
  autograd for both;
* the correlation ``out[t] = sum_p a[p + s_t] g[p]``, ``(B, 9, C)``: the kernel gradient of
  the first, and the one-step fit of ViT^3's conv inner model;
* ``position_code(tokens, weight, bias, hw_shape)``: ``tokens + conv(tokens) + bias`` (the
  conditional position encoding; ``(C, 1, 3, 3)`` weight).

Each comes in two PyTorch forms. The ``F.conv2d`` forms fold the images into the group count
of one grouped convolution; ONNX needs that count to be a constant, so with a symbolic batch
they cannot be exported. The tap-by-tap forms (a sum of nine shifted products) are the same
function for any batch, and inductor fuses their nine passes into one. The convolution runs
as ``F.conv2d`` in eager code (one cuDNN / oneDNN call) and tap by tap in traced code. The
correlation always runs tap by tap: as a grouped convolution its kernel is a whole image
(64 x 64 at 1024 px), which convolution libraries are not written for.

Token tensors need a channel stride of 1 only, so column slices of a fused qkv projection
are used in place.
"""
import torch
import torch.nn.functional as F

from ..utils.tracing import is_tracing


def kernel_taps(weight):
    """A depthwise ``(C, 1, 3, 3)`` kernel as ``(1, 9, C)`` taps, channels contiguous."""
    return weight.reshape(-1, 9).t().contiguous().unsqueeze(0)


# ---- F.conv2d forms ----------------------------------------------------------------------

def _image(tokens, hw_shape):
    """``(B, H*W, C)`` -> ``(1, B*C, H, W)``: images and channels as one grouped conv."""
    B, _, C = tokens.shape
    return tokens.transpose(1, 2).reshape(1, B * C, *hw_shape)


def depthwise3x3_reference(tokens, weight, hw_shape):
    B, N, C = tokens.shape
    if tokens.numel() == 0:  # F.conv2d refuses a group count or an image of size 0
        return depthwise3x3_by_taps(tokens, weight, hw_shape)
    kernel = weight.expand(B, 9, C).transpose(1, 2).reshape(B * C, 1, 3, 3)
    out = F.conv2d(_image(tokens, hw_shape), kernel, padding=1, groups=B * C)
    return out.reshape(B, C, N).transpose(1, 2)


def correlate3x3_reference(a, g, hw_shape):
    B, _, C = a.shape
    out = F.conv2d(_image(a, hw_shape), _image(g, hw_shape).transpose(0, 1), padding=1,
                   groups=B * C)
    return out.reshape(B, C, 9).transpose(1, 2)


# ---- tap-by-tap forms --------------------------------------------------------------------

def _shifted(tokens, hw_shape):
    """The nine ``(B, H, W, C)`` views ``tokens[p + s_t]`` of the zero-padded grid, tap order."""
    B, _, C = tokens.shape
    H, W = hw_shape
    padded = F.pad(tokens.reshape(B, H, W, C), (0, 0, 1, 1, 1, 1))
    return [padded[:, dy:dy + H, dx:dx + W] for dy in range(3) for dx in range(3)]


def depthwise3x3_by_taps(tokens, weight, hw_shape):
    """:func:`depthwise3x3_reference` as ``sum_t tokens[p + s_t] w[t]``."""
    B, N, C = tokens.shape
    views = _shifted(tokens, hw_shape)
    out = sum(view * weight[:, t, None, None] for t, view in enumerate(views))
    return out.reshape(B, N, C)


def correlate3x3_by_taps(a, g, hw_shape):
    """:func:`correlate3x3_reference` as nine products summed over the grid."""
    B, _, C = a.shape
    g = g.reshape(B, *hw_shape, C)
    return torch.stack([(view * g).sum((1, 2)) for view in _shifted(a, hw_shape)], dim=1)


# ---- what the operators call -------------------------------------------------------------

def depthwise3x3_tokens(tokens, taps, hw_shape):
    """The zero-padded depthwise 3x3 conv of ``(B, H*W, C)`` tokens with ``(B or 1, 9, C)``
    taps, differentiable in both: ``F.conv2d`` in eager code, tap by tap when traced."""
    if is_tracing():
        return depthwise3x3_by_taps(tokens, taps, hw_shape)
    return depthwise3x3_reference(tokens, taps, hw_shape)


def position_code(tokens, weight, bias, hw_shape):
    """``tokens + dwconv3x3(tokens) + bias`` on a ``(B, H*W, C)`` grid: a conditional position
    encoding with a depthwise ``(C, 1, 3, 3)`` kernel ``weight`` and ``(C,)`` ``bias``."""
    H, W = hw_shape
    if tokens.dim() != 3 or tokens.shape[1] != H * W:
        raise ValueError(f'tokens must be (B, H*W, C) for the grid {H}x{W}, got '
                         f'{tuple(tokens.shape)}')
    C = tokens.shape[2]
    if weight.shape != (C, 1, 3, 3) or bias.shape != (C, ):
        raise ValueError(f'weight must be ({C}, 1, 3, 3) and bias ({C},), got '
                         f'{tuple(weight.shape)} and {tuple(bias.shape)}')
    return tokens + depthwise3x3_tokens(tokens, kernel_taps(weight), hw_shape) + bias
