// Fast-scan top-k search over packed TurboQuant codes: see fastscan.h for the contract.
#include "fastscan.h"

#include "int8_scan.h"
#include "parallel.h"
#include "scratch.h"
#include "vector_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TQVEC_X86 1
#endif

namespace tqvec {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kLut = 16;              // entries of a step table in the SIMD kernel (codes of at most 4 bits)
constexpr int kFlushSteps = 256;      // 16-bit sums of <= 256 bytes cannot overflow
constexpr int64_t kQueryGroup = 16;   // queries that share each block (their tables stay in L2)
constexpr int64_t kMinRowsPerPart = 4096;
// The kernel's 32-bit sums come out in lane order: lane m holds slot kLaneSlot[m] (even slots of each 16, then
// odd ones); a block stores its rows' side fields and numbers in that order (kSlotLane is the inverse).
constexpr int kLaneSlot[kRowsPerBlock] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                          1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
constexpr int kSlotLane[kRowsPerBlock] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
constexpr bool lanes_invert_slots() {
  for (int slot = 0; slot < kRowsPerBlock; ++slot)
    if (kLaneSlot[kSlotLane[slot]] != slot) return false;
  return true;
}
static_assert(lanes_invert_slots(), "kSlotLane must invert kLaneSlot");  // rows a thread scans at least when one query's rows are split

struct Candidate {
  float score;
  int64_t row;
  float constant;  // the row's group constant, kept for the exact re-score
};

// The best `capacity` candidates seen so far (a min-heap on score; NaN and -inf never enter). Its comparator is
// a functor, so the heap operations inline into the SIMD kernels that call them.
class BestRows {
 public:
  explicit BestRows(int64_t capacity) : capacity_(static_cast<size_t>(capacity)) { heap_.reserve(capacity_); }

  float threshold() const { return heap_.size() < capacity_ ? kNegInf : heap_.front().score; }

  int64_t capacity() const { return static_cast<int64_t>(capacity_); }

  void push(float score, int64_t row, float constant) {
    if (!(score > threshold())) return;
    if (heap_.size() < capacity_) {
      heap_.push_back({score, row, constant});
      std::push_heap(heap_.begin(), heap_.end(), WorseFirst{});
    } else {
      std::pop_heap(heap_.begin(), heap_.end(), WorseFirst{});
      heap_.back() = {score, row, constant};
      std::push_heap(heap_.begin(), heap_.end(), WorseFirst{});
    }
  }

  std::vector<Candidate>& items() { return heap_; }

  int64_t exact = 0;  // rows scored with the float tables for this query (SearchArgs::out_exact)

 private:
  struct WorseFirst {
    bool operator()(const Candidate& a, const Candidate& b) const { return a.score > b.score; }
  };
  size_t capacity_;
  std::vector<Candidate> heap_;
};

// Step t's float table of one query: lut[offset[t] + c] = sum over the step's channels of query[channel] * level.
inline void float_table(const Plan& plan, int t, const float* query, float* lut) {
  const int32_t size = plan.offset[t + 1] - plan.offset[t];
  const int32_t* channel = plan.channel + t * kMaxStepChannels;
  const float* __restrict__ level = plan.level + static_cast<size_t>(kMaxStepChannels) * plan.offset[t];
  float* __restrict__ out = lut + plan.offset[t];
  const float q0 = channel[0] >= 0 ? query[channel[0]] : 0.0f;
  for (int32_t e = 0; e < size; ++e) out[e] = q0 * level[e];
  for (int j = 1; j < kMaxStepChannels && channel[j] >= 0; ++j) {
    const float qj = query[channel[j]];
    const float* __restrict__ lj = level + j * size;
    for (int32_t e = 0; e < size; ++e) out[e] += qj * lj[e];
  }
}

// The float tables of the steps `steps` (every step when null), each filled by `Table`. Always inlined, so each
// caller compiles it for its own ISA.
template <void (*Table)(const Plan&, int, const float*, float*)>
__attribute__((always_inline)) inline void float_tables_with(const Plan& plan, const std::vector<int32_t>* steps,
                                                           const float* query, float* lut) {
  if (!steps) {
    for (int t = 0; t < plan.n_steps; ++t) Table(plan, t, query, lut);
    return;
  }
  for (int32_t t : *steps) Table(plan, t, query, lut);
}

void float_tables(const Plan& plan, const std::vector<int32_t>* steps, const float* query, float* lut) {
  float_tables_with<float_table>(plan, steps, query, lut);
}

#ifdef TQVEC_X86
// float_table with the 16 entries of a 4-bit step in two registers (its channels' levels accumulated there, one
// store: a store per channel would be re-read by the next one's add).
__attribute__((target("avx2,fma"))) inline void float_table_avx2(const Plan& plan, int t, const float* query, float* lut) {
  if (plan.offset[t + 1] - plan.offset[t] != 16) return float_table(plan, t, query, lut);
  const int32_t* channel = plan.channel + t * kMaxStepChannels;
  const float* level = plan.level + static_cast<size_t>(kMaxStepChannels) * plan.offset[t];
  __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
  for (int j = 0; j < kMaxStepChannels && channel[j] >= 0; ++j) {
    const __m256 qj = _mm256_set1_ps(query[channel[j]]);
    low = _mm256_fmadd_ps(qj, _mm256_loadu_ps(level + 16 * j), low);
    high = _mm256_fmadd_ps(qj, _mm256_loadu_ps(level + 16 * j + 8), high);
  }
  _mm256_storeu_ps(lut + plan.offset[t], low);
  _mm256_storeu_ps(lut + plan.offset[t] + 8, high);
}

__attribute__((target("avx2,fma"))) void float_tables_avx2(const Plan& plan, const std::vector<int32_t>* steps, const float* query,
                                                           float* lut) {
  float_tables_with<float_table_avx2>(plan, steps, query, lut);
}
#endif

// The steps as exact scoring reads them: bytes whose two nibbles are two 4-bit steps (most codes of at most 4
// bits), then the others one at a time.
struct ExactSteps {
  struct Pair {
    int32_t byte, entry;  // low nibble: table entry + (byte & 15); high nibble: entry + 16 + (byte >> 4)
  };
  struct Single {
    int32_t byte, shift, straddle, entry;
    uint32_t mask;
  };
  // Runs of channels that share one level table (plan.level[level .. level + 2^width)), one channel per code, packed
  // from the byte-aligned `byte` on, channels from `channel` in order, in groups of run_channels(width) channels
  // (a whole number of bytes): exact_dot_avx2 decodes them to levels and multiplies by the query, 4-bit codes 16 at
  // a time (two 8-entry permutes), 3-bit codes 8 at a time (shifts, one permute), 8-bit codes 8 at a time (a gather
  // from the level table); exact_dot reads every step from the float tables instead.
  struct Run {
    int32_t byte, channel, groups, level, width;
  };
  std::vector<Pair> pairs;
  std::vector<Single> singles;
  std::vector<Run> runs;
  std::vector<int32_t> table_steps;  // the steps of pairs and singles: the only float tables exact_dot reads
};

// The exact scoring steps of `plan`; with `runs`, 3-, 4- and 8-bit codes in whole groups of run_channels (run_group)
// are kept as runs for exact_dot_avx2.
ExactSteps exact_steps(const Plan& plan, bool runs = false) {
  ExactSteps steps;
  for (int t = 0; t < plan.n_steps; ++t) {
    const int32_t b = plan.byte[t], s = plan.shift[t], w = plan.width[t];
    if (runs && (w == 4 || w == 3 || w == 8) && run_group(plan, t, t, w)) {
      const int first = t, n = run_channels(w);
      ExactSteps::Run run{b, plan.channel[t * kMaxStepChannels], 0, kMaxStepChannels * plan.offset[t], w};
      while (run_group(plan, t, first, w) && plan.byte[t] == run.byte + w * n / 8 * run.groups &&
             plan.channel[t * kMaxStepChannels] == run.channel + n * run.groups) {
        ++run.groups;
        t += n;
      }
      steps.runs.push_back(run);
      --t;  // the loop's ++t moves to the first step after the run
    } else if (nibble_pair(plan, t)) {
      steps.pairs.push_back({b, plan.offset[t]});
      steps.table_steps.insert(steps.table_steps.end(), {t, t + 1});
      ++t;
    } else {
      steps.singles.push_back({b, s, s + w > 8, plan.offset[t], (1u << w) - 1u});
      steps.table_steps.push_back(t);
    }
  }
  return steps;
}

// Exact inner product of one row with the float tables.
inline float exact_dot(const ExactSteps& steps, const float* lut, const uint8_t* row) {
  float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // four independent chains: the adds' latency, not the loads, bound one
  const ExactSteps::Pair* pair = steps.pairs.data();
  const size_t n_pairs = steps.pairs.size();
  size_t i = 0;
  for (; i + 2 <= n_pairs; i += 2) {
    const unsigned b0 = row[pair[i].byte], b1 = row[pair[i + 1].byte];
    sum[0] += lut[pair[i].entry + (b0 & 15u)];
    sum[1] += lut[pair[i].entry + 16 + (b0 >> 4)];
    sum[2] += lut[pair[i + 1].entry + (b1 & 15u)];
    sum[3] += lut[pair[i + 1].entry + 16 + (b1 >> 4)];
  }
  if (i < n_pairs) {
    const unsigned byte = row[pair[i].byte];
    sum[0] += lut[pair[i].entry + (byte & 15u)];
    sum[1] += lut[pair[i].entry + 16 + (byte >> 4)];
  }
  const ExactSteps::Single* single = steps.singles.data();
  const size_t n_singles = steps.singles.size();
  auto entry = [&](const ExactSteps::Single& s) {
    const unsigned bits = row[s.byte] | (static_cast<unsigned>(row[s.byte + s.straddle]) << 8);  // straddle: 0 or 1
    return lut[s.entry + ((bits >> s.shift) & s.mask)];
  };
  i = 0;
  for (; i + 4 <= n_singles; i += 4) {
    sum[0] += entry(single[i]);
    sum[1] += entry(single[i + 1]);
    sum[2] += entry(single[i + 2]);
    sum[3] += entry(single[i + 3]);
  }
  for (; i < n_singles; ++i) sum[0] += entry(single[i]);
  return (sum[0] + sum[1]) + (sum[2] + sum[3]);
}

inline float finish(const Rows& rows, int64_t r, float dot, float constant) {
  const float scale = rows.scale ? rows.scale[r] : 1.0f;
  const float bias = rows.bias ? rows.bias[r] : 0.0f;
  return scale * dot + bias + constant;
}

// One unit of work: a group of queries and a slice [probe_begin, probe_end) of their probed groups (or, for a
// single group, a slice [part_begin, part_end) of its rows or blocks).
struct Work {
  int64_t query, query_end;      // queries [query, query_end) scan the same rows (several only without probe)
  int64_t probe_begin, probe_end;
  int64_t part_begin, part_end;  // used when the queries scan one group split across workers
};

struct GroupSpan {
  int64_t lo, hi;  // positions in the groups' row order (exact kernel) or blocks (SIMD kernel)
  float constant;
  int64_t group;
};

// The spans work item `w` scans; `offsets` are the groups' row offsets or block offsets.
std::vector<GroupSpan> spans_of(const SearchArgs& a, const Work& w, const int64_t* offsets) {
  std::vector<GroupSpan> spans;
  const Groups& g = a.groups;
  for (int64_t p = w.probe_begin; p < w.probe_end; ++p) {
    const int64_t group = g.probe ? g.probe[w.query * g.n_probe + p] : 0;
    if (group < 0 || group >= g.n_groups) continue;
    int64_t lo = offsets[group], hi = offsets[group + 1];
    if (w.part_end > w.part_begin) {
      lo = std::max(lo, w.part_begin);
      hi = std::min(hi, w.part_end);
    }
    const float constant = g.probe_constant ? g.probe_constant[w.query * g.n_probe + p] : 0.0f;
    if (hi > lo) spans.push_back({lo, hi, constant, group});
  }
  return spans;
}

// ------------------------------------------------------------------------------------------ scalar kernel
void scan_exact(const SearchArgs& a, const ExactSteps& steps, const Work& w, const float* lut, BestRows& best) {
  const Rows& rows = a.ordered ? *a.ordered : a.rows;  // read by position (in list order), or by row number
  for (const GroupSpan& s : spans_of(a, w, a.groups.offsets)) {
    for (int64_t p = s.lo; p < s.hi; ++p) {
      const int64_t r = a.groups.list_rows ? a.groups.list_rows[p] : p;
      const int64_t at = a.ordered ? p : r;
      const float dot = exact_dot(steps, lut, rows.packed + at * rows.row_bytes);
      best.push(finish(rows, at, dot, s.constant), r, s.constant);
    }
    best.exact += s.hi - s.lo;
  }
}

// The steps as the AVX2 kernel runs them: both nibbles of a byte at once where two full 4-bit steps share it
// (the common case: 1-, 2- and 4-bit codes), the rest one at a time (3-bit codes, short last nibbles).
struct PairRun {
  int32_t byte_offset;  // first byte * 32 in the transposed block; byte i of the run holds steps lut + 2i, lut + 2i + 1
  int32_t lut;
  int32_t count;        // bytes in the run
};

struct alignas(32) SingleOp {
  uint8_t low_mask[32];   // code bits found in the step's byte, after the shift
  uint8_t high_mask[32];  // code bits found in the next byte (straddling codes)
  int32_t byte_offset;
  int32_t lut;
  int32_t shift;
  int32_t straddle;
};

struct StepOps {
  std::vector<PairRun> pairs;
  std::vector<SingleOp> singles;
};

StepOps step_ops(const Plan& plan) {
  StepOps ops;
  for (int t = 0; t < plan.n_steps; ++t) {
    const int b = plan.byte[t], s = plan.shift[t], w = plan.width[t];
    if (nibble_pair(plan, t)) {
      PairRun* last = ops.pairs.empty() ? nullptr : &ops.pairs.back();
      if (last && last->byte_offset + last->count * kRowsPerBlock == b * kRowsPerBlock && last->lut + 2 * last->count == t) {
        ++last->count;
      } else {
        ops.pairs.push_back({b * kRowsPerBlock, t, 1});
      }
      ++t;
      continue;
    }
    const unsigned mask = (1u << w) - 1u;
    const unsigned low = s + w > 8 ? ((1u << (8 - s)) - 1u) : mask;
    SingleOp op{};
    std::memset(op.low_mask, static_cast<int>(low), sizeof(op.low_mask));
    std::memset(op.high_mask, static_cast<int>(mask & ~low), sizeof(op.high_mask));
    op.byte_offset = b * kRowsPerBlock;
    op.lut = t;
    op.shift = s;
    op.straddle = s + w > 8;
    ops.singles.push_back(op);
  }
  return ops;
}

}  // namespace

struct PlanSteps {
  ExactSteps exact;       // every step from the float tables (exact_dot)
  ExactSteps exact_runs;  // with runs of 3-, 4- and 8-bit codes decoded by exact_dot_avx2
  StepOps ops;            // the SIMD kernels' reading of the plan's steps (at most 4 bits each)
  Int8Decoder int8;       // the rows as signed bytes, for the int8 batch kernel
};

bool run_group(const Plan& plan, int t, int first, int width) {
  const int n = run_channels(width);
  if (t + n > plan.n_steps || plan.shift[t] != 0) return false;
  const float* table = step_levels(plan, first);
  for (int i = 0; i < n; ++i) {
    const int u = t + i;
    if (plan.width[u] != width || 8 * plan.byte[u] + plan.shift[u] != 8 * plan.byte[t] + width * i ||
        plan.channel[u * kMaxStepChannels] != plan.channel[t * kMaxStepChannels] + i ||
        plan.channel[u * kMaxStepChannels + 1] != -1 || !std::equal(table, table + (1 << width), step_levels(plan, u)))
      return false;
  }
  return true;
}

std::shared_ptr<const PlanSteps> plan_steps(const Plan& plan) {
  return std::make_shared<const PlanSteps>(PlanSteps{exact_steps(plan), exact_steps(plan, true), step_ops(plan), int8_decoder(plan)});
}

namespace {

// Size of one query's float tables.
inline size_t table_entries(const Plan& plan) { return static_cast<size_t>(plan.offset[plan.n_steps]); }

#ifdef TQVEC_X86
// ------------------------------------------------------------------------------------------ AVX2 kernel
// One step's 8-bit table in both 128-bit lanes.
struct alignas(32) Lut32 {
  uint8_t bytes[32];
};

// How a query's 8-bit tables stand for its float ones: a row's dot ~= (sum of its entries) * inv_scale + offset.
struct TableScale {
  float inv_scale = 0.0f;
  float offset = 0.0f;
};

// Writes one step's 16 quantized entries, (x - low) * scale rounded and clamped to [0, 255] (x: entries 0-7 in lo8,
// 8-15 in hi8), into both 128-bit lanes of `out`.
__attribute__((target("avx2,fma"))) inline void store_quantized(__m256 lo8, __m256 hi8, __m256 low, __m256 scale, Lut32& out) {
  const __m256 half = _mm256_set1_ps(0.5f), top = _mm256_set1_ps(255.0f);
  const __m256i a = _mm256_cvttps_epi32(_mm256_min_ps(top, _mm256_fmadd_ps(_mm256_sub_ps(lo8, low), scale, half)));
  const __m256i b = _mm256_cvttps_epi32(_mm256_min_ps(top, _mm256_fmadd_ps(_mm256_sub_ps(hi8, low), scale, half)));
  // the packs work per 128-bit lane: its dwords are then a0-3, b0-3 (twice) in lane 0 and a4-7, b4-7 in lane 1, so
  // dwords 0, 4, 1, 5 are the 16 entries in order
  const __m256i words = _mm256_packus_epi32(a, b);
  const __m256i bytes = _mm256_packus_epi16(words, words);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5);
  _mm256_store_si256(reinterpret_cast<__m256i*>(out.bytes), _mm256_permutevar8x32_epi32(bytes, order));
}

// 8-bit tables with one scale for all steps (the sum must share it) and one low end per step: the float tables
// `lut` of `plan` quantized into out[0 .. n_steps).
__attribute__((target("avx2,fma"))) void quantize_tables(const Plan& plan, const float* lut, Lut32* out, TableScale& q) {
  std::vector<float> low(static_cast<size_t>(plan.n_steps));
  float span = 0.0f;
  double offset = 0.0;
  for (int t = 0; t < plan.n_steps; ++t) {
    const float* row = lut + plan.offset[t];
    const int used = 1 << plan.width[t];
    float lo = row[0], hi = row[0];
    if (used >= 8) {  // 8 or 16 entries: vector min / max
      __m256 vlo = _mm256_loadu_ps(row), vhi = vlo;
      if (used == 16) {
        vlo = _mm256_min_ps(vlo, _mm256_loadu_ps(row + 8));
        vhi = _mm256_max_ps(vhi, _mm256_loadu_ps(row + 8));
      }
      lo = lane_min(vlo);
      hi = lane_max(vhi);
    } else {
      for (int c = 1; c < used; ++c) {
        lo = std::min(lo, row[c]);
        hi = std::max(hi, row[c]);
      }
    }
    low[t] = lo;
    offset += lo;
    span = std::max(span, hi - lo);
  }
  const float scale = span > 0.0f ? 255.0f / span : 0.0f;
  const __m256 vscale = _mm256_set1_ps(scale);
  alignas(32) float entries[kLut];
  for (int t = 0; t < plan.n_steps; ++t) {
    const float* row = lut + plan.offset[t];
    const int used = 1 << plan.width[t];
    if (used < kLut) {  // entries past the step's codes: 0
      std::copy(row, row + used, entries);
      std::fill(entries + used, entries + kLut, low[t]);
      row = entries;
    }
    store_quantized(_mm256_loadu_ps(row), _mm256_loadu_ps(row + 8), _mm256_set1_ps(low[t]), vscale, out[t]);
  }
  q.inv_scale = scale > 0.0f ? 1.0f / scale : 0.0f;
  q.offset = static_cast<float>(offset);
}

// The channels of a sign plan of n_steps steps, padded to whole passes of sign_tables (32 channels).
inline size_t sign_padded_channels(int n_steps) { return (static_cast<size_t>(n_steps) * 4 + 31) / 32 * 32; }

// quantize_tables of a sign plan (arrange_signs: step t covers channels 4t .. 4t + 3 of the rotated `query`, level
// +1 where bit j of the entry is set, else -1), made from the query without float tables: with P_j = 2 max(q_j, 0)
// and N_j = 2 max(-q_j, 0), entry e less the step's low end -sum_j |q_j| is sum_j (bit j of e ? P_j : N_j), and the
// step's span is 2 sum_j |q_j|. `pn`: scratch of 2 * sign_padded_channels(n_steps) floats, any content.
__attribute__((target("avx2,fma"))) void sign_tables(const float* query, int64_t channels, int n_steps, Lut32* out, TableScale& q,
                                                     float* pn) {
  // P and N of every channel (zero past the last), 8 channels (2 steps) at a time; per 8 steps their spans
  const size_t padded = sign_padded_channels(n_steps);
  float* p = pn;
  float* n = p + padded;
  std::copy(query, query + channels, p);
  std::fill(p + channels, p + padded, 0.0f);
  const __m256 zero = _mm256_setzero_ps();
  __m256 widest = zero;
  __m256d offset = _mm256_setzero_pd();
  for (size_t c = 0; c < padded; c += 32) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 twice = _mm256_add_ps(_mm256_loadu_ps(p + c + 8 * i), _mm256_loadu_ps(p + c + 8 * i));
      const __m256 plus = _mm256_max_ps(twice, zero), minus = _mm256_max_ps(_mm256_sub_ps(zero, twice), zero);
      _mm256_storeu_ps(p + c + 8 * i, plus);
      _mm256_storeu_ps(n + c + 8 * i, minus);
      v[i] = _mm256_add_ps(plus, minus);  // 2 |q|
    }
    // the 8 steps' spans 2 sum_j |q_j| (in some order of the steps)
    const __m256 spans = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    widest = _mm256_max_ps(widest, spans);
    offset = _mm256_add_pd(offset, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(spans)),
                                                  _mm256_cvtps_pd(_mm256_extractf128_ps(spans, 1))));
  }
  alignas(32) double sums[4];
  _mm256_store_pd(sums, offset);
  const float span = lane_max(widest);
  const float scale = span > 0.0f ? 255.0f / span : 0.0f;
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int t = 0; t < n_steps; ++t) {
    const float* pt = p + 4 * t;
    const float* nt = n + 4 * t;
    // entries 0-7: bits 0-2 vary across the lanes, bit 3 clear; entries 8-15: the same with bit 3 set
    const __m256 common = _mm256_add_ps(
        _mm256_add_ps(_mm256_blend_ps(_mm256_broadcast_ss(nt), _mm256_broadcast_ss(pt), 0xAA),
                      _mm256_blend_ps(_mm256_broadcast_ss(nt + 1), _mm256_broadcast_ss(pt + 1), 0xCC)),
        _mm256_blend_ps(_mm256_broadcast_ss(nt + 2), _mm256_broadcast_ss(pt + 2), 0xF0));
    store_quantized(_mm256_add_ps(common, _mm256_broadcast_ss(nt + 3)), _mm256_add_ps(common, _mm256_broadcast_ss(pt + 3)), zero,
                    vscale, out[t]);
  }
  q.inv_scale = scale > 0.0f ? 1.0f / scale : 0.0f;
  q.offset = static_cast<float>(-0.5 * ((sums[0] + sums[1]) + (sums[2] + sums[3])));
}

// Adds the 16-bit sums (acc_a: even + 256 * odd bytes, acc_b: odd bytes) into 32-bit ones and clears them:
// wide[0] rows 0, 2, .., 14; wide[1] rows 16, 18, .., 30; wide[2] rows 1, 3, .., 15; wide[3] rows 17, .., 31.
__attribute__((target("avx2,fma"))) inline void widen_sums(__m256i& acc_a, __m256i& acc_b, __m256i* wide) {
  const __m256i even = _mm256_sub_epi16(acc_a, _mm256_slli_epi16(acc_b, 8));
  wide[0] = _mm256_add_epi32(wide[0], _mm256_cvtepu16_epi32(_mm256_castsi256_si128(even)));
  wide[1] = _mm256_add_epi32(wide[1], _mm256_cvtepu16_epi32(_mm256_extracti128_si256(even, 1)));
  wide[2] = _mm256_add_epi32(wide[2], _mm256_cvtepu16_epi32(_mm256_castsi256_si128(acc_b)));
  wide[3] = _mm256_add_epi32(wide[3], _mm256_cvtepu16_epi32(_mm256_extracti128_si256(acc_b, 1)));
  acc_a = acc_b = _mm256_setzero_si256();
}

__attribute__((target("avx2,fma"))) inline __m256i load32(const void* p) {
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
}

__attribute__((target("avx2,fma"))) inline __m256i loadu32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Adds the table entries of `count` consecutive nibble pairs into the 16-bit sums (count <= kFlushSteps / 2).
__attribute__((target("avx2,fma"))) inline void add_pairs(const uint8_t* bytes, const Lut32* luts, int count, __m256i& acc_a,
                                                      __m256i& acc_b) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256i a = acc_a, b = acc_b;
  for (int i = 0; i < count; ++i) {
    const __m256i codes = loadu32(bytes + i * kRowsPerBlock);
    const __m256i low = _mm256_shuffle_epi8(load32(luts[2 * i].bytes), _mm256_and_si256(codes, nibble));
    const __m256i high = _mm256_shuffle_epi8(load32(luts[2 * i + 1].bytes), _mm256_and_si256(_mm256_srli_epi16(codes, 4), nibble));
    a = _mm256_add_epi16(a, _mm256_add_epi16(low, high));
    b = _mm256_add_epi16(b, _mm256_add_epi16(_mm256_srli_epi16(low, 8), _mm256_srli_epi16(high, 8)));
  }
  acc_a = a;
  acc_b = b;
}

// Adds the single steps (codes other than nibble pairs) into the 16-bit sums, widening when due.
__attribute__((target("avx2,fma"))) inline void add_singles(const uint8_t* block, const StepOps& ops, const Lut32* luts,
                                                        __m256i& acc_a, __m256i& acc_b, __m256i* wide, int& pending) {
  for (const SingleOp& op : ops.singles) {
    if (pending == kFlushSteps) {
      widen_sums(acc_a, acc_b, wide);
      pending = 0;
    }
    const __m256i b0 = loadu32(block + op.byte_offset);
    __m256i code = _mm256_and_si256(_mm256_srl_epi16(b0, _mm_cvtsi32_si128(op.shift)), load32(op.low_mask));
    if (op.straddle) {
      const __m256i up = _mm256_sll_epi16(loadu32(block + op.byte_offset + kRowsPerBlock), _mm_cvtsi32_si128(8 - op.shift));
      code = _mm256_or_si256(code, _mm256_and_si256(up, load32(op.high_mask)));
    }
    const __m256i v = _mm256_shuffle_epi8(load32(luts[op.lut].bytes), code);
    acc_a = _mm256_add_epi16(acc_a, v);
    acc_b = _mm256_add_epi16(acc_b, _mm256_srli_epi16(v, 8));
    ++pending;
  }
}

// Sums of the quantized table entries of the 32 rows of a block, as 32-bit sums in lane order (kLaneSlot):
// wide[g] holds the rows of slots kLaneSlot[8g .. 8g + 7].
__attribute__((target("avx2,fma"))) void block_sums(const uint8_t* block, const StepOps& ops, const Lut32* luts,
                                                __m256i* wide) {
  __m256i acc_a = _mm256_setzero_si256(), acc_b = _mm256_setzero_si256();
  for (int g = 0; g < 4; ++g) wide[g] = acc_a;
  int pending = 0;  // table entries added per byte lane since the last widening
  for (const PairRun& run : ops.pairs) {
    for (int done = 0; done < run.count;) {
      if (pending + 2 > kFlushSteps) {
        widen_sums(acc_a, acc_b, wide);
        pending = 0;
      }
      const int count = std::min(run.count - done, (kFlushSteps - pending) / 2);
      add_pairs(block + run.byte_offset + done * kRowsPerBlock, luts + run.lut + 2 * done, count, acc_a, acc_b);
      pending += 2 * count;
      done += count;
    }
  }
  add_singles(block, ops, luts, acc_a, acc_b, wide, pending);
  widen_sums(acc_a, acc_b, wide);
}

// The tables of steps t and t + 2 side by side: what one 512-bit shuffle needs for two consecutive bytes of a
// pair run (lanes 0-1: byte i, lanes 2-3: byte i + 1).
struct alignas(64) Lut64 {
  uint8_t bytes[64];
};

// widen_sums of 512-bit sums: both 256-bit halves hold the same 32 rows (of two different bytes).
__attribute__((target("avx512f,avx512bw,avx2,fma"))) inline void widen_sums_512(__m512i& a, __m512i& b, __m256i* wide) {
  alignas(64) __m256i half_a[2], half_b[2];  // through memory: GCC's 256-bit extract warns on its own headers
  _mm512_store_si512(half_a, a);
  _mm512_store_si512(half_b, b);
  widen_sums(half_a[0], half_b[0], wide);
  widen_sums(half_a[1], half_b[1], wide);
  a = b = _mm512_setzero_si512();
}

// block_sums with 512-bit shuffles for the pair runs (two bytes of 32 rows per shuffle); `wide_luts[t]` holds the
// tables of steps t and t + 2.
__attribute__((target("avx512f,avx512bw,avx2,fma"))) void block_sums_avx512(const uint8_t* block, const StepOps& ops,
                                                                         const Lut32* luts, const Lut64* wide_luts,
                                                                         __m256i* wide) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
  __m256i acc_a = _mm256_setzero_si256(), acc_b = _mm256_setzero_si256();
  for (int g = 0; g < 4; ++g) wide[g] = acc_a;
  int pending = 0, pending_512 = 0;  // table entries added per byte lane since the last widening
  for (const PairRun& run : ops.pairs) {
    int done = 0;
    while (run.count - done >= 2) {
      if (pending_512 + 2 > kFlushSteps) {
        widen_sums_512(a, b, wide);
        pending_512 = 0;
      }
      const int count = std::min((run.count - done) / 2, (kFlushSteps - pending_512) / 2);
      const uint8_t* bytes = block + run.byte_offset + done * kRowsPerBlock;
      const Lut64* lut = wide_luts + run.lut + 2 * done;
      for (int i = 0; i < count; ++i) {
        const __m512i codes = _mm512_loadu_si512(bytes + 2 * i * kRowsPerBlock);
        const __m512i low = _mm512_shuffle_epi8(_mm512_load_si512(lut[4 * i].bytes), _mm512_and_si512(codes, nibble));
        const __m512i high = _mm512_shuffle_epi8(_mm512_load_si512(lut[4 * i + 1].bytes),
                                                 _mm512_and_si512(_mm512_srli_epi16(codes, 4), nibble));
        a = _mm512_add_epi16(a, _mm512_add_epi16(low, high));
        b = _mm512_add_epi16(b, _mm512_add_epi16(_mm512_srli_epi16(low, 8), _mm512_srli_epi16(high, 8)));
      }
      pending_512 += 2 * count;
      done += 2 * count;
    }
    if (done < run.count) {  // an odd last byte
      if (pending + 2 > kFlushSteps) {
        widen_sums(acc_a, acc_b, wide);
        pending = 0;
      }
      add_pairs(block + run.byte_offset + done * kRowsPerBlock, luts + run.lut + 2 * done, 1, acc_a, acc_b);
      pending += 2;
    }
  }
  widen_sums_512(a, b, wide);
  add_singles(block, ops, luts, acc_a, acc_b, wide, pending);
  widen_sums(acc_a, acc_b, wide);
}

// What the SIMD scan reads: the blocks, the plan their tables follow and its steps, and for the two-stage scan
// the slots' slack, the exact steps and float tables that re-score a row.
struct SimdSource {
  const Blocks* blocks;
  const Plan* plan;
  const StepOps* ops;
  const float* slack;         // null: one stage (keep the best rows by the 8-bit estimate)
  const ExactSteps* exact;    // two-stage: re-scoring steps of the search's plan, with runs (exact_dot_avx2)
  const float* exact_luts;    // two-stage: (queries of the item, exact_entries) float tables of the search's plan
  size_t exact_entries;       // the tables' entries per query: 0 where the exact scores read none
  const float* exact_queries;  // two-stage: (queries of the item, dim) rotated queries in run_query_order
};

// The 8-bit tables of a group of queries for the SIMD kernels: per query and step one Lut32 (filled by the caller,
// see quantize_tables and sign_tables), and with AVX-512 the Lut64 of each byte pair of the pair runs (steps t and
// t + 2 side by side, made by widen).
struct GroupTables {
  struct ScaleSite;
  struct NarrowSite;
  struct WideSite;

  int n_steps;
  int64_t group;
  Scratch<TableScale, ScaleSite> scale;           // per query
  Scratch<Lut32, NarrowSite> narrow;              // (queries, n_steps), uninitialized until written
  std::optional<Scratch<Lut64, WideSite>> wide;   // (queries, n_steps), after widen

  GroupTables(int steps, int64_t queries)
      : n_steps(steps), group(queries), scale(static_cast<size_t>(queries)), narrow(static_cast<size_t>(queries * steps)) {}

  Lut32* of(int64_t j) { return narrow.get() + j * n_steps; }
  const Lut32* narrow_of(int64_t j) const { return narrow.get() + j * n_steps; }
  const Lut64* wide_of(int64_t j) const { return wide ? wide->get() + j * n_steps : nullptr; }

  void widen(const StepOps& ops) {
    wide.emplace(static_cast<size_t>(group * n_steps));
    for (int64_t j = 0; j < group; ++j) {
      const Lut32* row = narrow.get() + j * n_steps;
      for (const PairRun& run : ops.pairs)
        for (int m = 0; 2 * m + 1 < run.count; ++m)
          for (int h = 0; h < 2; ++h) {
            const int t = run.lut + 4 * m + h;
            Lut64& lut = (*wide)[static_cast<size_t>(j * n_steps + t)];
            std::memcpy(lut.bytes, row[t].bytes, sizeof(Lut32));
            std::memcpy(lut.bytes + sizeof(Lut32), row[t + 2].bytes, sizeof(Lut32));
          }
    }
  }
};

// Adds the levels of a run of 3-bit codes times the query to acc, 8 channels (3 bytes) at a time.
__attribute__((target("avx2,fma"), always_inline)) inline void add_three_bit_run(const ExactSteps::Run& run, const uint8_t* bytes,
                                                                              const float* levels, const float* q, __m256& acc) {
  const __m256i shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21), three_bits = _mm256_set1_epi32(7);
  const __m256 table = _mm256_loadu_ps(levels + run.level);
  for (int g = 0; g < run.groups; ++g) {  // the group's 3 bytes only: a 4-byte load could pass the row's end
    const uint8_t* p = bytes + 3 * g;
    const int bits = static_cast<int>(p[0] | (p[1] << 8) | (p[2] << 16));
    const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(bits), shifts), three_bits);
    acc = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(table, codes), _mm256_loadu_ps(q + 8 * g), acc);
  }
}

// A run of 8-bit codes: 8 bytes widened to 32-bit indices, their levels gathered from the run's level table (256
// floats, in L1): for 8-bit codes this beats reading per-query float tables (256 entries per channel), which also
// no longer need filling. (5- to 7-bit codes, shifted out of a word and gathered alike, measured no faster than the
// tables: they stay on them.)
__attribute__((target("avx2,fma"), always_inline)) inline void add_byte_run(const ExactSteps::Run& run, const uint8_t* bytes,
                                                                         const float* levels, const float* q, __m256& acc) {
  const float* table = levels + run.level;
  for (int g = 0; g < run.groups; ++g) {
    const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * g)));
    acc = _mm256_fmadd_ps(_mm256_i32gather_ps(table, codes, 4), _mm256_loadu_ps(q + 8 * g), acc);
  }
}

// Adds a run of 3- or 8-bit codes (4-bit runs are read inline by the callers).
__attribute__((target("avx2,fma"), always_inline)) inline void add_other_run(const ExactSteps::Run& run, const uint8_t* bytes,
                                                                          const float* levels, const float* q, __m256& acc) {
  if (run.width == 3) {
    add_three_bit_run(run, bytes, levels, q, acc);
  } else {
    add_byte_run(run, bytes, levels, q, acc);
  }
}

// The channels of a 4-bit run come in chunks of kRunChunkAvx2 (AVX2) or kRunChunkAvx512 (AVX-512; the run's last
// group alone when their number is odd): one load widens a chunk's bytes to 32-bit lanes, whose low nibbles
// index the level permutes directly, and whose high nibbles do after one shift. The lanes then hold the chunk's
// even channels, then its odd ones: run_query_order writes the query in that order once, so that each product is
// one load of it.
constexpr int kRunChunkAvx2 = 16, kRunChunkAvx512 = 32;

// `query` (dim,) with the channels of each 4-bit run of `steps` reordered per chunk (even channels, then odd), as
// exact_dot_avx2 (`chunk` kRunChunkAvx2) or exact_dot_avx512 (kRunChunkAvx512) reads it; other channels unmoved.
void run_query_order(const ExactSteps& steps, const float* query, int64_t dim, int chunk, float* out) {
  std::copy(query, query + dim, out);
  for (const ExactSteps::Run& run : steps.runs) {
    if (run.width != 4) continue;
    const int channels = run_channels(4) * run.groups;
    for (int first = 0; first < channels; first += chunk) {
      const int n = std::min(chunk, channels - first), half = n / 2;
      const float* q = query + run.channel + first;
      float* o = out + run.channel + first;
      for (int i = 0; i < half; ++i) {
        o[i] = q[2 * i];
        o[half + i] = q[2 * i + 1];
      }
    }
  }
}

// exact_dot with the runs of `steps` (exact_steps(plan, true)) decoded to levels and multiplied by `query` (the
// rotated query of the float tables `lut`, in run_query_order with kRunChunkAvx2); the other steps are read from
// `lut`.
__attribute__((target("avx2,fma"))) inline float exact_dot_avx2(const ExactSteps& steps, const float* lut, const float* levels,
                                                             const float* query, const uint8_t* row) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (const ExactSteps::Run& run : steps.runs) {
    const uint8_t* bytes = row + run.byte;
    const float* q = query + run.channel;
    if (run.width != 4) {
      add_other_run(run, bytes, levels, q, acc1);
      continue;
    }
    const __m256 low_levels = _mm256_loadu_ps(levels + run.level), high_levels = _mm256_loadu_ps(levels + run.level + 8);
    for (int g = 0; g < run.groups; ++g) {  // a group's 8 bytes: even channels in the low nibbles, odd in the high
      const __m256i even = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * g)));
      const __m256i odd = _mm256_srli_epi32(even, 4);
      // the permutes read an index's low 3 bits; entries 8-15 where its bit 3 is set, read by the blend as the sign
      // of the index shifted to the top (the high nibble's bit 3 is the byte's bit 7)
      const __m256 v0 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(low_levels, even), _mm256_permutevar8x32_ps(high_levels, even),
                                         _mm256_castsi256_ps(_mm256_slli_epi32(even, 28)));
      const __m256 v1 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(low_levels, odd), _mm256_permutevar8x32_ps(high_levels, odd),
                                         _mm256_castsi256_ps(_mm256_slli_epi32(even, 24)));
      acc0 = _mm256_fmadd_ps(v0, _mm256_loadu_ps(q + 16 * g), acc0);
      acc1 = _mm256_fmadd_ps(v1, _mm256_loadu_ps(q + 16 * g + 8), acc1);
    }
  }
  return lane_sum(_mm256_add_ps(acc0, acc1)) + exact_dot(steps, lut, row);
}

// exact_dot_avx2 with AVX-512's 16-entry permute: a 4-bit run's level table is one register, 32 channels (16 bytes)
// a step; `query` in run_query_order with kRunChunkAvx512. (The all-lanes masked forms: GCC 12 warns that the
// plain ones read an undefined register.)
constexpr __mmask16 kAll16 = 0xFFFF, kLow8 = 0x00FF;
__attribute__((target("avx512f,avx512bw,avx2,fma"))) float exact_dot_avx512(const ExactSteps& steps, const float* lut,
                                                                          const float* levels, const float* query,
                                                                          const uint8_t* row) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps(), acc3 = _mm512_setzero_ps();
  __m256 other_sum = _mm256_setzero_ps();
  for (const ExactSteps::Run& run : steps.runs) {
    const uint8_t* bytes = row + run.byte;
    const float* q = query + run.channel;
    if (run.width != 4) {
      add_other_run(run, bytes, levels, q, other_sum);
      continue;
    }
    const __m512 table = _mm512_loadu_ps(levels + run.level);
    int g = 0;
    for (; g + 4 <= run.groups; g += 4) {  // two steps of the loop below, into two more sums (each sum's chain of
      // multiply-adds, not the shuffle port, bounded the loop with two)
      const __m512i even = _mm512_maskz_cvtepu8_epi32(kAll16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 8 * g)));
      const __m512i odd = _mm512_maskz_srli_epi32(kAll16, even, 4);
      const __m512i even2 = _mm512_maskz_cvtepu8_epi32(kAll16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 8 * g + 16)));
      const __m512i odd2 = _mm512_maskz_srli_epi32(kAll16, even2, 4);
      acc0 = _mm512_fmadd_ps(_mm512_maskz_permutexvar_ps(kAll16, even, table), _mm512_loadu_ps(q + 16 * g), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_maskz_permutexvar_ps(kAll16, odd, table), _mm512_loadu_ps(q + 16 * g + 16), acc1);
      acc2 = _mm512_fmadd_ps(_mm512_maskz_permutexvar_ps(kAll16, even2, table), _mm512_loadu_ps(q + 16 * g + 32), acc2);
      acc3 = _mm512_fmadd_ps(_mm512_maskz_permutexvar_ps(kAll16, odd2, table), _mm512_loadu_ps(q + 16 * g + 48), acc3);
    }
    for (; g + 2 <= run.groups; g += 2) {  // 16 bytes: 16 even channels in the low nibbles, 16 odd in the high
      const __m512i even = _mm512_maskz_cvtepu8_epi32(kAll16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 8 * g)));
      const __m512i odd = _mm512_maskz_srli_epi32(kAll16, even, 4);  // the permute reads an index's low 4 bits
      acc0 = _mm512_fmadd_ps(_mm512_maskz_permutexvar_ps(kAll16, even, table), _mm512_loadu_ps(q + 16 * g), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_maskz_permutexvar_ps(kAll16, odd, table), _mm512_loadu_ps(q + 16 * g + 16), acc1);
    }
    if (g < run.groups) {  // the last group's 8 bytes: 8 even channels, 8 odd (lanes 8-15 multiply zeros)
      const __m512i even = _mm512_maskz_cvtepu8_epi32(kAll16, _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * g)));
      const __m512i odd = _mm512_maskz_srli_epi32(kAll16, even, 4);
      acc0 = _mm512_fmadd_ps(_mm512_maskz_permutexvar_ps(kAll16, even, table), _mm512_maskz_loadu_ps(kLow8, q + 16 * g), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_maskz_permutexvar_ps(kAll16, odd, table), _mm512_maskz_loadu_ps(kLow8, q + 16 * g + 8), acc1);
    }
  }
  alignas(64) float part[16];
  _mm512_store_ps(part, _mm512_add_ps(_mm512_add_ps(acc0, acc2), _mm512_add_ps(acc1, acc3)));
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_load_ps(part), _mm256_load_ps(part + 8)), other_sum);
  return lane_sum(sum) + exact_dot(steps, lut, row);
}

// The `capacity` largest lower bounds seen so far: while it is full, a row whose upper bound is below its smallest
// cannot be among the best `capacity` (that many rows score at least their lower bounds, above it). Up to
// kSortedBounds of them are kept in a sorted array (an insertion moves the few smaller ones: most bounds that enter
// barely beat the smallest), more in a min-heap.
class LowerBounds {
 public:
  static constexpr size_t kSortedBounds = 32;

  explicit LowerBounds(int64_t capacity) : capacity_(static_cast<size_t>(capacity)) {
    if (capacity_ > kSortedBounds) heap_.reserve(capacity_);
    std::fill(sorted_, sorted_ + kSortedBounds, kNegInf);
  }

  float threshold() const {
    if (capacity_ <= kSortedBounds) return sorted_[capacity_ - 1];
    return heap_.size() < capacity_ ? kNegInf : heap_.front();
  }

  void push(float bound) {
    if (!(bound > threshold())) return;
    if (capacity_ <= kSortedBounds) {  // sorted_[0 .. capacity) largest first; the smallest leaves
      size_t i = capacity_ - 1;
      for (; i > 0 && sorted_[i - 1] < bound; --i) sorted_[i] = sorted_[i - 1];
      sorted_[i] = bound;
      return;
    }
    if (heap_.size() == capacity_) {
      std::pop_heap(heap_.begin(), heap_.end(), std::greater<float>());
      heap_.pop_back();
    }
    heap_.push_back(bound);
    std::push_heap(heap_.begin(), heap_.end(), std::greater<float>());
  }

 private:
  size_t capacity_;
  float sorted_[kSortedBounds];
  std::vector<float> heap_;
};

// Rows of one sign block that one query of a work item scores exactly (two-stage scan): lanes[0 .. n) of block b, in
// the group whose constant is `constant`. Their codes come from the slot-ordered copy, or where there is none (one
// group in row order) from the stored rows.
struct Refinement {
  int64_t b, j;
  float constant;
  int n;
  int lanes[kRowsPerBlock];
  float upper[kRowsPerBlock];  // the lanes' upper ends
};

inline const uint8_t* refined_row(const SearchArgs& a, int64_t slot) {
  const SignBlocks& signs = *a.signs;
  return signs.codes ? signs.codes + slot * a.rows.row_bytes : a.rows.packed + signs.blocks.rows[slot] * a.rows.row_bytes;
}

// Starts loading the codes of the rows of `r` (scored a block later, when they have arrived). An asm statement:
// GCC 12 compiled __builtin_prefetch / _mm_prefetch here to nothing.
__attribute__((target("avx2,fma"))) inline void prefetch_rows(const SearchArgs& a, const Refinement& r) {
  for (int i = 0; i < r.n; ++i) {
    const char* row = reinterpret_cast<const char*>(refined_row(a, r.b * kRowsPerBlock + r.lanes[i]));
    for (int64_t line = 0; line < a.rows.row_bytes; line += 64) asm volatile("prefetcht0 %0" : : "m"(row[line]));
  }
}

// Scores the rows of `r` exactly for its query (rotated `query`) and offers them to `best`, the highest upper end first;
// a row whose upper end no longer beats the query's k-th exact score or reaches its k-th largest lower end (`floor`:
// both rose since the row was queued) is not scored.
__attribute__((target("avx2,fma"))) inline void refine(const SearchArgs& a, const SimdSource& src, Refinement& r,
                                                     const float* query, BestRows& best, const LowerBounds& floor, bool avx512) {
  const SignBlocks& signs = *a.signs;
  const float* lut = src.exact_luts + r.j * src.exact_entries;
  for (int i = 1; i < r.n; ++i) {  // an insertion sort: a block holds few such rows
    const float upper = r.upper[i];
    const int lane = r.lanes[i];
    int m = i;
    for (; m > 0 && r.upper[m - 1] < upper; --m) {
      r.upper[m] = r.upper[m - 1];
      r.lanes[m] = r.lanes[m - 1];
    }
    r.upper[m] = upper;
    r.lanes[m] = lane;
  }
  const float reachable = floor.threshold();
  for (int i = 0; i < r.n; ++i) {
    if (!(r.upper[i] > best.threshold() && r.upper[i] >= reachable)) break;  // nor any later row: sorted
    ++best.exact;
    const int64_t slot = r.b * kRowsPerBlock + r.lanes[i];
    const uint8_t* row = refined_row(a, slot);
    const float dot = avx512 ? exact_dot_avx512(*src.exact, lut, a.plan.level, query, row)
                             : exact_dot_avx2(*src.exact, lut, a.plan.level, query, row);
    best.push(signs.scale[slot] * dot + signs.blocks.bias[slot] + r.constant, signs.blocks.rows[slot], r.constant);
  }
}

// Scores the waiting refinements of the work item, then makes the arriving ones wait.
__attribute__((target("avx2,fma"))) inline void refine_all(const SearchArgs& a, const SimdSource& src,
                                                         std::vector<Refinement>& waiting, std::vector<Refinement>& arriving,
                                                         std::vector<BestRows>& best, const std::vector<LowerBounds>& floor,
                                                         bool avx512) {
  for (Refinement& r : waiting) refine(a, src, r, src.exact_queries + r.j * a.dim, best[r.j], floor[r.j], avx512);
  waiting.swap(arriving);
  arriving.clear();
}


// One query's view of one block for settling its 32 estimates (scan_avx2): the block's side fields in lane order and
// the query's constants.
struct BlockQuery {
  const float* scale;    // gains
  const float* bias;
  const float* slack;    // two stages: the error scales; null: one stage
  const float* error;    // the estimates' errors at the reference vector, added (see arrange_signs), or null
  const int64_t* ids;    // row numbers
  float inv_scale, offset, constant;  // the 8-bit tables' (TableScale) and the group's constant
  float reach, rounding;              // two stages: the bound is reach * slack + rounding * |gain|
};

// The lanes set in `passing` of a group of lanes from `first` on, `score` their values (from lane `first`): two
// stages queue them in `r` with their upper ends (refined a block later), one stage offers them to `best`.
inline void take_passing(unsigned passing, const float* score, int first, const BlockQuery& q, bool two_stage, BestRows& best,
                         Refinement& r) {
  for (; passing; passing &= passing - 1) {
    const int i = __builtin_ctz(passing);
    if (two_stage) {
      r.upper[r.n] = score[i];
      r.lanes[r.n++] = first + i;
    } else {
      best.push(score[i], q.ids[first + i], q.constant);
    }
  }
}

// Settles one block for one query from its 8-bit sums (block_sums: 4 x 8 lanes). One stage: the rows whose estimate
// beats `best`'s threshold enter it. Two stages (floor non-null): each row's estimate plus or minus its bound brackets
// its score; the lower ends enter `floor`, and the lanes of the rows whose upper end beats `best`'s threshold and
// reaches `floor`'s are appended to r.lanes (to be scored exactly).
__attribute__((target("avx2,fma"))) void settle_avx2(const __m256i* sums, const BlockQuery& q, LowerBounds* floor, BestRows& best,
                                                     Refinement& r) {
  const __m256 inv_scale = _mm256_set1_ps(q.inv_scale), offset = _mm256_set1_ps(q.offset), constant = _mm256_set1_ps(q.constant);
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  alignas(32) float score[8];
  __m256 value[4];
  for (int g = 0; g < 4; ++g) {  // side fields and row numbers are stored in the same lane order
    const __m256 dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[g]), inv_scale, offset);
    const __m256 gain = _mm256_loadu_ps(q.scale + 8 * g);
    value[g] = _mm256_add_ps(_mm256_fmadd_ps(dot, gain, _mm256_loadu_ps(q.bias + 8 * g)), constant);
    if (!floor) continue;
    if (q.error) value[g] = _mm256_add_ps(value[g], _mm256_loadu_ps(q.error + 8 * g));
    const __m256 bound = _mm256_fmadd_ps(_mm256_loadu_ps(q.slack + 8 * g), _mm256_set1_ps(q.reach),
                                         _mm256_mul_ps(_mm256_andnot_ps(sign_bit, gain), _mm256_set1_ps(q.rounding)));
    const __m256 lower = _mm256_sub_ps(value[g], bound);
    value[g] = _mm256_add_ps(value[g], bound);  // the upper end
    int raising = _mm256_movemask_ps(_mm256_cmp_ps(lower, _mm256_set1_ps(floor->threshold()), _CMP_GT_OQ));
    if (!raising) continue;
    _mm256_store_ps(score, lower);
    for (; raising; raising &= raising - 1) floor->push(score[__builtin_ctz(raising)]);
  }
  const __m256 threshold = _mm256_set1_ps(best.threshold());
  const __m256 reachable = _mm256_set1_ps(floor ? floor->threshold() : kNegInf);
  for (int g = 0; g < 4; ++g) {
    int passing = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(value[g], threshold, _CMP_GT_OQ),
                                                   _mm256_cmp_ps(value[g], reachable, _CMP_GE_OQ)));
    if (!passing) continue;
    _mm256_store_ps(score, value[g]);
    take_passing(static_cast<unsigned>(passing), score, 8 * g, q, floor != nullptr, best, r);
  }
}

// settle_avx2 with 16-lane registers (the sums of two 8-lane groups side by side).
__attribute__((target("avx512f,avx512bw,avx2,fma"))) void settle_avx512(const __m256i* sums, const BlockQuery& q, LowerBounds* floor,
                                                                      BestRows& best, Refinement& r) {
  const __m512 inv_scale = _mm512_set1_ps(q.inv_scale), offset = _mm512_set1_ps(q.offset), constant = _mm512_set1_ps(q.constant);
  alignas(64) float score[16];
  __m512 value[2];
  for (int h = 0; h < 2; ++h) {
    // in registers (through memory, two 256-bit stores then a 512-bit load, the load waited for both stores: the
    // function's hottest line on KJV here); GCC 12 warns that its own headers' insert reads an undefined register
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(sums[2 * h]), sums[2 * h + 1], 1);
#pragma GCC diagnostic pop
    const __m512 dot = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(kAll16, both), inv_scale, offset);  // masked: the same warning
    const __m512 gain = _mm512_loadu_ps(q.scale + 16 * h);
    value[h] = _mm512_add_ps(_mm512_fmadd_ps(dot, gain, _mm512_loadu_ps(q.bias + 16 * h)), constant);
    if (!floor) continue;
    if (q.error) value[h] = _mm512_add_ps(value[h], _mm512_loadu_ps(q.error + 16 * h));
    const __m512 bound = _mm512_fmadd_ps(_mm512_loadu_ps(q.slack + 16 * h), _mm512_set1_ps(q.reach),
                                         _mm512_mul_ps(_mm512_abs_ps(gain), _mm512_set1_ps(q.rounding)));
    const __m512 lower = _mm512_sub_ps(value[h], bound);
    value[h] = _mm512_add_ps(value[h], bound);  // the upper end
    unsigned raising = _mm512_cmp_ps_mask(lower, _mm512_set1_ps(floor->threshold()), _CMP_GT_OQ);
    if (!raising) continue;
    _mm512_store_ps(score, lower);
    for (; raising; raising &= raising - 1) floor->push(score[__builtin_ctz(raising)]);
  }
  const __m512 threshold = _mm512_set1_ps(best.threshold());
  const __m512 reachable = _mm512_set1_ps(floor ? floor->threshold() : kNegInf);
  for (int h = 0; h < 2; ++h) {
    unsigned passing = _mm512_cmp_ps_mask(value[h], threshold, _CMP_GT_OQ) & _mm512_cmp_ps_mask(value[h], reachable, _CMP_GE_OQ);
    if (!passing) continue;
    _mm512_store_ps(score, value[h]);
    take_passing(passing, score, 16 * h, q, floor != nullptr, best, r);
  }
}

// Scans the blocks of work item `w` for each of its queries (8-bit `tables` of `src.plan`, one set per query):
// each block is looked up for every query of the group while it is in cache. One stage: a row enters `best`
// with its 8-bit estimate. Two stages: a row's estimate plus or minus confidence * |q| * slack plus the tables'
// rounding bound brackets its score; the row is scored exactly (and enters `best` with that score) when its upper
// end beats the query's k-th exact score and reaches the k-th largest lower end of the rows scanned (LowerBounds:
// so the first rows scanned are not all scored exactly while `best` fills). Exact scores wait one block: a block's
// rows to score are prefetched, and scored after the next block's first stage, when their codes have arrived.
__attribute__((target("avx2,fma"))) void scan_avx2(const SearchArgs& a, const Work& w, const GroupTables& tables,
                                                   std::vector<BestRows>& best, const SimdSource& src, bool avx512) {
  const Blocks& blocks = *src.blocks;
  const Plan& plan = *src.plan;
  const int64_t group = w.query_end - w.query;
  const int64_t block_bytes = blocks.row_bytes * kRowsPerBlock;
  const bool two_stage = src.slack != nullptr;
  std::vector<float> reach(static_cast<size_t>(group)), rounding(static_cast<size_t>(group));
  std::vector<LowerBounds> floor(two_stage ? static_cast<size_t>(group) : 0, LowerBounds(best.empty() ? 1 : best[0].capacity()));
  for (int64_t j = 0; two_stage && j < group; ++j) {  // bound = reach * slack + rounding * |gain|
    const float* q = a.queries + (w.query + j) * a.dim;
    reach[j] = a.confidence * std::sqrt(dot_avx2(q, q, a.dim));
    rounding[j] = 0.5f * static_cast<float>(plan.n_steps) * tables.scale[j].inv_scale;
  }
  std::vector<Refinement> waiting, arriving;  // exact scores of the previous block's rows, and of this block's
  waiting.reserve(two_stage ? static_cast<size_t>(group) : 0);
  arriving.reserve(two_stage ? static_cast<size_t>(group) : 0);
  __m256i sums[4];
  const float* reference = two_stage ? a.signs->reference : nullptr;
  // per query, the span's reach: confidence * |q|, or * |q - r_g| where that is smaller (then its estimates are
  // shifted by their error at r_g): both bound the estimate's error
  std::vector<float> span_reach(static_cast<size_t>(group));
  std::vector<char> shifted(static_cast<size_t>(group), 0);
  for (const GroupSpan& s : spans_of(a, w, blocks.group_blocks)) {
    for (int64_t j = 0; two_stage && j < group; ++j) {
      span_reach[j] = reach[j];
      if (!reference) continue;
      const float* q = a.queries + (w.query + j) * a.dim;
      // the estimate's error ignores the channels past the first stage's
      const float near = a.confidence * std::sqrt(squared_distance_avx2(q, reference + s.group * a.signs->channels, a.signs->channels));
      shifted[j] = near < reach[j];
      if (shifted[j]) span_reach[j] = near;
    }
    for (int64_t b = s.lo; b < s.hi; ++b) {
      const uint8_t* codes = blocks.codes + b * block_bytes;
      const float* scale = blocks.scale + b * kRowsPerBlock;
      const float* bias = blocks.bias + b * kRowsPerBlock;
      const float* slack = two_stage ? src.slack + b * kRowsPerBlock : nullptr;
      const float* error = reference ? a.signs->reference_error + b * kRowsPerBlock : nullptr;
      const int64_t* ids = blocks.rows + b * kRowsPerBlock;
      for (int64_t j = 0; j < group; ++j) {
        if (avx512) {
          block_sums_avx512(codes, *src.ops, tables.narrow_of(j), tables.wide_of(j), sums);
        } else {
          block_sums(codes, *src.ops, tables.narrow_of(j), sums);
        }
        const BlockQuery bq{scale, bias, slack, error && shifted[j] ? error : nullptr, ids, tables.scale[j].inv_scale,
                            tables.scale[j].offset, s.constant, two_stage ? span_reach[j] : 0.0f, two_stage ? rounding[j] : 0.0f};
        Refinement r;  // lanes [0, n) are written before they are read: no zeroing of all 32 per block and query
        r.b = b, r.j = j, r.constant = s.constant, r.n = 0;
        if (avx512) {
          settle_avx512(sums, bq, two_stage ? &floor[j] : nullptr, best[j], r);
        } else {
          settle_avx2(sums, bq, two_stage ? &floor[j] : nullptr, best[j], r);
        }
        if (r.n) {
          prefetch_rows(a, r);
          arriving.push_back(r);
        }
      }
      if (two_stage) refine_all(a, src, waiting, arriving, best, floor, avx512);
    }
  }
  if (two_stage) refine_all(a, src, waiting, arriving, best, floor, avx512);
}
#endif  // TQVEC_X86

// Writes the best k candidates (best first, ties by row) with -inf / -1 padding.
void write_best(int64_t k, std::vector<Candidate>& cands, float* values, int64_t* out_rows) {
  std::sort(cands.begin(), cands.end(), [](const Candidate& x, const Candidate& y) {
    return x.score > y.score || (x.score == y.score && x.row < y.row);
  });
  const int64_t take = std::min<int64_t>(k, static_cast<int64_t>(cands.size()));
  for (int64_t i = 0; i < k; ++i) {
    values[i] = i < take ? cands[i].score : kNegInf;
    out_rows[i] = i < take ? cands[i].row : -1;
  }
}

#ifdef TQVEC_X86
constexpr int64_t kInt8MinQueries = 32;      // queries below which decoding each row costs too much per query
constexpr int64_t kInt8MaxQueries = 512;     // queries that share the rows' decoding at most (their bytes stay in L2)
constexpr int64_t kInt8MinRowsPerPart = 1024;  // rows a thread scans at least when a chunk's rows are split

// True when the int8 batch kernel serves the search: a flat batch (one group of rows in order, probed once per
// query or not at all) of at least kInt8MinQueries queries over codes of the two-stage layouts (3 bits per channel
// or more), on a CPU with AVX-512 VNNI, allowed by max_isa.
bool int8_batch(const SearchArgs& a, Isa max_isa) {
  const bool flat = a.groups.n_groups == 1 && a.groups.list_rows == nullptr && (a.groups.probe == nullptr || a.groups.n_probe == 1);
  return max_isa >= Isa::kAvx512Vnni && flat && a.signs != nullptr && a.rescore > 0 && a.nq >= kInt8MinQueries &&
         has_avx512_vnni();
}

// The flat batch by int8 products (int8_scan.h): queries in chunks of up to kInt8MaxQueries, a chunk per thread where
// each still holds kInt8MinQueries (a chunk decodes every row once for its queries); only with fewer chunks than
// threads are a chunk's rows split into parts, which share their cuts (a split makes each query's cut rise once per
// part, docs/native.md). Then per query the
// max(k, rescore) best rows by estimate over all parts, scored exactly with the float tables. The products on AMX
// tiles where `amx`.
__attribute__((target("avx512f,avx512bw,avx2,fma"))) const char* search_int8(const SearchArgs& a, const PlanSteps& steps,
                                                                          int threads, bool amx) {
  const int64_t lo = a.groups.offsets[0], hi = a.groups.offsets[1];
  const int64_t keep = std::min<int64_t>(std::max(a.k, a.rescore), std::max<int64_t>(1, a.rows.n));
  const int64_t fewest = std::max<int64_t>((a.nq + kInt8MaxQueries - 1) / kInt8MaxQueries,
                                           std::min<int64_t>(threads, a.nq / kInt8MinQueries));
  const int64_t per_chunk = ((a.nq + fewest - 1) / fewest + 15) / 16 * 16;  // whole tiles of 16 queries
  const int64_t chunks = (a.nq + per_chunk - 1) / per_chunk;
  const int64_t parts = std::clamp<int64_t>((threads + chunks - 1) / chunks, 1, std::max<int64_t>(1, (hi - lo) / kInt8MinRowsPerPart));
  std::vector<Work> work;  // chunk c, part p: work[c * parts + p]
  for (int64_t q = 0; q < a.nq; q += per_chunk)
    for (int64_t p = 0; p < parts; ++p)
      work.push_back({q, std::min(a.nq, q + per_chunk), 0, 0, lo + (hi - lo) * p / parts, lo + (hi - lo) * (p + 1) / parts});
  std::vector<SharedCuts> cuts;
  for (int64_t c = 0; c < chunks; ++c) cuts.emplace_back(work[c * parts].query_end - work[c * parts].query);
  const Int8Queries queries = int8_queries(steps.int8, a.queries, a.nq, a.dim, threads);
  std::vector<std::vector<std::vector<Estimate>>> found(work.size());
  parallel_for(work.size(), threads, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const Work& w = work[i];
      found[i].resize(static_cast<size_t>(w.query_end - w.query));
      int8_candidates(steps.int8, a.rows, w.part_begin, w.part_end, queries, w.query, w.query_end, keep, cuts[i / parts], found[i],
                      amx);
    }
  }, 1, Idle::kSpin);
  const ExactSteps& exact = steps.exact_runs;
  parallel_for(static_cast<size_t>(a.nq), threads, [&](size_t begin, size_t end) {
    std::unique_ptr<float[]> lut(new float[table_entries(a.plan)]);
    std::unique_ptr<float[]> ordered(new float[static_cast<size_t>(a.dim)]);
    std::vector<Estimate> estimates;
    std::vector<Candidate> cands;
    for (size_t at = begin; at < end; ++at) {
      const int64_t q = static_cast<int64_t>(at), chunk = q / per_chunk;
      estimates.clear();
      for (int64_t p = 0; p < parts; ++p) {
        const auto& part = found[chunk * parts + p][q - chunk * per_chunk];
        estimates.insert(estimates.end(), part.begin(), part.end());
      }
      if (static_cast<int64_t>(estimates.size()) > keep)
        std::nth_element(estimates.begin(), estimates.begin() + (keep - 1), estimates.end(),
                         [](const Estimate& x, const Estimate& y) { return x.first > y.first; });
      estimates.resize(std::min<size_t>(estimates.size(), static_cast<size_t>(keep)));
      cands.clear();
      if (a.groups.probe == nullptr || a.groups.probe[q] == 0) {  // -1: the query scans nothing
        const float* query = a.queries + q * a.dim;
        const float constant = a.groups.probe_constant ? a.groups.probe_constant[q] : 0.0f;
        float_tables_avx2(a.plan, &exact.table_steps, query, lut.get());
        run_query_order(exact, query, a.dim, kRunChunkAvx512, ordered.get());
        for (const Estimate& e : estimates) {
          const int64_t r = e.second;
          const float dot = exact_dot_avx512(exact, lut.get(), a.plan.level, ordered.get(), a.rows.packed + r * a.rows.row_bytes);
          cands.push_back({finish(a.rows, r, dot, constant), r, constant});
        }
      }
      if (a.out_exact) a.out_exact[q] = static_cast<int64_t>(cands.size());
      write_best(a.k, cands, a.out_values + q * a.k, a.out_rows + q * a.k);
    }
  }, 16, Idle::kSpin);
  return amx ? "amx" : "avx512-vnni";
}
#endif  // TQVEC_X86

}  // namespace

bool has_avx2() {
#ifdef TQVEC_X86
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool has_avx512() {
#ifdef TQVEC_X86
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#else
  return false;
#endif
}

Blocks BlockStore::view() const {
  return {codes.data(), scale.data(), bias.data(), rows.data(), group_blocks.data(),
          static_cast<int64_t>(rows.size()) / kRowsPerBlock, static_cast<int64_t>(group_blocks.size()) - 1, row_bytes, n_rows};
}

size_t BlockStore::nbytes() const {
  return codes.size() + sizeof(float) * (scale.size() + bias.size()) + sizeof(int64_t) * (rows.size() + group_blocks.size());
}

BlockStore arrange(const Rows& rows, const int64_t* offsets, const int64_t* list_rows, int64_t n_groups) {
  BlockStore out;
  out.row_bytes = rows.row_bytes;
  out.n_rows = rows.n;
  out.group_blocks.assign(static_cast<size_t>(n_groups) + 1, 0);
  for (int64_t g = 0; g < n_groups; ++g)
    out.group_blocks[g + 1] = out.group_blocks[g] + (offsets[g + 1] - offsets[g] + kRowsPerBlock - 1) / kRowsPerBlock;
  const size_t slots = static_cast<size_t>(out.group_blocks[n_groups]) * kRowsPerBlock;
  out.codes.assign(slots * static_cast<size_t>(rows.row_bytes), 0);
  out.scale.assign(slots, 0.0f);
  out.bias.assign(slots, kNegInf);
  out.rows.assign(slots, -1);
  for (int64_t g = 0; g < n_groups; ++g) {
    for (int64_t p = offsets[g]; p < offsets[g + 1]; ++p) {
      const int64_t r = list_rows ? list_rows[p] : p;
      const int64_t position = out.group_blocks[g] * kRowsPerBlock + (p - offsets[g]);
      const int64_t block = position / kRowsPerBlock, slot = position % kRowsPerBlock;
      uint8_t* dst = out.codes.data() + block * rows.row_bytes * kRowsPerBlock + slot;
      const uint8_t* src = rows.packed + r * rows.row_bytes;
      for (int64_t j = 0; j < rows.row_bytes; ++j) dst[j * kRowsPerBlock] = src[j];
      const int64_t lane = block * kRowsPerBlock + kSlotLane[slot];
      out.scale[lane] = rows.scale ? rows.scale[r] : 1.0f;
      out.bias[lane] = rows.bias ? rows.bias[r] : 0.0f;
      out.rows[lane] = r;
    }
  }
  return out;
}

Rows ListOrder::view() const {
  return {codes.data(), static_cast<int64_t>(codes.size()) / std::max<int64_t>(1, row_bytes), row_bytes,
          scale.empty() ? nullptr : scale.data(), bias.empty() ? nullptr : bias.data()};
}

size_t ListOrder::nbytes() const { return codes.size() + sizeof(float) * (scale.size() + bias.size()); }

ListOrder arrange_lists(const Rows& rows, const int64_t* list_rows, int64_t positions) {
  ListOrder out;
  out.row_bytes = rows.row_bytes;
  out.codes.resize(static_cast<size_t>(positions * rows.row_bytes));
  if (rows.scale) out.scale.resize(static_cast<size_t>(positions));
  if (rows.bias) out.bias.resize(static_cast<size_t>(positions));
  for (int64_t p = 0; p < positions; ++p) {
    const int64_t r = list_rows[p];
    std::memcpy(out.codes.data() + p * rows.row_bytes, rows.packed + r * rows.row_bytes, static_cast<size_t>(rows.row_bytes));
    if (rows.scale) out.scale[p] = rows.scale[r];
    if (rows.bias) out.bias[p] = rows.bias[r];
  }
  return out;
}

Plan SignStore::plan() const {
  return {static_cast<int>(byte.size()), byte.data(), shift.data(), width.data(), channel.data(), offset.data(), level.data()};
}

size_t SignStore::nbytes() const {
  return blocks.nbytes() + sizeof(float) * (slack.size() + scale.size() + reference_error.size() + reference.size()) + codes.size();
}

namespace {

// Step t's code in `row`.
inline int32_t step_code(const Plan& plan, int t, const uint8_t* row) {
  unsigned bits = row[plan.byte[t]];
  if (plan.shift[t] + plan.width[t] > 8) bits |= static_cast<unsigned>(row[plan.byte[t] + 1]) << 8;
  return static_cast<int32_t>((bits >> plan.shift[t]) & ((1u << plan.width[t]) - 1u));
}

// The levels o (channels floats) that `plan` decodes `row` to.
void decode_levels(const Plan& plan, const uint8_t* row, float* o) {
  for (int t = 0; t < plan.n_steps; ++t) {
    const int32_t code = step_code(plan, t, row), size = plan.offset[t + 1] - plan.offset[t];
    const float* level = plan.level + static_cast<size_t>(kMaxStepChannels) * plan.offset[t];
    for (int j = 0; j < kMaxStepChannels && plan.channel[t * kMaxStepChannels + j] >= 0; ++j)
      o[plan.channel[t * kMaxStepChannels + j]] = level[j * size + code];
  }
}

// Completes a two-stage store whose first-stage plan is built: lays the rows' first-stage codes (`coarse`,
// coarse_bytes per row) out in blocks with their gains, and per slot the slack, the scale and, for rows taken through
// list_rows (an inverted file's lists), a copy of the row in slot order (so a list's rows sit side by side).
void fill_two_stage(SignStore& out, const Rows& rows, const std::vector<uint8_t>& coarse, int64_t coarse_bytes,
                    const std::vector<float>& gain, const std::vector<float>& slack, const std::vector<float>& error,
                    const int64_t* offsets, const int64_t* list_rows, int64_t n_groups) {
  out.steps = plan_steps(out.plan());
  out.blocks = arrange({coarse.data(), rows.n, coarse_bytes, gain.data(), rows.bias}, offsets, list_rows, n_groups);
  const size_t slots = out.blocks.rows.size();
  out.slack.assign(slots, 0.0f);
  out.scale.assign(slots, 0.0f);
  out.reference_error.assign(error.empty() ? 0 : slots, 0.0f);
  if (list_rows) out.codes.assign(slots * static_cast<size_t>(rows.row_bytes), 0);
  for (size_t lane = 0; lane < slots; ++lane) {
    const int64_t r = out.blocks.rows[lane];
    if (r < 0) continue;
    out.slack[lane] = slack[static_cast<size_t>(r)];
    if (!error.empty()) out.reference_error[lane] = error[static_cast<size_t>(r)];
    out.scale[lane] = rows.scale ? rows.scale[r] : 1.0f;
    if (list_rows)
      std::memcpy(out.codes.data() + lane * rows.row_bytes, rows.packed + r * rows.row_bytes, static_cast<size_t>(rows.row_bytes));
  }
}

// Each row's group (offsets / list_rows as in `arrange`; -1 for a row in none), for the reference vectors.
std::vector<int64_t> row_groups(int64_t n, const int64_t* offsets, const int64_t* list_rows, int64_t n_groups) {
  std::vector<int64_t> group(static_cast<size_t>(n), -1);
  for (int64_t g = 0; g < n_groups; ++g)
    for (int64_t p = offsets[g]; p < offsets[g + 1]; ++p) group[static_cast<size_t>(list_rows ? list_rows[p] : p)] = g;
  return group;
}

// <r, scale * o - gain * first> for the (channels,) vectors r, o and first (the first stage's levels of the row).
float reference_error(const float* r, const std::vector<float>& o, const std::vector<float>& first, double scale,
                      double gain) {
  double sum = 0.0;
  for (size_t c = 0; c < o.size(); ++c) sum += static_cast<double>(r[c]) * (scale * o[c] - gain * first[c]);
  return static_cast<float>(sum);
}

}  // namespace

SignStore arrange_signs(const Rows& rows, const Plan& plan, int64_t channels, const int64_t* offsets,
                        const int64_t* list_rows, int64_t n_groups, const float* reference) {
  SignStore out;
  out.sign_bits = true;
  const int64_t sign_bytes = (channels + 7) / 8, n_steps = (channels + 3) / 4;
  for (int64_t t = 0; t < n_steps; ++t) {  // step t: the nibble of channels 4t .. 4t + 3, level +1 where a bit is set
    out.byte.push_back(static_cast<int32_t>(t / 2));
    out.shift.push_back(static_cast<int32_t>(4 * (t % 2)));
    out.width.push_back(4);
    out.offset.push_back(static_cast<int32_t>(kLut * t));
    for (int j = 0; j < kMaxStepChannels; ++j) {
      const bool used = 4 * t + j < channels;
      out.channel.push_back(used ? static_cast<int32_t>(4 * t + j) : -1);
      for (int e = 0; e < kLut; ++e) out.level.push_back(!used ? 0.0f : (e >> j) & 1 ? 1.0f : -1.0f);
    }
  }
  out.offset.push_back(static_cast<int32_t>(kLut * n_steps));
  std::vector<uint8_t> signs(static_cast<size_t>(rows.n * sign_bytes), 0);
  std::vector<float> gain(static_cast<size_t>(rows.n)), slack(static_cast<size_t>(rows.n)), o(static_cast<size_t>(channels));
  std::vector<float> s(static_cast<size_t>(channels)), error(reference ? static_cast<size_t>(rows.n) : 0);
  const std::vector<int64_t> group = reference ? row_groups(rows.n, offsets, list_rows, n_groups) : std::vector<int64_t>();
  const double root_d = std::sqrt(static_cast<double>(channels)), root_d1 = std::sqrt(std::max<double>(1.0, channels - 1.0));
  for (int64_t r = 0; r < rows.n; ++r) {
    std::fill(o.begin(), o.end(), 0.0f);
    decode_levels(plan, rows.packed + r * rows.row_bytes, o.data());
    uint8_t* sign = signs.data() + r * sign_bytes;
    double l1 = 0.0, l2 = 0.0;
    for (int64_t c = 0; c < channels; ++c) {
      if (o[c] > 0.0f) sign[c / 8] |= static_cast<uint8_t>(1u << (c % 8));
      s[c] = o[c] > 0.0f ? 1.0f : -1.0f;
      l1 += std::fabs(o[c]);
      l2 += static_cast<double>(o[c]) * o[c];
    }
    const double scale = rows.scale ? rows.scale[r] : 1.0;
    const double f = l1 > 0.0 ? l1 / (root_d * std::sqrt(l2)) : 1.0;  // cos(o, s)
    gain[r] = l1 > 0.0 ? static_cast<float>(scale * l2 / l1) : 0.0f;
    slack[r] = static_cast<float>(std::fabs(scale) * std::sqrt(l2) * std::sqrt(std::max(0.0, 1.0 - f * f)) / (f * root_d1));
    if (reference && group[r] >= 0) error[r] = reference_error(reference + group[r] * channels, o, s, scale, gain[r]);
  }
  fill_two_stage(out, rows, signs, sign_bytes, gain, slack, error, offsets, list_rows, n_groups);
  if (reference) out.reference.assign(reference, reference + n_groups * channels);
  return out;
}

SignStore arrange_high_bits(const Rows& rows, const Plan& plan, int64_t channels, int kept, const int64_t* offsets,
                            const int64_t* list_rows, int64_t n_groups, const float* reference) {
  SignStore out;
  std::vector<int> step_of(static_cast<size_t>(channels), -1);
  for (int t = 0; t < plan.n_steps; ++t) step_of[plan.channel[t * kMaxStepChannels]] = t;
  // channel c's high code (code >> (width - kept)) stands for the mean of the levels it groups
  const int per_step = 4 / kept, groups = 1 << kept;
  std::vector<float> mean(static_cast<size_t>(channels) * groups, 0.0f);
  for (int64_t c = 0; c < channels; ++c) {
    const int t = step_of[static_cast<size_t>(c)];
    const int width = plan.width[t], low = std::max(0, width - kept), size = 1 << width;
    const float* level = plan.level + static_cast<size_t>(kMaxStepChannels) * plan.offset[t];
    for (int code = 0; code < size; ++code) mean[c * groups + (code >> low)] += level[code] / static_cast<float>(1 << low);
  }
  // step s of the first stage: the nibble of channels per_step * s ..; in byte s / 2; entry e holds channel
  // per_step * s + j's high code in bits kept * j ..
  const int64_t n_steps = (channels + per_step - 1) / per_step;
  for (int64_t step = 0; step < n_steps; ++step) {
    out.byte.push_back(static_cast<int32_t>(step / 2));
    out.shift.push_back(static_cast<int32_t>(4 * (step % 2)));
    out.width.push_back(4);
    out.offset.push_back(static_cast<int32_t>(kLut * step));
    for (int j = 0; j < kMaxStepChannels; ++j) {
      const int64_t c = per_step * step + j;
      const bool used = j < per_step && c < channels;
      out.channel.push_back(used ? static_cast<int32_t>(c) : -1);
      for (int e = 0; e < kLut; ++e) out.level.push_back(used ? mean[c * groups + ((e >> (kept * j)) & (groups - 1))] : 0.0f);
    }
  }
  out.offset.push_back(static_cast<int32_t>(kLut * n_steps));
  const int64_t coarse_bytes = (n_steps + 1) / 2;
  std::vector<uint8_t> coarse_codes(static_cast<size_t>(rows.n * coarse_bytes), 0);
  std::vector<float> gain(static_cast<size_t>(rows.n)), slack(static_cast<size_t>(rows.n));
  std::vector<float> o(static_cast<size_t>(channels)), coarse(static_cast<size_t>(channels));
  std::vector<float> error(reference ? static_cast<size_t>(rows.n) : 0);
  const std::vector<int64_t> group = reference ? row_groups(rows.n, offsets, list_rows, n_groups) : std::vector<int64_t>();
  const double root_d1 = std::sqrt(std::max<double>(1.0, channels - 1.0));
  for (int64_t r = 0; r < rows.n; ++r) {
    const uint8_t* row = rows.packed + r * rows.row_bytes;
    decode_levels(plan, row, o.data());
    double oo = 0.0, oc = 0.0, cc = 0.0;
    for (int64_t c = 0; c < channels; ++c) {
      const int t = step_of[static_cast<size_t>(c)];
      const int32_t high = step_code(plan, t, row) >> std::max(0, plan.width[t] - kept);
      const int64_t step = c / per_step;
      coarse_codes[r * coarse_bytes + step / 2] |= static_cast<uint8_t>(high << (4 * (step % 2) + kept * (c % per_step)));
      coarse[c] = mean[c * groups + high];
      oo += static_cast<double>(o[c]) * o[c];
      oc += static_cast<double>(o[c]) * coarse[c];
      cc += static_cast<double>(coarse[c]) * coarse[c];
    }
    // a mean shares its levels' sign, so <o, c> > 0 unless o = 0 (then the score is the bias: gain and slack 0)
    const double scale = rows.scale ? rows.scale[r] : 1.0, f = oc > 0.0 ? oc / std::sqrt(oo * cc) : 1.0;  // cos(o, c)
    gain[r] = oc > 0.0 ? static_cast<float>(scale * oo / oc) : 0.0f;
    slack[r] = static_cast<float>(std::fabs(scale) * std::sqrt(oo) * std::sqrt(std::max(0.0, 1.0 - f * f)) / (f * root_d1));
    if (reference && group[r] >= 0) error[r] = reference_error(reference + group[r] * channels, o, coarse, scale, gain[r]);
  }
  fill_two_stage(out, rows, coarse_codes, coarse_bytes, gain, slack, error, offsets, list_rows, n_groups);
  if (reference) out.reference.assign(reference, reference + n_groups * channels);
  return out;
}

namespace {
// search's per-thread scratch buffers (tqvec::Scratch): float tables, first-stage float tables, queries in run order,
// sign tables' P and N
struct FloatTablesSite;
struct FirstTablesSite;
struct ExactQueriesSite;
struct SignTablesSite;
}  // namespace

const char* search(const SearchArgs& a, Isa max_isa) {
#ifdef TQVEC_X86
  if (int8_batch(a, max_isa)) {
    std::shared_ptr<const PlanSteps> derived;  // when the caller has none
    return search_int8(a, a.steps ? *a.steps : *(derived = plan_steps(a.plan)), std::max(1, a.threads),
                       max_isa >= Isa::kAmx && has_amx());
  }
#endif
  const bool narrow = std::all_of(a.plan.width, a.plan.width + a.plan.n_steps, [](int32_t w) { return w <= 4; });
  const bool vector_isa = max_isa >= Isa::kAvx2 && has_avx2() && a.rescore > 0;
  const bool two_stage = vector_isa && a.signs != nullptr;
  const bool simd = two_stage || (vector_isa && narrow && a.blocks != nullptr);
  const bool avx512 = simd && max_isa >= Isa::kAvx512 && has_avx512();
  const int threads = std::max(1, a.threads);
  const Blocks* blocks = two_stage ? &a.signs->blocks : a.blocks;
  const Plan& table_plan = two_stage ? a.signs->plan : a.plan;  // the plan whose tables the SIMD scan looks up
  const bool flat = a.groups.probe == nullptr;  // every query scans the one group
  // Work items: without probe, groups of up to kQueryGroup queries share each block, and when there are too
  // few groups for the threads the rows (blocks) are split too; with probe, one query per item, its probed
  // groups split across items when there are fewer queries than threads. No item is split below
  // kMinRowsPerPart rows (starting a thread costs more than scanning fewer).
  const int64_t* offsets = simd ? blocks->group_blocks : a.groups.offsets;
  const int64_t unit = simd ? kRowsPerBlock : 1;  // rows per offset unit
  const int64_t rows_per_query = flat ? unit * (offsets[1] - offsets[0])
                                      : unit * offsets[a.groups.n_groups] * a.groups.n_probe / std::max<int64_t>(1, a.groups.n_groups);
  const int64_t group = flat && simd ? std::min<int64_t>(kQueryGroup, std::max<int64_t>(1, a.nq / threads)) : 1;
  const int64_t items = (a.nq + group - 1) / group;
  const int64_t parts = items >= threads ? 1 : std::max<int64_t>(1, std::min<int64_t>(threads / std::max<int64_t>(1, items),
                                                                                   rows_per_query / kMinRowsPerPart));
  std::vector<Work> work;
  for (int64_t q = 0; q < a.nq; q += group) {
    for (int64_t p = 0; p < parts; ++p) {
      Work w{q, std::min(a.nq, q + group), 0, a.groups.n_probe, 0, 0};
      if (parts > 1 && flat) {
        const int64_t lo = offsets[0], hi = offsets[1];
        w.part_begin = lo + (hi - lo) * p / parts;
        w.part_end = lo + (hi - lo) * (p + 1) / parts;
        if (w.part_end <= w.part_begin) continue;
      } else if (parts > 1) {
        w.probe_begin = a.groups.n_probe * p / parts;
        w.probe_end = a.groups.n_probe * (p + 1) / parts;
        if (w.probe_end <= w.probe_begin) continue;
      }
      work.push_back(w);
    }
  }
  // candidates kept per query: never more than the rows (a k past them is padding, written by write_best)
  const int64_t keep = std::min<int64_t>(simd && !two_stage ? std::max(a.k, a.rescore) : a.k, std::max<int64_t>(1, a.rows.n));
  std::shared_ptr<const PlanSteps> derived;  // when the caller has none
  const PlanSteps& steps = a.steps ? *a.steps : *(derived = plan_steps(a.plan));
  const ExactSteps& exact = steps.exact;
  // candidates per item and query of the item, kept for the merge when a query's rows are split across items
  std::vector<std::vector<std::vector<Candidate>>> found(work.size());
  std::vector<std::vector<int64_t>> exact_counts(work.size());  // rows scored exactly, per item and query of the item
  for (size_t i = 0; i < work.size(); ++i) exact_counts[i].resize(static_cast<size_t>(work[i].query_end - work[i].query));
#ifdef TQVEC_X86
  const StepOps& ops = two_stage ? a.signs->steps->ops : steps.ops;
#endif

#ifdef TQVEC_X86
  const auto tables = vector_isa ? float_tables_avx2 : float_tables;
#else
  const auto tables = float_tables;
#endif
  // each query's float tables, uninitialized: the two-stage scan fills (and reads) only the tables of the steps its
  // exact scores look up (none where every step is in a run: most codes of 3 and 4 bits; then no space at all)
  const size_t lut_stride = two_stage && steps.exact_runs.table_steps.empty() ? 0 : table_entries(a.plan);
  auto scan_items = [&](size_t begin, size_t end) {
    const Scratch<float, FloatTablesSite> luts(lut_stride * static_cast<size_t>(group));
    // one query's float tables of the first stage, quantized at once (a sign plan's are made from the query itself)
    const Scratch<float, FirstTablesSite> first_luts(two_stage && !a.signs->sign_bits ? table_entries(table_plan) : 0);
    const Scratch<float, ExactQueriesSite> exact_queries(two_stage ? static_cast<size_t>(a.dim * group) : 0);
#ifdef TQVEC_X86
    const Scratch<float, SignTablesSite> sign_scratch(two_stage && a.signs->sign_bits ? 2 * sign_padded_channels(table_plan.n_steps) : 0);
#endif
    for (size_t i = begin; i < end; ++i) {
      const Work& w = work[i];
#ifdef TQVEC_X86
      GroupTables quantized(simd ? table_plan.n_steps : 0, simd ? w.query_end - w.query : 0);
#endif
      for (int64_t q = w.query; q < w.query_end; ++q) {
        const float* query = a.queries + q * a.dim;
        float* lut = luts.get() + (q - w.query) * lut_stride;
        if (two_stage) {
          tables(a.plan, &steps.exact_runs.table_steps, query, lut);
#ifdef TQVEC_X86
          run_query_order(steps.exact_runs, query, a.dim, avx512 ? kRunChunkAvx512 : kRunChunkAvx2,
                          exact_queries.get() + (q - w.query) * a.dim);
          if (a.signs->sign_bits) {
            sign_tables(query, a.signs->channels, table_plan.n_steps, quantized.of(q - w.query), quantized.scale[q - w.query],
                        sign_scratch.get());
          } else {
            tables(table_plan, nullptr, query, first_luts.get());
            quantize_tables(table_plan, first_luts.get(), quantized.of(q - w.query), quantized.scale[q - w.query]);
          }
#endif
        } else {
          tables(a.plan, nullptr, query, lut);
#ifdef TQVEC_X86
          if (simd) quantize_tables(a.plan, lut, quantized.of(q - w.query), quantized.scale[q - w.query]);
#endif
        }
      }
      std::vector<BestRows> best(static_cast<size_t>(w.query_end - w.query), BestRows(keep));
#ifdef TQVEC_X86
      if (simd) {
        if (avx512) quantized.widen(ops);
        const SimdSource src{blocks, &table_plan, &ops, two_stage ? a.signs->slack : nullptr, &steps.exact_runs, luts.get(),
                             lut_stride, exact_queries.get()};
        scan_avx2(a, w, quantized, best, src, avx512);
      } else {
        scan_exact(a, exact, w, luts.get(), best[0]);
      }
#else
      scan_exact(a, exact, w, luts.get(), best[0]);
#endif
      for (size_t j = 0; j < best.size(); ++j) {
        std::vector<Candidate>& cands = best[j].items();
        if (simd && !two_stage) {  // exact scores for the candidates of the 8-bit estimate, with this item's float tables
          const float* lut = luts.get() + j * lut_stride;
          for (Candidate& c : cands)
            c.score = finish(a.rows, c.row, exact_dot(exact, lut, a.rows.packed + c.row * a.rows.row_bytes), c.constant);
          best[j].exact += static_cast<int64_t>(cands.size());
        }
        exact_counts[i][j] = best[j].exact;
        if (parts == 1) {  // the query's only item: answer now, keep nothing for the merge
          const int64_t q = w.query + static_cast<int64_t>(j);
          write_best(a.k, cands, a.out_values + q * a.k, a.out_rows + q * a.k);
        } else {
          found[i].push_back(std::move(cands));
        }
      }
    }
  };
  parallel_for(work.size(), threads, scan_items, 1, Idle::kSpin);
  if (a.out_exact) {
    std::fill(a.out_exact, a.out_exact + a.nq, int64_t{0});
    for (size_t i = 0; i < work.size(); ++i)
      for (size_t j = 0; j < exact_counts[i].size(); ++j) a.out_exact[work[i].query + static_cast<int64_t>(j)] += exact_counts[i][j];
  }
  const char* kernel = two_stage ? (avx512 ? "avx512-two-stage" : "avx2-two-stage") : avx512 ? "avx512" : simd ? "avx2" : "scalar";
  if (parts == 1) return kernel;  // each query was answered by its only item
  // Merge the (exactly scored) candidates of each query's items.
  std::vector<size_t> first_item(static_cast<size_t>(a.nq) + 1, work.size());
  for (size_t i = work.size(); i-- > 0;)
    for (int64_t q = work[i].query; q < work[i].query_end; ++q) first_item[q] = i;
  auto merge_queries = [&](size_t begin, size_t end) {
    for (size_t q = begin; q < end; ++q) {
      std::vector<Candidate> cands;
      for (size_t i = first_item[q]; i < work.size() && work[i].query <= static_cast<int64_t>(q); ++i)
        if (static_cast<int64_t>(q) < work[i].query_end) {
          const auto& part = found[i][q - work[i].query];
          cands.insert(cands.end(), part.begin(), part.end());
        }
      write_best(a.k, cands, a.out_values + q * a.k, a.out_rows + q * a.k);
    }
  };
  parallel_for(static_cast<size_t>(a.nq), threads, merge_queries, 16, Idle::kSpin);
  return kernel;
}

}  // namespace tqvec
