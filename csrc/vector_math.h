// Small dense float kernels shared by the scan and the query preparation (AVX2 + FMA; callers check the CPU).
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

namespace tqvec {

// Sum of the eight lanes of v, pairwise.
__attribute__((target("avx2,fma"))) inline float lane_sum(__m256 v) {
  alignas(32) float part[8];
  _mm256_store_ps(part, v);
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// Smallest and largest of the eight lanes of v (finite lanes).
__attribute__((target("avx2,fma"))) inline float lane_min(__m256 v) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_min_ss(m, _mm_shuffle_ps(m, m, 1)));
}

__attribute__((target("avx2,fma"))) inline float lane_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

// <a, b> for (n,) vectors, two 8-wide chains.
__attribute__((target("avx2,fma"))) inline float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  float s = lane_sum(_mm256_add_ps(s0, s1));
  for (; i < n; ++i) s += a[i] * b[i];  // inline: a call into baseline (SSE) code from here costs more than the tail
  return s;
}

// |x - y|^2 for (n,) vectors, two 8-wide chains.
__attribute__((target("avx2,fma"))) inline float squared_distance_avx2(const float* x, const float* y, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 d0 = _mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i));
    const __m256 d1 = _mm256_sub_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8));
    s0 = _mm256_fmadd_ps(d0, d0, s0);
    s1 = _mm256_fmadd_ps(d1, d1, s1);
  }
  float sum = lane_sum(_mm256_add_ps(s0, s1));
  for (; i < n; ++i) sum += (x[i] - y[i]) * (x[i] - y[i]);
  return sum;
}

}  // namespace tqvec
#endif
