"""The fast form of ViT^3's inner step: one autograd node with a hand-written backward.

``ttt_inner_step(qkv, w1, w2, w3, ...)`` maps a block's fused ``qkv`` projection to the
concatenated readouts of its two inner models (``ttt.py`` states the model and the inner
loss; ``TTTAttention.forward_reference`` takes the same step with autograd and is the oracle
the tests hold this to). Written as tensor operations with autograd the step is about forty
nodes per block, each keeping its inputs; here the forward keeps what the backward needs
(no copy of q, k, v: the backward reads them from qkv) and the backward is written out.

Traced code (``torch.export``, ``torch.compile``) takes the step as the PyTorch operator
``torch.ops.linvit_mm.ttt_inner_forward`` with its backward ``linvit_mm::ttt_inner_backward``
(``torch.library.custom_op``), one node each, which ``torch_forms()`` replaces by the PyTorch
form; eager code calls the same forward and backward without the dispatcher, whose Python
layer costs about 0.1 ms per call (0.6 ms with autograd).

Notation (per image and head; ``n`` tokens; ``c = n / scale``):

    z = k [W1 | W2],  g = sig(z2),  T = [v silu(z2) | z1 v silu'(z2)],  G = k^T T
    W' = [W1 | W2] + G / (||G|| + c)          (column norms; the normalised step)
    p = q W',  out = p1 silu(p2)

and for the conv inner model (``corr`` the tap correlation, ``conv`` the depthwise conv,
``c3 = H W / scale``):

    G3 = corr(k3, v3),  W3' = W3 + G3 / (||G3|| + c3),  out3 = conv(q3, W3')

Gradient of the step: with ``r = ||G|| + c`` per column,
``d(G / r) . D = D / r - G (sum_rows D G) / (r^2 ||G||)`` (the second term vanishes with G);
``G = k^T T`` gives ``dk = T dG^T``, ``dT = k dG``; ``z = k W`` gives ``dk += dz W^T``,
``dW = k^T dz``.
"""
import functools

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from .depthwise import (correlate3x3_by_taps, depthwise3x3_by_taps, depthwise3x3_reference,
                        kernel_taps)
from ..utils.tracing import is_tracing
from .forms import register_torch_form


def _untaps(tap_grad):
    """The gradient of ``kernel_taps``: ``(1, 9, C)`` -> ``(C, 1, 3, 3)``."""
    return tap_grad[0].t().reshape(-1, 1, 3, 3)


def _heads(qkv, heads, d):
    """Views of the fused qkv: q, k, v ``(B, heads, N, d)``, then the conv head's ``(B, N, d)``."""
    B, N, _ = qkv.shape
    parts = qkv.view(B, N, 3 * heads + 3, d)
    swiglu = [parts[:, :, i * heads:(i + 1) * heads].transpose(1, 2) for i in range(3)]
    return swiglu + [parts[:, :, 3 * heads + i] for i in range(3)]


def _conv(tokens, taps, hw_shape, flip=False, by_taps=False):
    # the forms are also the decompositions, which take the tap-by-tap convolutions (see
    # depthwise.py)
    conv = depthwise3x3_by_taps if by_taps else depthwise3x3_reference
    return conv(tokens, taps.flip(1) if flip else taps, hw_shape)


def _step(init, grad, offset, norm_dim):
    # a column norm of (d, 2d) is a strided reduction, several times slower than the norm of
    # a contiguous copy of the transpose
    norm = (grad.mT.contiguous().norm(dim=-1).unsqueeze(-2) if norm_dim == -2 else
            grad.norm(dim=norm_dim, keepdim=True))
    return torch.addcdiv(init, grad, norm + offset), norm


def _step_backward(grad_fitted, grad, norm, offset, norm_dim):
    denom = norm + offset
    dot = (grad_fitted * grad).sum(norm_dim, keepdim=True)
    # where the norm is 0 so is grad, and the second term with it
    radial = dot / (denom * denom * norm.clamp_min(torch.finfo(norm.dtype).tiny))
    return grad_fitted / denom - grad * radial


# The PyTorch forms are also the operators' decompositions (``torch_forms``), so they are
# functional: results are concatenated, never written into slices of a buffer.

def _inner_terms(k, v, w12):
    """``z = k W`` and the terms ``T`` of the inner gradient ``G = k^T T``. The forward
    computes them and the backward again: keeping them would hold two ``(N, 2d)`` tensors per
    head, twice the block's q, k and v, for one product and a few elementwise passes."""
    z = k @ w12
    z1, z2 = z.chunk(2, dim=-1)
    gate_z = torch.sigmoid(z2)
    vg = v * gate_z
    a = vg * z2
    return z, gate_z, torch.cat([a, z1 * (vg + a * (1 - gate_z))], dim=-1)


def _forward(qkv, w1, w2, w3, heads, num_extra, H, W, inner_scale, by_taps=False):
    """PyTorch form of ``ttt_inner_forward``: ``[out, *saved]``, the same tensors, laid out
    alike (contiguous); ``by_taps``: the decomposition. What is saved is small (inner weights
    and their gradients, ``(d, 2d)`` per head): the backward reads q, k and v from qkv and
    computes the per-token products again."""
    B, N, _ = qkv.shape
    d = w1.shape[-1]
    w12 = torch.cat([w1, w2], dim=-1)
    w3_taps = kernel_taps(w3)
    q, k, v, q3, k3, v3 = _heads(qkv, heads, d)

    _, _, terms = _inner_terms(k, v, w12)
    grad = k.mT @ terms
    w12_fit, norm = _step(w12, grad, N / inner_scale, -2)
    p = q @ w12_fit
    gate_p = torch.sigmoid(p[..., d:])
    out = (p[..., :d] * p[..., d:] * gate_p).transpose(1, 2)              # (B, N, heads, d)

    grid, patches = (H, W), slice(num_extra, None)
    grad3 = correlate3x3_by_taps(k3[:, patches], v3[:, patches], grid).contiguous()
    w3_fit, norm3 = _step(w3_taps, grad3, H * W / inner_scale, 1)
    out3 = _conv(q3[:, patches], w3_fit, grid, by_taps=by_taps)
    if num_extra:
        # extra tokens are 1 x 1 images of their own: only the centre tap reaches them
        out3 = torch.cat([q3[:, :num_extra] * w3_fit[:, None, 4], out3], dim=1)
    out = torch.cat([out, out3.unsqueeze(2)], dim=2).reshape(B, N, (heads + 1) * d)
    return [out, grad, norm, w12_fit, grad3, norm3, w3_fit, w12]


def _backward(grad_out, saved, qkv, heads, num_extra, H, W, inner_scale, by_taps=False):
    """PyTorch form of ``ttt_inner_backward``: ``[grad_qkv, grad_w1, grad_w2, grad_w3]``;
    ``by_taps``: the decomposition."""
    grad, norm, w12_fit, grad3, norm3, w3_fit, w12 = saved
    B, N, _ = qkv.shape
    d = w12.shape[-2]
    q, k, v, q3, k3, v3 = _heads(qkv, heads, d)
    z, gate_z, terms = _inner_terms(k, v, w12)
    p = q @ w12_fit
    gate_p = torch.sigmoid(p[..., d:])
    grad_out = grad_out.reshape(B, N, heads + 1, d)

    p1, p2 = p.chunk(2, dim=-1)
    grad_gated = grad_out[:, :, :heads].transpose(1, 2) * gate_p
    grad_p = torch.cat([grad_gated * p2, grad_gated * p1 * (1 + p2 * (1 - gate_p))], dim=-1)
    grad_q = grad_p @ w12_fit.mT
    grad_fitted = q.mT @ grad_p
    grad_grad = _step_backward(grad_fitted, grad, norm, N / inner_scale, -2)
    grad_terms = k @ grad_grad
    z1, z2 = z.chunk(2, dim=-1)
    da, db = grad_terms.chunk(2, dim=-1)
    silu1 = gate_z * (1 + z2 * (1 - gate_z))
    silu2 = gate_z * (1 - gate_z) * (2 + z2 * (1 - 2 * gate_z))
    grad_z = torch.cat([db * v * silu1, v * (da * silu1 + db * z1 * silu2)], dim=-1)
    grad_v = da * z2 * gate_z + db * z1 * silu1
    grad_k = terms @ grad_grad.mT + grad_z @ w12.mT
    grad_w12 = (grad_fitted + k.mT @ grad_z).sum(0, keepdim=True)

    grid, patches = (H, W), slice(num_extra, None)
    grad_out3 = grad_out[:, :, heads]
    grad_w3_fit = correlate3x3_by_taps(q3[:, patches], grad_out3[:, patches], grid)
    grad_q3 = _conv(grad_out3[:, patches], w3_fit, grid, flip=True, by_taps=by_taps)
    if num_extra:
        extra = slice(None, num_extra)
        grad_q3 = torch.cat([grad_out3[:, extra] * w3_fit[:, None, 4], grad_q3], dim=1)
        centre = (grad_out3[:, extra] * q3[:, extra]).sum(1, keepdim=True)
        grad_w3_fit = torch.cat([grad_w3_fit[:, :4], grad_w3_fit[:, 4:5] + centre,
                                 grad_w3_fit[:, 5:]], dim=1)
    grad_grad3 = _step_backward(grad_w3_fit, grad3, norm3, H * W / inner_scale, 1)
    # the extra tokens' keys and values take no part in the conv fit: zero rows first
    grad_k3, grad_v3 = (F.pad(t, (0, 0, num_extra, 0)) for t in (
        _conv(v3[:, patches], grad_grad3, grid, flip=True, by_taps=by_taps),
        _conv(k3[:, patches], grad_grad3, grid, by_taps=by_taps)))
    grad_qkv = torch.cat([t.transpose(1, 2) for t in (grad_q, grad_k, grad_v)]
                         + [t.unsqueeze(2) for t in (grad_q3, grad_k3, grad_v3)], dim=2)
    return [grad_qkv.reshape(qkv.shape), *grad_w12.chunk(2, dim=-1),
            _untaps(grad_w3_fit.sum(0, keepdim=True))]


class _TTTInnerStep(Function):
    """The step in eager code (without the operator's dispatcher costs)."""

    @staticmethod
    def forward(ctx, qkv, w1, w2, w3, heads, num_extra, H, W, inner_scale):
        out, *saved = _forward(qkv, w1, w2, w3, heads, num_extra, H, W, inner_scale)
        ctx.save_for_backward(qkv, *saved)
        ctx.config = heads, num_extra, H, W, inner_scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        qkv, *saved = ctx.saved_tensors
        return (*_backward(grad_out.contiguous(), saved, qkv, *ctx.config), None, None, None,
                None, None)


# ---- the PyTorch operators, for traced code ------------------------------------------------

@torch.library.custom_op('linvit_mm::ttt_inner_forward', mutates_args=())
def ttt_inner_forward(qkv: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, heads: int,
                      num_extra: int, H: int, W: int, inner_scale: float) -> list[Tensor]:
    """``[out, *saved]``: the readouts ``(B, N, C + d)`` and what the backward needs."""
    return _forward(qkv, w1, w2, w3, heads, num_extra, H, W, inner_scale)


@ttt_inner_forward.register_fake
def _forward_shapes(qkv, w1, w2, w3, heads, num_extra, H, W, inner_scale):
    B, N, _ = qkv.shape
    d = w1.shape[-1]
    new = qkv.new_empty
    inner_weights = (B, heads, d, 2 * d)                        # grad, w12_fit
    return [new(B, N, (heads + 1) * d), new(inner_weights), new(B, heads, 1, 2 * d),
            new(inner_weights), new(B, 9, d), new(B, 1, d), new(B, 9, d),
            new(1, heads, d, 2 * d)]


@torch.library.custom_op('linvit_mm::ttt_inner_backward', mutates_args=())
def ttt_inner_backward(grad_out: Tensor, saved: list[Tensor], qkv: Tensor, heads: int,
                       num_extra: int, H: int, W: int, inner_scale: float) -> list[Tensor]:
    """``[grad_qkv, grad_w1, grad_w2, grad_w3]`` from the readouts' gradient and what
    ``ttt_inner_forward`` kept."""
    # contiguous, as the shape function says: w1's and w2's gradients are the two halves of
    # one tensor (an operator's outputs may not share memory) and w3's a transposed view
    return [grad.contiguous() for grad in _backward(grad_out, saved, qkv, heads, num_extra, H, W,
                                                    inner_scale)]


@ttt_inner_backward.register_fake
def _backward_shapes(grad_out, saved, qkv, heads, num_extra, H, W, inner_scale):
    d = saved[-1].shape[-2]
    return [qkv.new_empty(qkv.shape), qkv.new_empty(1, heads, d, d),
            qkv.new_empty(1, heads, d, d), qkv.new_empty(d, 1, 3, 3)]


def _keep_for_backward(ctx, inputs, output):
    qkv, w1, w2, w3, heads, num_extra, H, W, inner_scale = inputs
    ctx.save_for_backward(qkv, *output[1:])
    ctx.config = heads, num_extra, H, W, inner_scale
    # only the readouts are used downstream: no zero gradients for the kept tensors
    ctx.set_materialize_grads(False)


def _step_gradients(ctx, grads):
    qkv, *saved = ctx.saved_tensors
    grad_out = grads[0]
    if grad_out is None:
        return None, None, None, None, None, None, None, None, None
    return (*ttt_inner_backward(grad_out.contiguous(), saved, qkv, *ctx.config), None, None,
            None, None, None)


ttt_inner_forward.register_autograd(_step_gradients, setup_context=_keep_for_backward)
register_torch_form(torch.ops.linvit_mm.ttt_inner_forward.default,
                    functools.partial(_forward, by_taps=True))


register_torch_form(torch.ops.linvit_mm.ttt_inner_backward.default,
                    functools.partial(_backward, by_taps=True))


def ttt_inner_step(qkv, w1, w2, w3, heads, num_extra, hw_shape, inner_scale):
    """``(B, N, 3C + 3d)`` qkv -> ``(B, N, C + d)`` readouts of the SwiGLU heads and the conv
    head, both inner models fitted by one normalised gradient step on this image's tokens.

    ``w1``, ``w2``: ``(1, heads, d, d)``; ``w3``: ``(d, 1, 3, 3)``; all of qkv's dtype.
    """
    qkv = qkv.contiguous()
    if is_tracing():
        return ttt_inner_forward(qkv, w1, w2, w3, heads, num_extra, *hw_shape, inner_scale)[0]
    if not torch.is_grad_enabled():
        # inference: no autograd node to build, nothing to keep
        return _forward(qkv, w1, w2, w3, heads, num_extra, *hw_shape, inner_scale)[0]
    return _TTTInnerStep.apply(qkv, w1, w2, w3, heads, num_extra, *hw_shape, inner_scale)
