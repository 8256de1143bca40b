// Batches of queries against the same rows with 8-bit integer products (AVX-512 VNNI): the candidates of a flat
// batch search.
//
// Each row decodes (by the search's plan) to its levels rounded to signed bytes, l8 = round(level * level_scale)
// with one level_scale for the plan (the largest level maps to 127); each query to unsigned bytes,
// q8 = round(q * s_q) + 128 with s_q = 127 / max |q_c|. One VPDPBUSD adds four byte products of 16 queries (its
// lanes) and one row (its broadcast operand), so
//   sum_c q8_c * l8_c - 128 * sum_c l8_c = s_q * level_scale * <q, o> + (the two roundings' error),
// and the estimate of a row's score is scale * that / (s_q * level_scale) + bias. A decoded row is read by every
// query of a batch while it is in cache, so its decoding costs little per query once a batch holds a few dozen
// queries; the rows with the best estimates are then scored exactly by the caller (the one-stage fast scan's
// contract: the top k is the exact one unless the roundings moved a row across the cut of `keep` candidates).
#pragma once

#include "fastscan.h"

#include <atomic>
#include <cstdlib>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace tqvec {

// How one plan's rows decode to signed bytes. Byte runs (consecutive bytes whose two nibbles are two 4-bit
// codes of one channel each, all with one level table) decode 32 bytes at a time with two byte shuffles; runs of
// 3-bit codes (groups of 8 codes in 3 bytes from a byte boundary, one table) a group at a time (a bit deposit
// spreads the 8 codes over 8 bytes, one shuffle looks them up); the other steps one code at a time. The decoded
// row holds `width` bytes (a multiple of 64; zeros past the channels), byte i holding channel channel_of[i] (-1 for
// padding).
struct Int8Decoder {
  struct ByteRun {
    int32_t byte, bytes, out, table;  // the run's bytes [byte, byte + bytes) decode to out .. out + 2 * bytes
  };
  struct ThreeBitRun {
    int32_t byte, groups, out, table;  // groups of 3 bytes from `byte` decode to out .. out + 8 * groups
  };
  struct Step {
    int32_t byte, shift, width, channels, entry;  // entry: the step's (2^width, channels) block of step_levels
    int32_t out[kMaxStepChannels];
  };
  std::vector<ByteRun> runs;
  std::vector<ThreeBitRun> three_bit_runs;
  std::vector<Step> steps;
  std::vector<int8_t> run_levels;   // 16 per run (byte runs and 3-bit runs, whose last 8 are unused)
  std::vector<int8_t> step_levels;  // per step, code-major: entry + code * channels + j
  std::vector<int32_t> channel_of;  // (width,)
  int64_t width = 0;
  int64_t channel_groups = 0;  // the groups of 4 bytes that hold channels (the rest of width is zeros)
  float level_scale = 1.0f;
};

// The byte decoding of `plan` (its channels must be 0 .. dim - 1 for queries of dim channels, each covered once).
Int8Decoder int8_decoder(const Plan& plan);

// True when this CPU runs the int8 kernel (AVX-512 F, BW, VL and VNNI, and BMI2).
bool has_avx512_vnni();

// True when the int8 kernel's products can run on AMX tiles (AMX-TILE and AMX-INT8, and the operating system's
// permission, asked for once per process).
bool has_amx();

// Per query, an estimate that `keep` rows scanned so far (by any of the threads that scan parts of the rows) exceed:
// a row whose estimate does not is not among the `keep` best, so every part skips it. Raised by every part.
class SharedCuts {
 public:
  explicit SharedCuts(int64_t nq);
  float get(int64_t q) const { return cut_[q].load(std::memory_order_relaxed); }
  void raise(int64_t q, float value);

 private:
  std::unique_ptr<std::atomic<float>[]> cut_;
};

// An estimate and its row.
using Estimate = std::pair<float, int64_t>;

// Queries as the int8 kernel reads them: per tile of 16 queries, (groups, 16, 4) unsigned bytes (lane l of group g:
// query 16 t + l at decoded positions 4 g .. 4 g + 3), and per query 1 / (s_q * level_scale) (0 for padding lanes).
struct Int8Queries {
  int64_t tiles = 0, groups = 0;
  std::unique_ptr<uint8_t[], void (*)(void*)> bytes{nullptr, std::free};
  std::vector<float> inverse;  // (tiles * 16,)

  const uint8_t* tile(int64_t t) const { return bytes.get() + t * groups * 64; }
};

// `queries` ((nq, dim) rotated) quantized for the decoder's rows, on `threads` threads. Needs has_avx512_vnni().
Int8Queries int8_queries(const Int8Decoder& decoder, const float* queries, int64_t nq, int64_t dim, int threads);

// For each query q in [query_begin, query_end) of `queries` (query_begin a multiple of 16), the `keep` rows r of
// [row_begin, row_end) of `rows` with the largest estimates of scale_r * <q, o_r> + bias_r, appended to
// out[q - query_begin] with those estimates (any order; fewer where the range holds fewer rows with a finite
// estimate, or where rows of other parts beat them: `cuts`, indexed from query_begin, shared by the parts of the
// rows that the same queries scan); the products on AMX tiles where `use_amx` (which needs has_amx()). Needs
// has_avx512_vnni().
void int8_candidates(const Int8Decoder& decoder, const Rows& rows, int64_t row_begin, int64_t row_end, const Int8Queries& queries,
                     int64_t query_begin, int64_t query_end, int64_t keep, SharedCuts& cuts, std::vector<std::vector<Estimate>>& out,
                     bool use_amx);

}  // namespace tqvec
