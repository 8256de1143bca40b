// Candidates of a batch of queries by 8-bit integer products: see int8_scan.h for the contract.
#include "int8_scan.h"

#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#define TQVEC_X86 1
#endif
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tqvec {
namespace {

constexpr int kLanes = 16;       // queries per 512-bit vector of 32-bit sums
constexpr int kRowsPerCall = 12;  // rows whose sums one call of `products` keeps in registers (2 x 12 accumulators)
constexpr int kRunChunk = 32;     // bytes of a byte run decoded by one pair of shuffles
constexpr int64_t kTileBytes = 64 * 1024;  // decoded rows held at once (they stay in L2 while every query reads them)
constexpr int kBlockBytes = 64;   // a decoded row's bytes come in blocks of 64 (an AMX tile row)
constexpr int kAmxRows = 32;      // rows per AMX call: two tiles of 16 rows, times two tiles of 16 queries
constexpr int64_t kRowGroup = 96; // decoded rows per tile come in multiples of this (of kRowsPerCall and kAmxRows)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int covered(const Plan& plan, int t) {
  int n = 0;
  while (n < kMaxStepChannels && plan.channel[t * kMaxStepChannels + n] >= 0) ++n;
  return n;
}

// True when step t is the low nibble and step t + 1 the high nibble of one byte, each one channel's 4-bit code,
// both with the 16 levels of step `first`.
bool run_byte(const Plan& plan, int t, int first) {
  if (!nibble_pair(plan, t) || covered(plan, t) != 1 || covered(plan, t + 1) != 1) return false;
  const float* table = step_levels(plan, first);
  return std::equal(table, table + 16, step_levels(plan, t)) && std::equal(table, table + 16, step_levels(plan, t + 1));
}

int8_t to_byte(float level, float scale) {
  return static_cast<int8_t>(std::clamp(std::lround(level * scale), -127L, 127L));
}

// The best `capacity` rows of one query by estimate: rows beating the threshold are appended to a buffer of twice
// that size, which, when full, keeps its best `capacity` (nth_element) and raises the threshold to the least of them.
// A row costs one store, not a heap update: most rows that enter a flat scan's top list leave it again.
class Best {
  static constexpr size_t kSpare = 2;  // the buffer holds this many times the rows kept
 public:
  explicit Best(int64_t capacity) : capacity_(static_cast<size_t>(capacity)) { items_.reserve(kSpare * capacity_); }

  // The estimate a row must beat to enter.
  float threshold() const { return threshold_; }

  void push(float estimate, int64_t row) {
    items_.push_back({estimate, row});
    if (items_.size() == kSpare * capacity_) shrink();
  }

  // Raises the threshold to `cut` where that is higher (rows elsewhere beat it).
  void raise(float cut) { threshold_ = std::max(threshold_, cut); }

  void append(std::vector<Estimate>& out) {
    if (items_.size() > capacity_) shrink();
    out.insert(out.end(), items_.begin(), items_.end());
  }

 private:
  void shrink() {
    std::nth_element(items_.begin(), items_.begin() + static_cast<std::ptrdiff_t>(capacity_ - 1), items_.end(),
                     [](const Estimate& a, const Estimate& b) { return a.first > b.first; });
    items_.resize(capacity_);
    threshold_ = std::max(threshold_, items_.back().first);
  }

  size_t capacity_;
  float threshold_ = kNegInf;
  std::vector<Estimate> items_;
};

#ifdef TQVEC_X86
constexpr __mmask16 kAll16 = 0xFFFF;  // the masked forms: GCC 12 warns that the plain ones read an undefined register
#define TQVEC_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,bmi2")))

// Decodes `row` into out (decoder.width bytes; the padding bytes past the channels are left as they are).
TQVEC_VNNI void decode_row(const Int8Decoder& d, const uint8_t* row, int8_t* out) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (const Int8Decoder::ByteRun& run : d.runs) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d.run_levels.data() + 16 * run.table)));
    for (int32_t first = 0; first < run.bytes; first += kRunChunk) {
      const int n = std::min(kRunChunk, run.bytes - first);
      const __mmask32 mask = n == kRunChunk ? ~__mmask32{0} : (__mmask32{1} << n) - 1;
      const __m256i bytes = _mm256_maskz_loadu_epi8(mask, row + run.byte + first);
      const __m256i low = _mm256_shuffle_epi8(table, _mm256_and_si256(bytes, nibble));
      const __m256i high = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble));
      int8_t* dst = out + run.out + 2 * first;
      _mm256_mask_storeu_epi8(dst, mask, low);
      _mm256_mask_storeu_epi8(dst + n, mask, high);
    }
  }
  for (const Int8Decoder::ThreeBitRun& run : d.three_bit_runs) {
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(d.run_levels.data() + 16 * run.table));
    const uint8_t* bytes = row + run.byte;
    for (int32_t g = 0; g < run.groups; ++g, bytes += 3) {  // the group's 3 bytes only: a 4-byte load could pass the row's end
      const uint64_t bits = bytes[0] | (static_cast<uint64_t>(bytes[1]) << 8) | (static_cast<uint64_t>(bytes[2]) << 16);
      const __m128i codes = _mm_cvtsi64_si128(static_cast<long long>(_pdep_u64(bits, 0x0707070707070707ULL)));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + run.out + 8 * g), _mm_shuffle_epi8(table, codes));
    }
  }
  for (const Int8Decoder::Step& s : d.steps) {
    unsigned bits = row[s.byte];
    if (s.shift + s.width > 8) bits |= static_cast<unsigned>(row[s.byte + 1]) << 8;
    const int8_t* level = d.step_levels.data() + s.entry + ((bits >> s.shift) & ((1u << s.width) - 1u)) * s.channels;
    for (int j = 0; j < s.channels; ++j) out[s.out[j]] = level[j];
  }
}

// Sum of the `width` signed bytes of a decoded row.
TQVEC_VNNI int32_t byte_sum(const int8_t* row, int64_t width) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i acc = _mm512_setzero_si512();
  for (int64_t i = 0; i < width; i += 64) {
    const int64_t n = std::min<int64_t>(64, width - i);
    const __mmask64 mask = n == 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1;
    acc = _mm512_dpbusd_epi32(acc, ones, _mm512_maskz_loadu_epi8(mask, row + i));
  }
  alignas(64) int32_t lanes[kLanes];  // through memory: GCC 12 warns on the reduction's 256-bit extract
  _mm512_store_si512(lanes, acc);
  int32_t sum = 0;
  for (const int32_t lane : lanes) sum += lane;
  return sum;
}

// The 32-bit sums of `V` tiles of 16 queries (qt[v]: (groups, 16 lanes, 4 bytes)) with kRowsPerCall decoded rows
// (`stride` bytes apart), written to sums[(r * V + v) * 16 + lane].
template <int V>
TQVEC_VNNI void products(const uint8_t* const* qt, const int8_t* rows, int64_t stride, int64_t groups, int32_t* sums) {
  __m512i acc[V][kRowsPerCall];
  for (int v = 0; v < V; ++v)
    for (int r = 0; r < kRowsPerCall; ++r) acc[v][r] = _mm512_setzero_si512();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i q[V];
    for (int v = 0; v < V; ++v) q[v] = _mm512_load_si512(qt[v] + 64 * g);
#pragma GCC unroll 12
    for (int r = 0; r < kRowsPerCall; ++r) {
      int32_t word;
      std::memcpy(&word, rows + r * stride + 4 * g, sizeof(word));
      const __m512i b = _mm512_set1_epi32(word);
      for (int v = 0; v < V; ++v) acc[v][r] = _mm512_dpbusd_epi32(acc[v][r], q[v], b);
    }
  }
  for (int r = 0; r < kRowsPerCall; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_si512(sums + (r * V + v) * kLanes, acc[v][r]);
}

// Quantizes query x (dim,) to unsigned bytes into its lane of a tile (`lane`: the tile's first byte plus 4 * lane)
// and writes 1 / (s_q * level_scale) to `inverse`.
TQVEC_VNNI void quantize_query(const Int8Decoder& d, const float* x, int64_t dim, uint8_t* lane, float* inverse) {
  __m512 top = _mm512_setzero_ps();
  for (int64_t c = 0; c < dim; c += kLanes) {
    const __mmask16 in = dim - c >= kLanes ? kAll16 : static_cast<__mmask16>((1u << (dim - c)) - 1u);
    top = _mm512_maskz_max_ps(kAll16, top, _mm512_abs_ps(_mm512_maskz_loadu_ps(in, x + c)));
  }
  alignas(64) float lanes[kLanes];
  _mm512_store_ps(lanes, top);
  const float largest = *std::max_element(lanes, lanes + kLanes);
  const float scale = largest > 0.0f ? 127.0f / largest : 1.0f;
  *inverse = 1.0f / (scale * d.level_scale);
  const __m512 gain = _mm512_set1_ps(scale);
  const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127), zero = _mm512_set1_epi32(128);
  for (int64_t i = 0; i < d.width; i += kLanes) {  // d.width is a multiple of 64: whole groups of 4 bytes
    const __m512i channel = _mm512_loadu_si512(d.channel_of.data() + i);
    const __mmask16 used = _mm512_cmpge_epi32_mask(channel, _mm512_setzero_si512());
    const __m512 value = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), used, channel, x, 4);
    const __m512i rounded = _mm512_maskz_cvtps_epi32(kAll16, _mm512_mul_ps(value, gain));  // to nearest
    const __m512i code = _mm512_maskz_min_epi32(kAll16, _mm512_maskz_max_epi32(kAll16, rounded, low), high);
    alignas(16) uint8_t bytes[kLanes];
    _mm_store_si128(reinterpret_cast<__m128i*>(bytes), _mm512_maskz_cvtepi32_epi8(kAll16, _mm512_add_epi32(code, zero)));
    for (int64_t g = 0; g < kLanes / 4; ++g) std::memcpy(lane + (i / 4 + g) * 64, bytes + 4 * g, 4);
  }
}

// Offers rows [first, first + n) of a products call (n <= kRowsPerCall, or kAmxRows for products_amx) over tiles
// [tile, tile + V) to the queries.
template <int V>
TQVEC_VNNI void offer(const int32_t* sums, const int32_t* correction, const float* scale, const float* bias, int64_t first,
                      int n, int64_t tile, int64_t nq, const float* inverse, std::vector<Best>& best,
                      std::vector<float>& threshold, SharedCuts& cuts) {
  for (int r = 0; r < n; ++r) {
    const __m512i shift = _mm512_set1_epi32(correction[r]);
    const __m512 gain = _mm512_set1_ps(scale[r]), offset = _mm512_set1_ps(bias[r]);
    for (int v = 0; v < V; ++v) {
      const int64_t q0 = (tile + v) * kLanes;
      if (q0 >= nq) break;  // a padding tile
      const __m512i sum = _mm512_sub_epi32(_mm512_loadu_si512(sums + (r * V + v) * kLanes), shift);
      const __m512 dot = _mm512_mul_ps(_mm512_maskz_cvtepi32_ps(kAll16, sum), _mm512_loadu_ps(inverse + q0));
      const __m512 estimate = _mm512_fmadd_ps(dot, gain, offset);
      __mmask16 passing = _mm512_cmp_ps_mask(estimate, _mm512_loadu_ps(threshold.data() + q0), _CMP_GT_OQ);
      if (nq - q0 < kLanes) passing &= static_cast<__mmask16>((1u << (nq - q0)) - 1u);
      if (!passing) continue;
      alignas(64) float value[kLanes];
      _mm512_store_ps(value, estimate);
      for (unsigned bits = passing; bits; bits &= bits - 1) {
        const int64_t q = q0 + __builtin_ctz(bits);
        best[q].push(value[__builtin_ctz(bits)], first + r);
        if (best[q].threshold() > threshold[q]) {  // this part's best list filled up: a cut for every part
          threshold[q] = best[q].threshold();
          cuts.raise(q, threshold[q]);
        }
      }
    }
  }
}

// The AMX form of `products` (AMX-INT8): tiles 4 and 5 hold 16 decoded rows each (signed bytes, 64 channels), 6 and 7
// 16 queries each (unsigned bytes, 4 channels per 32-bit lane, as qt stores them), 0 to 3 the 32-bit sums of rows
// (tile rows) by queries (columns); TDPBSUD adds 64 channels of all 16 x 16 pairs. Writes the sums of kAmxRows rows
// with two tiles of queries to sums[(r * 2 + v) * 16 + lane]. The caller has called load_amx_config().
#define TQVEC_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,bmi2")))
TQVEC_AMX void products_amx(const uint8_t* const* qt, const int8_t* rows, int64_t stride, int64_t blocks, int32_t* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t b = 0; b < blocks; ++b) {
    _tile_loadd(4, rows + b * kBlockBytes, stride);
    _tile_loadd(5, rows + 16 * stride + b * kBlockBytes, stride);
    _tile_loadd(6, qt[0] + b * 16 * 64, 64);
    _tile_loadd(7, qt[1] + b * 16 * 64, 64);
    _tile_dpbsud(0, 4, 6);
    _tile_dpbsud(1, 4, 7);
    _tile_dpbsud(2, 5, 6);
    _tile_dpbsud(3, 5, 7);
  }
  constexpr int64_t row_stride = 2 * kLanes * sizeof(int32_t);  // one row's sums for both tiles of queries
  _tile_stored(0, sums, row_stride);
  _tile_stored(1, sums + kLanes, row_stride);
  _tile_stored(2, sums + 16 * 2 * kLanes, row_stride);
  _tile_stored(3, sums + 16 * 2 * kLanes + kLanes, row_stride);
}

// Palette 1, eight tiles of 16 rows x 64 bytes.
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

TQVEC_AMX void load_amx_config() {
  static const AmxConfig config;
  _tile_loadconfig(&config);
}

TQVEC_AMX void release_amx() { _tile_release(); }

TQVEC_VNNI void scan_candidates(const Int8Decoder& d, const Rows& rows, int64_t row_begin, int64_t row_end,
                                const Int8Queries& queries, int64_t query_begin, int64_t query_end, int64_t keep, SharedCuts& cuts,
                                std::vector<std::vector<Estimate>>& out, bool amx) {
  const int64_t nq = query_end - query_begin, tiles = (nq + kLanes - 1) / kLanes, first_tile = query_begin / kLanes;
  const float* inverse = queries.inverse.data() + query_begin;
  std::vector<Best> best(static_cast<size_t>(nq), Best(keep));
  std::vector<float> threshold(static_cast<size_t>(tiles * kLanes), kNegInf);
  const int64_t stride = d.width;
  const int64_t tile_rows = std::max<int64_t>(1, kTileBytes / std::max<int64_t>(1, stride) / kRowGroup) * kRowGroup;
  std::vector<int8_t> decoded(static_cast<size_t>(tile_rows * stride), 0);
  std::vector<int32_t> correction(static_cast<size_t>(tile_rows));
  std::vector<float> scale(static_cast<size_t>(tile_rows)), bias(static_cast<size_t>(tile_rows));
  alignas(64) int32_t sums[2 * kAmxRows * kLanes];
  if (amx) load_amx_config();
  for (int64_t start = row_begin; start < row_end; start += tile_rows) {
    const int64_t n = std::min(tile_rows, row_end - start);
    for (int64_t q = 0; q < nq; ++q) {  // what the other parts found so far
      const float cut = cuts.get(q);
      if (cut > threshold[q]) {
        threshold[q] = cut;
        best[q].raise(cut);
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      int8_t* dst = decoded.data() + r * stride;
      decode_row(d, rows.packed + (start + r) * rows.row_bytes, dst);
      correction[r] = 128 * byte_sum(dst, d.width);
      scale[r] = rows.scale ? rows.scale[start + r] : 1.0f;
      bias[r] = rows.bias ? rows.bias[start + r] : 0.0f;
    }
    for (int64_t t = 0; t < tiles; t += 2) {
      const uint8_t* qt[2] = {queries.tile(first_tile + t), t + 1 < tiles ? queries.tile(first_tile + t + 1) : nullptr};
      if (amx) {  // queries.tiles is even: a last odd tile pairs with a padding one, whose lanes offer skips
        qt[1] = queries.tile(first_tile + t + 1);
        for (int64_t r = 0; r < n; r += kAmxRows) {
          products_amx(qt, decoded.data() + r * stride, stride, d.width / kBlockBytes, sums);
          const int count = static_cast<int>(std::min<int64_t>(kAmxRows, n - r));
          offer<2>(sums, &correction[r], &scale[r], &bias[r], start + r, count, t, nq, inverse, best, threshold, cuts);
        }
        continue;
      }
      for (int64_t r = 0; r < n; r += kRowsPerCall) {
        const int count = static_cast<int>(std::min<int64_t>(kRowsPerCall, n - r));
        const int8_t* block = decoded.data() + r * stride;
        if (qt[1]) {
          products<2>(qt, block, stride, d.channel_groups, sums);
          offer<2>(sums, &correction[r], &scale[r], &bias[r], start + r, count, t, nq, inverse, best, threshold, cuts);
        } else {
          products<1>(qt, block, stride, d.channel_groups, sums);
          offer<1>(sums, &correction[r], &scale[r], &bias[r], start + r, count, t, nq, inverse, best, threshold, cuts);
        }
      }
    }
  }
  if (amx) release_amx();
  for (int64_t q = 0; q < nq; ++q) best[q].append(out[q]);
}
#endif  // TQVEC_X86

}  // namespace

Int8Decoder int8_decoder(const Plan& plan) {
  Int8Decoder d;
  float top = 0.0f;
  for (int t = 0; t < plan.n_steps; ++t) {
    const int size = 1 << plan.width[t];
    for (int j = 0; j < covered(plan, t); ++j)
      for (int code = 0; code < size; ++code) top = std::max(top, std::fabs(step_levels(plan, t)[j * size + code]));
  }
  d.level_scale = top > 0.0f ? 127.0f / top : 1.0f;
  int32_t out = 0;
  for (int t = 0; t < plan.n_steps;) {
    if (run_byte(plan, t, t)) {
      Int8Decoder::ByteRun run{plan.byte[t], 0, out, static_cast<int32_t>(d.run_levels.size() / 16)};
      for (int i = 0; i < 16; ++i) d.run_levels.push_back(to_byte(step_levels(plan, t)[i], d.level_scale));
      std::vector<int32_t> low, high;  // the channels of the run's bytes
      const int first = t;
      while (run_byte(plan, t, first) && plan.byte[t] == run.byte + run.bytes) {
        low.push_back(plan.channel[t * kMaxStepChannels]);
        high.push_back(plan.channel[(t + 1) * kMaxStepChannels]);
        ++run.bytes;
        t += 2;
      }
      d.channel_of.resize(static_cast<size_t>(out + 2 * run.bytes), -1);
      for (int32_t i = 0; i < run.bytes; ++i) {  // chunk c's low nibbles, then its high ones
        const int32_t chunk = i / kRunChunk, n = std::min(kRunChunk, run.bytes - kRunChunk * chunk), at = i % kRunChunk;
        d.channel_of[static_cast<size_t>(out + 2 * kRunChunk * chunk + at)] = low[static_cast<size_t>(i)];
        d.channel_of[static_cast<size_t>(out + 2 * kRunChunk * chunk + n + at)] = high[static_cast<size_t>(i)];
      }
      out += 2 * run.bytes;
      d.runs.push_back(run);
      continue;
    }
    if (run_group(plan, t, t, 3)) {
      Int8Decoder::ThreeBitRun run{plan.byte[t], 0, out, static_cast<int32_t>(d.run_levels.size() / 16)};
      for (int i = 0; i < 16; ++i) d.run_levels.push_back(i < 8 ? to_byte(step_levels(plan, t)[i], d.level_scale) : 0);
      const int first = t;
      while (run_group(plan, t, first, 3) && plan.byte[t] == run.byte + 3 * run.groups &&
             plan.channel[t * kMaxStepChannels] == plan.channel[first * kMaxStepChannels] + 8 * run.groups) {
        for (int i = 0; i < run_channels(3); ++i) d.channel_of.push_back(plan.channel[(t + i) * kMaxStepChannels]);
        ++run.groups;
        t += run_channels(3);
      }
      out += 8 * run.groups;
      d.three_bit_runs.push_back(run);
      continue;
    }
    const int n = covered(plan, t), size = 1 << plan.width[t];
    Int8Decoder::Step step{plan.byte[t], plan.shift[t], plan.width[t], n, static_cast<int32_t>(d.step_levels.size()), {-1, -1, -1, -1}};
    for (int code = 0; code < size; ++code)
      for (int j = 0; j < n; ++j) d.step_levels.push_back(to_byte(step_levels(plan, t)[j * size + code], d.level_scale));
    for (int j = 0; j < n; ++j) {
      step.out[j] = out++;
      d.channel_of.push_back(plan.channel[t * kMaxStepChannels + j]);
    }
    d.steps.push_back(step);
    ++t;
  }
  d.channel_groups = (out + 3) / 4;
  d.width = (out + kBlockBytes - 1) / kBlockBytes * kBlockBytes;
  d.channel_of.resize(static_cast<size_t>(d.width), -1);
  return d;
}

bool has_amx() {
#ifdef TQVEC_X86
  // CPUID.(7, 0):EDX bit 24 AMX-TILE, bit 25 AMX-INT8; Linux then grants the tile data state on request
  // (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once per process
  static const bool ready = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!has_avx512_vnni() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !((edx >> 24) & 1u) || !((edx >> 25) & 1u))
      return false;
#ifdef __linux__
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return ready;
#else
  return false;
#endif
}

bool has_avx512_vnni() {
#ifdef TQVEC_X86
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("bmi2");
#else
  return false;
#endif
}

SharedCuts::SharedCuts(int64_t nq) : cut_(new std::atomic<float>[static_cast<size_t>(nq)]) {
  for (int64_t q = 0; q < nq; ++q) cut_[q].store(kNegInf, std::memory_order_relaxed);
}

void SharedCuts::raise(int64_t q, float value) {
  float seen = cut_[q].load(std::memory_order_relaxed);
  while (value > seen && !cut_[q].compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

Int8Queries int8_queries(const Int8Decoder& decoder, const float* queries, int64_t nq, int64_t dim, int threads) {
  Int8Queries out;
  out.tiles = (nq + 2 * kLanes - 1) / (2 * kLanes) * 2;  // even: the AMX kernel reads tiles in pairs
  out.groups = decoder.width / 4;
  const size_t size = static_cast<size_t>(out.tiles * out.groups * 64);
  out.bytes.reset(static_cast<uint8_t*>(std::aligned_alloc(64, std::max<size_t>(64, size))));
  std::memset(out.bytes.get(), 128, size);  // padding lanes: the value 0
  out.inverse.assign(static_cast<size_t>(out.tiles * kLanes), 0.0f);
#ifdef TQVEC_X86
  parallel_for(static_cast<size_t>(nq), threads, [&](size_t begin, size_t end) {
    for (size_t q = begin; q < end; ++q)
      quantize_query(decoder, queries + q * dim, dim, out.bytes.get() + (q / kLanes) * out.groups * 64 + 4 * (q % kLanes),
                     &out.inverse[q]);
  }, kLanes, Idle::kSpin);
#else
  (void)queries, (void)dim, (void)threads;
#endif
  return out;
}

void int8_candidates(const Int8Decoder& decoder, const Rows& rows, int64_t row_begin, int64_t row_end, const Int8Queries& queries,
                     int64_t query_begin, int64_t query_end, int64_t keep, SharedCuts& cuts, std::vector<std::vector<Estimate>>& out,
                     bool use_amx) {
#ifdef TQVEC_X86
  scan_candidates(decoder, rows, row_begin, row_end, queries, query_begin, query_end, keep, cuts, out, use_amx);
#else
  (void)decoder, (void)rows, (void)row_begin, (void)row_end, (void)queries, (void)query_begin, (void)query_end, (void)keep,
      (void)cuts, (void)out, (void)use_amx;
#endif
}

}  // namespace tqvec
