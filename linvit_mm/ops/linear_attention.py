"""The non-causal normalised linear-attention core as one operator, fused on the GPU.

``normalised_linear_attention(q, k, v, eps, feature)`` computes, per image and head,

    o_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j) + eps)

for ``(B, heads, N, d)`` queries and keys and ``(B, heads, N, e)`` values, ``phi`` one of
``'relu'``, ``'elu'`` (``elu(x) + 1``) or ``'identity'`` (features computed before). It is the
core of the relu, elu and hedgehog operators (without RoPE, which rotates their numerator
only) and of InLine (on the features ``[s q, 1]`` and ``[k - k_mean, 1]``).

Two forms of the same computation:

* :func:`normalised_linear_attention_torch`, PyTorch operations, for every device, dtype and
  tracer (``torch.onnx.export`` keeps it);
* the Triton kernels of :mod:`linvit_mm.ops.linear_attention_triton`, registered as the custom
  op ``torch.ops.linvit_mm.normalised_linear_attention`` (a fake implementation and an
  autograd formula, so ``torch.compile`` and ``torch.export`` see one node each way). They read
  q, k and v once per pass, in their dtype (float32, float16 or bfloat16; the interpreter
  cannot run bfloat16), with float32 accumulators and state.

:func:`fused_applies` says whether the kernels run for given tensors: CUDA tensors, head
widths up to 128, unless ``LINVIT_MM_FUSED=0``. CPU tensors take them only with both
``LINVIT_MM_FUSED=1`` and ``TRITON_INTERPRET=1`` (set before the kernels are first used): how
the tests prove the kernels without a GPU.
"""
import functools
import importlib.util
import os

import torch
import torch.nn.functional as F

__all__ = ['FEATURES', 'fused_applies', 'normalised_linear_attention',
           'normalised_linear_attention_torch']

FEATURES = ('identity', 'relu', 'elu')
# LINVIT_MM_FUSED=0 keeps the PyTorch form everywhere (to compare, or to work around a kernel)
FUSED_ENV = 'LINVIT_MM_FUSED'
MAX_HEAD_DIMS = 128
BLOCK_N = 64


def _feature(x, feature):
    if feature == 'relu':
        return F.relu(x)
    if feature == 'elu':
        return F.elu(x) + 1.
    return x


def normalised_linear_attention_torch(q, k, v, eps, feature='identity'):
    """The PyTorch form: the state and the key sum, then the normalised read-out."""
    fq, fk = _feature(q, feature), _feature(k, feature)
    denominator = fq @ fk.sum(dim=-2).unsqueeze(-1)
    return (fq @ (fk.transpose(-2, -1) @ v)) / (denominator + eps)


def _interpreting():
    return os.environ.get('TRITON_INTERPRET') == '1'


@functools.cache
def _triton_importable():
    return importlib.util.find_spec('triton') is not None


def fused_applies(q, k, v):
    """Whether the Triton kernels run for these tensors (see the module docstring). Never
    while exporting: ``torch.export`` and ONNX get the PyTorch form, which runs anywhere."""
    switch = os.environ.get(FUSED_ENV)
    if switch == '0' or not _triton_importable() or torch.compiler.is_exporting():
        return False
    tensors = (q, k, v)
    devices = {t.device.type for t in tensors}
    if devices == {'cuda'}:
        dtypes = (torch.float32, torch.float16, torch.bfloat16)
    elif devices == {'cpu'} and switch == '1' and _interpreting():
        # asked for explicitly: interpreted kernels are for proving them, far slower
        dtypes = (torch.float32, torch.float16)
    else:
        return False
    return (all(t.dtype in dtypes and t.dim() == 4 for t in tensors)
            and len({t.dtype for t in tensors}) == 1
            and max(q.shape[-1], v.shape[-1]) <= MAX_HEAD_DIMS)


def _kernels():
    from . import linear_attention_triton
    return linear_attention_triton


def _padded(width):
    return max(16, 1 << (int(width) - 1).bit_length())


def _layout(q, v):
    B, H, N, D = q.shape
    E = v.shape[-1]
    blocks = -(-N // BLOCK_N)
    # tokens per program of the passes that sum over tokens: enough programs for the GPU,
    # few partial states to add up (a power of two: one compiled variant per value)
    chunk = 1
    while chunk < 8 and blocks // (2 * chunk) >= 4:
        chunk *= 2
    return B, H, N, D, E, _padded(D), _padded(E), blocks, chunk


def _precision(dtype):
    # float32 inputs: IEEE products, as the PyTorch form computes them (not TF32)
    return 'ieee' if dtype == torch.float32 else 'tf32'


def _products_in_input_dtype(dtype):
    # bf16 holds the state's and the gradients' range; fp16 would overflow on a sum over
    # thousands of tokens or a small normaliser, so its products take float32 (TF32) operands
    return dtype == torch.bfloat16


def _partial_sums(like, programs, blocks, chunk, BD, BE):
    """``(chunks, d x e partials, d partials)``: one float32 sum per chunk of ``chunk`` token
    blocks, added up after the kernel (a few d x e matrices: cheaper than atomics)."""
    chunks = -(-blocks // chunk)
    f32 = dict(device=like.device, dtype=torch.float32)
    return (chunks, torch.empty(programs, chunks, BD, BE, **f32),
            torch.empty(programs, chunks, BD, **f32))


@torch.library.custom_op('linvit_mm::normalised_linear_attention', mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float,
             feature: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kernels = _kernels()
    B, H, N, D, E, BD, BE, blocks, chunk = _layout(q, v)
    chunks, s_part, z_part = _partial_sums(q, B * H, blocks, chunk, BD, BE)
    out = torch.empty(B, H, N, E, device=v.device, dtype=v.dtype)
    feature_id, precision = kernels.FEATURES[feature], _precision(q.dtype)
    narrow = _products_in_input_dtype(q.dtype)
    if N:
        kernels._state_kernel[(B * H, chunks)](
            k, v, s_part, z_part, N, D, E, H, *k.stride(), *v.stride(), FEATURE=feature_id,
            CHUNK=chunk, BLOCK_N=BLOCK_N, BLOCK_D=BD, BLOCK_E=BE, PRECISION=precision,
            NARROW=narrow)
    state, key_sum = s_part.sum(dim=1), z_part.sum(dim=1)
    if N:
        kernels._output_kernel[(B * H, blocks)](
            q, state, key_sum, out, N, D, E, H, float(eps), *q.stride(), *out.stride(),
            FEATURE=feature_id, BLOCK_N=BLOCK_N, BLOCK_D=BD, BLOCK_E=BE, PRECISION=precision,
            NARROW=narrow)
    return out, state, key_sum


@_forward.register_fake
def _forward_fake(q, k, v, eps, feature):
    B, H, N, D, E, BD, BE, _, _ = _layout(q, v)
    return (v.new_empty(B, H, N, E), q.new_empty(B * H, BD, BE, dtype=torch.float32),
            q.new_empty(B * H, BD, dtype=torch.float32))


@torch.library.custom_op('linvit_mm::normalised_linear_attention_backward', mutates_args=())
def _backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 state: torch.Tensor, key_sum: torch.Tensor, eps: float,
                 feature: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kernels = _kernels()
    B, H, N, D, E, BD, BE, blocks, chunk = _layout(q, v)
    chunks, ds_part, dz_part = _partial_sums(q, B * H, blocks, chunk, BD, BE)
    dq, dk, dv = (torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v))
    feature_id, precision = kernels.FEATURES[feature], _precision(q.dtype)
    narrow = _products_in_input_dtype(q.dtype)
    if N:
        kernels._query_grad_kernel[(B * H, chunks)](
            q, grad_out, state, key_sum, dq, ds_part, dz_part, N, D, E, H, float(eps),
            *q.stride(), *grad_out.stride(), *dq.stride(), FEATURE=feature_id, CHUNK=chunk,
            BLOCK_N=BLOCK_N, BLOCK_D=BD, BLOCK_E=BE, PRECISION=precision, NARROW=narrow)
        kernels._key_value_grad_kernel[(B * H, blocks)](
            k, v, ds_part.sum(dim=1), dz_part.sum(dim=1), dk, dv, N, D, E, H, *k.stride(),
            *v.stride(), *dk.stride(), *dv.stride(), FEATURE=feature_id, BLOCK_N=BLOCK_N,
            BLOCK_D=BD, BLOCK_E=BE, PRECISION=precision, NARROW=narrow)
    return dq, dk, dv


@_backward_op.register_fake
def _backward_fake(grad_out, q, k, v, state, key_sum, eps, feature):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, eps, feature = inputs
    _, state, key_sum = output
    ctx.save_for_backward(q, k, v, state, key_sum)
    ctx.eps, ctx.feature = eps, feature


def _backward(ctx, grad_out, grad_state, grad_key_sum):
    # state and key_sum are internal results for the backward: their gradients are unused
    q, k, v, state, key_sum = ctx.saved_tensors
    dq, dk, dv = _backward_op(grad_out, q, k, v, state, key_sum, ctx.eps, ctx.feature)
    return dq, dk, dv, None, None


torch.library.register_autograd('linvit_mm::normalised_linear_attention', _backward,
                                setup_context=_setup_context)


def normalised_linear_attention(q, k, v, eps, feature='identity', fused=None):
    """The core (see the module docstring): the Triton kernels where :func:`fused_applies`
    (unless ``fused=False``), else the PyTorch form; the same value either way."""
    if feature not in FEATURES:
        raise ValueError(f'feature {feature!r}: choose from {", ".join(FEATURES)}')
    if fused is None:
        fused = fused_applies(q, k, v)
    if fused:
        return _forward(q, k, v, float(eps), feature)[0]
    return normalised_linear_attention_torch(q, k, v, eps, feature)
