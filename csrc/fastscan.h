// Fast-scan top-k search over packed TurboQuant codes (the CPU counterpart of the Triton scan).
//
// A row of packed codes is read as a sequence of *steps*: step t extracts a code of `width[t]` <= 8 bits
// starting at bit `shift[t]` of byte `byte[t]` (it may continue into byte `byte[t] + 1`), and that code
// selects one of the 2^width entries of the step's look-up table. A step covers one channel (3- to 8-bit
// codes) or several (two 2-bit or four 1-bit channels share one 4-bit step), so the inner product of a query
// with a row is the sum over steps of table entries: exact, as long as the tables are exact.
//
// Three kernels, by the layout the rows were arranged in (built once per index snapshot):
// * one stage (`arrange`, steps of at most 4 bits): each group's rows in blocks of 32, byte-major within a block
//   (byte j of the 32 rows side by side). Tables quantized to 8 bits with one scale per query; one byte shuffle
//   looks up 32 rows (64 with AVX-512 BW); 16-bit sums, widened to 32 bits every 256 steps. The best `rescore`
//   rows by that estimate are re-scored exactly with the float tables (row-major codes); the best `k` returned.
// * two stages (`arrange_signs` or `arrange_high_bits`; SignStore): the rows' sign bits (or the high bits of their
//   codes) in that block layout are scanned the same way; a row is scored exactly only when
//   its estimate plus an error bound beats the query's k-th exact score.
// * exact: float tables for every row (no AVX2, or wide codes without a two-stage layout), reading an inverted file's rows in list order
//   (`arrange_lists`) where that copy exists.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

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

// Step t's table: (kMaxStepChannels, 2^width[t]) levels, each covered channel's level per code.
inline const float* step_levels(const Plan& plan, int t) {
  return plan.level + static_cast<size_t>(kMaxStepChannels) * plan.offset[t];
}

// True when steps t and t + 1 are the low and high nibble of one byte, each a full 4-bit code.
inline bool nibble_pair(const Plan& plan, int t) {
  return plan.shift[t] == 0 && plan.width[t] == 4 && t + 1 < plan.n_steps && plan.byte[t + 1] == plan.byte[t] &&
         plan.shift[t + 1] == 4 && plan.width[t + 1] == 4;
}

// Channels per group of a run of `width`-bit codes (3, 4 or 8): 16 channels in 8 bytes for 4-bit codes, else 8
// channels in `width` bytes.
constexpr int run_channels(int width) { return width == 4 ? 16 : 8; }

// True when steps t .. t + run_channels(width) - 1 are `width`-bit codes packed from a byte boundary (byte[t],
// shift 0), one channel each, channels consecutive from channel[t], all with the level table of step `first`.
bool run_group(const Plan& plan, int t, int first, int width);

// How the kernels read a plan (its exact scoring steps, and the SIMD kernels' step operations): derived once per
// plan and passed with it.
struct PlanSteps;
std::shared_ptr<const PlanSteps> plan_steps(const Plan& plan);

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

// The fast-scan layout of the rows of every group: group g is blocks [group_blocks[g], group_blocks[g + 1]),
// block b holds codes[b * row_bytes * 32 + j * 32 + i] = byte j of the row in slot i; that row's scale, bias and
// number sit at b * 32 + lane(i) of scale / bias / rows, in the order the kernel's sums come out (even slots of
// each 16 first, then odd ones). Empty slots hold zero codes, scale 0, bias -inf, row -1.
struct Blocks {
  const uint8_t* codes;         // (n_blocks, row_bytes, 32)
  const float* scale;           // (n_blocks * 32,)
  const float* bias;            // (n_blocks * 32,)
  const int64_t* rows;          // (n_blocks * 32,)
  const int64_t* group_blocks;  // (n_groups + 1,)
  int64_t n_blocks, n_groups, row_bytes, n_rows;  // n_rows: the rows the slots index (of `Rows`)
};

// The owner of one fast-scan layout (see Blocks).
struct BlockStore {
  std::vector<uint8_t> codes;
  std::vector<float> scale, bias;
  std::vector<int64_t> rows, group_blocks;
  int64_t row_bytes = 0, n_rows = 0;

  Blocks view() const;
  size_t nbytes() const;
};

// Arranges `rows` in the fast-scan layout, group g holding rows list_rows[offsets[g]:offsets[g + 1]] (the
// contiguous range [offsets[g], offsets[g + 1]) when list_rows is null), in that order.
BlockStore arrange(const Rows& rows, const int64_t* offsets, const int64_t* list_rows, int64_t n_groups);

// The rows in their groups' order, for the exact kernel over inverted lists (whose rows otherwise lie anywhere in
// the row-major codes): position p holds row list_rows[p], so a list is read front to back.
struct ListOrder {
  std::vector<uint8_t> codes;      // (positions, row_bytes)
  std::vector<float> scale, bias;  // (positions,) each, or empty when the rows have none
  int64_t row_bytes = 0;

  Rows view() const;
  size_t nbytes() const;
};

// The rows list_rows[0 .. positions) of `rows`, in that order.
ListOrder arrange_lists(const Rows& rows, const int64_t* list_rows, int64_t positions);

// The sign layout of the two-stage scan. Row r decodes (by the search's plan) to levels o in R^D; its sign
// vector s (s_c = +1 where o_c > 0, else -1) is stored as D bits in the fast-scan layout, with, per slot,
//   gain  = scale_r * |o|^2 / sum_c |o_c|     (the estimate of scale_r * <q, o> is gain * <q, s>),
//   bias  = bias_r,
//   slack = |scale_r| * |o| * sqrt(1 - f^2) / (f * sqrt(D - 1)),  f = sum_c |o_c| / (sqrt(D) * |o|),
// RaBitQ's estimator and error scale (Gao & Long, SIGMOD 2024) applied to the decoded row: under the random
// rotation, |scale_r * <q, o> - gain * <q, s>| <= confidence * |q| * slack except with the probability of a
// normal deviate beyond `confidence` standard deviations. The search scans the signs (1-bit steps, four
// channels per nibble) and scores exactly only the rows whose estimate plus that bound beats its current k-th
// exact score, reading their codes from a copy in the same slot order (a list's rows side by side).
struct SignStore {
  BlockStore blocks;         // codes: ceil(D / 8) sign bytes per row; scale: gain; bias: bias
  std::vector<float> slack;  // per slot, in the blocks' lane order (0 for empty slots)
  // With reference vectors r_g (one per group, see arrange_signs): per slot the first stage's exact error at r_g of
  // its row's group, <r_g, scale * o - gain * s>, added to the estimate (else empty)
  std::vector<float> reference_error;
  std::vector<float> reference;  // (groups, D) the reference vectors, or empty
  std::vector<float> scale;  // scale_r per slot, in lane order (0 for empty slots)
  std::vector<uint8_t> codes;  // (slots, row_bytes): each slot's row, in lane order (lists only; else empty)
  std::vector<int32_t> byte, shift, width, channel, offset;  // the plan that reads the sign bytes (levels +-1)
  std::vector<float> level;
  std::shared_ptr<const PlanSteps> steps;  // of plan()
  bool sign_bits = false;  // the first stage reads sign bits (arrange_signs): its tables are made from the query alone

  Plan plan() const;
  size_t nbytes() const;
};

// What the search reads of a SignStore.
struct SignBlocks {
  Blocks blocks;
  const float* slack;
  const float* scale;
  const float* reference_error;  // SignStore::reference_error, or null (no reference vectors)
  const float* reference;        // SignStore::reference (groups, channels), or null
  int64_t channels;              // the channels the first stage reads (a reference vector's length)
  const uint8_t* codes;  // each slot's row (SignStore::codes), or null: the search's rows, by row number
  Plan plan;
  const PlanSteps* steps;  // of plan
  bool sign_bits;          // SignStore::sign_bits
};

// The sign layout of `rows` read by `plan` (channels [0, channels)), grouped as in `arrange`. With `reference`
// ((n_groups, channels), or null; each row in one group): the estimate's error is linear in the query,
// e(q) = <q, scale * o - gain * s>, so e(q) = e(r_g) + e(q - r_g); e(r_g) is computed here, and where
// |q - r_g| < |q| the search adds it to the row's estimate and bounds e(q - r_g) with |q - r_g| instead of e(q) with
// |q| (RaBitQ's use of the list centroid: a query near its probed lists' centroids gets a tighter bound).
SignStore arrange_signs(const Rows& rows, const Plan& plan, int64_t channels, const int64_t* offsets,
                        const int64_t* list_rows, int64_t n_groups, const float* reference = nullptr);

// The two-stage layout of codes read one channel per step (`plan`: 3 to 8 bits, channels 0 .. channels - 1) whose first
// stage reads the high `kept` bits of each channel's code (code >> (width - kept); kept = 4: a nibble per channel,
// for 5- to 8-bit codes; kept = 2: two channels per nibble, for 3- and 4-bit codes), each standing for the mean of
// the levels it groups. With c those means for a row's codes and f = cos(o, c), the estimate of scale_r * <q, o> is
// gain * <q, c>, gain = scale_r * |o|^2 / <o, c> (exact for q along o, as the sign layout's), and the slack
// |scale_r| * |o| * sqrt(1 - f^2) / (f * sqrt(D - 1)): the sign layout's estimator and bound with c for s.
SignStore arrange_high_bits(const Rows& rows, const Plan& plan, int64_t channels, int kept, const int64_t* offsets,
                            const int64_t* list_rows, int64_t n_groups, const float* reference = nullptr);

struct SearchArgs {
  Plan plan;
  const PlanSteps* steps;  // plan_steps(plan), or null (derived by the search)
  Rows rows;
  Groups groups;
  const float* queries;   // (nq, dim) rotated queries
  int64_t nq;
  int64_t dim;
  int64_t k;
  int64_t rescore;        // candidates kept by approximate score (>= k); 0: exact scan (no quantized tables)
  const Blocks* blocks;   // the rows' fast-scan layout with the groups of `groups`; null: exact scan
  const SignBlocks* signs;  // or their sign layout (two-stage scan; `blocks` unused); null: none
  const Rows* ordered;    // the rows by position in the groups' order (ListOrder) for the exact kernel, or null
  float confidence;       // the two-stage scan's bound in standard deviations
  int threads;
  float* out_values;      // (nq, k), best first; -inf padding
  int64_t* out_rows;      // (nq, k); -1 padding
  int64_t* out_exact;     // (nq,): rows each query scored with the float tables (its exact scores), or null
};

// Instruction sets of the kernels, in order: the scalar exact kernel, the AVX2 fast scan, the fast scan with
// 512-bit shuffles for the nibble pairs, and for flat batches of two-stage codes the int8 products (int8_scan.h) with
// AVX-512 VNNI or on AMX tiles.
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3, kAmx = 4 };

// Runs the search with the best kernel this CPU has, up to `max_isa`; returns its name ("amx", "avx512-vnni",
// "avx512", "avx2" or "scalar", with "-two-stage" for the two-stage scans).
const char* search(const SearchArgs& args, Isa max_isa);

// True when this CPU runs the AVX2 kernel (AVX2 and FMA).
bool has_avx2();

// True when this CPU runs the AVX-512 kernel (AVX-512 F and BW, with AVX2 and FMA).
bool has_avx512();

}  // namespace tqvec
