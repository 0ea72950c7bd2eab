// Hedgehog attention's fast form (the `hedgehog` operator, linvit_mm/models/attention/
// hedgehog.py, which derives it), forward and backward.
//
// Per image and head, with x = q W (or k W_k; d x d maps) and L the log-features, [x, -x] or,
// with the softmax map, the log-softmax of each half:
//
//   c = max_tokens L(K)                   (per feature; no gradient, nothing depends on it)
//   phi = exp(L(K) - c),  z = sum_tokens phi,  S = V^T phi        (d x 2d)
//   U = (S / z)^T   (2d x d),   kappa = c + log z
//   A = softmax_features(L(Q) + kappa),   out = A U
//
// The softmax map has a second form, which a head takes when it is exact in the type (see
// probability_floor): with p = exp(L) the per-half probabilities, the shift c can be any
// per-feature constant, and c = 0 gives
//
//   phi = p(K),  z = Z = sum_tokens p(K) = exp(kappa),  A = p(Q) * Z / (p(Q) . Z)
//
// which needs no exponential beyond the softmaxes themselves: half of the log form's.
// Nothing downstream depends on c, so both forms share the backward.
//
// As tensor operations this is about twenty calls and autograd nodes per block; here the
// softmaxes, exponentials and sums are fused loops on raw pointers and the products are
// batched BLAS calls. The second half of the features is built from -x in those loops, so
// the feature maps cost N d^2 per head, not the 2 N d^2 of a product with [W | -W].
// Backward, with G the gradient of out:
//
//   dA = G U^T,  dU = A^T G,  dlogits = A * (dA - rowsum(dA * A)),  dkappa = colsum(dlogits)
//   dS[c, m] = dU[m, c] / z[m],  dz[m] = (dkappa[m] - sum_c dU[m, c] U[m, c]) / z[m]
//   dphi = V dS + dz,  dV = phi dS^T,  dL(K) = dphi * phi
//
// then through each log-softmax half, dx = dy - p sum_half(dy), the two halves
// (dx = dL[:, :d] - dL[:, d:]) and the maps.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "heads.h"
#include "vector_math.h"

namespace linvit_mm {
namespace {

// out <- L(x) = [x, -x], or each half's log-softmax: [x - lse(x), -x - lse(-x)]; x holds
// n values, out 2n, scratch n.
template <typename T>
inline void log_features(const T* __restrict__ x, T* __restrict__ out, int64_t n,
                         bool softmax_map, T* __restrict__ scratch) {
  T* __restrict__ negative = out + n;
  if (!softmax_map) {
    for (int64_t i = 0; i < n; ++i) {
      out[i] = x[i];
      negative[i] = -x[i];
    }
    return;
  }
  T top = max_of(x, n);
  for (int64_t i = 0; i < n; ++i) scratch[i] = exp_vectorisable(x[i] - top);
  const T shift = top + std::log(sum_of(scratch, n));
  for (int64_t i = 0; i < n; ++i) {
    out[i] = x[i] - shift;
    negative[i] = -x[i];
  }
  top = max_of(negative, n);
  for (int64_t i = 0; i < n; ++i) scratch[i] = exp_vectorisable(negative[i] - top);
  const T negative_shift = top + std::log(sum_of(scratch, n));
  for (int64_t i = 0; i < n; ++i) negative[i] -= negative_shift;
}

// dx from dL (2n values, overwritten): through each log-softmax half (p its probabilities,
// as half_softmaxes wrote them), dy - p sum_half(dy), then the two halves' difference
template <typename T>
inline void log_features_backward(const T* __restrict__ prob, T* __restrict__ grad,
                                  T* __restrict__ grad_x, int64_t n, bool softmax_map) {
  T* __restrict__ negative = grad + n;
  if (softmax_map) {
    const T sum = sum_of(grad, n), negative_sum = sum_of(negative, n);
    for (int64_t i = 0; i < n; ++i) {
      grad[i] -= prob[i] * sum;
      negative[i] -= prob[n + i] * negative_sum;
    }
  }
  for (int64_t i = 0; i < n; ++i) grad_x[i] = grad[i] - negative[i];
}

// p <- [softmax(x), softmax(-x)], each over the n values of x (p holds 2n). With
// e_i = exp(x_i - max x), softmax(-x)_i is proportional to 1 / e_i: a division where an
// exponential would be, exact as long as no e_i fell to the exponential's floor. A sum of
// the 1 / e_i at most exp(80) guarantees that (each e_i is then at least exp(-80)); past it,
// the second half takes its own exponentials.
template <typename T>
inline void half_softmaxes(const T* __restrict__ x, T* __restrict__ p, int64_t n) {
  T* __restrict__ negative = p + n;
  const T top = max_of(x, n);
  for (int64_t i = 0; i < n; ++i) p[i] = exp_vectorisable(x[i] - top);
  for (int64_t i = 0; i < n; ++i) negative[i] = T(1) / p[i];
  T negative_sum = sum_of(negative, n);
  if (!(negative_sum <= T(5.54062238439351e34))) {  // exp(80); also catches inf
    for (int64_t i = 0; i < n; ++i) negative[i] = -x[i];
    const T negative_top = max_of(negative, n);
    for (int64_t i = 0; i < n; ++i) negative[i] = exp_vectorisable(negative[i] - negative_top);
    negative_sum = sum_of(negative, n);
  }
  const T inv = T(1) / sum_of(p, n), negative_inv = T(1) / negative_sum;
  for (int64_t i = 0; i < n; ++i) {
    p[i] *= inv;
    negative[i] *= negative_inv;
  }
}

// The smallest key sum of p(K) per feature with which a head takes the probability form:
// a probability the exponential flushed to its floor (or below the normal range) errs by at
// most the smallest normal number, which against a sum of at least its square root is a
// relative error of the same size, far below the type's precision. Each query's weights then
// sum, before their normalisation, to at least 2 floors (p(q) sums to 1 in each half).
template <typename T>
inline T probability_floor() {
  return std::sqrt(std::numeric_limits<T>::min());
}

void check_heads(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.dim() == 4 && t.sizes() == like.sizes(), name, " must be shaped like q ",
              like.sizes(), ", got ", t.sizes());
  TORCH_CHECK(t.stride(3) == 1 && t.device().is_cpu(), name,
              " must be a CPU tensor with a channel stride of 1");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), "q, k, v and the maps' dtypes differ");
}

}  // namespace

// Returns {out (B, heads, N, d), then what hedgehog_backward needs}. q, k, v: (B, heads, N, d)
// heads; map_q, map_k: (heads, d, d), the W of the queries and of the keys; softmax_map:
// the log-features are each half's log-softmax (else [x, -x]).
std::vector<at::Tensor> hedgehog_forward(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& map_q,
                                         const at::Tensor& map_k, bool softmax_map) {
  check_heads(q, "q", q);
  check_heads(k, "k", q);
  check_heads(v, "v", q);
  const int64_t B = q.size(0), heads = q.size(1), N = q.size(2), d = q.size(3), F = 2 * d;
  for (const auto* w : {&map_q, &map_k}) {
    TORCH_CHECK(w->dim() == 3 && w->size(0) == heads && w->size(1) == d && w->size(2) == d,
                "the maps must be (", heads, ", ", d, ", ", d, "), got ", w->sizes());
    TORCH_CHECK(w->scalar_type() == q.scalar_type(), "q, k, v and the maps' dtypes differ");
  }
  const auto options = q.options();
  const auto key_x = at::matmul(k, map_k);                                  // (B, h, N, d)
  auto phi = at::empty({B, heads, N, F}, options);
  auto key_sum = at::empty({B, heads, 1, F}, options);                      // z
  auto key_mass = at::empty({B, heads, 1, F}, options);                     // kappa
  // the softmax map's per-half probabilities p(K), which its backward needs
  at::Tensor prob_k = at::empty({0}, options);
  // per (image, head): phi = p(K) unshifted (the probability form) or the log form
  std::vector<char> probability_form(B * heads, 0);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "hedgehog_keys", [&] {
    using T = scalar_t;
    const Heads<const T> x(key_x);
    const Heads<T> ph(phi), z(key_sum), kappa(key_mass);
    if (softmax_map) {
      for_heads(B, heads, [&](int64_t b, int64_t h) {
        T* __restrict__ sum = z.row(b, h, 0);
        std::fill(sum, sum + F, T(0));
        for (int64_t i = 0; i < N; ++i) {
          T* __restrict__ row = ph.row(b, h, i);
          half_softmaxes(x.row(b, h, i), row, d);
          for (int64_t m = 0; m < F; ++m) sum[m] += row[m];
        }
        probability_form[b * heads + h] =
            *std::min_element(sum, sum + F) >= probability_floor<T>();
      });
      // phi is p(K) now; the log form below overwrites it in its heads, so where there are
      // any (features past the type's range), p(K) is kept in a copy first
      const bool all_probabilities = std::all_of(
          probability_form.begin(), probability_form.end(), [](char form) { return form; });
      prob_k = all_probabilities ? phi : phi.clone();
    }
    for_heads(B, heads, [&](int64_t b, int64_t h) {
      if (probability_form[b * heads + h]) return;
      T* __restrict__ sum = z.row(b, h, 0);
      std::vector<T> scratch(d), log_k(N * F);
      T* __restrict__ top = kappa.row(b, h, 0);
      std::fill(top, top + F, -std::numeric_limits<T>::infinity());
      for (int64_t i = 0; i < N; ++i) {
        T* __restrict__ row = log_k.data() + i * F;
        log_features(x.row(b, h, i), row, d, softmax_map, scratch.data());
        for (int64_t m = 0; m < F; ++m) top[m] = std::max(top[m], row[m]);
      }
      std::fill(sum, sum + F, T(0));
      for (int64_t i = 0; i < N; ++i) {
        const T* __restrict__ row = log_k.data() + i * F;
        T* __restrict__ out = ph.row(b, h, i);
        for (int64_t m = 0; m < F; ++m) {
          out[m] = exp_vectorisable(row[m] - top[m]);
          sum[m] += out[m];
        }
      }
      for (int64_t m = 0; m < F; ++m) top[m] += std::log(sum[m]);
    });
  });
  // U = (S / z)^T: S^T is formed directly as phi^T V
  auto values = at::matmul(phi.transpose(-2, -1), v).div_(key_sum.transpose(-2, -1));
  const auto query_x = at::matmul(q, map_q);                                // (B, h, N, d)
  auto weights = at::empty({B, heads, N, F}, options);
  auto prob_q = softmax_map ? at::empty_like(weights) : at::empty({0}, options);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "hedgehog_queries", [&] {
    using T = scalar_t;
    const Heads<const T> x(query_x), kappa(key_mass), z(key_sum);
    const Heads<T> a(weights), pq(softmax_map ? prob_q : weights);
    for_heads(B, heads, [&](int64_t b, int64_t h) {
      std::vector<T> scratch(d);
      const bool probabilities = probability_form[b * heads + h];
      const T* __restrict__ mass = probabilities ? z.row(b, h, 0) : kappa.row(b, h, 0);
      for (int64_t i = 0; i < N; ++i) {
        T* __restrict__ out = a.row(b, h, i);
        if (softmax_map) half_softmaxes(x.row(b, h, i), pq.row(b, h, i), d);
        if (probabilities) {
          // A = p(q) * Z / (p(q) . Z), Z = exp(kappa) the key sums of p(K)
          const T* __restrict__ prob = pq.row(b, h, i);
          for (int64_t m = 0; m < F; ++m) out[m] = prob[m] * mass[m];
          const T inv = T(1) / sum_of(out, F);
          for (int64_t m = 0; m < F; ++m) out[m] *= inv;
          continue;
        }
        log_features(x.row(b, h, i), out, d, softmax_map, scratch.data());
        for (int64_t m = 0; m < F; ++m) out[m] += mass[m];
        const T top = max_of(out, F);
        for (int64_t m = 0; m < F; ++m) out[m] = exp_vectorisable(out[m] - top);
        const T inv = T(1) / sum_of(out, F);
        for (int64_t m = 0; m < F; ++m) out[m] *= inv;
      }
    });
  });
  auto out = at::matmul(weights, values);                                  // (B, h, N, d)
  return {out, prob_k, phi, key_sum, values, prob_q, weights};
}

// Returns {grad_q, grad_k, grad_v (B, heads, N, d), grad_map_q, grad_map_k (heads, d, d)}.
std::vector<at::Tensor> hedgehog_backward(const at::Tensor& grad_out,
                                          const std::vector<at::Tensor>& saved,
                                          const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const at::Tensor& map_q,
                                          const at::Tensor& map_k, bool softmax_map) {
  TORCH_CHECK(saved.size() == 6, "saved must be what hedgehog_forward returned after out");
  const auto &prob_k = saved[0], &phi = saved[1], &key_sum = saved[2], &values = saved[3],
             &prob_q = saved[4], &weights = saved[5];
  const int64_t B = q.size(0), heads = q.size(1), N = q.size(2), d = q.size(3), F = 2 * d;
  TORCH_CHECK(grad_out.sizes() == q.sizes(), "grad_out must be shaped like q ", q.sizes(),
              ", got ", grad_out.sizes());
  const auto options = q.options();
  auto grad_weights = at::matmul(grad_out, values.transpose(-2, -1));     // dA (B, h, N, 2d)
  const auto grad_values = at::matmul(weights.transpose(-2, -1), grad_out);  // dU (B, h, 2d, d)
  auto grad_mass = at::empty({B, heads, 1, F}, options);
  auto grad_query_x = at::empty({B, heads, N, d}, options);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "hedgehog_queries_backward", [&] {
    using T = scalar_t;
    const Heads<const T> a(weights), pq(softmax_map ? prob_q : weights);
    const Heads<T> da(grad_weights), dkappa(grad_mass), dx(grad_query_x);
    for_heads(B, heads, [&](int64_t b, int64_t h) {
      T* __restrict__ mass = dkappa.row(b, h, 0);
      std::fill(mass, mass + F, T(0));
      for (int64_t i = 0; i < N; ++i) {
        const T* __restrict__ prob = a.row(b, h, i);
        T* __restrict__ grad = da.row(b, h, i);
        const T dot = dot_of(grad, prob, F);
        for (int64_t m = 0; m < F; ++m) {
          grad[m] = prob[m] * (grad[m] - dot);  // the logits' gradient
          mass[m] += grad[m];
        }
        log_features_backward(pq.row(b, h, i), grad, dx.row(b, h, i), d, softmax_map);
      }
    });
  });
  // dS^T = dU / z, and dz
  auto grad_state_t = at::empty_like(grad_values);                           // (B, h, 2d, d)
  auto grad_sum = at::empty({B, heads, 1, F}, options);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "hedgehog_state_backward", [&] {
    using T = scalar_t;
    const Heads<const T> du(grad_values), u(values), z(key_sum), dkappa(grad_mass);
    const Heads<T> ds(grad_state_t), dz(grad_sum);
    for_heads(B, heads, [&](int64_t b, int64_t h) {
      const T *sum = z.row(b, h, 0), *mass = dkappa.row(b, h, 0);
      T* out_sum = dz.row(b, h, 0);
      for (int64_t m = 0; m < F; ++m) {
        const T *dum = du.row(b, h, m), *um = u.row(b, h, m);
        T* dsm = ds.row(b, h, m);
        const T inv = T(1) / sum[m];
        for (int64_t c = 0; c < d; ++c) dsm[c] = dum[c] * inv;
        out_sum[m] = (mass[m] - dot_of(dum, um, d)) * inv;
      }
    });
  });
  auto grad_phi = at::matmul(v, grad_state_t.transpose(-2, -1));           // (B, h, N, 2d)
  auto grad_v = at::matmul(phi, grad_state_t);                              // (B, h, N, d)
  auto grad_key_x = at::empty({B, heads, N, d}, options);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "hedgehog_keys_backward", [&] {
    using T = scalar_t;
    const Heads<const T> ph(phi), pk(softmax_map ? prob_k : phi), dz(grad_sum);
    const Heads<T> dphi(grad_phi), dx(grad_key_x);
    for_heads(B, heads, [&](int64_t b, int64_t h) {
      const T* __restrict__ sum = dz.row(b, h, 0);
      for (int64_t i = 0; i < N; ++i) {
        const T* __restrict__ features = ph.row(b, h, i);
        T* __restrict__ grad = dphi.row(b, h, i);
        for (int64_t m = 0; m < F; ++m) grad[m] = (grad[m] + sum[m]) * features[m];
        log_features_backward(pk.row(b, h, i), grad, dx.row(b, h, i), d, softmax_map);
      }
    });
  });
  const auto grad_q = at::matmul(grad_query_x, map_q.transpose(-2, -1));
  const auto grad_k = at::matmul(grad_key_x, map_k.transpose(-2, -1));
  const auto grad_map_q = at::matmul(q.transpose(-2, -1), grad_query_x).sum(0);
  const auto grad_map_k = at::matmul(k.transpose(-2, -1), grad_key_x).sum(0);
  return {grad_q, grad_k, grad_v, grad_map_q, grad_map_k};
}

}  // namespace linvit_mm
