// Fast-scan top-k search over packed TurboQuant codes: see fastscan.h for the contract.
#include "fastscan.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
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
constexpr int64_t kQueryGroup = 16;   // queries that share each transposed block (their tables stay in L2)

struct Candidate {
  float score;
  int64_t row;
  float constant;  // the row's group constant, kept for the exact re-score
};

// The best `capacity` candidates seen so far (a min-heap on score; NaN and -inf never enter).
class BestRows {
 public:
  explicit BestRows(int64_t capacity) : capacity_(static_cast<size_t>(capacity)) { heap_.reserve(capacity_); }

  float threshold() const { return heap_.size() < capacity_ ? kNegInf : heap_.front().score; }

  void push(float score, int64_t row, float constant) {
    if (!(score > threshold())) return;
    if (heap_.size() < capacity_) {
      heap_.push_back({score, row, constant});
      std::push_heap(heap_.begin(), heap_.end(), worse_first);
    } else {
      std::pop_heap(heap_.begin(), heap_.end(), worse_first);
      heap_.back() = {score, row, constant};
      std::push_heap(heap_.begin(), heap_.end(), worse_first);
    }
  }

  std::vector<Candidate>& items() { return heap_; }

 private:
  static bool worse_first(const Candidate& a, const Candidate& b) { return a.score > b.score; }
  size_t capacity_;
  std::vector<Candidate> heap_;
};

// The float tables of one query: lut[offset[t] + c] = sum over step t's channels of query[channel] * level.
void float_tables(const Plan& plan, const float* query, float* lut) {
  for (int t = 0; t < plan.n_steps; ++t) {
    const int32_t size = plan.offset[t + 1] - plan.offset[t];
    const int32_t* channel = plan.channel + t * kMaxStepChannels;
    const float* level = plan.level + static_cast<size_t>(kMaxStepChannels) * plan.offset[t];
    float* out = lut + plan.offset[t];
    const float q0 = channel[0] >= 0 ? query[channel[0]] : 0.0f;
    for (int32_t e = 0; e < size; ++e) out[e] = q0 * level[e];
    for (int j = 1; j < kMaxStepChannels && channel[j] >= 0; ++j) {
      const float qj = query[channel[j]];
      const float* lj = level + j * size;
      for (int32_t e = 0; e < size; ++e) out[e] += qj * lj[e];
    }
  }
}

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
  std::vector<Pair> pairs;
  std::vector<Single> singles;
};

// True when steps t and t + 1 are the low and high nibble of one byte, each a full 4-bit code.
inline bool nibble_pair(const Plan& plan, int t) {
  return plan.shift[t] == 0 && plan.width[t] == 4 && t + 1 < plan.n_steps && plan.byte[t + 1] == plan.byte[t] &&
         plan.shift[t + 1] == 4 && plan.width[t + 1] == 4;
}

ExactSteps exact_steps(const Plan& plan) {
  ExactSteps steps;
  for (int t = 0; t < plan.n_steps; ++t) {
    const int32_t b = plan.byte[t], s = plan.shift[t], w = plan.width[t];
    if (nibble_pair(plan, t)) {
      steps.pairs.push_back({b, plan.offset[t]});
      ++t;
    } else {
      steps.singles.push_back({b, s, s + w > 8, plan.offset[t], (1u << w) - 1u});
    }
  }
  return steps;
}

// Exact inner product of one row with the float tables.
inline float exact_dot(const ExactSteps& steps, const float* lut, const uint8_t* row) {
  float low = 0.0f, high = 0.0f;
  for (const ExactSteps::Pair& p : steps.pairs) {
    const unsigned byte = row[p.byte];
    low += lut[p.entry + (byte & 15u)];
    high += lut[p.entry + 16 + (byte >> 4)];
  }
  for (const ExactSteps::Single& s : steps.singles) {
    unsigned bits = row[s.byte];
    if (s.straddle) bits |= static_cast<unsigned>(row[s.byte + 1]) << 8;
    low += lut[s.entry + ((bits >> s.shift) & s.mask)];
  }
  return low + high;
}

inline float finish(const Rows& rows, int64_t r, float dot, float constant) {
  const float scale = rows.scale ? rows.scale[r] : 1.0f;
  const float bias = rows.bias ? rows.bias[r] : 0.0f;
  return scale * dot + bias + constant;
}

// One unit of work: a group of queries and a slice [probe_begin, probe_end) of their probed groups (or, for a
// single contiguous group, a slice of its rows).
struct Work {
  int64_t query, query_end;    // queries [query, query_end) scan the same rows (several only without probe)
  int64_t probe_begin, probe_end;
  int64_t row_begin, row_end;  // used when the queries scan one contiguous group split across workers
};

// Calls f(row, position) for the rows at positions [lo, hi) of the groups' row order.
template <class F>
inline void for_rows(const Groups& groups, int64_t lo, int64_t hi, F&& f) {
  for (int64_t p = lo; p < hi; ++p) f(groups.list_rows ? groups.list_rows[p] : p, p);
}

struct GroupSpan {
  int64_t group, lo, hi;
  float constant;
};

std::vector<GroupSpan> spans_of(const SearchArgs& a, const Work& w) {
  std::vector<GroupSpan> spans;
  const Groups& g = a.groups;
  for (int64_t p = w.probe_begin; p < w.probe_end; ++p) {
    const int64_t group = g.probe ? g.probe[w.query * g.n_probe + p] : 0;
    if (group < 0 || group >= g.n_groups) continue;
    int64_t lo = g.offsets[group], hi = g.offsets[group + 1];
    if (w.row_end > w.row_begin) {
      lo = std::max(lo, w.row_begin);
      hi = std::min(hi, w.row_end);
    }
    const float constant = g.probe_constant ? g.probe_constant[w.query * g.n_probe + p] : 0.0f;
    if (hi > lo) spans.push_back({group, lo, hi, constant});
  }
  return spans;
}

// ------------------------------------------------------------------------------------------ scalar kernel
void scan_exact(const SearchArgs& a, const ExactSteps& steps, const Work& w, const float* lut, BestRows& best) {
  for (const GroupSpan& s : spans_of(a, w)) {
    for_rows(a.groups, s.lo, s.hi, [&](int64_t r, int64_t) {
      const float dot = exact_dot(steps, lut, a.rows.packed + r * a.rows.row_bytes);
      best.push(finish(a.rows, r, dot, s.constant), r, s.constant);
    });
  }
}

// Size of one query's float tables.
inline size_t table_entries(const Plan& plan) { return static_cast<size_t>(plan.offset[plan.n_steps]); }

#ifdef TQVEC_X86
// ------------------------------------------------------------------------------------------ AVX2 kernel
struct QuantizedTables {
  std::vector<uint8_t> lut;  // (n_steps, 16)
  float inv_scale = 0.0f;    // dot ~= sum of entries * inv_scale + offset
  float offset = 0.0f;
};

// 8-bit tables with one scale for all steps (the sum must share it) and one offset per step.
void quantize_tables(const Plan& plan, const float* lut, QuantizedTables& q) {
  q.lut.assign(static_cast<size_t>(plan.n_steps) * kLut, 0);
  float span = 0.0f;
  double offset = 0.0;
  for (int t = 0; t < plan.n_steps; ++t) {
    const float* row = lut + plan.offset[t];
    float lo = row[0], hi = row[0];
    for (int c = 1, used = 1 << plan.width[t]; c < used; ++c) {
      lo = std::min(lo, row[c]);
      hi = std::max(hi, row[c]);
    }
    offset += lo;
    span = std::max(span, hi - lo);
  }
  const float scale = span > 0.0f ? 255.0f / span : 0.0f;
  for (int t = 0; t < plan.n_steps; ++t) {
    const float* row = lut + plan.offset[t];
    float lo = row[0];
    const int used = 1 << plan.width[t];
    for (int c = 1; c < used; ++c) lo = std::min(lo, row[c]);
    uint8_t* out = q.lut.data() + t * kLut;
    for (int c = 0; c < used; ++c) out[c] = static_cast<uint8_t>(std::min(255.0f, (row[c] - lo) * scale + 0.5f));
  }
  q.inv_scale = scale > 0.0f ? 1.0f / scale : 0.0f;
  q.offset = static_cast<float>(offset);
}

// One step's 8-bit table in both 128-bit lanes.
struct alignas(32) Lut32 {
  uint8_t bytes[32];
};

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

// Byte-major copy of 32 rows: block[j * 32 + r] = byte j of row r (rows 16..31 in the upper 128-bit lane).
// Reads 16-byte chunks of each row, so every row pointer must have chunks * 16 readable bytes.
__attribute__((target("avx2,fma"))) void transpose_rows(const uint8_t* const* rows, int64_t chunks, uint8_t* block) {
  __m256i x[16], y[16];
  for (int64_t c = 0; c < chunks; ++c) {
    for (int r = 0; r < 16; ++r) {
      const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + 16 * c));
      const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r + 16] + 16 * c));
      x[r] = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    }
    for (int round = 0; round < 4; ++round) {  // four perfect shuffles transpose 16 x 16 bytes per lane
      for (int i = 0; i < 8; ++i) {
        y[2 * i] = _mm256_unpacklo_epi8(x[i], x[i + 8]);
        y[2 * i + 1] = _mm256_unpackhi_epi8(x[i], x[i + 8]);
      }
      std::memcpy(x, y, sizeof(x));
    }
    for (int j = 0; j < 16; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(block + (16 * c + j) * kRowsPerBlock), x[j]);
  }
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

// Adds the table entries of `count` consecutive nibble pairs into the 16-bit sums (count <= kFlushSteps / 2).
__attribute__((target("avx2,fma"))) inline void add_pairs(const uint8_t* bytes, const Lut32* luts, int count, __m256i& acc_a,
                                                      __m256i& acc_b) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256i a = acc_a, b = acc_b;
  for (int i = 0; i < count; ++i) {
    const __m256i codes = load32(bytes + i * kRowsPerBlock);
    const __m256i low = _mm256_shuffle_epi8(load32(luts[2 * i].bytes), _mm256_and_si256(codes, nibble));
    const __m256i high = _mm256_shuffle_epi8(load32(luts[2 * i + 1].bytes), _mm256_and_si256(_mm256_srli_epi16(codes, 4), nibble));
    a = _mm256_add_epi16(a, _mm256_add_epi16(low, high));
    b = _mm256_add_epi16(b, _mm256_add_epi16(_mm256_srli_epi16(low, 8), _mm256_srli_epi16(high, 8)));
  }
  acc_a = a;
  acc_b = b;
}

// Sums of the quantized table entries of 32 transposed rows: sums[r] for row r.
__attribute__((target("avx2,fma"))) void block_sums(const uint8_t* block, const StepOps& ops, const Lut32* luts,
                                                uint32_t* sums) {
  __m256i acc_a = _mm256_setzero_si256(), acc_b = _mm256_setzero_si256();
  __m256i wide[4] = {acc_a, acc_a, acc_a, acc_a};
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
  for (const SingleOp& op : ops.singles) {
    if (pending == kFlushSteps) {
      widen_sums(acc_a, acc_b, wide);
      pending = 0;
    }
    const __m256i b0 = load32(block + op.byte_offset);
    __m256i code = _mm256_and_si256(_mm256_srl_epi16(b0, _mm_cvtsi32_si128(op.shift)), load32(op.low_mask));
    if (op.straddle) {
      const __m256i up = _mm256_sll_epi16(load32(block + op.byte_offset + kRowsPerBlock), _mm_cvtsi32_si128(8 - op.shift));
      code = _mm256_or_si256(code, _mm256_and_si256(up, load32(op.high_mask)));
    }
    const __m256i v = _mm256_shuffle_epi8(load32(luts[op.lut].bytes), code);
    acc_a = _mm256_add_epi16(acc_a, v);
    acc_b = _mm256_add_epi16(acc_b, _mm256_srli_epi16(v, 8));
    ++pending;
  }
  widen_sums(acc_a, acc_b, wide);
  alignas(32) uint32_t part[4][8];
  for (int i = 0; i < 4; ++i) _mm256_store_si256(reinterpret_cast<__m256i*>(part[i]), wide[i]);
  for (int m = 0; m < 8; ++m) {
    sums[2 * m] = part[0][m];
    sums[16 + 2 * m] = part[1][m];
    sums[2 * m + 1] = part[2][m];
    sums[17 + 2 * m] = part[3][m];
  }
}

// Per-thread buffers of the AVX2 scan.
struct Scratch {
  int64_t chunks = 0;
  std::vector<uint8_t> storage;     // transposed block (+ one zero byte row, + alignment)
  uint8_t* block = nullptr;
  std::vector<uint8_t> zero_row;    // a row of zeros standing in for missing rows
  std::vector<uint8_t> tail;        // rows near the end of the array, padded to whole chunks

  Scratch(const Rows& rows) {
    chunks = (rows.row_bytes + 15) / 16;
    storage.assign(static_cast<size_t>((16 * chunks + 1) * kRowsPerBlock + 32), 0);
    const uintptr_t p = reinterpret_cast<uintptr_t>(storage.data());
    block = storage.data() + ((32 - p % 32) % 32);
    zero_row.assign(static_cast<size_t>(16 * chunks), 0);
  }
};

// Rows r >= safe_rows may sit too close to the array end for whole-chunk reads: read them from a padded copy.
struct RowSource {
  const Rows& rows;
  int64_t safe_rows;
  const uint8_t* tail;  // rows [safe_rows, n) padded

  const uint8_t* row(int64_t r) const {
    return r < safe_rows ? rows.packed + r * rows.row_bytes : tail + (r - safe_rows) * rows.row_bytes;
  }
};

// Scans the rows of work item `w` for each of its queries (tables `luts`, one table set per query): each block
// of 32 rows is transposed once and looked up for every query of the group.
__attribute__((target("avx2,fma"))) void scan_avx2(const SearchArgs& a, const Work& w, const float* luts,
                                                   std::vector<BestRows>& best, Scratch& scratch, const RowSource& source,
                                                   const StepOps& ops) {
  const int64_t group = w.query_end - w.query;
  std::vector<QuantizedTables> q(group);
  std::vector<Lut32> tables(static_cast<size_t>(group * a.plan.n_steps));
  for (int64_t j = 0; j < group; ++j) {
    quantize_tables(a.plan, luts + j * table_entries(a.plan), q[j]);
    for (int t = 0; t < a.plan.n_steps; ++t) {
      Lut32& lut = tables[j * a.plan.n_steps + t];
      std::memcpy(lut.bytes, q[j].lut.data() + t * kLut, kLut);
      std::memcpy(lut.bytes + kLut, q[j].lut.data() + t * kLut, kLut);
    }
  }
  const uint8_t* rows[kRowsPerBlock];
  int64_t ids[kRowsPerBlock];
  alignas(32) float scale[kRowsPerBlock], shift[kRowsPerBlock], score[kRowsPerBlock];
  alignas(32) uint32_t sums[kRowsPerBlock];
  for (const GroupSpan& s : spans_of(a, w)) {
    for (int64_t start = s.lo; start < s.hi; start += kRowsPerBlock) {
      const int filled = static_cast<int>(std::min<int64_t>(kRowsPerBlock, s.hi - start));
      for (int i = 0; i < filled; ++i) {
        const int64_t r = a.groups.list_rows ? a.groups.list_rows[start + i] : start + i;
        rows[i] = source.row(r);
        ids[i] = r;
        scale[i] = a.rows.scale ? a.rows.scale[r] : 1.0f;
        shift[i] = (a.rows.bias ? a.rows.bias[r] : 0.0f) + s.constant;
      }
      for (int i = filled; i < kRowsPerBlock; ++i) {
        rows[i] = scratch.zero_row.data();
        scale[i] = 0.0f;
        shift[i] = kNegInf;  // never passes the threshold test
      }
      transpose_rows(rows, scratch.chunks, scratch.block);
      for (int64_t j = 0; j < group; ++j) {
        block_sums(scratch.block, ops, tables.data() + j * a.plan.n_steps, sums);
        const __m256 inv_scale = _mm256_set1_ps(q[j].inv_scale), offset = _mm256_set1_ps(q[j].offset);
        const __m256 threshold = _mm256_set1_ps(best[j].threshold());
        for (int g = 0; g < kRowsPerBlock; g += 8) {
          const __m256 dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(load32(sums + g)), inv_scale, offset);
          const __m256 value = _mm256_fmadd_ps(dot, _mm256_load_ps(scale + g), _mm256_load_ps(shift + g));
          _mm256_store_ps(score + g, value);
          int passing = _mm256_movemask_ps(_mm256_cmp_ps(value, threshold, _CMP_GT_OQ));
          while (passing) {
            const int i = g + __builtin_ctz(passing);
            passing &= passing - 1;
            best[j].push(score[i], ids[i], s.constant);
          }
        }
      }
    }
  }
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

// Runs f(begin, end) over [0, n) split in contiguous ranges on up to `threads` threads (inline for one).
template <class F>
void parallel_for(size_t n, int threads, F&& f) {
  const size_t workers = std::min<size_t>(static_cast<size_t>(std::max(1, threads)), n);
  if (workers <= 1) {
    f(size_t{0}, n);
    return;
  }
  std::vector<std::thread> pool;
  for (size_t t = 0; t < workers; ++t) pool.emplace_back(f, n * t / workers, n * (t + 1) / workers);
  for (auto& th : pool) th.join();
}

}  // namespace

bool has_avx2() {
#ifdef TQVEC_X86
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

const char* search(const SearchArgs& a, bool allow_simd) {
  const bool narrow = std::all_of(a.plan.width, a.plan.width + a.plan.n_steps, [](int32_t w) { return w <= 4; });
  const bool simd = allow_simd && narrow && has_avx2() && a.rescore > 0;
  const int threads = std::max(1, a.threads);
  const bool flat = a.groups.probe == nullptr;  // every query scans the one group
  // Work items: without probe, groups of up to kQueryGroup queries share each transposed block, and when there
  // are too few groups for the threads the rows are split too; with probe, one query per item, its probed
  // groups split across items when there are fewer queries than threads.
  const int64_t group = flat && simd ? std::min<int64_t>(kQueryGroup, std::max<int64_t>(1, a.nq / threads)) : 1;
  const int64_t items = (a.nq + group - 1) / group;
  const int64_t parts = items >= threads ? 1 : std::max<int64_t>(1, threads / std::max<int64_t>(1, items));
  std::vector<Work> work;
  for (int64_t q = 0; q < a.nq; q += group) {
    for (int64_t p = 0; p < parts; ++p) {
      Work w{q, std::min(a.nq, q + group), 0, a.groups.n_probe, 0, 0};
      if (parts > 1 && flat) {
        const int64_t lo = a.groups.offsets[0], hi = a.groups.offsets[1];
        w.row_begin = lo + (hi - lo) * p / parts;
        w.row_end = lo + (hi - lo) * (p + 1) / parts;
        if (w.row_end <= w.row_begin) continue;
      } else if (parts > 1) {
        w.probe_begin = a.groups.n_probe * p / parts;
        w.probe_end = a.groups.n_probe * (p + 1) / parts;
        if (w.probe_end <= w.probe_begin) continue;
      }
      work.push_back(w);
    }
  }
  const int64_t keep = simd ? std::max(a.k, a.rescore) : a.k;
  const ExactSteps exact = exact_steps(a.plan);
  std::vector<std::vector<std::vector<Candidate>>> found(work.size());  // per item, per query of the item

#ifdef TQVEC_X86
  const StepOps ops = simd ? step_ops(a.plan) : StepOps{};
  // rows whose last chunk would read past the array: a padded copy
  const int64_t chunk_bytes = 16 * ((a.rows.row_bytes + 15) / 16);
  const int64_t unsafe = a.rows.row_bytes ? std::min<int64_t>(a.rows.n, (chunk_bytes + a.rows.row_bytes - 1) / a.rows.row_bytes) : 0;
  std::vector<uint8_t> tail(static_cast<size_t>(unsafe * a.rows.row_bytes + chunk_bytes), 0);
  if (unsafe) std::memcpy(tail.data(), a.rows.packed + (a.rows.n - unsafe) * a.rows.row_bytes, unsafe * a.rows.row_bytes);
  const RowSource source{a.rows, a.rows.n - unsafe, tail.data()};
#endif

  auto scan_items = [&](size_t begin, size_t end) {
    std::vector<float> luts(table_entries(a.plan) * static_cast<size_t>(group));
#ifdef TQVEC_X86
    Scratch scratch(a.rows);
#endif
    for (size_t i = begin; i < end; ++i) {
      const Work& w = work[i];
      for (int64_t q = w.query; q < w.query_end; ++q)
        float_tables(a.plan, a.queries + q * a.dim, luts.data() + (q - w.query) * table_entries(a.plan));
      std::vector<BestRows> best(static_cast<size_t>(w.query_end - w.query), BestRows(keep));
#ifdef TQVEC_X86
      if (simd) {
        scan_avx2(a, w, luts.data(), best, scratch, source, ops);
      } else {
        scan_exact(a, exact, w, luts.data(), best[0]);
      }
#else
      scan_exact(a, exact, w, luts.data(), best[0]);
#endif
      for (BestRows& b : best) found[i].push_back(std::move(b.items()));
    }
  };
  // Merge the items of each query; with SIMD, re-score the candidates exactly.
  std::vector<size_t> first_item(static_cast<size_t>(a.nq) + 1, work.size());
  for (size_t i = work.size(); i-- > 0;)
    for (int64_t q = work[i].query; q < work[i].query_end; ++q) first_item[q] = i;
  auto merge_queries = [&](size_t begin, size_t end) {
    std::vector<float> lut(table_entries(a.plan));
    for (size_t q = begin; q < end; ++q) {
      std::vector<Candidate> cands;
      for (size_t i = first_item[q]; i < work.size() && work[i].query <= static_cast<int64_t>(q); ++i)
        if (static_cast<int64_t>(q) < work[i].query_end) {
          const auto& part = found[i][q - work[i].query];
          cands.insert(cands.end(), part.begin(), part.end());
        }
      if (simd && !cands.empty()) {
        float_tables(a.plan, a.queries + q * a.dim, lut.data());
        for (Candidate& c : cands)
          c.score = finish(a.rows, c.row, exact_dot(exact, lut.data(), a.rows.packed + c.row * a.rows.row_bytes), c.constant);
      }
      write_best(a.k, cands, a.out_values + q * a.k, a.out_rows + q * a.k);
    }
  };
  parallel_for(work.size(), threads, scan_items);
  parallel_for(static_cast<size_t>(a.nq), threads, merge_queries);
  return simd ? "avx2" : "scalar";
}

}  // namespace tqvec
