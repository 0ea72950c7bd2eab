"""Analytic attention initialisations that need no checkpoint: Mimetic and Impulse.

Both write the query/key rows of ``attn.qkv`` so that every head's bilinear form
``W_q^T W_k`` (``C x C``; a token pair ``x, y`` scores ``x^T W_q^T W_k y``) has a chosen
structure, and write the value rows of ``attn.qkv`` and ``attn.proj`` so that the layer's
value-output map ``W_v^T W_proj^T`` (``x -> x W_v^T W_proj^T`` for a row token ``x``) is
close to a negative identity. Biases are left as they are (zero after the default init).

- **Mimetic** (Trockman & Kolter, ICML 2023, "Mimetic Initialization of Self-Attention
  Layers"): per head ``W_q^T W_k ~ a1 Z + b1 I`` with ``a1 = b1 = 0.7``; per layer
  ``W_v^T W_proj^T ~ a2 Z - b2 I`` with ``a2 = b2 = 0.4``; ``Z`` has i.i.d. entries of
  variance ``1 / C``. Each target ``A`` is factored by an SVD, ``A = U S V^T``,
  ``L = U sqrt(S)``, ``R = sqrt(S) V^T``; the query/key pair keeps the top ``head_dim``
  components (its rank is ``head_dim``), the value/output pair all ``C``.
- **Impulse** (Zheng, Li, Saratchandran & Lucey, NeurIPS 2025, "Structured Initialization
  for Vision Transformers"): head ``i`` targets a 3x3 "impulse" attention map, query
  ``(r, c)`` attending to key ``(r + dy, c + dx)``, offsets assigned centre first, then
  up, right, left, down, then the four diagonals, cycling when there are more than nine
  heads (fewer heads take the first offsets). The target map holds ``1000`` on the
  impulse and ``3 * trunc_normal(std=0.6)`` elsewhere; ``W_q^T W_k`` is the least-squares
  solution of ``P M P^T = target`` for the layer-normed position embeddings ``P``
  (``N x C``) through a pseudo-inverse of ``P^T P`` limited to ``head_dim`` components,
  truncated to rank ``head_dim`` by an SVD, with both factors scaled to unit Frobenius norm
  and then multiplied by a gain of 7. The learned position embedding is multiplied by 18,
  so that at initialisation it dominates the patch embedding and the attention of real
  images follows the position structure the solve was made for. Value/output as Mimetic.
  The constants are those of the authors' public timm implementation
  (``post_weight_init='impulse'``). Two departures: eigenvalues of ``P^T P`` at rounding
  level are dropped from the pseudo-inverse (the reference inverts the top ``head_dim``
  whatever their size, which fills the solution with noise when the grid has fewer tokens
  than a head has channels); and a model without a learned embedding (MHLA's fixed sin-cos)
  is solved against that embedding, which cannot be rescaled. Its layer-normed Gram has
  only ~20 non-zero, fast-decaying eigenvalues, so the solution lives mostly in weak
  directions: every head's position-only scores still peak at its offset, but after the
  reference's normalisation they are small (DeiT-Tiny, 14x14: softmax maps nearly flat).
"""
import math

import torch
import torch.nn.functional as F

__all__ = ['MIMETIC_DEFAULTS', 'IMPULSE_DEFAULTS', 'IMPULSE_OFFSETS', 'identity_plus_noise_factors',
           'impulse_offsets', 'impulse_attention_targets', 'impulse_qk_factors', 'mimetic_init',
           'impulse_init', 'attention_layers']

MIMETIC_DEFAULTS = dict(qk_alpha=0.7, qk_beta=0.7, vo_alpha=0.4, vo_beta=0.4)
IMPULSE_DEFAULTS = dict(pos_scale=18., qk_gain=7., impulse_value=1000., noise_std=0.6,
                        noise_scale=3., vo_alpha=0.4, vo_beta=0.4)

# Relative size below which an eigenvalue of a float64 Gram matrix is rounding noise
# (its error is ~1e-16 of the largest).
_NUMERICAL_RTOL = 1e-10

# (dy, dx) of the 3x3 impulses in the order heads take them: centre, the four direct
# neighbours (up, right, left, down), then the diagonals.
IMPULSE_OFFSETS = ((0, 0), (-1, 0), (0, 1), (0, -1), (1, 0), (-1, -1), (-1, 1), (1, -1), (1, 1))


def identity_plus_noise_factors(dim, rank, alpha, beta, sign=1, num=1):
    """``num`` factor pairs ``L (num, dim, rank)``, ``R (num, rank, dim)``, each ``L R`` the
    best rank-``rank`` approximation of ``alpha * Z + sign * beta * I`` for its own ``Z``
    (Gaussian, variance ``1 / dim``).

    Draws from the global torch generator, so ``torch.manual_seed`` fixes the result. The
    SVD runs in float32: a ViT-B layer needs thirteen 768 x 768 ones, and the targets are
    random draws that need no more precision.
    """
    if not 1 <= rank <= dim:
        raise ValueError(f'rank must be in [1, {dim}], got {rank}')
    noise = torch.randn(num, dim, dim) / math.sqrt(dim)
    target = alpha * noise + sign * beta * torch.eye(dim)
    left, singular, right = torch.linalg.svd(target)
    root = singular[:, :rank].sqrt()
    return left[:, :, :rank] * root[:, None, :], root[:, :, None] * right[:, :rank]


def impulse_offsets(num_heads):
    """The 3x3 offset ``(dy, dx)`` each head's impulse map points to."""
    return [IMPULSE_OFFSETS[i % len(IMPULSE_OFFSETS)] for i in range(num_heads)]


def impulse_attention_targets(offsets, hw_shape, impulse_value, noise_std, noise_scale,
                              dtype=torch.float64):
    """``(heads, H*W, H*W)`` target scores: ``impulse_value`` where query ``(r, c)`` meets key
    ``(r + dy, c + dx)``, truncated-normal noise everywhere else.

    A query whose impulse falls outside the grid has only noise in its row, as the shift
    of a zero-padded convolution has nothing there.
    """
    H, W = hw_shape
    rows = torch.arange(H).repeat_interleave(W)
    cols = torch.arange(W).repeat(H)
    targets = torch.empty(len(offsets), H * W, H * W, dtype=dtype)
    torch.nn.init.trunc_normal_(targets, std=noise_std)
    targets.mul_(noise_scale)
    for head, (dy, dx) in enumerate(offsets):
        key_rows, key_cols = rows + dy, cols + dx
        inside = (key_rows >= 0) & (key_rows < H) & (key_cols >= 0) & (key_cols < W)
        queries = torch.nonzero(inside).squeeze(1)
        keys = key_rows[inside] * W + key_cols[inside]
        targets[head, queries, keys] = impulse_value
    return targets


def impulse_qk_factors(position_embed, targets, rank, gain):
    """Per-head ``L (heads, C, rank)``, ``R (heads, rank, C)`` with ``LN(P) L R LN(P)^T``
    following ``targets``.

    ``P`` (``N x C``) is layer-normed without affine parameters, as the block's ``ln1``
    does at initialisation. ``M = P^+ T P^+^T`` with ``P^+ = (P^T P)^+_r P^T``, the
    pseudo-inverse of the Gram matrix keeping its top ``rank`` components (fewer when the
    Gram has fewer non-zero eigenvalues); ``L R`` is the best rank-``rank`` approximation
    of ``M``; ``L`` and ``R`` are each scaled to unit Frobenius norm per head, then by
    ``gain``. Components beyond the Gram's numerical rank are zero.

    ``M = V B V^T`` with ``V`` the top ``rank`` eigenvectors of ``P^T P`` and ``B`` a
    ``rank x rank`` matrix, so ``M`` already has rank ``rank`` and its SVD is that of
    ``B``: one small SVD per head instead of a ``C x C`` one.
    """
    pe = F.layer_norm(position_embed.to(torch.float64), position_embed.shape[-1:])
    eigval, eigvec = torch.linalg.eigh(pe.T @ pe)  # ascending
    eigval, eigvec = eigval.flip(0), eigvec.flip(1)
    # Eigenvalues at rounding level are zero, not tiny: inverting them would fill M with
    # noise. That happens when the grid has fewer tokens than a head has channels, and with
    # a sin-cos embedding, whose layer-normed Gram has only ~20 non-zero eigenvalues.
    kept = min(rank, int((eigval > _NUMERICAL_RTOL * eigval[0]).sum()))
    eigval, eigvec = eigval[:kept], eigvec[:, :kept]
    whitened = (pe @ eigvec) / eigval  # (N, kept): P V diag(1/lambda)
    small = whitened.T @ targets.to(torch.float64) @ whitened  # (heads, kept, kept)
    left, singular, right = torch.linalg.svd(small)
    root = singular.sqrt()
    left = eigvec @ (left * root[:, None, :])  # (heads, C, kept)
    right = (root[:, :, None] * right) @ eigvec.T  # (heads, kept, C)
    left = left / left.flatten(1).norm(dim=1)[:, None, None]
    right = right / right.flatten(1).norm(dim=1)[:, None, None]
    missing = rank - kept
    return gain * F.pad(left, (0, missing)), gain * F.pad(right, (0, 0, 0, missing))


def attention_layers(module):
    """``(index, attention)`` of the blocks of a ViT-like module (``module.layers[i].attn``)."""
    layers = getattr(module, 'layers', None)
    if layers is None:
        return []
    return [(i, layer.attn) for i, layer in enumerate(layers)
            if hasattr(getattr(layer, 'attn', None), 'qkv')]


def _check_qk_parameterised(attn, index):
    C = attn.embed_dims
    if tuple(attn.qkv.weight.shape) != (3 * C, C) or tuple(attn.proj.weight.shape) != (C, C):
        raise ValueError(
            f'layers.{index}.attn ({getattr(attn, "attn_type", type(attn).__name__)}) is not a '
            f'q/k/v + output projection of width {C} (qkv {tuple(attn.qkv.weight.shape)}, proj '
            f'{tuple(attn.proj.weight.shape)}); Mimetic and Impulse need that parameterisation')


def _write_value_output(attn, alpha, beta):
    C = attn.embed_dims
    value, output = identity_plus_noise_factors(C, C, alpha, beta, sign=-1)
    value, output = value[0], output[0]
    weight = attn.qkv.weight
    weight[2 * C:].copy_(value.T)  # the value rows: the shape is checked to be (3C, C)
    attn.proj.weight.copy_(output.T)


def _write_query_key(attn, head, query, key):
    """Rows of head ``head``: ``W_q^h = query^T``, ``W_k^h = key`` so ``W_q^T W_k = query key``."""
    C, d = attn.embed_dims, attn.head_dims
    rows = slice(head * d, (head + 1) * d)
    attn.qkv.weight[rows].copy_(query.T)
    attn.qkv.weight[C + head * d:C + (head + 1) * d].copy_(key)


@torch.no_grad()
def mimetic_init(module, qk_alpha, qk_beta, vo_alpha, vo_beta):
    """Mimetic initialisation of every block's attention; returns the names written."""
    written = []
    for index, attn in attention_layers(module):
        _check_qk_parameterised(attn, index)
        query, key = identity_plus_noise_factors(attn.embed_dims, attn.head_dims, qk_alpha,
                                                 qk_beta, sign=1, num=attn.num_heads)
        for head in range(attn.num_heads):
            _write_query_key(attn, head, query[head], key[head])
        _write_value_output(attn, vo_alpha, vo_beta)
        written += [f'layers.{index}.attn.qkv.weight', f'layers.{index}.attn.proj.weight']
    return written


def _patch_position_embedding(module):
    """The ``(H*W, C)`` position embedding of the module's own patch grid."""
    grid = tuple(module.patch_resolution)
    pos_embed = getattr(module, 'pos_embed', None)
    if pos_embed is not None:
        slots = getattr(module, 'pos_embed_extra_tokens', getattr(module, 'num_extra_tokens', 0))
        return pos_embed[0, int(slots):]
    fixed = module.position_embedding(grid, torch.empty(0, dtype=torch.float64))
    return fixed[0, -grid[0] * grid[1]:]


@torch.no_grad()
def impulse_init(module, pos_scale, qk_gain, impulse_value, noise_std, noise_scale, vo_alpha,
                 vo_beta):
    """Impulse initialisation of every block's attention; returns the names written.

    A learned ``pos_embed`` is multiplied by ``pos_scale`` first (all of its slots, the
    class slot included, as in the reference) and the query/key solve uses its patch part;
    a fixed (sin-cos) embedding is used as it is.
    """
    layers = attention_layers(module)
    if not layers:
        return []
    for index, attn in layers:
        _check_qk_parameterised(attn, index)
    written = []
    if getattr(module, 'pos_embed', None) is not None:
        module.pos_embed.mul_(pos_scale)
        written.append('pos_embed')
    position_embed = _patch_position_embedding(module)
    for index, attn in layers:
        targets = impulse_attention_targets(impulse_offsets(attn.num_heads),
                                            module.patch_resolution, impulse_value, noise_std,
                                            noise_scale)
        query, key = impulse_qk_factors(position_embed, targets, attn.head_dims, qk_gain)
        for head in range(attn.num_heads):
            _write_query_key(attn, head, query[head], key[head])
        _write_value_output(attn, vo_alpha, vo_beta)
        written += [f'layers.{index}.attn.qkv.weight', f'layers.{index}.attn.proj.weight']
    return written
