// MHLA's attention (the `mhla` operator without RoPE or extra tokens, either normaliser) and
// its value convolution, forward and backward.
//
// The patch grid is cut into M = rows x cols blocks of T = block_h x block_w positions (see
// linvit_mm/models/attention/mhla/blocks.py). Per image and head, with phi(x) = relu(x) +
// floor, block j's keys phi(K_j) (T x d, zero rows where the block overhangs the grid) and
// values with a ones column [V_j | 1]:
//
//   S_j = phi(K_j)^T [V_j | 1]            (d x (d + 1): the summary and, last, the key sums)
//   X_i = sum_j W_ij S_j                  (the mixing)
//   R_i = phi(Q_i) X_i,  out_i = R_i[:, :d] / (R_i[:, d] + eps)
//
// and out += dwconv(V) + bias on the grid. With the official normaliser the numerator is the
// same, and the normaliser of position t of block i mixes the products of the queries at
// that position in every block with their own block's key sums: D_i[t] = sum_j W_ij
// phi(q_{j,t}) . z_j (z_j = S_j[:, d]; a position where block j overhangs the grid holds no
// query, its product is 0).
//
// As tensor operations this is about twenty-five calls and autograd nodes per block (layout
// copies, features, three products, the division, the convolution with its permutes), which
// at 196 tokens cost twice softmax's fused attention. Here the layout moves, features,
// normalisation and the convolution are fused loops on raw pointers and the products are
// batched BLAS calls; Python sees one call each way.
//
// Backward, with G_i the gradient of out_i and u = 1 / (R_i[:, d] + eps) per query:
//   dR_i = [G_i u | -u^2 rowsum(G_i * R_i[:, :d])]
//   dphi(Q_i) = dR_i X_i^T,  dX_i = phi(Q_i)^T dR_i,  dW_ij = <dX_i, S_j>,
//   dS_j = sum_i W_ij dX_i,  dphi(K_j) = [V_j | 1] dS_j^T,  dV_j = phi(K_j) dS_j[:, :d]
// and relu passes a feature's gradient where its input is positive. Official normaliser:
// dR_i[:, d] = 0 and dD_i = -u^2 rowsum(G_i * R_i[:, :d]); with o_j[t] = phi(q_{j,t}) . z_j,
//   do_j = sum_i W_ij dD_i,  dW_ij += <dD_i, o_j>,  dphi(q_{j,t}) += do_j[t] z_j,
//   dz_j = dS_j[:, d] += sum_t do_j[t] phi(q_{j,t}).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "heads.h"
#include "vector_math.h"

namespace linvit_mm {

void depthwise_into(const at::Tensor& input, const at::Tensor& weight,
                    const c10::optional<at::Tensor>& bias, bool residual, bool accumulate,
                    int64_t H, int64_t W, int64_t K, bool flip, at::Tensor out);
at::Tensor correlate_taps(const at::Tensor& a, const at::Tensor& g, int64_t H, int64_t W,
                          int64_t K);

namespace {

// Where the blocks lie on the grid: position p of block m is token `token(m, p)`, or -1
// where the block overhangs the grid.
struct Layout {
  int64_t H, W, rows, cols, block_h, block_w;
  int64_t blocks() const { return rows * cols; }
  int64_t positions() const { return block_h * block_w; }
  int64_t token(int64_t m, int64_t p) const {
    const int64_t y = (m / cols) * block_h + p / block_w, x = (m % cols) * block_w + p % block_w;
    return y < H && x < W ? y * W + x : -1;
  }
};

// A (B, N, channels) token tensor with channel stride 1.
template <typename T>
struct Tokens {
  T* data;
  int64_t sb, sn;
  explicit Tokens(const at::Tensor& t)
      : data(static_cast<T*>(t.data_ptr())), sb(t.stride(0)), sn(t.stride(1)) {}
  T* at(int64_t b, int64_t n) const { return data + b * sb + n * sn; }
};

// Row p of block m of head h of image b of a contiguous (B, heads, M, T, width) tensor.
template <typename T>
struct Blocks {
  T* data;
  int64_t heads, M, T_, width;
  Blocks(const at::Tensor& t)
      : data(static_cast<T*>(t.data_ptr())), heads(t.size(1)), M(t.size(2)), T_(t.size(3)),
        width(t.size(4)) {}
  T* row(int64_t b, int64_t h, int64_t m, int64_t p) const {
    return data + (((b * heads + h) * M + m) * T_ + p) * width;
  }
};

template <typename T>
inline T feature(T x, T floor) {
  return (x > T(0) ? x : T(0)) + floor;  // relu as F.threshold(x, 0, 0): NaN maps to 0
}

void check_tokens(const at::Tensor& t, const char* name, int64_t B, int64_t N, int64_t C) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == B && t.size(1) == N && t.size(2) == C, name,
              " must be (", B, ", ", N, ", ", C, "), got ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1 && t.device().is_cpu(), name,
              " must be a CPU tensor with a channel stride of 1");
}

at::Tensor conv_taps(const at::Tensor& weight) {
  // (C, 1, K, K) -> (1, K*K, C), channels contiguous
  return weight.reshape({weight.size(0), -1}).t().contiguous().unsqueeze(0);
}

}  // namespace

// Returns {out (B, H*W, C), then what mhla_backward needs}. qk: (B, H*W, 2C) queries then
// keys; v: (B, H*W, C); mixing (M, M); conv_weight (C, 1, K, K) and conv_bias (C,).
std::vector<at::Tensor> mhla_forward(const at::Tensor& qk, const at::Tensor& v,
                                     const at::Tensor& mixing, const at::Tensor& conv_weight,
                                     const c10::optional<at::Tensor>& conv_bias, int64_t heads,
                                     int64_t H, int64_t W, int64_t rows, int64_t cols,
                                     int64_t block_h, int64_t block_w, double floor,
                                     double eps, bool official) {
  const int64_t B = v.size(0), N = H * W, C = v.size(2), d = C / heads;
  const Layout layout{H, W, rows, cols, block_h, block_w};
  const int64_t M = layout.blocks(), P = layout.positions(), K = conv_weight.size(-1);
  TORCH_CHECK(C == heads * d, "C=", C, " does not split into ", heads, " heads");
  TORCH_CHECK(rows * block_h >= H && cols * block_w >= W, "the blocks do not cover the grid");
  check_tokens(qk, "qk", B, N, 2 * C);
  check_tokens(v, "v", B, N, C);
  TORCH_CHECK(mixing.dim() == 2 && mixing.size(0) == M && mixing.size(1) == M,
              "mixing must be (", M, ", ", M, "), got ", mixing.sizes());
  TORCH_CHECK(conv_weight.dim() == 4 && conv_weight.size(0) == C && conv_weight.size(1) == 1 &&
                  conv_weight.size(2) == K,
              "conv_weight must be (C, 1, K, K), got ", conv_weight.sizes());
  for (const auto* t : {&v, &mixing, &conv_weight})
    TORCH_CHECK(t->scalar_type() == qk.scalar_type(),
                "qk, v, mixing and conv_weight dtypes differ");
  const auto options = qk.options();
  auto phi_q = at::empty({B, heads, M, P, d}, options);
  auto phi_k = at::empty({B, heads, M, P, d}, options);
  auto values = at::empty({B, heads, M, P, d + 1}, options);
  AT_DISPATCH_FLOATING_TYPES(qk.scalar_type(), "mhla_gather", [&] {
    using T = scalar_t;
    const Tokens<const T> in_qk(qk), in_v(v);
    const Blocks<T> fq(phi_q), fk(phi_k), vals(values);
    const T fl = T(floor);
    for_heads(B, heads, [&](int64_t b, int64_t h) {
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t p = 0; p < P; ++p) {
          T *q = fq.row(b, h, m, p), *k = fk.row(b, h, m, p), *val = vals.row(b, h, m, p);
          const int64_t n = layout.token(m, p);
          if (n < 0) {
            std::memset(q, 0, d * sizeof(T));
            std::memset(k, 0, d * sizeof(T));
            std::memset(val, 0, (d + 1) * sizeof(T));
            continue;
          }
          const T *sq = in_qk.at(b, n) + h * d, *sk = sq + C, *sv = in_v.at(b, n) + h * d;
_Pragma("GCC ivdep")
          for (int64_t c = 0; c < d; ++c) {
            q[c] = feature(sq[c], fl);
            k[c] = feature(sk[c], fl);
            val[c] = sv[c];
          }
          val[d] = T(1);
        }
      }
    });
  });
  const auto state = at::matmul(phi_k.transpose(-2, -1), values);          // (B, h, M, d, d+1)
  // batched (M x M) @ (M x d(d+1)): a plain 2-D product would be run transposed, with copies
  const auto mixed = at::matmul(mixing.expand({B, heads, M, M}),
                                state.view({B, heads, M, d * (d + 1)}))
                         .view({B, heads, M, d, d + 1});
  const auto read = at::matmul(phi_q, mixed);                               // (B, h, M, P, d+1)
  auto out = at::empty({B, N, C}, options);
  // 1 / (normaliser + eps) per query; the official normaliser D is written here first
  auto inverse = at::empty({B, heads, M, P, 1}, options);
  // the official normaliser's products o_j[t], which its backward needs too
  auto own = official ? at::empty({B, heads, M, P, 1}, options) : at::empty({0}, options);
  const auto weights = mixing.contiguous();
  AT_DISPATCH_FLOATING_TYPES(qk.scalar_type(), "mhla_normalise", [&] {
    using T = scalar_t;
    const Blocks<const T> r(read), fq(phi_q), s(state);
    const Blocks<T> inv(inverse), o_own(official ? own : inverse);
    const Tokens<T> o(out);
    const T e = T(eps);
    const T* w = weights.data_ptr<T>();
    for_heads(B, heads, [&](int64_t b, int64_t h) {
      if (official) {
        std::vector<T> z(d);
        for (int64_t j = 0; j < M; ++j) {
          for (int64_t a = 0; a < d; ++a) z[a] = s.row(b, h, j, a)[d];
          for (int64_t p = 0; p < P; ++p) *o_own.row(b, h, j, p) = dot_of(fq.row(b, h, j, p),
                                                                          z.data(), d);
        }
        for (int64_t i = 0; i < M; ++i) {
          for (int64_t p = 0; p < P; ++p) {
            T sum = 0;
            for (int64_t j = 0; j < M; ++j) sum += w[i * M + j] * *o_own.row(b, h, j, p);
            *inv.row(b, h, i, p) = sum;
          }
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t p = 0; p < P; ++p) {
          const int64_t n = layout.token(m, p);
          const T* row = r.row(b, h, m, p);
          const T u = T(1) / ((official ? *inv.row(b, h, m, p) : row[d]) + e);
          *inv.row(b, h, m, p) = u;
          if (n < 0) continue;
          T* dst = o.at(b, n) + h * d;
_Pragma("GCC ivdep")
          for (int64_t c = 0; c < d; ++c) dst[c] = row[c] * u;
        }
      }
    });
  });
  const auto taps = conv_taps(conv_weight);
  depthwise_into(v, taps, conv_bias, false, true, H, W, K, false, out);
  return {out, phi_q, phi_k, values, state, mixed, read, inverse, taps, own};
}

// Returns {grad_qk (B, H*W, 2C), grad_v (B, H*W, C), grad_mixing (M, M), grad_conv_weight
// (C, 1, K, K), grad_conv_bias (C,)}.
std::vector<at::Tensor> mhla_backward(const at::Tensor& grad_out,
                                      const std::vector<at::Tensor>& saved,
                                      const at::Tensor& qk, const at::Tensor& v,
                                      const at::Tensor& mixing, int64_t heads, int64_t H,
                                      int64_t W, int64_t rows, int64_t cols, int64_t block_h,
                                      int64_t block_w, bool official) {
  TORCH_CHECK(saved.size() == 9, "saved must be what mhla_forward returned after out");
  const auto &phi_q = saved[0], &phi_k = saved[1], &values = saved[2], &state = saved[3],
             &mixed = saved[4], &read = saved[5], &inverse = saved[6], &taps = saved[7],
             &own = saved[8];
  const int64_t B = v.size(0), N = H * W, C = v.size(2), d = C / heads;
  const Layout layout{H, W, rows, cols, block_h, block_w};
  const int64_t M = layout.blocks(), P = layout.positions();
  check_tokens(grad_out, "grad_out", B, N, C);
  int64_t kernel = 1;
  while (kernel * kernel < taps.size(1)) ++kernel;
  TORCH_CHECK(kernel * kernel == taps.size(1), "taps must hold K*K rows");
  const auto options = qk.options();
  auto grad_read = at::empty({B, heads, M, P, d + 1}, options);
  // official: dD, zero where a block overhangs the grid
  auto grad_normaliser = official ? at::zeros({B, heads, M, P, 1}, options) : inverse;
  AT_DISPATCH_FLOATING_TYPES(qk.scalar_type(), "mhla_normalise_backward", [&] {
    using T = scalar_t;
    const Blocks<const T> r(read), inv(inverse);
    const Blocks<T> dr(grad_read), dd(grad_normaliser);
    const Tokens<const T> g(grad_out);
    for_heads(B, heads, [&](int64_t b, int64_t h) {
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t p = 0; p < P; ++p) {
          T* dst = dr.row(b, h, m, p);
          const int64_t n = layout.token(m, p);
          if (n < 0) {
            std::memset(dst, 0, (d + 1) * sizeof(T));
            continue;
          }
          const T *src = g.at(b, n) + h * d, *row = r.row(b, h, m, p);
          const T u = *inv.row(b, h, m, p);
          for (int64_t c = 0; c < d; ++c) dst[c] = src[c] * u;
          const T grad_denominator = -dot_of(src, row, d) * u * u;
          if (official) {
            dst[d] = T(0);
            *dd.row(b, h, m, p) = grad_denominator;
          } else {
            dst[d] = grad_denominator;
          }
        }
      }
    });
  });
  auto grad_phi_q = at::matmul(grad_read, mixed.transpose(-2, -1));        // (B, h, M, P, d)
  const auto grad_mixed = at::matmul(phi_q.transpose(-2, -1), grad_read)   // (B, h, M, D)
                              .view({B, heads, M, d * (d + 1)});
  const auto state_flat = state.view({B, heads, M, d * (d + 1)});
  auto grad_mixing = at::matmul(grad_mixed, state_flat.transpose(-2, -1)).sum({0, 1});
  auto grad_state = at::matmul(mixing.t().expand({B, heads, M, M}), grad_mixed)
                        .view({B, heads, M, d, d + 1});
  if (official) {
    // the normaliser's path: do = W^T dD, into phi(q), the key sums and the mixing
    auto grad_mixing_own = at::empty({B, heads, M, M}, options);
    const auto weights = mixing.contiguous();
    AT_DISPATCH_FLOATING_TYPES(qk.scalar_type(), "mhla_official_backward", [&] {
      using T = scalar_t;
      const Blocks<const T> fq(phi_q), s(state), o_own(own), dd(grad_normaliser);
      const Blocks<T> dq(grad_phi_q), ds(grad_state);
      const T* w = weights.data_ptr<T>();
      T* dw = grad_mixing_own.data_ptr<T>();
      for_heads(B, heads, [&](int64_t b, int64_t h) {
        std::vector<T> z(d), grad_z(d);
        T* dw_head = dw + (b * heads + h) * M * M;
        for (int64_t i = 0; i < M; ++i) {
          for (int64_t j = 0; j < M; ++j) {
            T sum = 0;
            for (int64_t p = 0; p < P; ++p) sum += *dd.row(b, h, i, p) * *o_own.row(b, h, j, p);
            dw_head[i * M + j] = sum;
          }
        }
        for (int64_t j = 0; j < M; ++j) {
          for (int64_t a = 0; a < d; ++a) z[a] = s.row(b, h, j, a)[d];
          std::fill(grad_z.begin(), grad_z.end(), T(0));
          for (int64_t p = 0; p < P; ++p) {
            T grad_own = 0;
            for (int64_t i = 0; i < M; ++i) grad_own += w[i * M + j] * *dd.row(b, h, i, p);
            T* grad_q = dq.row(b, h, j, p);
            const T* q = fq.row(b, h, j, p);
            for (int64_t a = 0; a < d; ++a) {
              grad_q[a] += grad_own * z[a];
              grad_z[a] += grad_own * q[a];
            }
          }
          for (int64_t a = 0; a < d; ++a) ds.row(b, h, j, a)[d] += grad_z[a];
        }
      });
    });
    grad_mixing += grad_mixing_own.sum({0, 1});
  }
  const auto grad_phi_k = at::matmul(values, grad_state.transpose(-2, -1));  // (B, h, M, P, d)
  const auto grad_values = at::matmul(phi_k, grad_state.narrow(-1, 0, d));  // (B, h, M, P, d)
  auto grad_qk = at::empty({B, N, 2 * C}, options);
  auto grad_v = at::empty({B, N, C}, options);
  AT_DISPATCH_FLOATING_TYPES(qk.scalar_type(), "mhla_scatter_backward", [&] {
    using T = scalar_t;
    const Blocks<const T> gq(grad_phi_q), gk(grad_phi_k), gv(grad_values);
    const Tokens<const T> in_qk(qk);
    const Tokens<T> out_qk(grad_qk), out_v(grad_v);
    for_heads(B, heads, [&](int64_t b, int64_t h) {
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t p = 0; p < P; ++p) {
          const int64_t n = layout.token(m, p);
          if (n < 0) continue;
          const T *sq = in_qk.at(b, n) + h * d, *sk = sq + C;
          const T *dq = gq.row(b, h, m, p), *dk = gk.row(b, h, m, p), *dv = gv.row(b, h, m, p);
          T *oq = out_qk.at(b, n) + h * d, *ok = oq + C, *ov = out_v.at(b, n) + h * d;
_Pragma("GCC ivdep")
          for (int64_t c = 0; c < d; ++c) {
            oq[c] = sq[c] > T(0) ? dq[c] : T(0);
            ok[c] = sk[c] > T(0) ? dk[c] : T(0);
            ov[c] = dv[c];
          }
        }
      }
    });
  });
  // the value convolution: its input gradient (the transposed convolution) joins the values'
  const auto grad = grad_out.contiguous();
  depthwise_into(grad, taps, c10::nullopt, false, true, H, W, kernel, true, grad_v);
  const auto grad_taps = correlate_taps(v, grad, H, W, kernel);
  const auto grad_weight = grad_taps.sum(0).t().reshape({C, 1, kernel, kernel});
  return {grad_qk, grad_v, grad_mixing, grad_weight, grad.sum({0, 1})};
}

}  // namespace linvit_mm
