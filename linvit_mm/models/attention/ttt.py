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

from ...ops import position_code, ttt_inner_step
from .base import (LEADING_ROWS, OWN_INIT, BaseAttention, autocast_disabled, float32_state,
                   register_attention)

# The conv inner model has one channel and a 3x3 kernel: "head dim" 9.
DEFAULT_INNER_SCALE = 9**-0.5


def naive_neighbours(hw_shape, device=None, dtype=None):
    """``(9, H*W, H*W)`` 0/1 matrices: entry ``[3 (a + 1) + (b + 1), p, q]`` is 1 where token
    ``q`` sits at row offset ``a`` and column offset ``b`` (each in -1, 0, 1) from token ``p``
    on the row-major ``H x W`` grid, 0 where that neighbour falls off the grid (zero padding)."""
    H, W = hw_shape
    entries = [(3 * (a + 1) + (b + 1), i * W + j, (i + a) * W + j + b)
               for i in range(H) for j in range(W) for a in (-1, 0, 1) for b in (-1, 0, 1)
               if 0 <= i + a < H and 0 <= j + b < W]
    neighbours = torch.zeros(9, H * W, H * W, device=device, dtype=dtype)
    neighbours[tuple(torch.tensor(entries, device=device).T)] = 1
    return neighbours


def naive_depthwise3x3(tokens, kernel, hw_shape):
    """The zero-padded 3x3 depthwise convolution of ``(..., H*W, c)`` grid tokens with a
    ``(c, 3, 3)`` kernel, as ``F.conv2d`` defines it (a cross-correlation), summed pixel by
    pixel over the in-grid neighbours:

        out[i, j, ch] = sum_{a, b in -1, 0, 1} kernel[ch, a + 1, b + 1] * x[i + a, j + b, ch]

    O((H W)^2): the test oracle of the fast convolutions, which shares no code with them."""
    neighbours = naive_neighbours(hw_shape, tokens.device, tokens.dtype)
    return torch.einsum('tpq,...qc,ct->...pc', neighbours, tokens, kernel.reshape(-1, 9))


def naive_swiglu(tokens, w1, w2):
    """The SwiGLU inner model ``F(t) = (t W1) * silu(t W2)``."""
    return (tokens @ w1) * F.silu(tokens @ w2)


def naive_inner_step(loss_of, inits, norm_dims):
    """One normalised gradient step (step size 1) of ``loss_of(*weights)`` from ``inits``:
    ``W' = W - g / (||g|| + 1)``, ``g = dL/dW`` by autograd, the norm over ``norm_dims`` of
    ``g``. The gradient is taken at the inits through a zero offset, so it exists even when
    the inits themselves need no gradient; its graph is kept, so ``W'`` is differentiable."""
    offsets = [torch.zeros_like(init, requires_grad=True) for init in inits]
    loss = loss_of(*(init + offset for init, offset in zip(inits, offsets)))
    grads = torch.autograd.grad(loss, offsets, create_graph=True)
    return [init - grad / (torch.linalg.vector_norm(grad, dim=norm_dims, keepdim=True) + 1)
            for init, grad in zip(inits, grads)]


def naive_ttt_inner(qkv, w1, w2, w3, num_extra, hw_shape, inner_scale, rotations=None):
    """ViT^3's inner models of ONE image written out from their definition (the test oracle,
    see :class:`TTTAttention`): ``(N, 3C + 3d)`` qkv -> ``(N, C + d)`` readouts.

    Head ``h`` of ``q``, ``k``, ``v`` is read off channels ``[p*C + h*d, p*C + (h+1)*d)``
    of ``qkv`` (``p`` = 0, 1, 2), the conv head's off ``[3C + p*d, 3C + (p+1)*d)``. Per
    SwiGLU head, ``(W1, W2)`` take one :func:`naive_inner_step` of
    ``-scale / N * sum_i <F(k_i), v_i>`` (norms per output column), then ``F`` reads the
    queries. The conv kernel takes one step of ``-scale / (H W) * sum_p <conv(k)_p, v_p>``
    over the patches (norms per channel) and reads the patch queries with
    :func:`naive_depthwise3x3`; every extra token is read as a 1 x 1 image of its own.
    ``rotations`` (``(N, d, d)``, identity for extra tokens) turn the SwiGLU heads' queries
    and keys first. Shares no code with the fast form.

    Args:
        qkv (Tensor): ``(N, 3C + 3d)``.
        w1, w2 (Tensor): ``(heads, d, d)`` initial SwiGLU weights.
        w3 (Tensor): ``(d, 3, 3)`` initial conv kernel.
    """
    heads, d, _ = w1.shape
    C = heads * d
    N = qkv.shape[0]
    H, W = hw_shape
    readouts = []
    for h in range(heads):
        q, k, v = (qkv[:, p * C + h * d:p * C + (h + 1) * d] for p in range(3))
        if rotations is not None:
            q, k = (torch.einsum('nij,nj->ni', rotations, t) for t in (q, k))

        def swiglu_loss(a, b, k=k, v=v):
            return -inner_scale / N * (naive_swiglu(k, a, b) * v).sum()

        readouts.append(naive_swiglu(q, *naive_inner_step(swiglu_loss, (w1[h], w2[h]), -2)))

    q3, k3, v3 = (qkv[:, 3 * C + p * d:3 * C + (p + 1) * d] for p in range(3))

    def conv_loss(kernel):
        fitted = naive_depthwise3x3(k3[num_extra:], kernel, hw_shape)
        return -inner_scale / (H * W) * (fitted * v3[num_extra:]).sum()

    (w3_fit, ) = naive_inner_step(conv_loss, (w3, ), (-2, -1))
    conv_out = [naive_depthwise3x3(q3[i:i + 1], w3_fit, (1, 1)) for i in range(num_extra)]
    conv_out.append(naive_depthwise3x3(q3[num_extra:], w3_fit, hw_shape))
    return torch.cat(readouts + [torch.cat(conv_out, dim=0)], dim=-1)


def _inner_precision(like):
    """No autocast inside the inner step: its token sums lose too much in fp16 / bf16."""
    return autocast_disabled(like)


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

    RoPE: the queries and keys of the SwiGLU heads (patch tokens) are rotated before the
    inner step, so the inner model is fitted on rotated keys and read with rotated queries,
    as the scores ``q_i^T k_j`` of Softmax attention would be; the inner model is then a
    function of relative position through ``k``, like the Softmax map it replaces. The conv
    head is left alone: its inner model is a 3x3 convolution on the grid, which already sees
    positions (and a rotation of its per-channel q, k would mix channels it fits one by one).

    ``forward`` computes the inner gradients in closed form, batched over images and heads,
    as one autograd node with a hand-written backward (``ops/ttt_step.py``);
    ``forward_reference`` (the test oracle) is :func:`naive_ttt_inner`, image by image: the
    heads read off channel slices, RoPE as explicit per-token matrices, the inner gradients
    by ``torch.autograd.grad`` of the inner loss and the convolutions as sums over each
    pixel's neighbours; apart from ``qkv``, ``proj`` and the RoPE tables it shares no code
    with ``forward``. Both keep the inner step differentiable for outer training.
    ``encode_position_reference`` is the same kind of oracle for ``encode_position``.

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
    has_qk_form = False
    qk_form_absent_because = (
        'its queries read a SwiGLU and a 3x3 conv inner model fitted by one gradient step on '
        'the keys and values of the image, not a softmax/kernel of q_i^T k_j, so there is no '
        'QK^T (or value-output) product to initialise; its qkv (3C + 3d rows) and proj (C + d '
        'inputs) are wider than a Softmax block\'s as well')
    # qkv is Linear(C, 3C + 3d): a Softmax checkpoint's 3C rows are its standard q, k, v and
    # the extra 3d rows (the conv head) keep their init; proj is Linear(C + d, C), not a
    # Softmax block's layer.
    softmax_fill = {'qkv': LEADING_ROWS, 'proj': OWN_INIT}

    options = BaseAttention.options + ('inner_scale', )

    def __init__(self, embed_dims, num_heads, qkv_bias=True, attn_drop=0., proj_drop=0.,
                 rope=None, layer_scale_init_value=0., inner_scale=DEFAULT_INNER_SCALE):
        super().__init__(embed_dims, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop, rope=rope,
                         layer_scale_init_value=layer_scale_init_value)
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
        patch_code = position_code(x[:, num_extra:] if num_extra else x, self.cpe.weight,
                                   self.cpe.bias, hw_shape)
        if not num_extra:
            return patch_code
        extra_code = x[:, :num_extra] * (1 + self.cpe.weight[:, 0, 1, 1]) + self.cpe.bias
        return torch.cat([extra_code, patch_code], dim=1)

    def _rotate_qk(self, qkv, hw_shape, num_extra):
        """``qkv`` ``(B, N, 3C + 3d)`` with the SwiGLU heads' q and k rotated by RoPE."""
        rotation = self.rotation(hw_shape, num_extra, qkv)
        if rotation is None:
            return qkv
        C = self.embed_dims
        q, k, rest = qkv.split([C, C, qkv.shape[-1] - 2 * C], dim=-1)
        q, k = (rotation.rotate(self.split_heads(t, num_parts=1)[0]) for t in (q, k))
        return torch.cat([self.merge_heads(q), self.merge_heads(k), rest.to(q.dtype)], dim=-1)

    # ---- fast form: closed-form inner gradients, batched over images and heads -------------

    def _inner(self, qkv, num_extra, hw_shape):
        qkv, w1, w2, w3 = float32_state(qkv, self.w1, self.w2, self.w3)
        return ttt_inner_step(qkv, w1, w2, w3, self.num_heads, num_extra, hw_shape,
                              self.inner_scale)

    def forward(self, x, hw_shape):
        num_extra = self.num_extra_tokens(x, hw_shape)
        if hw_shape[0] * hw_shape[1] == 0:
            raise ValueError(f'the ttt operator fits its inner weights to the patch tokens: '
                             f'the patch grid must be at least 1x1, got '
                             f'{hw_shape[0]}x{hw_shape[1]}')
        qkv = self.qkv(x)
        with _inner_precision(x):
            inner_out = self._inner(self._rotate_qk(qkv, hw_shape, num_extra), num_extra,
                                    hw_shape)
        return self.project(inner_out.to(qkv.dtype))

    # ---- reference: the definitions written out, one image at a time ----------------------

    def encode_position_reference(self, x, hw_shape):
        """:meth:`encode_position` from its definition (the test oracle): ``x`` plus
        :func:`naive_depthwise3x3` of the grid plus the bias, every extra token a 1 x 1 image
        of its own."""
        num_extra = self.num_extra_tokens(x, hw_shape)
        kernel, bias = self.cpe.weight[:, 0], self.cpe.bias
        images = [(x[:, i:i + 1], (1, 1)) for i in range(num_extra)]
        images.append((x[:, num_extra:], hw_shape))
        return torch.cat([t + naive_depthwise3x3(t, kernel, grid) + bias for t, grid in images],
                         dim=1)

    def forward_reference(self, x, hw_shape):
        num_extra = self.num_extra_tokens(x, hw_shape)
        grad_enabled = torch.is_grad_enabled()
        # autograd.grad needs a graph even when the caller runs under no_grad
        with torch.enable_grad():
            qkv = self.qkv(x)
            dtype = torch.promote_types(qkv.dtype, torch.float32)
            rotations = self.rotation_matrices(hw_shape, num_extra, qkv)
            with autocast_disabled(x):
                w1, w2, w3 = (t.to(dtype) for t in (self.w1[0], self.w2[0], self.w3[:, 0]))
                if rotations is not None:
                    rotations = rotations.to(dtype)
                inner_out = torch.stack([
                    naive_ttt_inner(image.to(dtype), w1, w2, w3, num_extra, hw_shape,
                                    self.inner_scale, rotations) for image in qkv])
            out = self.project(inner_out.to(qkv.dtype))
        return out if grad_enabled else out.detach()

    def core_macs(self, num_tokens, hw_shape):
        # SwiGLU branch: k [W1|W2], the inner gradient k^T T and q W' (2 N d^2 per head
        # each), the column norms; conv branch: the tap correlation and the read-out (9 per
        # patch and channel each), the centre tap of extra tokens, the kernel norms; RoPE on
        # the SwiGLU heads' patch queries and keys
        C, d, h = self.embed_dims, self.head_dims, self.num_heads
        num_patches = hw_shape[0] * hw_shape[1]
        num_extra = num_tokens - num_patches
        return (6 * num_tokens * C * d + 2 * h * d * d + 18 * num_patches * d + num_extra * d
                + 9 * d + self.rotation_macs(num_patches))

    def extra_repr(self):
        return f'{super().extra_repr()}, inner_scale={self.inner_scale:.4g}'
