// ViT^3's inner step (the `ttt` operator's attention), forward and backward.
//
// Two inner models are fitted by one normalised gradient step on an image's keys and values
// and read with its queries (see linvit_mm/models/attention/ttt.py). Per image and head, with
// n tokens, width d, c = n / scale and W = [W1 | W2] of shape (d, 2d):
//
//   z = k W,  g = sigmoid(z2),  T = [v silu(z2) | z1 v silu'(z2)],  G = k^T T
//   W' = W + G / (||G|| + c)          (per column)
//   p = q W',  out = p1 silu(p2)
//
// and per image and channel for the 3x3 depthwise conv model (c3 = H W / scale):
//
//   G3 = corr(k3, v3),  W3' = W3 + G3 / (||G3|| + c3),  out3 = conv(q3, W3')
//
// As separate tensor operations this is about forty autograd nodes and as many passes over
// memory per block, which at 196 tokens cost more than its matrix products. Here the
// products are batched BLAS calls and everything between them is a fused loop run in
// parallel over (image, head) pairs on raw pointers; Python sees one call each way.
//
// Gradient of the step: with u = G / r, r = ||G|| + c (per column),
//   du/dG . D = D / r - G (sum_rows D G) / (r^2 ||G||)   (the second term vanishes with G).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "heads.h"
#include "vector_math.h"

namespace linvit_mm {

void depthwise3x3_into(const at::Tensor& input, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias, bool residual, int64_t H, int64_t W,
                       bool flip, at::Tensor out);
at::Tensor correlate3x3(const at::Tensor& a, const at::Tensor& g, int64_t H, int64_t W);

namespace {

// sigmoid inside the fused loops, on the vectorisable exp of vector_math.h for float
template <typename T>
inline T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

template <>
inline float sigmoid<float>(float x) {
  return 1.f / (1.f + exp_vectorisable(-x));
}

// The loops read and write row halves through separate pointers; `ivdep` tells the compiler
// they never overlap, which it cannot prove for this many.

template <typename T>
void fit_terms(const Heads<const T>& z, const Heads<const T>& v, const Heads<T>& terms,
               int64_t b, int64_t h, int64_t n, int64_t d) {
  for (int64_t i = 0; i < n; ++i) {
    const T *z1 = z.row(b, h, i), *z2 = z1 + d, *vv = v.row(b, h, i);
    T *m1 = terms.row(b, h, i), *m2 = m1 + d;
#pragma GCC ivdep
    for (int64_t j = 0; j < d; ++j) {
      const T g = sigmoid(z2[j]), vg = vv[j] * g, a = vg * z2[j];
      m1[j] = a;                                // v silu(z2)
      m2[j] = z1[j] * (vg + a * (T(1) - g));    // z1 v silu'(z2)
    }
  }
}

template <typename T>
void fit_terms_backward(const Heads<const T>& z, const Heads<const T>& v,
                        const Heads<const T>& grad_terms, const Heads<T>& grad_z,
                        const Heads<T>& grad_v, int64_t b, int64_t h, int64_t n, int64_t d) {
  const T one(1), two(2);
  for (int64_t i = 0; i < n; ++i) {
    const T *z1 = z.row(b, h, i), *z2 = z1 + d, *vv = v.row(b, h, i),
            *da = grad_terms.row(b, h, i), *db = da + d;
    T *dz1 = grad_z.row(b, h, i), *dz2 = dz1 + d, *dv = grad_v.row(b, h, i);
#pragma GCC ivdep
    for (int64_t j = 0; j < d; ++j) {
      const T s = z2[j], gj = sigmoid(s);
      const T silu = s * gj;
      const T silu1 = gj * (one + s * (one - gj));
      const T silu2 = gj * (one - gj) * (two + s * (one - two * gj));
      dz1[j] = db[j] * vv[j] * silu1;
      dz2[j] = vv[j] * (da[j] * silu1 + db[j] * z1[j] * silu2);
      dv[j] = da[j] * silu + db[j] * z1[j] * silu1;
    }
  }
}

template <typename T>
void read(const Heads<const T>& p, const Heads<T>& out, int64_t b, int64_t h, int64_t n,
          int64_t d) {
  for (int64_t i = 0; i < n; ++i) {
    const T *p1 = p.row(b, h, i), *p2 = p1 + d;
    T* o = out.row(b, h, i);
#pragma GCC ivdep
    for (int64_t j = 0; j < d; ++j) o[j] = p1[j] * p2[j] * sigmoid(p2[j]);
  }
}

template <typename T>
void read_backward(const Heads<const T>& p, const Heads<const T>& grad_out,
                   const Heads<T>& grad_p, int64_t b, int64_t h, int64_t n, int64_t d) {
  const T one(1);
  for (int64_t i = 0; i < n; ++i) {
    const T *p1 = p.row(b, h, i), *p2 = p1 + d, *go = grad_out.row(b, h, i);
    T *dp1 = grad_p.row(b, h, i), *dp2 = dp1 + d;
#pragma GCC ivdep
    for (int64_t j = 0; j < d; ++j) {
      const T g = sigmoid(p2[j]), grad_g = go[j] * g;
      dp1[j] = grad_g * p2[j];
      dp2[j] = grad_g * p1[j] * (one + p2[j] * (one - g));
    }
  }
}

// dst = src row by row, for a (B, heads, n, d) view (a slot of the qkv gradient)
template <typename T>
void copy_rows(const Heads<const T>& src, const Heads<T>& dst, int64_t b, int64_t h, int64_t n,
               int64_t d) {
  for (int64_t i = 0; i < n; ++i) std::memcpy(dst.row(b, h, i), src.row(b, h, i), d * sizeof(T));
}

// fitted = init + grad / (||grad|| + offset) for a rows x cols block, norms over the rows.
template <typename T>
void step(const T* init, const T* grad, T offset, T* norm, T* fitted, int64_t rows,
          int64_t cols) {
  std::fill(norm, norm + cols, T(0));
  for (int64_t i = 0; i < rows; ++i) {
    const T* gi = grad + i * cols;
#pragma GCC ivdep
    for (int64_t j = 0; j < cols; ++j) norm[j] += gi[j] * gi[j];
  }
  std::vector<T> inv(cols);
  for (int64_t j = 0; j < cols; ++j) {
    norm[j] = std::sqrt(norm[j]);
    inv[j] = T(1) / (norm[j] + offset);
  }
  for (int64_t i = 0; i < rows; ++i) {
    const T *wi = init + i * cols, *gi = grad + i * cols;
    T* fi = fitted + i * cols;
#pragma GCC ivdep
    for (int64_t j = 0; j < cols; ++j) fi[j] = wi[j] + gi[j] * inv[j];
  }
}

template <typename T>
void step_backward(const T* grad_fitted, const T* grad, const T* norm, T offset, T* grad_grad,
                   int64_t rows, int64_t cols) {
  std::vector<T> dot(cols, T(0)), inv(cols), radial(cols);
  for (int64_t i = 0; i < rows; ++i) {
    const T *di = grad_fitted + i * cols, *gi = grad + i * cols;
#pragma GCC ivdep
    for (int64_t j = 0; j < cols; ++j) dot[j] += di[j] * gi[j];
  }
  for (int64_t j = 0; j < cols; ++j) {
    inv[j] = T(1) / (norm[j] + offset);
    radial[j] = dot[j] * inv[j] * inv[j] / std::max(norm[j], std::numeric_limits<T>::min());
  }
  for (int64_t i = 0; i < rows; ++i) {
    const T *di = grad_fitted + i * cols, *gi = grad + i * cols;
    T* oi = grad_grad + i * cols;
#pragma GCC ivdep
    for (int64_t j = 0; j < cols; ++j) oi[j] = di[j] * inv[j] - gi[j] * radial[j];
  }
}

// The fused qkv (B, N, 3 heads + 3, d) as q, k, v (B, heads, N, d) and the conv head's q3, k3,
// v3 (B, N, d), all views.
struct QKV {
  at::Tensor q, k, v, q3, k3, v3;
  QKV(const at::Tensor& qkv, int64_t heads, int64_t d) {
    const auto parts = qkv.view({qkv.size(0), qkv.size(1), 3 * heads + 3, d});
    q = parts.narrow(2, 0, heads).transpose(1, 2);
    k = parts.narrow(2, heads, heads).transpose(1, 2);
    v = parts.narrow(2, 2 * heads, heads).transpose(1, 2);
    q3 = parts.select(2, 3 * heads);
    k3 = parts.select(2, 3 * heads + 1);
    v3 = parts.select(2, 3 * heads + 2);
  }
};

void check_inputs(const at::Tensor& qkv, const at::Tensor& w1, const at::Tensor& w2,
                  const at::Tensor& w3, int64_t heads, int64_t num_extra, int64_t H, int64_t W) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous() && qkv.device().is_cpu(),
              "qkv must be a contiguous (B, N, 3C + 3d) CPU tensor, got ", qkv.sizes());
  TORCH_CHECK(w1.dim() == 4 && w1.size(0) == 1 && w1.size(1) == heads &&
                  w1.size(2) == w1.size(3) && w2.sizes() == w1.sizes(),
              "w1 and w2 must be (1, heads, d, d), got ", w1.sizes(), " and ", w2.sizes());
  const int64_t d = w1.size(2);
  TORCH_CHECK(qkv.size(2) == (3 * heads + 3) * d, "qkv has ", qkv.size(2),
              " channels, (3 heads + 3) d = ", (3 * heads + 3) * d, " expected");
  TORCH_CHECK(w3.dim() == 4 && w3.size(0) == d && w3.size(1) == 1 && w3.size(2) == 3 &&
                  w3.size(3) == 3,
              "w3 must be (d, 1, 3, 3), got ", w3.sizes());
  TORCH_CHECK(num_extra >= 0 && qkv.size(1) == num_extra + H * W, "qkv has ", qkv.size(1),
              " tokens, ", num_extra, " extra + ", H, "x", W, " patches expected");
  TORCH_CHECK(w1.scalar_type() == qkv.scalar_type() && w2.scalar_type() == qkv.scalar_type() &&
                  w3.scalar_type() == qkv.scalar_type(),
              "qkv, w1, w2 and w3 dtypes differ");
}

}  // namespace

// Returns {out (B, N, (heads + 1) d), then what ttt_inner_backward needs}. w1, w2 are the
// SwiGLU inner model's initial weights (1, heads, d, d), w3 the conv model's (d, 1, 3, 3).
std::vector<at::Tensor> ttt_inner_forward(const at::Tensor& qkv, const at::Tensor& w1,
                                          const at::Tensor& w2, const at::Tensor& w3_kernel,
                                          int64_t heads, int64_t num_extra, int64_t H, int64_t W,
                                          double inner_scale) {
  check_inputs(qkv, w1, w2, w3_kernel, heads, num_extra, H, W);
  const int64_t B = qkv.size(0), N = qkv.size(1), d = w1.size(2), P = H * W;
  const auto w12 = at::cat({w1, w2}, 3);                              // (1, heads, d, 2d)
  const auto w3 = w3_kernel.reshape({d, 9}).t().contiguous().unsqueeze(0);  // (1, 9, d) taps
  const QKV in(qkv, heads, d);
  auto out = at::empty({B, N, heads + 1, d}, qkv.options());
  const auto out_heads = out.narrow(2, 0, heads).transpose(1, 2);

  const auto z = at::matmul(in.k, w12);
  auto terms = at::empty_like(z);
  auto norm = at::empty({B, heads, 1, 2 * d}, qkv.options());
  auto w12_fit = at::empty({B, heads, d, 2 * d}, qkv.options());
  at::Tensor grad, p;
  AT_DISPATCH_FLOATING_TYPES(qkv.scalar_type(), "ttt_inner_forward", [&] {
    using T = scalar_t;
    for_heads(B, heads, [&](int64_t b, int64_t h) {
      fit_terms<T>(Heads<const T>(z), Heads<const T>(in.v), Heads<T>(terms), b, h, N, d);
    });
    grad = at::matmul(in.k.transpose(2, 3), terms);
    const T offset = T(N / inner_scale);
    for_heads(B, heads, [&](int64_t b, int64_t h) {
      const int64_t block = (b * heads + h) * d * 2 * d;
      step<T>(w12.data_ptr<T>() + h * d * 2 * d, grad.data_ptr<T>() + block, offset,
              norm.data_ptr<T>() + (b * heads + h) * 2 * d, w12_fit.data_ptr<T>() + block, d,
              2 * d);
    });
    p = at::matmul(in.q, w12_fit);
    for_heads(B, heads, [&](int64_t b, int64_t h) {
      read<T>(Heads<const T>(p), Heads<T>(out_heads), b, h, N, d);
    });
  });

  // the conv model is fitted on the patch grid; extra tokens are 1 x 1 images of their own,
  // which only the centre tap reaches
  const auto k3 = in.k3.narrow(1, num_extra, P), v3 = in.v3.narrow(1, num_extra, P),
             q3 = in.q3.narrow(1, num_extra, P);
  const auto grad3 = correlate3x3(k3, v3, H, W);
  auto norm3 = at::empty({B, 1, d}, qkv.options());
  auto w3_fit = at::empty({B, 9, d}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES(qkv.scalar_type(), "ttt_inner_conv_step", [&] {
    using T = scalar_t;
    for (int64_t b = 0; b < B; ++b)
      step<T>(w3.data_ptr<T>(), grad3.data_ptr<T>() + b * 9 * d, T(P / inner_scale),
              norm3.data_ptr<T>() + b * d, w3_fit.data_ptr<T>() + b * 9 * d, 9, d);
  });
  const auto out3 = out.select(2, heads);
  depthwise3x3_into(q3, w3_fit, c10::nullopt, false, H, W, false, out3.narrow(1, num_extra, P));
  if (num_extra)
    out3.narrow(1, 0, num_extra).copy_(in.q3.narrow(1, 0, num_extra) * w3_fit.narrow(1, 4, 1));
  return {out.view({B, N, (heads + 1) * d}), z, terms, grad, norm, w12_fit, p, grad3, norm3,
          w3_fit, w12};
}

// Returns {grad_qkv (B, N, 3C + 3d), grad_w1, grad_w2 (1, heads, d, d), grad_w3 (d, 1, 3, 3)}.
std::vector<at::Tensor> ttt_inner_backward(const at::Tensor& grad_out_flat,
                                           const std::vector<at::Tensor>& saved,
                                           const at::Tensor& qkv, int64_t heads,
                                           int64_t num_extra, int64_t H, int64_t W,
                                           double inner_scale) {
  TORCH_CHECK(saved.size() == 10, "saved must be what ttt_inner_forward returned after out");
  const auto& w12 = saved[9];
  const int64_t B = qkv.size(0), N = qkv.size(1), d = w12.size(2), P = H * W;
  TORCH_CHECK(grad_out_flat.sizes() == at::IntArrayRef({B, N, (heads + 1) * d}),
              "grad_out must be (B, N, (heads + 1) d), got ", grad_out_flat.sizes());
  const auto &z = saved[0], &terms = saved[1], &grad = saved[2], &norm = saved[3],
             &w12_fit = saved[4], &p = saved[5], &grad3 = saved[6], &norm3 = saved[7],
             &w3_fit = saved[8];
  const QKV in(qkv, heads, d);
  const auto grad_out = grad_out_flat.contiguous().view({B, N, heads + 1, d});
  auto grad_qkv = at::empty_like(qkv);
  const QKV gin(grad_qkv, heads, d);
  const auto grad_out_heads = grad_out.narrow(2, 0, heads).transpose(1, 2);

  auto grad_p = at::empty_like(p);
  auto grad_grad = at::empty_like(grad);
  auto grad_z = at::empty_like(z);
  at::Tensor grad_fitted;
  AT_DISPATCH_FLOATING_TYPES(qkv.scalar_type(), "ttt_inner_backward", [&] {
    using T = scalar_t;
    for_heads(B, heads, [&](int64_t b, int64_t h) {
      read_backward<T>(Heads<const T>(p), Heads<const T>(grad_out_heads), Heads<T>(grad_p), b,
                       h, N, d);
    });
    const auto grad_q = at::matmul(grad_p, w12_fit.transpose(2, 3));
    for_heads(B, heads, [&](int64_t b, int64_t h) {
      copy_rows<T>(Heads<const T>(grad_q), Heads<T>(gin.q), b, h, N, d);
    });
    grad_fitted = at::matmul(in.q.transpose(2, 3), grad_p);
    const T offset = T(N / inner_scale);
    for_heads(B, heads, [&](int64_t b, int64_t h) {
      const int64_t block = (b * heads + h) * d * 2 * d;
      step_backward<T>(grad_fitted.data_ptr<T>() + block, grad.data_ptr<T>() + block,
                       norm.data_ptr<T>() + (b * heads + h) * 2 * d, offset,
                       grad_grad.data_ptr<T>() + block, d, 2 * d);
    });
    const auto grad_terms = at::matmul(in.k, grad_grad);
    for_heads(B, heads, [&](int64_t b, int64_t h) {
      fit_terms_backward<T>(Heads<const T>(z), Heads<const T>(in.v), Heads<const T>(grad_terms),
                            Heads<T>(grad_z), Heads<T>(gin.v), b, h, N, d);
    });
  });
  // products accumulated in place over (image, head) batches: k's two gradient terms, and
  // w12's from the step and from the fit
  const auto flat = [&](const at::Tensor& t) { return t.expand({B, heads, t.size(2), t.size(3)})
                                                   .reshape({B * heads, t.size(2), t.size(3)}); };
  auto grad_k = at::matmul(terms, grad_grad.transpose(2, 3));
  flat(grad_k).baddbmm_(flat(grad_z), flat(w12).transpose(1, 2));
  AT_DISPATCH_FLOATING_TYPES(qkv.scalar_type(), "ttt_inner_grad_k", [&] {
    for_heads(B, heads, [&](int64_t b, int64_t h) {
      copy_rows<scalar_t>(Heads<const scalar_t>(grad_k), Heads<scalar_t>(gin.k), b, h, N, d);
    });
  });
  flat(grad_fitted).baddbmm_(flat(in.k).transpose(1, 2), flat(grad_z));
  const auto grad_w12 = grad_fitted.sum(0, true).chunk(2, 3);

  // conv model: readout, step, fit
  const auto q3 = in.q3.narrow(1, num_extra, P), k3 = in.k3.narrow(1, num_extra, P),
             v3 = in.v3.narrow(1, num_extra, P);
  const auto grad_out3 = grad_out.select(2, heads);
  const auto grad_out3_patches = grad_out3.narrow(1, num_extra, P);
  auto grad_w3_fit = correlate3x3(q3, grad_out3_patches, H, W);
  const auto no_bias = c10::nullopt;
  depthwise3x3_into(grad_out3_patches, w3_fit, no_bias, false, H, W, true,
                    gin.q3.narrow(1, num_extra, P));
  if (num_extra) {
    const auto grad_extra = grad_out3.narrow(1, 0, num_extra);
    gin.q3.narrow(1, 0, num_extra).copy_(grad_extra * w3_fit.narrow(1, 4, 1));
    grad_w3_fit.select(1, 4).add_((grad_extra * in.q3.narrow(1, 0, num_extra)).sum(1));
    // the extra tokens' keys and values take no part in the conv fit
    gin.k3.narrow(1, 0, num_extra).zero_();
    gin.v3.narrow(1, 0, num_extra).zero_();
  }
  auto grad_grad3 = at::empty_like(grad3);
  AT_DISPATCH_FLOATING_TYPES(qkv.scalar_type(), "ttt_inner_conv_step_backward", [&] {
    using T = scalar_t;
    for (int64_t b = 0; b < B; ++b)
      step_backward<T>(grad_w3_fit.data_ptr<T>() + b * 9 * d, grad3.data_ptr<T>() + b * 9 * d,
                       norm3.data_ptr<T>() + b * d, T(P / inner_scale),
                       grad_grad3.data_ptr<T>() + b * 9 * d, 9, d);
  });
  depthwise3x3_into(v3, grad_grad3, no_bias, false, H, W, true, gin.k3.narrow(1, num_extra, P));
  depthwise3x3_into(k3, grad_grad3, no_bias, false, H, W, false, gin.v3.narrow(1, num_extra, P));
  return {grad_qkv, grad_w12[0], grad_w12[1], grad_w3_fit.sum(0).t().reshape({d, 1, 3, 3})};
}

}  // namespace linvit_mm
