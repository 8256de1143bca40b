// Fast-scan top-k search over packed TurboQuant codes (the CPU counterpart of the Triton scan).
//
// A row of packed codes is read as a sequence of *steps*: step t extracts a code of `width[t]` <= 8 bits
// starting at bit `shift[t]` of byte `byte[t]` (it may continue into byte `byte[t] + 1`), and that code
// selects one of the 2^width entries of the step's look-up table. A step covers one channel (3- to 8-bit
// codes) or several (two 2-bit or four 1-bit channels share one 4-bit step), so the inner product of a query
// with a row is the sum over steps of table entries: exact, as long as the tables are exact.
//
// The SIMD kernel (steps of at most 4 bits; wider codes are scored by the exact kernel) transposes 32 rows at a time into a byte-major block (byte j of rows 0..31 side by side),
// quantizes the tables to 8 bits with one scale per query, looks up 32 rows per byte shuffle and accumulates
// in 16 bits (widened to 32 bits every 256 steps). It keeps the best `rescore` rows by that approximate
// score, then re-scores them exactly with the float tables and returns the best `k`.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tqvec {

constexpr int kMaxStepChannels = 4;  // channels one step may cover (four 1-bit codes)
constexpr int kRowsPerBlock = 32;

struct Plan {
  int n_steps;
  const int32_t* byte;      // (n_steps,)
  const int32_t* shift;     // (n_steps,)
  const int32_t* width;     // (n_steps,) 1..8
  const int32_t* channel;   // (n_steps, kMaxStepChannels), -1 where unused
  const int32_t* offset;    // (n_steps + 1,): step t's table is entries [offset[t], offset[t + 1]), 2^width of them
  const float* level;       // (kMaxStepChannels * offset[n_steps],): step t's block at kMaxStepChannels * offset[t] is
                            // (kMaxStepChannels, 2^width): the level of each covered channel per table entry
};

struct Rows {
  const uint8_t* packed;    // (n, row_bytes)
  int64_t n;
  int64_t row_bytes;
  const float* scale;       // (n,) or nullptr (1)
  const float* bias;        // (n,) or nullptr (0)
};

// Row groups to scan per query: groups[g] = rows list_rows[offsets[g]:offsets[g + 1]] (or the contiguous range
// [offsets[g], offsets[g + 1]) when list_rows is null); query q scans groups probe[q, :] with an additive
// constant probe_constant[q, :] (0 when null).
struct Groups {
  const int64_t* offsets;
  const int64_t* list_rows;
  int64_t n_groups;
  const int64_t* probe;           // (nq, n_probe); -1 entries are skipped
  const float* probe_constant;    // (nq, n_probe) or nullptr
  int64_t n_probe;
};

struct SearchArgs {
  Plan plan;
  Rows rows;
  Groups groups;
  const float* queries;   // (nq, dim) rotated queries
  int64_t nq;
  int64_t dim;
  int64_t k;
  int64_t rescore;        // candidates kept by approximate score (>= k); 0: exact scan (no quantized tables)
  int threads;
  float* out_values;      // (nq, k), best first; -inf padding
  int64_t* out_rows;      // (nq, k); -1 padding
};

// Runs the search; returns the name of the kernel used ("avx2" or "scalar").
const char* search(const SearchArgs& args, bool allow_simd);

// True when this CPU runs the AVX2 kernel (AVX2 and FMA).
bool has_avx2();

}  // namespace tqvec
