// 3x3 depthwise convolution on channels-last token grids, and its kernel correlation.
//
// ViT^3 runs three tiny depthwise 3x3 convolutions per block (the conditional position
// encoding and the conv inner model's fit and read). oneDNN spends tens of microseconds of
// set-up on each call and its weight-gradient path is slow for them, so at 196 tokens they
// cost more than the arithmetic. These two loops cover all of them, forward and backward:
//
//   conv:      out[b, y, x, c] = sum_t in[b, y + dy_t, x + dx_t, c] * w[b, t, c]
//              (zero padding; t = 3 * (dy + 1) + (dx + 1); `flip` reads tap 8 - t, which
//              is the transposed convolution, i.e. the gradient with respect to `in`)
//   correlate: out[b, t, c] = sum_{y, x} a[b, y + dy_t, x + dx_t, c] * g[b, y, x, c]
//              (the gradient of `conv` with respect to w when g is the output gradient)
//
// Grids are (B, H*W, C) token tensors whose channel stride is 1; the token and batch
// strides are free, so column slices of a fused qkv tensor need no copy. Weights are
// (B or 1, 9, C) with channel stride 1 (batch stride 0 shares one kernel across images).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

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

template <typename scalar_t>
void conv_kernel(const at::Tensor& input, const at::Tensor& weight, at::Tensor& out,
                 int64_t H, int64_t W, bool flip) {
  const int64_t B = input.size(0), C = input.size(2);
  const int64_t sb = input.stride(0), sp = input.stride(1);
  const int64_t wb = weight.size(0) == 1 ? 0 : weight.stride(0), wt = weight.stride(1);
  const scalar_t* in = input.data_ptr<scalar_t>();
  const scalar_t* w = weight.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t ob = out.stride(0), op = out.stride(1);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / H, y = row % H;
      for (int64_t x = 0; x < W; ++x) {
        scalar_t* __restrict__ dst = o + b * ob + (y * W + x) * op;
        for (int64_t c = 0; c < C; ++c) dst[c] = 0;
        for (int64_t t = 0; t < 9; ++t) {
          const int64_t yy = y + t / 3 - 1, xx = x + t % 3 - 1;
          if (yy < 0 || yy >= H || xx < 0 || xx >= W) continue;
          const scalar_t* __restrict__ src = in + b * sb + (yy * W + xx) * sp;
          const scalar_t* __restrict__ tap = w + b * wb + (flip ? 8 - t : t) * wt;
#pragma GCC ivdep
          for (int64_t c = 0; c < C; ++c) dst[c] += src[c] * tap[c];
        }
      }
    }
  });
}

template <typename scalar_t>
void correlate_kernel(const at::Tensor& a, const at::Tensor& g, at::Tensor& out, int64_t H,
                      int64_t W) {
  const int64_t B = a.size(0), C = a.size(2);
  const int64_t ab = a.stride(0), ap = a.stride(1), gb = g.stride(0), gp = g.stride(1);
  const scalar_t* pa = a.data_ptr<scalar_t>();
  const scalar_t* pg = g.data_ptr<scalar_t>();
  // Rows are summed in parallel into per-thread partial sums, added up at the end.
  const int64_t threads = at::get_num_threads();
  std::vector<scalar_t> partial(threads * B * 9 * C, scalar_t(0));
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    scalar_t* acc = partial.data() + at::get_thread_num() * B * 9 * C;
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / H, y = row % H;
      for (int64_t x = 0; x < W; ++x) {
        const scalar_t* __restrict__ grad = pg + b * gb + (y * W + x) * gp;
        for (int64_t t = 0; t < 9; ++t) {
          const int64_t yy = y + t / 3 - 1, xx = x + t % 3 - 1;
          if (yy < 0 || yy >= H || xx < 0 || xx >= W) continue;
          const scalar_t* __restrict__ src = pa + b * ab + (yy * W + xx) * ap;
          scalar_t* __restrict__ dst = acc + (b * 9 + t) * C;
#pragma GCC ivdep
          for (int64_t c = 0; c < C; ++c) dst[c] += src[c] * grad[c];
        }
      }
    }
  });
  scalar_t* o = out.data_ptr<scalar_t>();
  for (int64_t i = 0; i < B * 9 * C; ++i) {
    scalar_t sum = 0;
    for (int64_t th = 0; th < threads; ++th) sum += partial[th * B * 9 * C + i];
    o[i] = sum;
  }
}

}  // namespace

void depthwise3x3_into(const at::Tensor& input, const at::Tensor& weight, int64_t H, int64_t W,
                       bool flip, at::Tensor out) {
  check_grid(input, "input", H, W);
  check_grid(out, "out", H, W);
  TORCH_CHECK(out.size(0) == input.size(0) && out.size(2) == input.size(2),
              "out must be shaped like the input ", input.sizes(), ", got ", out.sizes());
  TORCH_CHECK(weight.dim() == 3 && weight.size(1) == 9 && weight.size(2) == input.size(2),
              "weight must be (B or 1, 9, C=", input.size(2), "), got ", weight.sizes());
  TORCH_CHECK(weight.size(0) == 1 || weight.size(0) == input.size(0),
              "weight batch ", weight.size(0), " must be 1 or the input's ", input.size(0));
  TORCH_CHECK(weight.stride(2) == 1, "weight needs a channel stride of 1");
  TORCH_CHECK(weight.scalar_type() == input.scalar_type() &&
                  out.scalar_type() == input.scalar_type(),
              "weight, input and out dtypes differ");
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "depthwise3x3_conv", [&] {
    conv_kernel<scalar_t>(input, weight, out, H, W, flip);
  });
}

at::Tensor depthwise3x3(const at::Tensor& input, const at::Tensor& weight, int64_t H, int64_t W,
                        bool flip) {
  auto out = at::empty({input.size(0), H * W, input.size(2)}, input.options());
  depthwise3x3_into(input, weight, H, W, flip, out);
  return out;
}

at::Tensor correlate3x3(const at::Tensor& a, const at::Tensor& g, int64_t H, int64_t W) {
  check_grid(a, "a", H, W);
  check_grid(g, "g", H, W);
  TORCH_CHECK(a.sizes() == g.sizes(), "a and g shapes differ: ", a.sizes(), " vs ", g.sizes());
  TORCH_CHECK(a.scalar_type() == g.scalar_type(), "a and g dtypes differ");
  auto out = at::empty({a.size(0), 9, a.size(2)}, a.options());
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "depthwise3x3_correlate", [&] {
    correlate_kernel<scalar_t>(a, g, out, H, W);
  });
  return out;
}

}  // namespace linvit_mm
