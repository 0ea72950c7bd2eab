// Elementwise math the fused loops of linvit_mm's kernels share.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace linvit_mm {

// For float, exp is computed by range reduction to [-ln2/2, ln2/2] and a degree-6 polynomial
// (relative error ~1e-7, i.e. about one ulp) in plain arithmetic that the compiler
// vectorises; std::exp would keep the loops scalar. Inputs are clamped to [-87.3, 88.7], so
// the result is finite and positive (exp(-87.3) ~ 1.2e-38 stands for every smaller value).
inline float exp_vectorisable(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float t = x * 1.44269504f;
  const float n = (t + 12582912.f) - 12582912.f;  // t rounded to nearest (1.5 * 2^23 trick)
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  const float p = 1.f + r * (1.f + r * (0.5f + r * (0.16666667f + r * (0.041666668f + r *
                                                (0.008333334f + r * 0.0013888889f)))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline double exp_vectorisable(double x) { return std::exp(x); }

// Reductions along a row. A plain `s += x[i]` loop stays scalar without -ffast-math
// (floating-point addition is not associative), so the terms are summed in kLanes
// independent partial sums, added up at the end; for float on AVX-512 / AVX2 builds the
// partial sums are one vector register and the last step a horizontal reduction, which at
// rows of 64 values costs half what the generic fold does.
constexpr int64_t kLanes = 16;

// acc[0] <- the sum of acc[0 .. kLanes), by halving (each step one vector operation)
template <typename T>
inline T fold_sum(T* acc) {
  for (int64_t width = kLanes / 2; width > 0; width /= 2)
    for (int64_t j = 0; j < width; ++j) acc[j] += acc[j + width];
  return acc[0];
}

template <typename T>
inline T dot_of(const T* __restrict__ x, const T* __restrict__ y, int64_t n) {
  T acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += x[i + j] * y[i + j];
  T total = fold_sum(acc);
  for (; i < n; ++i) total += x[i] * y[i];
  return total;
}

template <typename T>
inline T sum_of(const T* __restrict__ x, int64_t n) {
  T acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += x[i + j];
  T total = fold_sum(acc);
  for (; i < n; ++i) total += x[i];
  return total;
}

// the largest of n >= 1 values (NaN propagation is not guaranteed)
template <typename T>
inline T max_of(const T* __restrict__ x, int64_t n) {
  T top = x[0];
  int64_t i = 0;
  if (n >= kLanes) {
    T acc[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) acc[j] = x[j];
    for (i = kLanes; i + kLanes <= n; i += kLanes)
      for (int64_t j = 0; j < kLanes; ++j) acc[j] = std::max(acc[j], x[i + j]);
    for (int64_t width = kLanes / 2; width > 0; width /= 2)
      for (int64_t j = 0; j < width; ++j) acc[j] = std::max(acc[j], acc[j + width]);
    top = acc[0];
  }
  for (; i < n; ++i) top = std::max(top, x[i]);
  return top;
}

#if defined(__AVX512F__)
inline float dot_of(const float* x, const float* y, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), acc);
  float total = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) total += x[i] * y[i];
  return total;
}

inline float sum_of(const float* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(x + i));
  float total = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) total += x[i];
  return total;
}

inline float max_of(const float* x, int64_t n) {
  if (n < 16) return max_of<float>(x, n);
  __m512 acc = _mm512_loadu_ps(x);
  int64_t i = 16;
  for (; i + 16 <= n; i += 16) acc = _mm512_max_ps(acc, _mm512_loadu_ps(x + i));
  float top = _mm512_reduce_max_ps(acc);
  for (; i < n; ++i) top = std::max(top, x[i]);
  return top;
}
#elif defined(__AVX2__)
inline float horizontal_sum(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

inline float dot_of(const float* x, const float* y, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), acc);
  float total = horizontal_sum(acc);
  for (; i < n; ++i) total += x[i] * y[i];
  return total;
}

inline float sum_of(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + i));
  float total = horizontal_sum(acc);
  for (; i < n; ++i) total += x[i];
  return total;
}

inline float max_of(const float* x, int64_t n) {
  if (n < 8) return max_of<float>(x, n);
  __m256 acc = _mm256_loadu_ps(x);
  int64_t i = 8;
  for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(x + i));
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  float top = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
  for (; i < n; ++i) top = std::max(top, x[i]);
  return top;
}
#endif

}  // namespace linvit_mm
