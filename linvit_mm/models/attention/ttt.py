"""ViT^3 test-time-training attention (Han et al. 2026, "Unlocking Test-Time Training in Vision").

Attention is recast as fitting a small inner model to an image's key/value pairs and
reading it with the queries. Two inner models run side by side:

* a simplified SwiGLU per head, ``F(t) = (t W1) * silu(t W2)`` with ``W1, W2`` in R^{d x d}
  (SwiGLU whose output layer is the identity), on the standard q, k, v heads;
* a 3x3 depthwise conv ``W3`` on one extra head of size ``d``, laid out on the patch grid
  (zero padding).

Each is fitted by ONE gradient step (step size 1) of the inner loss
``L(W) = -scale / n * sum_i <F_W(k_i), v_i>`` (``n`` the tokens it is fitted on), starting
from learned initial weights for every image. The loss is taken per image and per head (per
channel for the conv), so heads and images never share an inner model. The gradient is
normalised before the step, as in the paper: for W1 and W2 every output column (the weights
feeding one output unit) is divided by ``its norm + 1``; for W3 every channel's 3x3 kernel is.
``scale`` is 9^-1/2 (the conv head's equivalent head dim, 1 channel x 3 x 3, which the paper
uses for both branches). The SwiGLU readouts of all heads and the conv readout are
concatenated (``C + d`` channels) and projected back to ``C``.

Cost is O(N * C * d): the inner gradients are sums over tokens of d x d outer products.

Extra leading tokens (a class token): ViT^3 itself has none, but the interface allows them.
They are ordinary members of the token set for the SwiGLU branch (fitted on and read out like
patches, ``n = N``). The conv branch needs positions, which extra tokens do not have: its
kernel is fitted on the patch grid only (``n = H * W``, so the fit is the same with or without
a class token), and an extra token reads it as an image of its own of size 1 x 1, where zero
padding leaves only the centre tap: ``out = W3'[:, centre] * q``. That keeps the extra
token's conv channels a (learned, per-image) function of its own query instead of a constant
zero, and it is exactly what the depthwise conv computes for a token without neighbours.
"""
import torch
import torch.nn.functional as F
from torch import nn

from .base import BaseAttention, float32_state, register_attention

# The conv inner model has one channel and a 3x3 kernel: "head dim" 9.
DEFAULT_INNER_SCALE = 9**-0.5


def _normalise_gradient(grad, dim):
    """``g / (||g|| + 1)`` along ``dim``: a soft clip that keeps small steps linear."""
    return grad / (grad.norm(dim=dim, keepdim=True) + 1.)


def _swiglu(tokens, w1, w2):
    return (tokens @ w1) * F.silu(tokens @ w2)


def _inner_precision(device_type):
    """No autocast inside the inner step: its token sums lose too much in fp16 / bf16."""
    return torch.autocast(device_type=device_type, enabled=False)


@register_attention('ttt')
class TTTAttention(BaseAttention):
    """ViT^3 test-time-training attention: per-image SwiGLU + 3x3 depthwise conv inner models.

    Parameter layout: ``qkv`` is ``Linear(C, 3C + 3d)`` whose first ``3C`` rows are the
    standard q, k, v of all heads (q of head 0, 1, ... first), so a Softmax checkpoint's qkv
    copies into ``qkv.weight[:3C]``; the last ``3d`` rows are q, k, v of the conv head.
    ``proj`` is ``Linear(C + d, C)`` over ``[swiglu heads, conv head]``. ``w1``, ``w2``
    (``1 x heads x d x d``) and ``w3`` (``d x 1 x 3 x 3``) are the inner models' learned
    initial weights (names and shapes as in the public ViT^3 model). ``cpe`` is the block's
    3x3 depthwise conditional position encoding, applied through ``encode_position``.

    ``forward`` computes the inner gradients in closed form, batched over images and heads;
    ``forward_reference`` takes them with ``torch.autograd.grad`` of the inner loss, image by
    image (the test oracle). Both keep the inner step differentiable for outer training.

    Args:
        embed_dims (int): channels ``C``.
        num_heads (int): SwiGLU heads; ``d = C // num_heads`` is also the conv head's width.
        qkv_bias (bool): bias in ``qkv``.
        attn_drop (float): must be 0, there is no attention map to drop from.
        proj_drop (float): dropout after ``proj``.
        inner_scale (float): ``scale`` of the inner loss.
    """

    has_map = False
    uses_cls_token = False

    def __init__(self, embed_dims, num_heads, qkv_bias=True, attn_drop=0., proj_drop=0.,
                 inner_scale=DEFAULT_INNER_SCALE):
        super().__init__(embed_dims, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop)
        if attn_drop != 0:
            raise ValueError(f'the ttt operator has no attention map, so attn_drop must be 0, '
                             f'got {attn_drop}')
        if not inner_scale > 0:
            # the fast steps fold -scale / n into the norm clip's offset, which needs scale > 0
            raise ValueError(f'inner_scale must be positive, got {inner_scale}')
        d = self.head_dims
        self.inner_scale = float(inner_scale)
        self.qkv = nn.Linear(embed_dims, 3 * embed_dims + 3 * d, bias=qkv_bias)
        self.w1 = nn.Parameter(torch.empty(1, num_heads, d, d))
        self.w2 = nn.Parameter(torch.empty(1, num_heads, d, d))
        self.w3 = nn.Parameter(torch.empty(d, 1, 3, 3))
        self.proj = nn.Linear(embed_dims + d, embed_dims)
        # ViT^3's conditional position encoding (it has no absolute position embedding); it
        # keeps PyTorch's default conv init, as in the paper's model.
        self.cpe = nn.Conv2d(embed_dims, embed_dims, kernel_size=3, padding=1, groups=embed_dims)
        self.reset_inner_parameters()

    def reset_inner_parameters(self):
        # ViT^3 starts every inner model near zero (truncated normal, std 0.02).
        for weight in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(weight, std=.02)

    def encode_position(self, x, hw_shape):
        """``x + dwconv3x3(x)`` on the patch grid, applied by the block before its first norm.

        Extra tokens are 1 x 1 images of their own, as in the conv inner model: they get the
        centre tap and the bias.
        """
        num_extra = self.num_extra_tokens(x, hw_shape)
        patch_code = self._token_conv(x[:, num_extra:], hw_shape, self.cpe)
        if not num_extra:
            return x + patch_code
        extra_code = x[:, :num_extra] * self.cpe.weight[:, 0, 1, 1] + self.cpe.bias
        return x + torch.cat([extra_code, patch_code], dim=1)

    @staticmethod
    def _grid(tokens, hw_shape):
        """``(B, H*W, c)`` tokens as a ``(B, c, H, W)`` image, without a copy.

        The result is a channels-last view; oneDNN's channels-last depthwise kernels are
        faster than the NCHW ones and their output reads back as tokens for free.
        """
        B, _, c = tokens.shape
        return tokens.reshape(B, *hw_shape, c).permute(0, 3, 1, 2)

    @staticmethod
    def _tokens(image):
        """``(B, c, H, W)`` -> ``(B, H*W, c)``; a view for channels-last images."""
        B, c = image.shape[:2]
        return image.permute(0, 2, 3, 1).reshape(B, -1, c)

    def _token_conv(self, tokens, hw_shape, conv):
        return self._tokens(conv(self._grid(tokens, hw_shape)))

    # ---- fast form: closed-form inner gradients, batched over images and heads -------------

    def _swiglu_step(self, k, v):
        """One normalised gradient step per image and head: ``[W1' | W2']``, ``(B, heads, d, 2d)``.

        W1 and W2 side by side make each token product one matmul, and their column norms
        are unchanged by the concatenation.
        """
        w12 = torch.cat(float32_state(self.w1, self.w2), dim=-1)
        # chunk rather than slicing: its backward concatenates the two gradients instead
        # of zero-filling a full-size gradient per slice
        z1, z2 = (k @ w12).chunk(2, dim=-1)
        gate = torch.sigmoid(z2)
        # dF/dW1 and dF/dW2 times dL/dF(k_i) = -scale / n * v_i. With
        # silu'(z) = sig(z) (1 + z (1 - sig(z))), vg = v sig(z2) and a = v silu(z2) = vg z2,
        # the W1 factor v z1 silu'(z2) is z1 (vg + a (1 - sig(z2))): one elementwise pass
        # fewer than forming silu and silu' first.
        vg = v * gate
        a = vg * z2
        grad = k.mT @ torch.cat([a, z1 * torch.addcmul(vg, a, 1. - gate)], dim=-1)
        # A column norm of this (d, 2d) layout is a strided reduction, several times slower
        # than the whole normalisation on a contiguous copy of the transpose.
        norm = grad.mT.contiguous().norm(dim=-1).unsqueeze(-2)
        # With grad = c G, c = -scale / n < 0, the step w - c G / (|c| ||G|| + 1) is
        # w + G / (||G|| + 1 / |c|): the scale folds into the norm's offset.
        return torch.addcdiv(w12, grad, norm + k.shape[-2] / self.inner_scale)

    def _conv_step(self, k_grid, v_grid):
        """One normalised gradient step of the depthwise kernel per image: ``(B, d, 3, 3)``.

        ``dL/dW3[c, tap] = -scale / n * sum_p k[c, p + tap] v[c, p]`` correlates each
        channel's zero-padded keys with its values: a grouped convolution of the keys whose
        ``H x W`` kernel is the values, one group per image and channel.
        """
        B, d, H, W = k_grid.shape
        grad = F.conv2d(k_grid.reshape(1, B * d, H, W), v_grid.reshape(B * d, 1, H, W),
                        padding=1, groups=B * d)
        grad = grad.view(B, d, 3, 3)
        (w3, ) = float32_state(self.w3)
        # the scale folds into the norm's offset, as in ``_swiglu_step``
        return torch.addcdiv(w3.view(1, d, 3, 3), grad,
                             grad.norm(dim=(-2, -1), keepdim=True) + H * W / self.inner_scale)

    def _conv_read(self, q_grid, w3):
        """Each image's own depthwise kernel on its queries: ``(B, d, H, W)`` -> ``(B, HW, d)``."""
        B, d, H, W = q_grid.shape
        out = F.conv2d(q_grid.reshape(1, B * d, H, W), w3.reshape(B * d, 1, 3, 3), padding=1,
                       groups=B * d)
        return self._tokens(out.reshape(B, d, H, W))

    def _inner(self, qkv, num_extra, hw_shape):
        B, N, _ = qkv.shape
        heads, d = self.num_heads, self.head_dims
        # qkv's rows are 3 * heads + 3 blocks of d (q, k, v of every head, then of the conv
        # head): one split, whose backward assembles qkv's gradient in a single cat.
        q, k, v, q_conv, k_conv, v_conv = float32_state(*qkv.view(B, N, 3 * heads + 3, d).split(
            [heads, heads, heads, 1, 1, 1], dim=2))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        z1, z2 = (q @ self._swiglu_step(k, v)).chunk(2, dim=-1)
        swiglu_out = z1 * F.silu(z2)                                      # (B, heads, N, d)

        q_conv, k_conv, v_conv = q_conv.squeeze(2), k_conv.squeeze(2), v_conv.squeeze(2)
        # a slice's backward zero-fills its input's gradient, so slice only if there is
        # anything to drop
        q_grid, k_grid, v_grid = (self._grid(t[:, num_extra:] if num_extra else t, hw_shape)
                                  for t in (q_conv, k_conv, v_conv))
        w3 = self._conv_step(k_grid, v_grid)
        conv_out = self._conv_read(q_grid, w3)
        if num_extra:
            extra_out = q_conv[:, :num_extra] * w3[:, None, :, 1, 1]
            conv_out = torch.cat([extra_out, conv_out], dim=1)
        # The heads and the conv head side by side in one copy: (B, N, heads + 1, d).
        return torch.cat([swiglu_out.transpose(1, 2), conv_out.unsqueeze(2)], dim=2).flatten(2)

    def forward(self, x, hw_shape, return_map=False):
        if return_map:
            self.attention_map(x, hw_shape)
        num_extra = self.num_extra_tokens(x, hw_shape)
        qkv = self.qkv(x)
        with _inner_precision(x.device.type):
            inner_out = self._inner(qkv, num_extra, hw_shape)
        return self.proj_drop(self.proj(inner_out.to(qkv.dtype)))

    # ---- reference: autograd of the stated inner loss, one image at a time -----------------

    def _inner_reference(self, qkv, num_extra, hw_shape):
        """``qkv`` of ONE image ``(N, 3C + 3d)`` -> its ``(N, C + d)`` inner readouts."""
        C, d, heads = self.embed_dims, self.head_dims, self.num_heads
        H, W = hw_shape
        N = qkv.shape[0]
        q, k, v = float32_state(*(t.reshape(N, heads, d).transpose(0, 1)
                                  for t in qkv[:, :3 * C].chunk(3, dim=-1)))
        q_conv, k_conv, v_conv = float32_state(*qkv[:, 3 * C:].chunk(3, dim=-1))

        # SwiGLU: the per-head losses are summed; each head's gradient only sees its own loss
        # because heads share no weights. The step is taken at the learned init through a zero
        # offset, so the gradient exists even when the init itself is frozen.
        w1_init, w2_init = float32_state(self.w1[0], self.w2[0])
        offset1 = torch.zeros_like(w1_init, requires_grad=True)
        offset2 = torch.zeros_like(w2_init, requires_grad=True)
        fitted = _swiglu(k, w1_init + offset1, w2_init + offset2)
        loss = -self.inner_scale / N * (fitted * v).sum()
        grad_w1, grad_w2 = torch.autograd.grad(loss, (offset1, offset2), create_graph=True)
        w1 = w1_init - _normalise_gradient(grad_w1, -2)
        w2 = w2_init - _normalise_gradient(grad_w2, -2)
        swiglu_out = _swiglu(q, w1, w2).transpose(0, 1).reshape(N, C)

        def depthwise(image, kernel):
            return F.conv2d(image, kernel, padding=1, groups=d)

        def to_image(t):
            return t[num_extra:].transpose(0, 1).reshape(1, d, H, W)

        (w3_init, ) = float32_state(self.w3)
        offset3 = torch.zeros_like(w3_init, requires_grad=True)
        fitted = depthwise(to_image(k_conv), w3_init + offset3)
        loss = -self.inner_scale / (H * W) * (fitted * to_image(v_conv)).sum()
        (grad_w3, ) = torch.autograd.grad(loss, (offset3, ), create_graph=True)
        w3 = w3_init - _normalise_gradient(grad_w3, (-2, -1))
        patch_out = depthwise(to_image(q_conv), w3).reshape(d, H * W).transpose(0, 1)
        # every extra token is a 1 x 1 image of its own
        extra_out = depthwise(q_conv[:num_extra].reshape(num_extra, d, 1, 1), w3)
        conv_out = torch.cat([extra_out.reshape(num_extra, d), patch_out], dim=0)
        return torch.cat([swiglu_out, conv_out], dim=-1)

    def forward_reference(self, x, hw_shape):
        num_extra = self.num_extra_tokens(x, hw_shape)
        grad_enabled = torch.is_grad_enabled()
        # autograd.grad needs a graph even when the caller runs under no_grad
        with torch.enable_grad():
            qkv = self.qkv(x)
            with _inner_precision(x.device.type):
                inner_out = torch.stack(
                    [self._inner_reference(image, num_extra, hw_shape) for image in qkv])
            out = self.proj_drop(self.proj(inner_out.to(qkv.dtype)))
        return out if grad_enabled else out.detach()

    def extra_repr(self):
        return f'{super().extra_repr()}, inner_scale={self.inner_scale:.4g}'
