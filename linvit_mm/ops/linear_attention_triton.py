"""Triton kernels of the non-causal normalised linear-attention core.

For one (image, head), with feature maps ``phi`` applied to the queries and keys:

    S = sum_j phi(k_j) v_j^T        (d x e)      z = sum_j phi(k_j)        (d)
    o_i = phi(q_i)^T S / (phi(q_i)^T z + eps)

and the gradients, with ``den_i = phi(q_i)^T z + eps``, ``g_i = do_i / den_i`` and
``r_i = g_i . o_i``:

    dphi(q_i) = S g_i - r_i z          dS = sum_i phi(q_i) g_i^T      dz = -sum_i r_i phi(q_i)
    dphi(k_j) = dS v_j + dz            dv_j = dS^T phi(k_j)

Four kernels, each reading its token blocks once: the state (partial sums over chunks of
tokens, added up in PyTorch: a few d x e matrices), the output, and the backward's query and
key / value passes. Inputs are read in their dtype through their strides (the head views of a
fused qkv projection need no copy); products accumulate in float32 (``tl.dot``), the state
is kept in float32; products take bf16 operands for bf16 inputs and float32 ones otherwise
(fp16 would overflow on a state summed over thousands of tokens). ``feature`` fuses the map as
a prologue: ``'relu'``, ``'elu'`` (``elu(x) + 1``) or ``'identity'`` (features computed
before, e.g. hedgehog's). Padding tokens and channels are zeroed *after* the map (``elu + 1``
of a padded zero would be 1 and add a phantom key).

Imported only where the kernels run (a CUDA tensor, or ``TRITON_INTERPRET=1`` on the CPU,
which must be set before this module is imported); :mod:`linvit_mm.ops.linear_attention`
registers them as one custom op.
"""
import triton
import triton.language as tl

FEATURES = {'identity': 0, 'relu': 1, 'elu': 2}


@triton.jit
def _feature(x, FEATURE: tl.constexpr):
    if FEATURE == 1:
        x = tl.maximum(x, 0.)
    elif FEATURE == 2:
        x = tl.where(x > 0, x + 1., tl.exp(tl.minimum(x, 0.)))
    return x


@triton.jit
def _feature_grad(x, FEATURE: tl.constexpr):
    """d phi / d x, elementwise (relu: 0 at 0, as torch; elu + 1: 1 at 0)."""
    if FEATURE == 1:
        grad = tl.where(x > 0, 1., 0.)
    elif FEATURE == 2:
        grad = tl.where(x > 0, 1., tl.exp(tl.minimum(x, 0.)))
    else:
        grad = tl.full(x.shape, 1., tl.float32)
    return grad


@triton.jit
def _operand(x, like, NARROW: tl.constexpr):
    """A product's operand: in the inputs' dtype where that is bf16 (``NARROW``), else
    float32; products accumulate in float32 either way."""
    if NARROW:
        x = x.to(like.dtype.element_ty)
    else:
        x = x.to(tl.float32)
    return x


@triton.jit
def _state_pointers(S, Z, index, offs_d, offs_e, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr):
    """Pointers to the ``index``-th (BLOCK_D, BLOCK_E) state and (BLOCK_D, ) key sum of
    contiguous float32 buffers: the layout the passes write their partial sums in and read
    the added-up ones from."""
    return (S + index * BLOCK_D * BLOCK_E + offs_d[:, None] * BLOCK_E + offs_e[None, :],
            Z + index * BLOCK_D + offs_d)


@triton.jit
def _block(ptr, stride_n, stride_c, offs_n, offs_c, N, C):
    """A (BLOCK_N, BLOCK_C) tile, zero outside the N tokens and C channels, in float32."""
    mask = (offs_n[:, None] < N) & (offs_c[None, :] < C)
    tile = tl.load(ptr + offs_n[:, None] * stride_n + offs_c[None, :] * stride_c, mask=mask,
                   other=0.)
    return tile.to(tl.float32), mask


@triton.jit
def _state_kernel(K, V, S_PART, Z_PART, N, D, E, H,
                  skb, skh, skn, skd, svb, svh, svn, sve,
                  FEATURE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, PRECISION: tl.constexpr,
                  NARROW: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_E)
    k_ptr = K + b * skb + h * skh
    v_ptr = V + b * svb + h * svh
    s = tl.zeros((BLOCK_D, BLOCK_E), tl.float32)
    z = tl.zeros((BLOCK_D, ), tl.float32)
    for i in range(CHUNK):
        offs_n = (pid_c * CHUNK + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        k, k_mask = _block(k_ptr, skn, skd, offs_n, offs_d, N, D)
        v, _ = _block(v_ptr, svn, sve, offs_n, offs_e, N, E)
        fk = tl.where(k_mask, _feature(k, FEATURE), 0.)
        s += tl.dot(_operand(tl.trans(fk), V, NARROW), _operand(v, V, NARROW),
                    input_precision=PRECISION)
        z += tl.sum(fk, axis=0)
    n_chunks = tl.num_programs(1)
    part = pid_bh * n_chunks + pid_c
    s_ptrs, z_ptrs = _state_pointers(S_PART, Z_PART, part, offs_d, offs_e, BLOCK_D, BLOCK_E)
    tl.store(s_ptrs, s)
    tl.store(z_ptrs, z)


@triton.jit
def _output_kernel(Q, S, Z, OUT, N, D, E, H, eps,
                   sqb, sqh, sqn, sqd, sob, soh, son, soe,
                   FEATURE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_E: tl.constexpr, PRECISION: tl.constexpr, NARROW: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_E)
    q, q_mask = _block(Q + b * sqb + h * sqh, sqn, sqd, offs_n, offs_d, N, D)
    fq = tl.where(q_mask, _feature(q, FEATURE), 0.)
    s_ptrs, z_ptrs = _state_pointers(S, Z, pid_bh, offs_d, offs_e, BLOCK_D, BLOCK_E)
    s = tl.load(s_ptrs)
    z = tl.load(z_ptrs)
    numerator = tl.dot(_operand(fq, Q, NARROW), _operand(s, Q, NARROW),
                       input_precision=PRECISION)
    denominator = tl.sum(fq * z[None, :], axis=1) + eps
    out = numerator / denominator[:, None]
    o_mask = (offs_n[:, None] < N) & (offs_e[None, :] < E)
    tl.store(OUT + b * sob + h * soh + offs_n[:, None] * son + offs_e[None, :] * soe,
             out.to(OUT.dtype.element_ty), mask=o_mask)


@triton.jit
def _query_grad_kernel(Q, DO, S, Z, DQ, DS_PART, DZ_PART, N, D, E, H, eps,
                       sqb, sqh, sqn, sqd, sgb, sgh, sgn, sge, sdb, sdh, sdn, sdd,
                       FEATURE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                       PRECISION: tl.constexpr, NARROW: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_E)
    q_ptr = Q + b * sqb + h * sqh
    g_ptr = DO + b * sgb + h * sgh
    dq_ptr = DQ + b * sdb + h * sdh
    s_ptrs, z_ptrs = _state_pointers(S, Z, pid_bh, offs_d, offs_e, BLOCK_D, BLOCK_E)
    s = tl.load(s_ptrs)
    z = tl.load(z_ptrs)
    ds = tl.zeros((BLOCK_D, BLOCK_E), tl.float32)
    dz = tl.zeros((BLOCK_D, ), tl.float32)
    for i in range(CHUNK):
        offs_n = (pid_c * CHUNK + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        q, q_mask = _block(q_ptr, sqn, sqd, offs_n, offs_d, N, D)
        grad_out, _ = _block(g_ptr, sgn, sge, offs_n, offs_e, N, E)
        fq = tl.where(q_mask, _feature(q, FEATURE), 0.)
        denominator = tl.sum(fq * z[None, :], axis=1) + eps
        out = tl.dot(_operand(fq, Q, NARROW), _operand(s, Q, NARROW),
                     input_precision=PRECISION) / denominator[:, None]
        g = grad_out / denominator[:, None]
        r = tl.sum(g * out, axis=1)
        dfq = tl.dot(_operand(g, Q, NARROW), _operand(tl.trans(s), Q, NARROW),
                     input_precision=PRECISION)
        dfq -= r[:, None] * z[None, :]
        dq = tl.where(q_mask, dfq * _feature_grad(q, FEATURE), 0.)
        tl.store(dq_ptr + offs_n[:, None] * sdn + offs_d[None, :] * sdd,
                 dq.to(DQ.dtype.element_ty), mask=q_mask)
        ds += tl.dot(_operand(tl.trans(fq), Q, NARROW), _operand(g, Q, NARROW),
                     input_precision=PRECISION)
        dz -= tl.sum(fq * r[:, None], axis=0)
    n_chunks = tl.num_programs(1)
    part = pid_bh * n_chunks + pid_c
    ds_ptrs, dz_ptrs = _state_pointers(DS_PART, DZ_PART, part, offs_d, offs_e, BLOCK_D,
                                       BLOCK_E)
    tl.store(ds_ptrs, ds)
    tl.store(dz_ptrs, dz)


@triton.jit
def _key_value_grad_kernel(K, V, DS, DZ, DK, DV, N, D, E, H,
                           skb, skh, skn, skd, svb, svh, svn, sve,
                           sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdve,
                           FEATURE: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                           PRECISION: tl.constexpr, NARROW: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_E)
    k, k_mask = _block(K + b * skb + h * skh, skn, skd, offs_n, offs_d, N, D)
    v, v_mask = _block(V + b * svb + h * svh, svn, sve, offs_n, offs_e, N, E)
    fk = tl.where(k_mask, _feature(k, FEATURE), 0.)
    ds_ptrs, dz_ptrs = _state_pointers(DS, DZ, pid_bh, offs_d, offs_e, BLOCK_D, BLOCK_E)
    ds = tl.load(ds_ptrs)
    dz = tl.load(dz_ptrs)
    dfk = tl.dot(_operand(v, K, NARROW), _operand(tl.trans(ds), K, NARROW),
                 input_precision=PRECISION) + dz[None, :]
    dk = tl.where(k_mask, dfk * _feature_grad(k, FEATURE), 0.)
    dv = tl.dot(_operand(fk, K, NARROW), _operand(ds, K, NARROW), input_precision=PRECISION)
    tl.store(DK + b * sdkb + h * sdkh + offs_n[:, None] * sdkn + offs_d[None, :] * sdkd,
             dk.to(DK.dtype.element_ty), mask=k_mask)
    tl.store(DV + b * sdvb + h * sdvh + offs_n[:, None] * sdvn + offs_e[None, :] * sdve,
             dv.to(DV.dtype.element_ty), mask=v_mask)
