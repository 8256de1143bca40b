#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "vector_math.h"

namespace tqvec {

// Decodes a packed row into the levels of its channels (channels no step covers stay 0). A byte read only by
// steps that stay inside it and cover consecutive channels in bit order (4-, 2- and 1-bit codes) is decoded by one
// look-up in a 256-entry table of its channels' levels (tables of equal content are shared: one per segment);
// 3-bit codes in groups of 8 channels per 3 bytes two channels per look-up in a table of 64 level pairs; every
// other step (5- to 8-bit codes, other codes across a byte boundary) reads its code and levels on its own.
class RowDecoder {
 public:
  explicit RowDecoder(const Plan& plan) {
    int32_t n_bytes = 0;
    for (int t = 0; t < plan.n_steps; ++t) n_bytes = std::max(n_bytes, plan.byte[t] + 2);
    std::vector<std::vector<int>> readers(static_cast<size_t>(n_bytes));
    std::vector<bool> shared(static_cast<size_t>(n_bytes), false);  // read by a step that crosses a byte boundary
    for (int t = 0; t < plan.n_steps; ++t) {
      readers[plan.byte[t]].push_back(t);
      if (plan.shift[t] + plan.width[t] > 8) shared[plan.byte[t]] = shared[plan.byte[t] + 1] = true;
    }
    for (int32_t b = 0; b < n_bytes; ++b) {
      std::vector<int>& steps = readers[b];
      if (steps.empty()) continue;
      std::sort(steps.begin(), steps.end(), [&](int x, int y) { return plan.shift[x] < plan.shift[y]; });
      std::vector<int32_t> channels;
      bool whole = !shared[b];
      int32_t bit = 0;
      for (int t : steps) {
        whole = whole && plan.shift[t] == bit;
        bit += plan.width[t];
        for (int j = 0; j < kMaxStepChannels && plan.channel[t * kMaxStepChannels + j] >= 0; ++j)
          channels.push_back(plan.channel[t * kMaxStepChannels + j]);
      }
      for (size_t j = 1; whole && j < channels.size(); ++j) whole = channels[j] == channels[0] + static_cast<int32_t>(j);
      if (whole && !channels.empty()) {
        add_byte(plan, b, steps, channels);
      } else {
        for (int t : steps) add_step(plan, t);
      }
    }
    // the common case (4-, 2- or 1-bit codes of one codebook): byte i holds channels [i * count, (i + 1) * count)
    bool uniform = steps_.empty() && tables_.size() == 1 && !bytes_.empty();
    for (size_t i = 0; uniform && i < bytes_.size(); ++i) {
      const ByteOp& op = bytes_[i];
      uniform = op.byte == static_cast<int32_t>(i) && op.count == bytes_[0].count && op.first_channel == op.byte * op.count;
    }
    if (uniform) uniform_count_ = bytes_[0].count;
    // 5-, 6- or 7-bit codes of one codebook packed in channel order: 8 channels per `width` bytes (3-bit codes:
    // take_three_bit_runs, wherever they stand)
    const int32_t width = steps_.empty() ? 0 : static_cast<int32_t>(__builtin_popcount(steps_[0].mask));
    bool packed = bytes_.empty() && !steps_.empty() && steps_.size() % 8 == 0 && width >= 5 && width <= 7;
    for (size_t t = 0; packed && t < steps_.size(); ++t) {
      const Step& st = steps_[t];
      packed = st.channel[0] == static_cast<int32_t>(t) && st.channel[1] < 0 && st.mask == steps_[0].mask &&
               st.byte * 8 + st.shift == width * static_cast<int32_t>(t) &&
               std::equal(st.level, st.level + st.size, steps_[0].level);  // one codebook
    }
    if (packed) packed_width_ = width;
    take_three_bit_runs();
  }

  // How a `dim`-channel row (a multiple of 8) decodes 8 channels at a time from one table (vector_table): 2, 4 or 8
  // where every byte is one look-up of that many levels, in channel order; 3 where the row is 3-bit codes of one
  // codebook in channel order (8 channels per 3 bytes, two per look-up of a level pair); else 0.
  int vector_kind(int64_t dim) const {
    if (dim % 8) return 0;
    const bool wide = uniform_count_ == 2 || uniform_count_ == 4 || uniform_count_ == 8;  // not 8-bit codes (1 per byte)
    if (wide && static_cast<int64_t>(bytes_.size()) * uniform_count_ == dim) return uniform_count_;
    if (!bytes_.empty() || !steps_.empty() || runs_.empty()) return 0;
    int64_t groups = 0;  // the runs must follow each other from byte 0 and share one pair table
    for (const Run& run : runs_) {
      if (run.byte != 3 * groups || run.channel != 8 * groups || run.pairs != runs_[0].pairs) return 0;
      groups += run.groups;
    }
    return 8 * groups == dim ? 3 : 0;
  }
  // That table: per byte value its levels (kinds 2, 4, 8), or the run's 64 level pairs (kind 3).
  const float* vector_table() const { return uniform_count_ ? tables_[0].data() : pairs_[runs_[0].pairs].data(); }

  void decode(const uint8_t* row, float* out) const {
    switch (uniform_count_) {
      case 2: return decode_uniform<2>(row, out);
      case 4: return decode_uniform<4>(row, out);
      case 8: return decode_uniform<8>(row, out);
      default: break;
    }
    switch (packed_width_) {
      case 5: return decode_packed<5>(row, out);
      case 6: return decode_packed<6>(row, out);
      case 7: return decode_packed<7>(row, out);
      default: break;
    }
    for (const ByteOp& op : bytes_) {
      const float* levels = tables_[op.table].data() + static_cast<size_t>(row[op.byte]) * op.count;
      for (int32_t j = 0; j < op.count; ++j) out[op.first_channel + j] = levels[j];
    }
    for (const Run& run : runs_) {  // two channels per look-up in the run's 64 level pairs
      const float* pairs = pairs_[run.pairs].data();
      for (int32_t i = 0; i < run.groups; ++i) {
        const uint8_t* p = row + run.byte + 3 * i;
        const uint32_t bits = p[0] | (p[1] << 8) | (p[2] << 16);  // byte by byte: no partial store to wait on
        float* o = out + run.channel + 8 * i;
        for (int j = 0; j < 4; ++j) std::memcpy(o + 2 * j, pairs + 2 * ((bits >> (6 * j)) & 63u), 2 * sizeof(float));
      }
    }
    for (const Step& s : steps_) {
      unsigned bits = row[s.byte];
      if (s.straddle) bits |= static_cast<unsigned>(row[s.byte + 1]) << 8;
      const unsigned code = (bits >> s.shift) & s.mask;
      for (int j = 0; j < kMaxStepChannels && s.channel[j] >= 0; ++j) out[s.channel[j]] = s.level[j * s.size + code];
    }
  }

 private:
  // decode() where every byte is one look-up of `count` levels in the one table, in byte order
  template <int count>
  void decode_uniform(const uint8_t* row, float* out) const {
    const float* table = tables_[0].data();
    const size_t n = bytes_.size();
    for (size_t i = 0; i < n; ++i) std::memcpy(out + i * count, table + static_cast<size_t>(row[i]) * count, count * sizeof(float));
  }

  // decode() of `width`-bit codes in channel order (packed_width_): each group of 8 channels is `width` bytes
  template <int width>
  void decode_packed(const uint8_t* row, float* out) const {
    constexpr uint64_t mask = (1u << width) - 1u;
    const float* level = steps_[0].level;
    const size_t groups = steps_.size() / 8;
    for (size_t i = 0; i < groups; ++i) {
      uint64_t bits = 0;  // byte by byte: a short memcpy into it is a partial store its wide read then waits on
      for (int j = 0; j < width; ++j) bits |= static_cast<uint64_t>(row[i * width + j]) << (8 * j);
      for (int j = 0; j < 8; ++j) out[i * 8 + j] = level[(bits >> (width * j)) & mask];
    }
  }

  struct ByteOp {
    int32_t byte, first_channel, count, table;
  };
  struct Step {
    int32_t byte, shift, size;
    bool straddle;
    unsigned mask;
    const float* level;
    int32_t channel[kMaxStepChannels];
  };

  void add_byte(const Plan& plan, int32_t b, const std::vector<int>& steps, const std::vector<int32_t>& channels) {
    const int32_t count = static_cast<int32_t>(channels.size());
    std::vector<float> table(static_cast<size_t>(256 * count));
    for (unsigned v = 0; v < 256; ++v) {
      float* out = table.data() + v * count;
      for (int t : steps) {
        const int32_t size = plan.offset[t + 1] - plan.offset[t];
        const float* level = plan.level + static_cast<size_t>(kMaxStepChannels) * plan.offset[t];
        const unsigned code = (v >> plan.shift[t]) & ((1u << plan.width[t]) - 1u);
        for (int j = 0; j < kMaxStepChannels && plan.channel[t * kMaxStepChannels + j] >= 0; ++j) *out++ = level[j * size + code];
      }
    }
    int32_t index = 0;
    while (index < static_cast<int32_t>(tables_.size()) && tables_[index] != table) ++index;
    if (index == static_cast<int32_t>(tables_.size())) tables_.push_back(std::move(table));
    bytes_.push_back({b, channels[0], count, index});
  }

  void add_step(const Plan& plan, int t) {
    Step s;
    s.byte = plan.byte[t];
    s.shift = plan.shift[t];
    s.straddle = plan.shift[t] + plan.width[t] > 8;
    s.mask = (1u << plan.width[t]) - 1u;
    s.size = plan.offset[t + 1] - plan.offset[t];
    s.level = plan.level + static_cast<size_t>(kMaxStepChannels) * plan.offset[t];
    for (int j = 0; j < kMaxStepChannels; ++j) s.channel[j] = plan.channel[t * kMaxStepChannels + j];
    steps_.push_back(s);
  }

  std::vector<ByteOp> bytes_;
  std::vector<Step> steps_;
  std::vector<std::vector<float>> tables_;
  int32_t uniform_count_ = 0;  // 2, 4 or 8 where decode_uniform applies
  // Moves the 3-bit steps that form groups of 8 channels in 3 bytes (a byte boundary first, channels and bits
  // consecutive, one codebook) from steps_ into runs_ of consecutive groups.
  void take_three_bit_runs() {
    std::vector<Step> rest;
    for (size_t t = 0; t < steps_.size();) {
      if (!three_bit_group(t)) {
        rest.push_back(steps_[t++]);
        continue;
      }
      const Step& first = steps_[t];
      Run* last = runs_.empty() ? nullptr : &runs_.back();
      const bool extends = last && last->byte + 3 * last->groups == first.byte &&
                           last->channel + 8 * last->groups == first.channel[0] && last->level == first.level;
      if (extends) {
        ++last->groups;
      } else {
        runs_.push_back({first.byte, first.channel[0], 1, pair_table(first.level), first.level});
      }
      t += 8;
    }
    steps_ = std::move(rest);
  }

  // True when steps_[t .. t + 8) are one group of a 3-bit run.
  bool three_bit_group(size_t t) const {
    if (t + 8 > steps_.size() || steps_[t].shift != 0) return false;
    const Step& first = steps_[t];
    for (int i = 0; i < 8; ++i) {
      const Step& s = steps_[t + i];
      if (s.mask != 7u || s.channel[1] >= 0 || s.channel[0] != first.channel[0] + i ||
          8 * s.byte + s.shift != 8 * first.byte + 3 * i || !std::equal(s.level, s.level + 8, first.level))
        return false;
    }
    return true;
  }

  // The index in pairs_ of the 64 level pairs (low code first) of two consecutive 3-bit codes of `level`.
  int32_t pair_table(const float* level) {
    std::vector<float> pairs;
    for (unsigned v = 0; v < 64; ++v) {
      pairs.push_back(level[v & 7u]);
      pairs.push_back(level[v >> 3]);
    }
    int32_t index = 0;
    while (index < static_cast<int32_t>(pairs_.size()) && pairs_[index] != pairs) ++index;
    if (index == static_cast<int32_t>(pairs_.size())) pairs_.push_back(std::move(pairs));
    return index;
  }

  struct Run {
    int32_t byte, channel, groups, pairs;
    const float* level;
  };

  int32_t packed_width_ = 0;              // 5, 6 or 7 where decode_packed applies
  std::vector<Run> runs_;                 // 3-bit codes, 8 channels per 3 bytes
  std::vector<std::vector<float>> pairs_;  // per run codebook: the levels of 6-bit code pairs (low code first)
};

std::shared_ptr<const RowDecoder> row_decoder(const Plan& plan) { return std::make_shared<const RowDecoder>(plan); }

namespace {

// <a, b> over n floats in 8 independent partial sums (a reduction the compiler can vectorize, 8 lanes wide in
// one_head_avx2).
__attribute__((always_inline)) inline float dot(const float* a, const float* b, int64_t n) {
  float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t c = 0;
  for (; c + 8 <= n; c += 8)
    for (int j = 0; j < 8; ++j) part[j] += a[c + j] * b[c + j];
  float total = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
  for (; c < n; ++c) total += a[c] * b[c];
  return total;
}

// Decodes token r of `head` from every segment into `row` (each at its first channel) and returns the scale its
// levels still need: the one segment's, or 1 when there are `several` (each segment's levels already carry theirs).
__attribute__((always_inline)) inline float decode_token(const std::vector<CodedTokens>& segments, int64_t head, int64_t r,
                                                         bool several, float* row) {
  float scale = 1.0f;
  for (size_t s = 0; s < segments.size(); ++s) {
    const CodedTokens& seg = segments[s];
    float* out = row + seg.first;
    seg.decoder->decode(seg.packed + head * seg.head_stride + r * seg.row_bytes, out);
    scale = seg.scale[head * seg.scale_stride + r];
    if (several)
      for (int64_t c = 0; c < seg.dim; ++c) out[c] *= scale;
  }
  return several ? 1.0f : scale;
}

// Turns one head's logits (G rows of n; masked tokens set to -inf here) into exp(logit - max) in place and writes the
// head's max and sum, with its value sums zeroed for the caller to add to.
inline void softmax_rows(const DecodeArgs& a, float* logits, const uint8_t* valid, int64_t head) {
  const int64_t G = a.group, n = a.n, vd = a.value_dim;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < G; ++g) {
    float* lg = logits + g * n;
    if (valid)
      for (int64_t r = 0; r < n; ++r)
        if (!valid[r]) lg[r] = kNegInf;
    const float m = n ? *std::max_element(lg, lg + n) : kNegInf;
    float total = 0.0f;
    if (m != kNegInf) {
      for (int64_t r = 0; r < n; ++r) total += (lg[r] = std::exp(lg[r] - m));
    } else {
      std::fill(lg, lg + n, 0.0f);
    }
    a.max[head * G + g] = m;
    a.sum[head * G + g] = total;
    std::fill(a.acc + (head * G + g) * vd, a.acc + (head * G + g + 1) * vd, 0.0f);
  }
}

// One head's online-softmax state; always inlined, so one_head and one_head_avx2 compile it for their own ISA.
__attribute__((always_inline)) inline void one_head_with(const DecodeArgs& a, int64_t head) {
  const int64_t G = a.group, n = a.n, kd = a.key_dim, vd = a.value_dim;
  std::vector<float> row(static_cast<size_t>(std::max(kd, vd)), 0.0f), logits(static_cast<size_t>(G * n), 0.0f);
  const float* q = a.queries + head * G * kd;
  const uint8_t* valid = a.valid ? a.valid + (head / a.heads_per_batch) * a.valid_stride : nullptr;
  // A token's segments are decoded side by side into one row (each segment's levels times its scale where there are
  // several), which then meets the G queries in one product over the segments' channels.
  const bool several_keys = a.keys.size() > 1, several_values = a.values.size() > 1;
  const int64_t key_first = several_keys ? 0 : a.keys[0].first, key_width = several_keys ? kd : a.keys[0].dim;
  for (int64_t r = 0; r < n; ++r) {
    if (valid && !valid[r]) continue;
    const float scale = decode_token(a.keys, head, r, several_keys, row.data());
    for (int64_t g = 0; g < G; ++g) logits[g * n + r] = scale * dot(q + g * kd + key_first, row.data() + key_first, key_width);
  }
  softmax_rows(a, logits.data(), valid, head);
  std::fill(row.begin(), row.end(), 0.0f);
  const int64_t value_first = several_values ? 0 : a.values[0].first, value_width = several_values ? vd : a.values[0].dim;
  for (int64_t r = 0; r < n; ++r) {
    if (valid && !valid[r]) continue;
    const float scale = decode_token(a.values, head, r, several_values, row.data());
    for (int64_t g = 0; g < G; ++g) {
      const float w = logits[g * n + r] * scale;
      float* __restrict__ acc = a.acc + (head * G + g) * vd + value_first;
      const float* __restrict__ levels = row.data() + value_first;
      for (int64_t c = 0; c < value_width; ++c) acc[c] += w * levels[c];
    }
  }
}

void one_head(const DecodeArgs& a, int64_t head) {
  one_head_with(a, head);
}

#if defined(__x86_64__) || defined(_M_X64)
// one_head with 8-lane FMA products and sums (AVX2 + FMA).
__attribute__((target("avx2,fma"))) void one_head_avx2(const DecodeArgs& a, int64_t head) {
  one_head_with(a, head);
}

// Levels of channels [8 * j, 8 * j + 8) of a row of RowDecoder::vector_kind `kind`, gathered from its table straight
// into a register: no decoded row is stored and read back (a wide read of several narrow stores waits for them).
template <int kind>
__attribute__((target("avx2,fma"), always_inline)) inline __m256 levels8(const float* table, const uint8_t* row, int64_t j) {
  if constexpr (kind == 8) {
    return _mm256_loadu_ps(table + 8 * static_cast<size_t>(row[j]));
  } else if constexpr (kind == 4) {
    const __m128 low = _mm_loadu_ps(table + 4 * static_cast<size_t>(row[2 * j]));
    const __m128 high = _mm_loadu_ps(table + 4 * static_cast<size_t>(row[2 * j + 1]));
    return _mm256_insertf128_ps(_mm256_castps128_ps256(low), high, 1);
  } else {
    static_assert(kind == 2 || kind == 3, "vector kinds are 2, 3, 4 and 8");
    size_t pair[4];  // four level pairs: one byte each (kind 2), or 6-bit fields of three bytes (kind 3)
    if constexpr (kind == 2) {
      for (int i = 0; i < 4; ++i) pair[i] = row[4 * j + i];
    } else {
      const uint8_t* p = row + 3 * j;
      const uint32_t bits = p[0] | (p[1] << 8) | (p[2] << 16);
      for (int i = 0; i < 4; ++i) pair[i] = (bits >> (6 * i)) & 63u;
    }
    auto at = [&](int i) { return reinterpret_cast<const double*>(table + 2 * pair[i]); };
    const __m128d low = _mm_loadh_pd(_mm_load_sd(at(0)), at(1));
    const __m128d high = _mm_loadh_pd(_mm_load_sd(at(2)), at(3));
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_castpd_ps(low)), _mm_castpd_ps(high), 1);
  }
}

// <q, levels> over `vectors` vectors of 8 channels (two partial sums).
__attribute__((target("avx2,fma"), always_inline)) inline float dot_vectors(const float* q, const __m256* levels,
                                                                           int64_t vectors) {
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 2 <= vectors; j += 2) {
    even = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * j), levels[j], even);
    odd = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * j + 8), levels[j + 1], odd);
  }
  if (j < vectors) even = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * j), levels[j], even);
  return lane_sum(_mm256_add_ps(even, odd));
}

// Most vectors of 8 channels that one token's segments hold in vector_head_with.
constexpr int64_t kMaxRowVectors = 64;

// One segment as vector_head_with reads it: its RowDecoder::vector_kind and table.
struct VectorSegment {
  int kind;
  const float* table;
};

// Levels of `vectors` vectors of a row of kind `kind`, each times `factor`, into `out`.
template <int kind>
__attribute__((target("avx2,fma"), always_inline)) inline void scaled_levels(const float* table, const uint8_t* row,
                                                                            int64_t vectors, __m256 factor, __m256* out) {
  for (int64_t j = 0; j < vectors; ++j) out[j] = _mm256_mul_ps(levels8<kind>(table, row, j), factor);
}

// Token r's levels of one head, every segment's side by side, each times its own scale: the
// scale still due is 1.
struct SegmentsGather {
  const std::vector<CodedTokens>& segments;
  const std::vector<VectorSegment>& kinds;
  int64_t head;

  __attribute__((target("avx2,fma"), always_inline)) float operator()(int64_t r, __m256* levels) const {
    for (size_t s = 0; s < segments.size(); ++s) {
      const CodedTokens& seg = segments[s];
      const uint8_t* row = seg.packed + head * seg.head_stride + r * seg.row_bytes;
      const __m256 factor = _mm256_set1_ps(seg.scale[head * seg.scale_stride + r]);
      const int64_t vectors = seg.dim / 8;
      switch (kinds[s].kind) {
        case 8: scaled_levels<8>(kinds[s].table, row, vectors, factor, levels); break;
        case 4: scaled_levels<4>(kinds[s].table, row, vectors, factor, levels); break;
        case 3: scaled_levels<3>(kinds[s].table, row, vectors, factor, levels); break;
        default: scaled_levels<2>(kinds[s].table, row, vectors, factor, levels); break;
      }
      levels += vectors;
    }
    return 1.0f;
  }
};

// Token r's levels of one head of the one segment `seg`, of kind `kind` known at compile time, unscaled: the scale
// still due is the token's.
template <int kind>
struct SingleGather {
  const float* table;
  const uint8_t* rows;
  const float* scale;
  int64_t row_bytes, vectors;

  SingleGather(const CodedTokens& seg, const VectorSegment& segment_kind, int64_t head)
      : table(segment_kind.table), rows(seg.packed + head * seg.head_stride), scale(seg.scale + head * seg.scale_stride),
        row_bytes(seg.row_bytes), vectors(seg.dim / 8) {}

  __attribute__((target("avx2,fma"), always_inline)) float operator()(int64_t r, __m256* levels) const {
    const uint8_t* row = rows + r * row_bytes;
    for (int64_t j = 0; j < vectors; ++j) levels[j] = levels8<kind>(table, row, j);
    return scale[r];
  }
};

// Token r's levels of one head over two segments of kinds k1 and k2 known at compile time, each times its own scale:
// the scale still due is 1.
template <int k1, int k2>
struct PairGather {
  SingleGather<k1> first;
  SingleGather<k2> second;

  __attribute__((target("avx2,fma"), always_inline)) float operator()(int64_t r, __m256* levels) const {
    scaled_levels<k1>(first.table, first.rows + r * first.row_bytes, first.vectors, _mm256_set1_ps(first.scale[r]),
                      levels);
    scaled_levels<k2>(second.table, second.rows + r * second.row_bytes, second.vectors,
                      _mm256_set1_ps(second.scale[r]), levels + first.vectors);
    return 1.0f;
  }
};

// One head's online-softmax state where each side's segments decode 8 channels at a time (RowDecoder::vector_kind;
// side by side from the first segment's channel, at most 8 * kMaxRowVectors channels a side): `keys` / `values`
// gather a token's `key_vectors` / `value_vectors` levels into registers and return the scale still due, and they
// meet the G queries (keys) or the softmax weights (values) there.
template <class KeyGather, class ValueGather>
__attribute__((target("avx2,fma"), always_inline)) inline void vector_head_with(const DecodeArgs& a, const KeyGather& keys,
                                                                               int64_t key_vectors, const ValueGather& values,
                                                                               int64_t value_vectors, int64_t head) {
  const int64_t G = a.group, n = a.n, kd = a.key_dim, vd = a.value_dim;
  const float* q = a.queries + head * G * kd + a.keys[0].first;
  const uint8_t* valid = a.valid ? a.valid + (head / a.heads_per_batch) * a.valid_stride : nullptr;
  std::vector<float> logits(static_cast<size_t>(G * n), 0.0f);
  __m256 levels[kMaxRowVectors];
  for (int64_t r = 0; r < n; ++r) {
    if (valid && !valid[r]) continue;
    const float scale = keys(r, levels);
    for (int64_t g = 0; g < G; ++g) logits[g * n + r] = scale * dot_vectors(q + g * kd, levels, key_vectors);
  }
  softmax_rows(a, logits.data(), valid, head);
  for (int64_t r = 0; r < n; ++r) {
    if (valid && !valid[r]) continue;
    const float scale = values(r, levels);
    for (int64_t g = 0; g < G; ++g) {
      const __m256 w = _mm256_set1_ps(logits[g * n + r] * scale);
      float* acc = a.acc + (head * G + g) * vd + a.values[0].first;
      for (int64_t j = 0; j < value_vectors; ++j)
        _mm256_storeu_ps(acc + 8 * j, _mm256_fmadd_ps(w, levels[j], _mm256_loadu_ps(acc + 8 * j)));
    }
  }
}

// vector_head_with for any other segments, their kinds read at run time (one switch per segment).
__attribute__((target("avx2,fma"))) void one_head_vectors_avx2(const DecodeArgs& a, const std::vector<VectorSegment>& key_kinds,
                                                               const std::vector<VectorSegment>& value_kinds, int64_t head) {
  int64_t key_vectors = 0, value_vectors = 0;
  for (const CodedTokens& seg : a.keys) key_vectors += seg.dim / 8;
  for (const CodedTokens& seg : a.values) value_vectors += seg.dim / 8;
  vector_head_with(a, SegmentsGather{a.keys, key_kinds, head}, key_vectors, SegmentsGather{a.values, value_kinds, head},
                   value_vectors, head);
}

// vector_head_with for one key and one value segment, of kinds kc and vc known at compile time.
template <int kc, int vc>
struct SingleHead {
  __attribute__((target("avx2,fma"))) static void run(const DecodeArgs& a, const std::vector<VectorSegment>& key_kinds,
                                                      const std::vector<VectorSegment>& value_kinds, int64_t head) {
    vector_head_with(a, SingleGather<kc>(a.keys[0], key_kinds[0], head), a.keys[0].dim / 8,
                     SingleGather<vc>(a.values[0], value_kinds[0], head), a.values[0].dim / 8, head);
  }
};

// vector_head_with for two segments a side, keys and values of the same kinds k1, k2 known at compile time.
template <int k1, int k2>
struct PairHead {
  __attribute__((target("avx2,fma"))) static void run(const DecodeArgs& a, const std::vector<VectorSegment>& key_kinds,
                                                      const std::vector<VectorSegment>& value_kinds, int64_t head) {
    const PairGather<k1, k2> keys{SingleGather<k1>(a.keys[0], key_kinds[0], head),
                                  SingleGather<k2>(a.keys[1], key_kinds[1], head)};
    const PairGather<k1, k2> values{SingleGather<k1>(a.values[0], value_kinds[0], head),
                                    SingleGather<k2>(a.values[1], value_kinds[1], head)};
    vector_head_with(a, keys, (a.keys[0].dim + a.keys[1].dim) / 8, values, (a.values[0].dim + a.values[1].dim) / 8,
                     head);
  }
};

using VectorHead = void (*)(const DecodeArgs&, const std::vector<VectorSegment>&, const std::vector<VectorSegment>&, int64_t);

// Head<first, second>::run for the kind `first` known at run time.
template <template <int, int> class Head, int second>
VectorHead with_first_kind(int first) {
  switch (first) {
    case 8: return Head<8, second>::run;
    case 4: return Head<4, second>::run;
    case 3: return Head<3, second>::run;
    default: return Head<2, second>::run;
  }
}

// Head<first, second>::run for kinds known at run time.
template <template <int, int> class Head>
VectorHead with_kinds(int first, int second) {
  switch (second) {
    case 8: return with_first_kind<Head, 8>(first);
    case 4: return with_first_kind<Head, 4>(first);
    case 3: return with_first_kind<Head, 3>(first);
    default: return with_first_kind<Head, 2>(first);
  }
}

// The head function for these segment kinds: SingleHead for one segment a side, PairHead for two of the same kinds
// a side (fractional rates), else one_head_vectors_avx2.
VectorHead vector_head(const std::vector<VectorSegment>& key_kinds, const std::vector<VectorSegment>& value_kinds) {
  if (key_kinds.size() == 1 && value_kinds.size() == 1) return with_kinds<SingleHead>(key_kinds[0].kind, value_kinds[0].kind);
  const bool same_pair = key_kinds.size() == 2 && value_kinds.size() == 2 && key_kinds[0].kind == value_kinds[0].kind &&
                         key_kinds[1].kind == value_kinds[1].kind;
  if (same_pair) return with_kinds<PairHead>(key_kinds[0].kind, key_kinds[1].kind);
  return one_head_vectors_avx2;
}

// The segments as the vector heads read them, or empty where those do not serve them all (a segment that does not
// decode 8 channels at a time, segments not side by side, more than kMaxRowVectors vectors).
std::vector<VectorSegment> vector_segments(const std::vector<CodedTokens>& segments) {
  std::vector<VectorSegment> out;
  int64_t vectors = 0;
  for (size_t s = 0; s < segments.size(); ++s) {
    const int kind = segments[s].decoder->vector_kind(segments[s].dim);
    const bool adjacent = s == 0 || segments[s].first == segments[s - 1].first + segments[s - 1].dim;
    vectors += segments[s].dim / 8;
    if (!kind || !adjacent || vectors > kMaxRowVectors) return {};
    out.push_back({kind, segments[s].decoder->vector_table()});
  }
  return out;
}
#endif

// Runs before(h), coded(h), after(h) for every head h, heads in parallel.
template <class Before, class Coded, class After>
void heads_in_parallel(const DecodeArgs& a, const Before& before, const Coded& coded, const After& after) {
  parallel_for(static_cast<size_t>(a.heads), a.threads, [&](size_t begin, size_t end) {
    for (auto h = static_cast<int64_t>(begin); h < static_cast<int64_t>(end); ++h) {
      before(h);
      coded(h);
      after(h);
    }
  });
}

// Runs, for every head h (heads in parallel), before(h), then h's coded tokens' online-softmax state, then after(h).
template <class Before, class After>
void for_each_head(const DecodeArgs& a, const Before& before, const After& after) {
#if defined(__x86_64__) || defined(_M_X64)
  if (has_avx2()) {
    const std::vector<VectorSegment> key_kinds = vector_segments(a.keys), value_kinds = vector_segments(a.values);
    if (!key_kinds.empty() && !value_kinds.empty()) {
      const VectorHead vector = vector_head(key_kinds, value_kinds);
      heads_in_parallel(a, before, [&](int64_t h) { vector(a, key_kinds, value_kinds, h); }, after);
      return;
    }
  }
#endif
  auto head = one_head;
#if defined(__x86_64__) || defined(_M_X64)
  if (has_avx2()) head = one_head_avx2;
#endif
  heads_in_parallel(a, before, [&](int64_t h) { head(a, h); }, after);
}

// out (width) += x (n) @ m (n, width).
__attribute__((always_inline)) inline void add_vector_times_matrix(const float* x, const float* m, int64_t n, int64_t width,
                                                                    float* __restrict__ out) {
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x[i];
    const float* __restrict__ row = m + i * width;
    for (int64_t j = 0; j < width; ++j) out[j] += xi * row[j];
  }
}

// out (G, kd) = q (G, d) @ rotation (d, kd).
void rotate(const float* q, const float* rotation, int64_t G, int64_t d, int64_t kd, float* out) {
  std::fill(out, out + G * kd, 0.0f);
  for (int64_t g = 0; g < G; ++g) add_vector_times_matrix(q + g * d, rotation, d, kd, out + g * kd);
}

// One query's logits <q, key - mean> over `part`'s tokens of `head` into `logits` (-inf where masked out); returns
// their largest (-inf where none is valid).
__attribute__((always_inline)) inline float exact_logits(const ExactTokens& part, const float* q, float q_mean, int64_t d,
                                                          const uint8_t* valid, int64_t head, float* logits) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const float* keys = part.keys + head * part.count * d;
  float top = kNegInf;
  for (int64_t t = 0; t < part.count; ++t) {
    logits[t] = valid && !valid[part.first_column + t] ? kNegInf : dot(q, keys + t * d, d) - q_mean;
    top = std::max(top, logits[t]);
  }
  return top;
}

// acc (d) += exp(logit - top) * value over `part`'s tokens of `head`; returns the sum of those weights.
__attribute__((always_inline)) inline float exact_values(const ExactTokens& part, const float* logits, float top, int64_t d,
                                                          int64_t head, float* __restrict__ acc) {
  const float* values = part.values + head * part.count * d;
  float total = 0.0f;
  for (int64_t t = 0; t < part.count; ++t) {
    const float w = std::exp(logits[t] - top);  // 0 for a masked token
    total += w;
    const float* __restrict__ v = values + t * d;
    for (int64_t c = 0; c < d; ++c) acc[c] += w * v[c];
  }
  return total;
}

// Head `head`'s output (decode_step): the exact tokens' softmax state, merged with the coded tokens' in `a` (their
// weighted value sum rotated back by value_back, plus the value mean times their weight).
__attribute__((always_inline)) inline void finish_head_with(const StepArgs& s, const DecodeArgs& a, int64_t head) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t G = a.group, d = s.dim, vd = a.value_dim;
  const float* back = s.value_back + (head % a.heads_per_batch) * s.value_back_stride;
  const float* key_mean = s.key_mean + head * d;
  const float* value_mean = s.value_mean + head * d;
  const uint8_t* valid = s.valid ? s.valid + (head / a.heads_per_batch) * a.valid_stride : nullptr;
  std::vector<float> logits(static_cast<size_t>(s.sinks.count + s.window.count)), exact(static_cast<size_t>(d)),
      coded(static_cast<size_t>(d));
  float* window_logits = logits.data() + s.sinks.count;
  for (int64_t g = 0; g < G; ++g) {
    const float* q = s.queries + (head * G + g) * d;
    const float q_mean = dot(q, key_mean, d);
    const float m_e = std::max(exact_logits(s.sinks, q, q_mean, d, valid, head, logits.data()),
                               exact_logits(s.window, q, q_mean, d, valid, head, window_logits));
    std::fill(exact.begin(), exact.end(), 0.0f);
    float l_e = 0.0f;
    if (m_e != kNegInf) {
      l_e = exact_values(s.sinks, logits.data(), m_e, d, head, exact.data()) +
            exact_values(s.window, window_logits, m_e, d, head, exact.data());
    }
    const float m_c = a.max[head * G + g], l_c = a.sum[head * G + g];
    const float* acc = a.acc + (head * G + g) * vd;
    for (int64_t c = 0; c < d; ++c) coded[c] = l_c * value_mean[c];
    add_vector_times_matrix(acc, back, vd, d, coded.data());
    const float m = std::max(m_c, m_e), m_safe = std::isinf(m) ? 0.0f : m;
    const float w_c = std::exp(m_c - m_safe), w_e = std::exp(m_e - m_safe);
    const float total = w_c * l_c + w_e * l_e, divisor = total > 0.0f ? total : 1.0f;
    float* out = s.out + (head * G + g) * d;
    for (int64_t c = 0; c < d; ++c) out[c] = (w_c * coded[c] + w_e * exact[c]) / divisor;
  }
}

void finish_head(const StepArgs& s, const DecodeArgs& a, int64_t head) { finish_head_with(s, a, head); }

#if defined(__x86_64__) || defined(_M_X64)
__attribute__((target("avx2,fma"))) void finish_head_avx2(const StepArgs& s, const DecodeArgs& a, int64_t head) {
  finish_head_with(s, a, head);
}
#else
void finish_head_avx2(const StepArgs& s, const DecodeArgs& a, int64_t head) { finish_head_with(s, a, head); }
#endif

}  // namespace

void decode_step(const StepArgs& s) {
  const DecodeArgs& c = s.coded;
  const int64_t G = c.group, d = s.dim, kd = c.key_dim;
  std::vector<float> rotated(static_cast<size_t>(c.heads * G * kd)), max(static_cast<size_t>(c.heads * G)),
      sum(static_cast<size_t>(c.heads * G)), acc(static_cast<size_t>(c.heads * G * c.value_dim));
  DecodeArgs a = c;
  a.queries = rotated.data();
  a.max = max.data();
  a.sum = sum.data();
  a.acc = acc.data();
  a.valid = s.valid ? s.valid + s.sinks.count : nullptr;
  a.valid_stride = s.sinks.count + c.n + s.window.count;
  const auto finish = has_avx2() ? finish_head_avx2 : finish_head;
  for_each_head(
      a,
      [&](int64_t head) {
        const float* rotation = s.key_rotation + (head % c.heads_per_batch) * s.key_rotation_stride;
        rotate(s.queries + head * G * d, rotation, G, d, kd, rotated.data() + head * G * kd);
      },
      [&](int64_t head) { finish(s, a, head); });
}

}  // namespace tqvec
