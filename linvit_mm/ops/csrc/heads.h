// How the kernels walk attention heads: the (image, head) loop run in parallel, and row
// pointers into (B, heads, n, width) tensors.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>

namespace linvit_mm {

// body(b, h) for every image and head, the pairs split among the intra-op threads
template <typename F>
void for_heads(int64_t B, int64_t heads, const F& body) {
  at::parallel_for(0, B * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) body(i / heads, i % heads);
  });
}

// Row i of head h of image b of a (B, heads, n, width) tensor whose last stride is 1.
template <typename T>
struct Heads {
  T* data;
  int64_t sb, sh, si;
  explicit Heads(const at::Tensor& t)
      : data(static_cast<T*>(t.data_ptr())), sb(t.stride(0)), sh(t.stride(1)), si(t.stride(2)) {}
  T* row(int64_t b, int64_t h, int64_t i) const { return data + b * sb + h * sh + i * si; }
};

}  // namespace linvit_mm
