// Depthwise convolutions with odd K x K kernels on channels-last token grids, and their
// kernel correlation.
//
// ViT^3 runs three tiny depthwise 3x3 convolutions per block (the conditional position
// encoding and the conv inner model's fit and read), MHLA one 5x5 value convolution. oneDNN
// spends tens of microseconds of set-up on each call and its weight-gradient path is slow for
// them, so at 196 tokens they cost more than the arithmetic. These two loops cover all of
// them, forward and backward (r = K / 2):
//
//   conv:      out[b, y, x, c] = sum_t in[b, y + dy_t, x + dx_t, c] * w[b, t, c]
//              (zero padding; t = K * (dy + r) + (dx + r); `flip` reads tap K*K - 1 - t,
//              which is the transposed convolution, i.e. the gradient with respect to `in`)
//   correlate: out[b, t, c] = sum_{y, x} a[b, y + dy_t, x + dx_t, c] * g[b, y, x, c]
//              (the gradient of `conv` with respect to w when g is the output gradient)
//
// Grids are (B, H*W, C) token tensors whose channel stride is 1; the token and batch
// strides are free, so column slices of a fused qkv tensor need no copy. Weights are
// (B or 1, K*K, C) with channel stride 1 (batch stride 0 shares one kernel across images).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace linvit_mm {
namespace {

void check_grid(const at::Tensor& t, const char* name, int64_t H, int64_t W) {
  TORCH_CHECK(t.dim() == 3, name, " must be (B, H*W, C) tokens, got ", t.sizes());
  TORCH_CHECK(t.size(1) == H * W, name, " has ", t.size(1), " tokens, the grid ", H, "x", W,
              " needs ", H * W);
  TORCH_CHECK(t.stride(2) == 1, name, " needs a channel stride of 1");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

// `accumulate` adds to what `out` holds instead of overwriting it (MHLA adds its value
// convolution to the attention output, and its input gradient to the values' gradient).
template <typename T>
void conv_kernel(const at::Tensor& input, const at::Tensor& weight, const T* bias, bool residual,
                 bool accumulate, at::Tensor& out, int64_t H, int64_t W, int64_t K, bool flip) {
  const int64_t B = input.size(0), C = input.size(2), r = K / 2, taps = K * K;
  const int64_t sb = input.stride(0), sp = input.stride(1);
  const int64_t wb = weight.size(0) == 1 ? 0 : weight.stride(0), wt = weight.stride(1);
  const T* in = input.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t ob = out.stride(0), op = out.stride(1);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / H, y = row % H;
      for (int64_t x = 0; x < W; ++x) {
        T* __restrict__ dst = o + b * ob + (y * W + x) * op;
        const T* __restrict__ center = in + b * sb + (y * W + x) * sp;
        if (!accumulate) {
          for (int64_t c = 0; c < C; ++c) dst[c] = 0;
        }
        if (residual) {
#pragma GCC ivdep
          for (int64_t c = 0; c < C; ++c) dst[c] += center[c];
        }
        if (bias) {
#pragma GCC ivdep
          for (int64_t c = 0; c < C; ++c) dst[c] += bias[c];
        }
        for (int64_t t = 0; t < taps; ++t) {
          const int64_t yy = y + t / K - r, xx = x + t % K - r;
          if (yy < 0 || yy >= H || xx < 0 || xx >= W) continue;
          const T* __restrict__ src = in + b * sb + (yy * W + xx) * sp;
          const T* __restrict__ tap = w + b * wb + (flip ? taps - 1 - t : t) * wt;
#pragma GCC ivdep
          for (int64_t c = 0; c < C; ++c) dst[c] += src[c] * tap[c];
        }
      }
    }
  });
}

// Per tap, channels are summed in blocks of kBlock held in registers along a grid row.
constexpr int64_t kBlock = 64;

template <typename T>
void correlate_kernel(const at::Tensor& a, const at::Tensor& g, at::Tensor& out, int64_t H,
                      int64_t W, int64_t K) {
  const int64_t B = a.size(0), C = a.size(2), r = K / 2, taps = K * K;
  const int64_t ab = a.stride(0), ap = a.stride(1), gb = g.stride(0), gp = g.stride(1);
  const T* pa = a.data_ptr<T>();
  const T* pg = g.data_ptr<T>();
  // Rows are summed in parallel into per-thread partial sums, added up at the end.
  const int64_t threads = at::get_num_threads();
  std::vector<T> partial(threads * B * taps * C, T(0));
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    T* acc_all = partial.data() + at::get_thread_num() * B * taps * C;
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / H, y = row % H;
      for (int64_t t = 0; t < taps; ++t) {
        const int64_t dy = t / K - r, dx = t % K - r, yy = y + dy;
        if (yy < 0 || yy >= H) continue;
        const int64_t x_begin = std::max<int64_t>(0, -dx), x_end = std::min(W, W - dx);
        T* __restrict__ dst = acc_all + (b * taps + t) * C;
        for (int64_t c0 = 0; c0 < C; c0 += kBlock) {
          const int64_t width = std::min(kBlock, C - c0);
          T acc[kBlock] = {};
          for (int64_t x = x_begin; x < x_end; ++x) {
            const T* __restrict__ src = pa + b * ab + (yy * W + x + dx) * ap + c0;
            const T* __restrict__ grad = pg + b * gb + (y * W + x) * gp + c0;
#pragma GCC ivdep
            for (int64_t c = 0; c < width; ++c) acc[c] += src[c] * grad[c];
          }
          for (int64_t c = 0; c < width; ++c) dst[c0 + c] += acc[c];
        }
      }
    }
  });
  T* o = out.data_ptr<T>();
  for (int64_t i = 0; i < B * taps * C; ++i) {
    T sum = 0;
    for (int64_t th = 0; th < threads; ++th) sum += partial[th * B * taps * C + i];
    o[i] = sum;
  }
}

}  // namespace

void depthwise_into(const at::Tensor& input, const at::Tensor& weight,
                    const c10::optional<at::Tensor>& bias, bool residual, bool accumulate,
                    int64_t H, int64_t W, int64_t K, bool flip, at::Tensor out) {
  check_grid(input, "input", H, W);
  check_grid(out, "out", H, W);
  TORCH_CHECK(K > 0 && K % 2 == 1, "the kernel size must be odd, got ", K);
  TORCH_CHECK(out.size(0) == input.size(0) && out.size(2) == input.size(2),
              "out must be shaped like the input ", input.sizes(), ", got ", out.sizes());
  TORCH_CHECK(weight.dim() == 3 && weight.size(1) == K * K && weight.size(2) == input.size(2),
              "weight must be (B or 1, ", K * K, ", C=", input.size(2), "), got ",
              weight.sizes());
  TORCH_CHECK(weight.size(0) == 1 || weight.size(0) == input.size(0),
              "weight batch ", weight.size(0), " must be 1 or the input's ", input.size(0));
  TORCH_CHECK(weight.stride(2) == 1, "weight needs a channel stride of 1");
  TORCH_CHECK(weight.scalar_type() == input.scalar_type() &&
                  out.scalar_type() == input.scalar_type(),
              "weight, input and out dtypes differ");
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == input.size(2) && bias->is_contiguous() &&
                    bias->scalar_type() == input.scalar_type(),
                "bias must be a contiguous (C,) tensor of the input's dtype");
  }
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "depthwise_conv", [&] {
    conv_kernel<scalar_t>(input, weight, bias ? bias->data_ptr<scalar_t>() : nullptr, residual,
                          accumulate, out, H, W, K, flip);
  });
}

void depthwise3x3_into(const at::Tensor& input, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias, bool residual, int64_t H, int64_t W,
                       bool flip, at::Tensor out) {
  depthwise_into(input, weight, bias, residual, false, H, W, 3, flip, out);
}

at::Tensor depthwise3x3(const at::Tensor& input, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias, bool residual, int64_t H, int64_t W,
                        bool flip) {
  auto out = at::empty({input.size(0), H * W, input.size(2)}, input.options());
  depthwise3x3_into(input, weight, bias, residual, H, W, flip, out);
  return out;
}

at::Tensor correlate_taps(const at::Tensor& a, const at::Tensor& g, int64_t H, int64_t W,
                          int64_t K) {
  check_grid(a, "a", H, W);
  check_grid(g, "g", H, W);
  TORCH_CHECK(K > 0 && K % 2 == 1, "the kernel size must be odd, got ", K);
  TORCH_CHECK(a.sizes() == g.sizes(), "a and g shapes differ: ", a.sizes(), " vs ", g.sizes());
  TORCH_CHECK(a.scalar_type() == g.scalar_type(), "a and g dtypes differ");
  auto out = at::empty({a.size(0), K * K, a.size(2)}, a.options());
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "depthwise_correlate", [&] {
    correlate_kernel<scalar_t>(a, g, out, H, W, K);
  });
  return out;
}

at::Tensor correlate3x3(const at::Tensor& a, const at::Tensor& g, int64_t H, int64_t W) {
  return correlate_taps(a, g, H, W, 3);
}

}  // namespace linvit_mm
