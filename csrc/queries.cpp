// Query preparation for the native index search: see queries.h.
#include "queries.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "fastscan.h"
#include "parallel.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TQVEC_X86 1
#endif

namespace tqvec {
namespace {

float dot_scalar(const float* a, const float* b, int64_t n) {
  float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int j = 0; j < 4; ++j) s[j] += a[i + j] * b[i + j];
  for (; i < n; ++i) s[0] += a[i] * b[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

#ifdef TQVEC_X86
__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  alignas(32) float part[8];
  _mm256_store_ps(part, _mm256_add_ps(s0, s1));
  float s = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  return s + dot_scalar(a + i, b + i, n - i);
}
#endif

// y[r] = <m[r], x> for the rows r of the row-major (rows, n) matrix m.
void matvec_scalar(const float* m, int64_t rows, int64_t n, const float* x, float* y) {
  for (int64_t r = 0; r < rows; ++r) y[r] = dot_scalar(m + r * n, x, n);
}

#ifdef TQVEC_X86
// Four rows at a time, two 8-wide chunks each: eight independent sums keep the FMA units busy.
__attribute__((target("avx2,fma"))) void matvec_avx2(const float* m, int64_t rows, int64_t n, const float* x, float* y) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    __m256 acc[8];
    for (__m256& a : acc) a = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + c), x1 = _mm256_loadu_ps(x + c + 8);
      for (int i = 0; i < 4; ++i) {
        acc[2 * i] = _mm256_fmadd_ps(_mm256_loadu_ps(m + (r + i) * n + c), x0, acc[2 * i]);
        acc[2 * i + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(m + (r + i) * n + c + 8), x1, acc[2 * i + 1]);
      }
    }
    for (int i = 0; i < 4; ++i) {
      alignas(32) float part[8];
      _mm256_store_ps(part, _mm256_add_ps(acc[2 * i], acc[2 * i + 1]));
      const float head = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
      y[r + i] = head + dot_scalar(m + (r + i) * n + c, x + c, n - c);
    }
  }
  for (; r < rows; ++r) y[r] = dot_avx2(m + r * n, x, n);
}
#endif

using Dot = float (*)(const float*, const float*, int64_t);
using Matvec = void (*)(const float*, int64_t, int64_t, const float*, float*);

Dot pick_dot() {
#ifdef TQVEC_X86
  if (has_avx2()) return dot_avx2;
#endif
  return dot_scalar;
}

Matvec pick_matvec() {
#ifdef TQVEC_X86
  if (has_avx2()) return matvec_avx2;
#endif
  return matvec_scalar;
}

// In-place unnormalized Walsh-Hadamard transform of x (n a power of two).
void walsh_hadamard(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

}  // namespace

void prepare_queries(const QueryTransform& t, const Coarse& c, const float* queries, int64_t nq, int threads,
                     float* rotated, int64_t* probe, float* probe_constant) {
  const Dot dot = pick_dot();
  const Matvec matvec = pick_matvec();
  const int64_t n_probe = c.n_lists ? c.n_probe : 1;
  const float center_squared = t.center ? dot(t.center, t.center, t.dim) : 0.0f;
  parallel_for(static_cast<size_t>(nq), threads, [&](size_t begin, size_t end) {
    std::vector<float> q(static_cast<size_t>(t.dim)), padded(static_cast<size_t>(t.out_dim));
    std::vector<float> closeness(static_cast<size_t>(c.n_lists)), product(static_cast<size_t>(c.n_lists));
    std::vector<int64_t> order(static_cast<size_t>(c.n_lists));
    for (size_t i = begin; i < end; ++i) {
      std::copy(queries + i * t.dim, queries + (i + 1) * t.dim, q.begin());
      if (t.normalize) {
        const float norm = std::sqrt(dot(q.data(), q.data(), t.dim));
        const float scale = 1.0f / std::max(norm, kNormalizeEps);
        for (float& v : q) v *= scale;
      }
      float* out_probe_constant = probe_constant + i * n_probe;
      int64_t* out_probe = probe + i * n_probe;
      if (c.n_lists) {
        matvec(c.centroids, c.n_lists, t.dim, q.data(), product.data());
        for (int64_t l = 0; l < c.n_lists; ++l) closeness[l] = c.half_squared ? product[l] - c.half_squared[l] : product[l];
        std::iota(order.begin(), order.end(), int64_t{0});
        std::partial_sort(order.begin(), order.begin() + n_probe, order.end(), [&](int64_t x, int64_t y) {
          return closeness[x] > closeness[y] || (closeness[x] == closeness[y] && x < y);
        });
        const float base = c.base ? dot(q.data(), c.base, t.dim) : 0.0f;
        for (int64_t p = 0; p < n_probe; ++p) {
          out_probe[p] = order[p];
          out_probe_constant[p] = c.residual ? product[order[p]] : base;
        }
      } else {
        out_probe[0] = 0;
        out_probe_constant[0] = t.center ? dot(q.data(), t.center, t.dim) - center_squared : 0.0f;
        if (t.center)
          for (int64_t d = 0; d < t.dim; ++d) q[d] -= t.center[d];
      }
      float* out = rotated + i * t.out_dim;
      if (t.rotation) {
        matvec(t.rotation, t.out_dim, t.dim, q.data(), out);
      } else {
        std::fill(padded.begin(), padded.end(), 0.0f);
        for (int64_t d = 0; d < t.dim; ++d) padded[d] = q[d] * t.signs[d];
        walsh_hadamard(padded.data(), t.out_dim);
        const float scale = 1.0f / std::sqrt(static_cast<float>(t.out_dim));
        for (int64_t r = 0; r < t.out_dim; ++r) out[r] = padded[r] * scale;
      }
    }
  }, 8);
}

}  // namespace tqvec
