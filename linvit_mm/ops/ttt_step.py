"""The fast form of ViT^3's inner step: one autograd node with a hand-written backward.

``ttt_inner_step(qkv, w1, w2, w3, ...)`` maps a block's fused ``qkv`` projection to the
concatenated readouts of its two inner models (``ttt.py`` states the model and the inner
loss; ``TTTAttention.forward_reference`` takes the same step with autograd and is the oracle
the tests hold this to). Written as tensor operations the step is about forty autograd nodes
per block, and at 224 px their per-operation costs made ViT^3 1.2-1.3x slower than softmax
attention. Here the forward keeps what the backward needs and the backward is written out.
On the CPU both run in C++ (``ops/csrc/ttt_inner.cpp``: batched BLAS products, fused loops
between them); elsewhere (GPU, fp16 / bf16, or no compiler) the same computation runs as the
PyTorch operations below. The two never mix: a backward runs the form its forward ran.

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
import torch
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from .depthwise import conv_tokens, correlate_tokens, kernel_taps
from .extension import cpu_kernels, use_cpu_kernels


def _untaps(tap_grad):
    """The gradient of ``kernel_taps``: ``(1, 9, C)`` -> ``(C, 1, 3, 3)``."""
    return tap_grad[0].t().reshape(-1, 1, 3, 3)


def _heads(qkv, heads, d):
    """Views of the fused qkv: q, k, v ``(B, heads, N, d)``, then the conv head's ``(B, N, d)``."""
    B, N, _ = qkv.shape
    parts = qkv.view(B, N, 3 * heads + 3, d)
    swiglu = [parts[:, :, i * heads:(i + 1) * heads].transpose(1, 2) for i in range(3)]
    return swiglu + [parts[:, :, 3 * heads + i] for i in range(3)]


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


def _torch_forward(qkv, w1, w2, w3, heads, num_extra, H, W, inner_scale):
    """PyTorch form of ``ttt_inner_forward``: ``[out, *saved]``, the same tensors."""
    B, N, _ = qkv.shape
    d = w1.shape[-1]
    w12 = torch.cat([w1, w2], dim=-1)
    w3_taps = kernel_taps(w3)
    q, k, v, q3, k3, v3 = _heads(qkv, heads, d)
    out = qkv.new_empty(B, N, heads + 1, d)

    z = k @ w12
    z1, z2 = z.chunk(2, dim=-1)
    gate_z = torch.sigmoid(z2)
    vg = v * gate_z
    a = vg * z2
    terms = torch.cat([a, z1 * (vg + a * (1 - gate_z))], dim=-1)
    grad = k.mT @ terms
    w12_fit, norm = _step(w12, grad, N / inner_scale, -2)
    p = q @ w12_fit
    gate_p = torch.sigmoid(p[..., d:])
    out[:, :, :heads] = (p[..., :d] * p[..., d:] * gate_p).transpose(1, 2)

    grid, patches = (H, W), slice(num_extra, None)
    grad3 = correlate_tokens(k3[:, patches], v3[:, patches], grid)
    w3_fit, norm3 = _step(w3_taps, grad3, H * W / inner_scale, 1)
    out[:, patches, heads] = conv_tokens(q3[:, patches], w3_fit, grid)
    if num_extra:
        # extra tokens are 1 x 1 images of their own: only the centre tap reaches them
        out[:, :num_extra, heads] = q3[:, :num_extra] * w3_fit[:, None, 4]
    return [out.view(B, N, -1), z, gate_z, terms, grad, norm, w12_fit, p, gate_p, grad3, norm3,
            w3_fit, w12]


def _torch_backward(grad_out, saved, qkv, heads, num_extra, H, W, inner_scale):
    """PyTorch form of ``ttt_inner_backward``: ``[grad_qkv, grad_w1, grad_w2, grad_w3]``."""
    z, gate_z, terms, grad, norm, w12_fit, p, gate_p, grad3, norm3, w3_fit, w12 = saved
    B, N, _ = qkv.shape
    d = w12.shape[-2]
    q, k, v, q3, k3, v3 = _heads(qkv, heads, d)
    grad_out = grad_out.reshape(B, N, heads + 1, d)
    grad_qkv = torch.empty_like(qkv)
    grad_q, grad_k, grad_v, grad_q3, grad_k3, grad_v3 = _heads(grad_qkv, heads, d)

    p1, p2 = p.chunk(2, dim=-1)
    grad_gated = grad_out[:, :, :heads].transpose(1, 2) * gate_p
    grad_p = torch.cat([grad_gated * p2, grad_gated * p1 * (1 + p2 * (1 - gate_p))], dim=-1)
    grad_q.copy_(grad_p @ w12_fit.mT)
    grad_fitted = q.mT @ grad_p
    grad_grad = _step_backward(grad_fitted, grad, norm, N / inner_scale, -2)
    grad_terms = k @ grad_grad
    z1, z2 = z.chunk(2, dim=-1)
    da, db = grad_terms.chunk(2, dim=-1)
    silu1 = gate_z * (1 + z2 * (1 - gate_z))
    silu2 = gate_z * (1 - gate_z) * (2 + z2 * (1 - 2 * gate_z))
    grad_z = torch.cat([db * v * silu1, v * (da * silu1 + db * z1 * silu2)], dim=-1)
    grad_v.copy_(da * z2 * gate_z + db * z1 * silu1)
    grad_k.copy_(terms @ grad_grad.mT + grad_z @ w12.mT)
    grad_w12 = (grad_fitted + k.mT @ grad_z).sum(0, keepdim=True)

    grid, patches = (H, W), slice(num_extra, None)
    grad_out3 = grad_out[:, :, heads]
    grad_w3_fit = correlate_tokens(q3[:, patches], grad_out3[:, patches], grid)
    grad_q3[:, patches] = conv_tokens(grad_out3[:, patches], w3_fit, grid, flip=True)
    if num_extra:
        extra = slice(None, num_extra)
        grad_q3[:, extra] = grad_out3[:, extra] * w3_fit[:, None, 4]
        grad_w3_fit[:, 4] += (grad_out3[:, extra] * q3[:, extra]).sum(1)
        # the extra tokens' keys and values take no part in the conv fit
        grad_k3[:, extra] = 0
        grad_v3[:, extra] = 0
    grad_grad3 = _step_backward(grad_w3_fit, grad3, norm3, H * W / inner_scale, 1)
    grad_k3[:, patches] = conv_tokens(v3[:, patches], grad_grad3, grid, flip=True)
    grad_v3[:, patches] = conv_tokens(k3[:, patches], grad_grad3, grid)
    return [grad_qkv, *grad_w12.chunk(2, dim=-1), _untaps(grad_w3_fit.sum(0, keepdim=True))]


class _TTTInnerStep(Function):

    @staticmethod
    def forward(ctx, qkv, w1, w2, w3, heads, num_extra, H, W, inner_scale):
        ctx.use_cpp = use_cpu_kernels(qkv, w1)
        forward = cpu_kernels().ttt_inner_forward if ctx.use_cpp else _torch_forward
        out, *saved = forward(qkv, w1, w2, w3, heads, num_extra, H, W, inner_scale)
        ctx.save_for_backward(qkv, *saved)
        ctx.config = heads, num_extra, H, W, inner_scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        qkv, *saved = ctx.saved_tensors
        backward = cpu_kernels().ttt_inner_backward if ctx.use_cpp else _torch_backward
        return (*backward(grad_out.contiguous(), saved, qkv, *ctx.config), None, None, None,
                None, None)


def ttt_inner_step(qkv, w1, w2, w3, heads, num_extra, hw_shape, inner_scale):
    """``(B, N, 3C + 3d)`` qkv -> ``(B, N, C + d)`` readouts of the SwiGLU heads and the conv
    head, both inner models fitted by one normalised gradient step on this image's tokens.

    ``w1``, ``w2``: ``(1, heads, d, d)``; ``w3``: ``(d, 1, 3, 3)``; all of qkv's dtype.
    """
    qkv = qkv.contiguous()
    if not torch.is_grad_enabled() and use_cpu_kernels(qkv, w1):
        # inference: no autograd node to build, nothing to keep
        return cpu_kernels().ttt_inner_forward(qkv, w1, w2, w3, heads, num_extra, *hw_shape,
                                               inner_scale)[0]
    return _TTTInnerStep.apply(qkv, w1, w2, w3, heads, num_extra, *hw_shape, inner_scale)
