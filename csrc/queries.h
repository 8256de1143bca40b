// Query preparation for the native index search: what tqvec's indexes do to a validated float query before the
// scan (normalize, rotate, choose the inverted lists to probe and their score constants), done per query on the
// search's own threads, so that a search needs no torch or BLAS call (their idle threads spin and slow the scan).
#pragma once

#include <cstdint>

#include "fastscan.h"

namespace tqvec {

// The rotation and centering that map a query to the codes' rotated domain.
struct QueryTransform {
  int64_t dim, out_dim;      // query and rotated dimensions
  const float* rotation;     // (out_dim, dim) row-major Haar matrix, or null for the Hadamard and FHT-Kac rotations
  const float* signs;        // rounds == 0: (out_dim,) Hadamard signs (out_dim a power of two >= dim), applied to the
                             // query zero-padded to out_dim before an orthonormal Walsh-Hadamard transform;
                             // rounds > 0: (rounds, dim) FHT-Kac signs (out_dim == dim): round r multiplies by
                             // signs[r], transforms `block` coordinates (the first in even rounds, the last in odd
                             // ones; orthonormal), then maps (a, b) -> ((a + b), (a - b)) / sqrt(2) between the first
                             // and second dim / 2 coordinates (tqvec.rotation.KacRotation)
  int rounds;                // 0 (Haar or Hadamard) or the FHT-Kac rounds
  int64_t block;             // FHT-Kac: the largest power of two <= dim
  bool normalize;            // divide the query by its norm first (cosine), at least kNormalizeEps
  const float* center;       // (dim,) or null: a flat index's center c, rotated q - c, constant <q, c> - <c, c>
};

// The inverted lists a query probes (n_lists == 0: a flat index, one group, probe 0 with the center constant).
struct Coarse {
  int64_t n_lists, n_probe;
  const float* centroids;     // (n_lists, dim)
  const float* half_squared;  // (n_lists,) |c_l|^2 / 2: probe the nearest lists in L2; null: largest <q, c_l>
  bool residual;              // list constant <q, c_l> (residual encoding); else <q, base> (base below, or 0)
  const float* base;          // (dim,) or null: the direct encoding's global center
};

constexpr float kNormalizeEps = 1e-12f;

// For queries (nq, dim): squared (nq,) their squared norms |q|^2 in double precision (not finite where a query
// holds NaN or Inf; the caller checks them before it scans); rotated (nq, out_dim); probe (nq, n_probe) lists (best
// first) and their constants probe_constant (nq, n_probe) (a flat index: n_probe 1). Runs on up to `threads`
// threads, with AVX2 or AVX-512 where the CPU has it and `max_isa` allows it.
void prepare_queries(const QueryTransform& transform, const Coarse& coarse, const float* queries, int64_t nq, int threads,
                     Isa max_isa, double* squared, float* rotated, int64_t* probe, float* probe_constant);

}  // namespace tqvec
