// Query preparation for the native index search: see queries.h.
#include "queries.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "fastscan.h"
#include "parallel.h"
#include "scratch.h"
#include "vector_math.h"

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

// Sum of x[d]^2 in double precision (NaN or Inf in x make it non-finite; a float32 squared cannot overflow it).
double squared_norm_scalar(const float* x, int64_t n) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int j = 0; j < 4; ++j) s[j] += static_cast<double>(x[i + j]) * x[i + j];
  for (; i < n; ++i) s[0] += static_cast<double>(x[i]) * x[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

#ifdef TQVEC_X86
__attribute__((target("avx2,fma"))) double squared_norm_avx2(const float* x, int64_t n) {
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256d a = _mm256_cvtps_pd(_mm_loadu_ps(x + i)), b = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
    s0 = _mm256_fmadd_pd(a, a, s0);
    s1 = _mm256_fmadd_pd(b, b, s1);
  }
  alignas(32) double part[4];
  _mm256_store_pd(part, _mm256_add_pd(s0, s1));
  double s = (part[0] + part[1]) + (part[2] + part[3]);
  for (; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
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
      float sum = lane_sum(_mm256_add_ps(acc[2 * i], acc[2 * i + 1]));
      for (int64_t d = c; d < n; ++d) sum += m[(r + i) * n + d] * x[d];
      y[r + i] = sum;
    }
  }
  for (; r < rows; ++r) y[r] = dot_avx2(m + r * n, x, n);
}
#endif

// y[j * rows + r] = <m[r], x[j]> for the rows r of m and the g rows x[j] of x (g <= kQueryBlock): each row of m
// is read once for all of them.
constexpr int64_t kQueryBlock = 8;

void matmat_scalar(const float* m, int64_t rows, int64_t n, const float* x, int64_t g, float* y) {
  for (int64_t j = 0; j < g; ++j) matvec_scalar(m, rows, n, x + j * n, y + j * rows);
}

#ifdef TQVEC_X86
__attribute__((target("avx2,fma"))) void matmat_avx2(const float* m, int64_t rows, int64_t n, const float* x, int64_t g,
                                                     float* y) {
  if (g == 1) return matvec_avx2(m, rows, n, x, y);
  const int64_t wide = n / 8 * 8;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = m + r * n;
    __m256 acc[kQueryBlock];
    for (int64_t j = 0; j < g; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < wide; c += 8) {
      const __m256 v = _mm256_loadu_ps(row + c);
      for (int64_t j = 0; j < g; ++j) acc[j] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + j * n + c), acc[j]);
    }
    for (int64_t j = 0; j < g; ++j) {
      float sum = lane_sum(acc[j]);
      for (int64_t d = wide; d < n; ++d) sum += row[d] * x[j * n + d];
      y[j * rows + r] = sum;
    }
  }
}
#endif

#ifdef TQVEC_X86
// The sum of a 512-bit register's lanes (through memory: GCC 12 warns on its own headers' 512-bit reductions).
__attribute__((target("avx512f,avx2,fma"))) inline float lane_sum_512(__m512 v) {
  alignas(64) float part[16];
  _mm512_store_ps(part, v);
  return lane_sum(_mm256_add_ps(_mm256_load_ps(part), _mm256_load_ps(part + 8)));
}

// R rows of `m` (from `row` on) against the G queries of x, written to y (G x rows): each row chunk is loaded once
// for all G. Each (row, query) sum is the same chain of products as in matmat_avx512's one-query path.
template <int R, int G>
__attribute__((target("avx512f,avx2,fma"), always_inline)) inline void matmat_rows_avx512(const float* m, int64_t rows, int64_t n,
                                                                                        int64_t row, const float* x, float* y) {
  const int64_t wide = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - wide)) - 1u);
  __m512 acc[R][G];
  for (auto& per_row : acc)
    for (__m512& a : per_row) a = _mm512_setzero_ps();
  for (int64_t c = 0; c < wide; c += 16) {
    __m512 v[R];
    for (int i = 0; i < R; ++i) v[i] = _mm512_loadu_ps(m + (row + i) * n + c);
    for (int j = 0; j < G; ++j) {
      const __m512 q = _mm512_loadu_ps(x + j * n + c);
      for (int i = 0; i < R; ++i) acc[i][j] = _mm512_fmadd_ps(v[i], q, acc[i][j]);
    }
  }
  if (tail) {
    __m512 v[R];
    for (int i = 0; i < R; ++i) v[i] = _mm512_maskz_loadu_ps(tail, m + (row + i) * n + wide);
    for (int j = 0; j < G; ++j) {
      const __m512 q = _mm512_maskz_loadu_ps(tail, x + j * n + wide);
      for (int i = 0; i < R; ++i) acc[i][j] = _mm512_fmadd_ps(v[i], q, acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < G; ++j) y[j * rows + row + i] = lane_sum_512(acc[i][j]);
}

// matmat_avx512 for G >= 2 queries: two rows of `m` at a time against all G, so each row is read once per block
// of queries.
template <int G>
__attribute__((target("avx512f,avx2,fma"), always_inline)) inline void matmat_block_avx512(const float* m, int64_t rows,
                                                                                         int64_t n, const float* x, float* y) {
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) matmat_rows_avx512<2, G>(m, rows, n, r, x, y);
  if (r < rows) matmat_rows_avx512<1, G>(m, rows, n, r, x, y);
}

// matmat with 16-wide products, the last n % 16 columns masked. One query: 8 rows of `m` at a time (8 independent
// sums); more: matmat_block_avx512 (each row read once for the block). (Sums are taken in another order than
// matmat_avx2's, so results may differ in the last bits; a (row, query) sum does not depend on the other queries.)
__attribute__((target("avx512f,avx2,fma"))) void matmat_avx512(const float* m, int64_t rows, int64_t n, const float* x,
                                                               int64_t g, float* y) {
  switch (g) {
    case 2: return matmat_block_avx512<2>(m, rows, n, x, y);
    case 3: return matmat_block_avx512<3>(m, rows, n, x, y);
    case 4: return matmat_block_avx512<4>(m, rows, n, x, y);
    case 5: return matmat_block_avx512<5>(m, rows, n, x, y);
    case 6: return matmat_block_avx512<6>(m, rows, n, x, y);
    case 7: return matmat_block_avx512<7>(m, rows, n, x, y);
    case 8: return matmat_block_avx512<8>(m, rows, n, x, y);
    default: break;
  }
  constexpr int kRows = 8;
  const int64_t wide = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - wide)) - 1u);
  for (int64_t j = 0; j < g; ++j) {
    const float* q = x + j * n;
    float* out = y + j * rows;
    int64_t r = 0;
    for (; r + kRows <= rows; r += kRows) {
      __m512 acc[kRows];
      for (__m512& a : acc) a = _mm512_setzero_ps();
      for (int64_t c = 0; c < wide; c += 16) {
        const __m512 v = _mm512_loadu_ps(q + c);
        for (int i = 0; i < kRows; ++i) acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(m + (r + i) * n + c), v, acc[i]);
      }
      if (tail) {
        const __m512 v = _mm512_maskz_loadu_ps(tail, q + wide);
        for (int i = 0; i < kRows; ++i) acc[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, m + (r + i) * n + wide), v, acc[i]);
      }
      for (int i = 0; i < kRows; ++i) out[r + i] = lane_sum_512(acc[i]);
    }
    for (; r < rows; ++r) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < wide; c += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(m + r * n + c), _mm512_loadu_ps(q + c), acc);
      if (tail) acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, m + r * n + wide), _mm512_maskz_loadu_ps(tail, q + wide), acc);
      out[r] = lane_sum_512(acc);
    }
  }
}
#endif

using Dot = float (*)(const float*, const float*, int64_t);
using SquaredNorm = double (*)(const float*, int64_t);
using Matmat = void (*)(const float*, int64_t, int64_t, const float*, int64_t, float*);

Dot pick_dot(bool vector_isa) {
#ifdef TQVEC_X86
  if (vector_isa && has_avx2()) return dot_avx2;
#endif
  return dot_scalar;
}

SquaredNorm pick_squared_norm(bool vector_isa) {
#ifdef TQVEC_X86
  if (vector_isa && has_avx2()) return squared_norm_avx2;
#endif
  return squared_norm_scalar;
}

Matmat pick_matmat(Isa max_isa) {
#ifdef TQVEC_X86
  if (max_isa >= Isa::kAvx512 && has_avx512()) return matmat_avx512;
  if (max_isa >= Isa::kAvx2 && has_avx2()) return matmat_avx2;
#endif
  return matmat_scalar;
}

// In-place unnormalized Walsh-Hadamard transform of x (n a power of two). Always inlined: the AVX2 version runs it
// for n < 8 without a call into baseline code.
__attribute__((always_inline)) inline void walsh_hadamard_scalar(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

// v[d], v[d + half] -> ((a + b) * root, (a - b) * root) * next[d], next[d + half] for d in [lo, hi), where a = v[d] * sa
// and b = v[d + half] * sb (a factor of 1 leaves a value exactly as it is), next null: no factor. Always inlined.
__attribute__((always_inline)) inline void butterflies(float* v, int64_t half, int64_t lo, int64_t hi, float sa, float sb,
                                                       float root, const float* next) {
  float* __restrict__ low = v;
  float* __restrict__ high = v + half;
  if (next == nullptr) {
    for (int64_t d = lo; d < hi; ++d) {
      const float a = low[d] * sa, b = high[d] * sb;
      low[d] = (a + b) * root;
      high[d] = (a - b) * root;
    }
    return;
  }
  const float* __restrict__ next_low = next;
  const float* __restrict__ next_high = next + half;
  for (int64_t d = lo; d < hi; ++d) {
    const float a = low[d] * sa, b = high[d] * sb;
    low[d] = (a + b) * root * next_low[d];
    high[d] = (a - b) * root * next_high[d];
  }
}

// Rotates a padded query in place (v holds out_dim floats, the query's dim first, zeros after) with the
// unnormalized Walsh-Hadamard transform `Fwht`: the Hadamard rotation's signs and transform, or the FHT-Kac
// rotation's rounds (see QueryTransform). An FHT-Kac round after its transform makes one pass over the query: the
// block's scale, the butterflies and the next round's signs (the same products and sums as three passes, which the
// compiler may fuse into multiply-adds). Always inlined, so each caller compiles it for its own ISA.
template <void (*Fwht)(float*, int64_t)>
__attribute__((always_inline)) inline void rotate_with(const QueryTransform& t, float* v) {
  if (t.rounds == 0) {
    for (int64_t d = 0; d < t.dim; ++d) v[d] *= t.signs[d];
    Fwht(v, t.out_dim);
    const float scale = 1.0f / std::sqrt(static_cast<float>(t.out_dim));
    for (int64_t d = 0; d < t.out_dim; ++d) v[d] *= scale;
    return;
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(t.block)), half_root = std::sqrt(0.5f);
  const int64_t half = t.dim / 2;
  for (int64_t d = 0; d < t.dim; ++d) v[d] *= t.signs[d];
  for (int r = 0; r < t.rounds; ++r) {
    const int64_t first = r % 2 == 0 ? 0 : t.dim - t.block, last = first + t.block;  // the transformed block
    Fwht(v + first, t.block);
    const float* next = r + 1 < t.rounds ? t.signs + (r + 1) * t.dim : nullptr;
    // spans of the butterflies' d over which d and d + half each stay in or out of the block
    int64_t cuts[6] = {0, half, std::clamp<int64_t>(first, 0, half), std::clamp<int64_t>(last, 0, half),
                       std::clamp<int64_t>(first - half, 0, half), std::clamp<int64_t>(last - half, 0, half)};
    std::sort(cuts, cuts + 6);
    for (int i = 0; i + 1 < 6; ++i) {
      if (cuts[i] == cuts[i + 1]) continue;
      const int64_t d = cuts[i];
      const float sa = d >= first && d < last ? scale : 1.0f, sb = d + half >= first && d + half < last ? scale : 1.0f;
      butterflies(v, half, cuts[i], cuts[i + 1], sa, sb, half_root, next);
    }
    if (t.dim % 2) {  // the last coordinate has no butterfly
      const int64_t d = t.dim - 1;
      if (d >= first && d < last) v[d] *= scale;
      if (next) v[d] *= next[d];
    }
  }
}

void rotate_scalar(const QueryTransform& t, float* v) { rotate_with<walsh_hadamard_scalar>(t, v); }

#ifdef TQVEC_X86
// The Walsh-Hadamard levels at distances h, 2h, .., 2^(levels-1) h (h a multiple of 8, h << levels <= n) in one pass:
// the 2^levels vectors that those butterflies connect are loaded once, combined in registers and stored once.
template <int levels>
__attribute__((target("avx2,fma"), always_inline)) inline void hadamard_levels_avx2(float* x, int64_t n, int64_t h) {
  constexpr int m = 1 << levels;
  for (int64_t i = 0; i < n; i += h * m)
    for (int64_t j = i; j < i + h; j += 8) {
      __m256 r[m];
      for (int k = 0; k < m; ++k) r[k] = _mm256_loadu_ps(x + j + k * h);
      for (int s = 1; s < m; s *= 2)
        for (int k = 0; k < m; ++k)
          if (!(k & s)) {
            const __m256 a = r[k], b = r[k + s];
            r[k] = _mm256_add_ps(a, b);
            r[k + s] = _mm256_sub_ps(a, b);
          }
      for (int k = 0; k < m; ++k) _mm256_storeu_ps(x + j + k * h, r[k]);
    }
}

// walsh_hadamard_scalar with the first three levels inside each 8-float register and the others 8 lanes wide, up
// to three at a time (hadamard_levels_avx2).
__attribute__((target("avx2,fma"))) void walsh_hadamard_avx2(float* x, int64_t n) {
  if (n < 8) return walsh_hadamard_scalar(x, n);
  const __m256 odd = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1), pairs = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
  const __m256 halves = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
  for (int64_t i = 0; i < n; i += 8) {  // (a, b) -> (a + b, a - b) at distances 1, 2, 4: partner + own * sign
    __m256 v = _mm256_loadu_ps(x + i);
    v = _mm256_fmadd_ps(v, odd, _mm256_permute_ps(v, 0xB1));
    v = _mm256_fmadd_ps(v, pairs, _mm256_permute_ps(v, 0x4E));
    v = _mm256_fmadd_ps(v, halves, _mm256_permute2f128_ps(v, v, 1));
    _mm256_storeu_ps(x + i, v);
  }
  for (int64_t h = 8; h < n; h *= 8) {  // up to three levels (distances h, 2h, 4h) per pass over x
    if (h * 2 == n) {
      hadamard_levels_avx2<1>(x, n, h);
    } else if (h * 4 == n) {
      hadamard_levels_avx2<2>(x, n, h);
    } else {
      hadamard_levels_avx2<3>(x, n, h);
    }
  }
}

// rotate_scalar compiled for AVX2, with walsh_hadamard_avx2.
__attribute__((target("avx2,fma"))) void rotate_avx2(const QueryTransform& t, float* v) {
  rotate_with<walsh_hadamard_avx2>(t, v);
}

// walsh_hadamard_avx2 with 16-wide registers: distances 1 to 8 within a register, then up to three levels a pass.
template <int levels>
__attribute__((target("avx512f,avx2,fma"), always_inline)) inline void hadamard_levels_avx512(float* x, int64_t n, int64_t h) {
  constexpr int m = 1 << levels;
  for (int64_t i = 0; i < n; i += h * m)
    for (int64_t j = i; j < i + h; j += 16) {
      __m512 r[m];
      for (int k = 0; k < m; ++k) r[k] = _mm512_loadu_ps(x + j + k * h);
      for (int s = 1; s < m; s *= 2)
        for (int k = 0; k < m; ++k)
          if (!(k & s)) {
            const __m512 a = r[k], b = r[k + s];
            r[k] = _mm512_add_ps(a, b);
            r[k + s] = _mm512_sub_ps(a, b);
          }
      for (int k = 0; k < m; ++k) _mm512_storeu_ps(x + j + k * h, r[k]);
    }
}

__attribute__((target("avx512f,avx2,fma"))) void walsh_hadamard_avx512(float* x, int64_t n) {
  if (n < 16) return walsh_hadamard_avx2(x, n);
  const __m512 odd = _mm512_setr_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
  const __m512 pairs = _mm512_setr_ps(1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1);
  const __m512 quads = _mm512_setr_ps(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1);
  const __m512 halves = _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
  constexpr __mmask16 all = 0xFFFF;  // the masked forms: GCC 12 warns that the plain ones read an undefined register
  for (int64_t i = 0; i < n; i += 16) {  // (a, b) -> (a + b, a - b) at distances 1, 2, 4, 8: partner + own * sign
    __m512 v = _mm512_loadu_ps(x + i);
    v = _mm512_fmadd_ps(v, odd, _mm512_maskz_permute_ps(all, v, 0xB1));
    v = _mm512_fmadd_ps(v, pairs, _mm512_maskz_permute_ps(all, v, 0x4E));
    v = _mm512_fmadd_ps(v, quads, _mm512_maskz_shuffle_f32x4(all, v, v, 0xB1));
    v = _mm512_fmadd_ps(v, halves, _mm512_maskz_shuffle_f32x4(all, v, v, 0x4E));
    _mm512_storeu_ps(x + i, v);
  }
  for (int64_t h = 16; h < n; h *= 8) {
    if (h * 2 == n) {
      hadamard_levels_avx512<1>(x, n, h);
    } else if (h * 4 == n) {
      hadamard_levels_avx512<2>(x, n, h);
    } else {
      hadamard_levels_avx512<3>(x, n, h);
    }
  }
}

__attribute__((target("avx512f,avx2,fma,prefer-vector-width=512"))) void rotate_avx512(const QueryTransform& t, float* v) {
  rotate_with<walsh_hadamard_avx512>(t, v);
}
#endif

using Rotate = void (*)(const QueryTransform&, float*);

Rotate pick_rotate(Isa max_isa) {
#ifdef TQVEC_X86
  if (max_isa >= Isa::kAvx512 && has_avx512()) return rotate_avx512;
  if (max_isa >= Isa::kAvx2 && has_avx2()) return rotate_avx2;
#endif
  return rotate_scalar;
}

// A list's closeness to a query (the larger the closer).
struct Closeness {
  float value;
  int64_t list;
};

// the preparation's scratch buffers (tqvec::Scratch): a block's queries, their centroid products, the lists' order
struct PrepQueries;
struct PrepProducts;
struct PrepOrder;

}  // namespace

void prepare_queries(const QueryTransform& t, const Coarse& c, const float* queries, int64_t nq, int threads,
                     Isa max_isa, double* squared, float* rotated, int64_t* probe, float* probe_constant) {
  const bool vector_isa = max_isa >= Isa::kAvx2;
  const Dot dot = pick_dot(vector_isa);
  const SquaredNorm squared_norm = pick_squared_norm(vector_isa);
  const Matmat matmat = pick_matmat(max_isa);
  const Rotate rotate = pick_rotate(max_isa);
  const int64_t n_probe = c.n_lists ? c.n_probe : 1;
  const float center_squared = t.center ? dot(t.center, t.center, t.dim) : 0.0f;
  // Blocks of up to kQueryBlock queries share each pass over the rotation and the centroids.
  const size_t blocks = static_cast<size_t>((nq + kQueryBlock - 1) / kQueryBlock);
  parallel_for(blocks, threads, [&](size_t begin, size_t end) {
    const int64_t most = std::min(kQueryBlock, nq);  // queries of a block at most (a single query's search: one)
    const Scratch<float, PrepQueries> q(static_cast<size_t>(most * t.dim));
    const Scratch<float, PrepProducts> product(static_cast<size_t>(most * c.n_lists));
    const Scratch<Closeness, PrepOrder> order(static_cast<size_t>(c.n_lists));
    for (size_t block = begin; block < end; ++block) {
      const int64_t first = static_cast<int64_t>(block) * kQueryBlock, g = std::min(kQueryBlock, nq - first);
      std::copy(queries + first * t.dim, queries + (first + g) * t.dim, q.get());
      for (int64_t j = 0; j < g; ++j) squared[first + j] = squared_norm(q.get() + j * t.dim, t.dim);
      for (int64_t j = 0; t.normalize && j < g; ++j) {
        float* v = q.get() + j * t.dim;
        const float scale = 1.0f / std::max(std::sqrt(dot(v, v, t.dim)), kNormalizeEps);
        for (int64_t d = 0; d < t.dim; ++d) v[d] *= scale;
      }
      if (c.n_lists) matmat(c.centroids, c.n_lists, t.dim, q.get(), g, product.get());
      for (int64_t j = 0; j < g; ++j) {
        const int64_t i = first + j;
        float* v = q.get() + j * t.dim;
        float* out_probe_constant = probe_constant + i * n_probe;
        int64_t* out_probe = probe + i * n_probe;
        if (c.n_lists) {
          const float* p = product.get() + j * c.n_lists;
          for (int64_t l = 0; l < c.n_lists; ++l) {  // NaN (a bad query, refused later) as -inf: the order stays total
            const float close = c.half_squared ? p[l] - c.half_squared[l] : p[l];
            order[l] = {std::isnan(close) ? -std::numeric_limits<float>::infinity() : close, l};
          }
          // the n_probe closest first, ties to the lower list: a selection, then a sort of the selected (a partial
          // sort's heap cost more on 128 lists)
          auto closer = [](const Closeness& x, const Closeness& y) {
            return x.value > y.value || (x.value == y.value && x.list < y.list);
          };
          Closeness* lists = order.get();
          if (n_probe < c.n_lists) std::nth_element(lists, lists + (n_probe - 1), lists + c.n_lists, closer);
          std::sort(lists, lists + n_probe, closer);
          const float base = c.base ? dot(v, c.base, t.dim) : 0.0f;
          for (int64_t k = 0; k < n_probe; ++k) {
            out_probe[k] = lists[k].list;
            out_probe_constant[k] = c.residual ? p[lists[k].list] : base;
          }
        } else {
          out_probe[0] = 0;
          out_probe_constant[0] = t.center ? dot(v, t.center, t.dim) - center_squared : 0.0f;
          if (t.center)
            for (int64_t d = 0; d < t.dim; ++d) v[d] -= t.center[d];
        }
      }
      float* out = rotated + first * t.out_dim;
      if (t.rotation) {
        matmat(t.rotation, t.out_dim, t.dim, q.get(), g, out);
        continue;
      }
      for (int64_t j = 0; j < g; ++j) {
        float* v = out + j * t.out_dim;
        std::copy(q.get() + j * t.dim, q.get() + (j + 1) * t.dim, v);
        std::fill(v + t.dim, v + t.out_dim, 0.0f);
        rotate(t, v);
      }
    }
  }, 1, Idle::kSpin);
}

}  // namespace tqvec
