// Python bindings of the fast-scan search (module tqvec._native); the Python side is tqvec/_fastscan.py.
//
// What does not change between searches is checked and held once: a Plan (how a layout's rows are read) and a
// Rows object (the row-major codes, side fields, groups and, for the SIMD kernel, their fast-scan layout). A
// search call then converts only the queries and the probes.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "attention.h"
#include "fastscan.h"
#include "int8_scan.h"
#include "parallel.h"
#include "queries.h"
#include "scratch.h"

namespace nb = nanobind;

template <class T, class... Extra>
using Array = nb::ndarray<const T, nb::c_contig, nb::device::cpu, Extra...>;

namespace {

template <class T>
const T* optional_data(const Array<T>& a) {
  return a.size() ? a.data() : nullptr;
}

void require(bool ok, const char* message) {  // a C string: no allocation on the hot path
  if (!ok) throw std::invalid_argument(message);
}

// A checked copy of the steps that read one layout (see tqvec::Plan).
class PlanHandle {
 public:
  PlanHandle(Array<int32_t, nb::ndim<1>> byte, Array<int32_t, nb::ndim<1>> shift, Array<int32_t, nb::ndim<1>> width,
             Array<int32_t, nb::ndim<2>> channel, Array<int32_t, nb::ndim<1>> offset, Array<float, nb::ndim<1>> level) {
    const size_t steps = byte.shape(0);
    require(shift.shape(0) == steps && width.shape(0) == steps, "step arrays differ in length");
    require(channel.shape(0) == steps && channel.shape(1) == tqvec::kMaxStepChannels, "step_channel must be (steps, 4)");
    require(offset.shape(0) == steps + 1 && offset.data()[0] == 0, "step_offset must be (steps + 1,) from 0");
    require(level.shape(0) == tqvec::kMaxStepChannels * static_cast<size_t>(offset.data()[steps]),
            "step_level must hold 4 levels per table entry");
    for (size_t t = 0; t < steps; ++t) {
      const int32_t b = byte.data()[t], s = shift.data()[t], w = width.data()[t];
      require(w >= 1 && w <= 8 && s >= 0 && s < 8 && b >= 0, "a step must read 1 to 8 bits inside the row");
      require(offset.data()[t + 1] - offset.data()[t] == (1 << w), "a step table must have 2^width entries");
      last_byte_ = std::max(last_byte_, b + (s + w > 8 ? 1 : 0));
      for (int j = 0; j < tqvec::kMaxStepChannels; ++j) {
        const int32_t c = channel.data()[t * tqvec::kMaxStepChannels + j];
        require(c >= -1 && (j == 0 || c == -1 || channel.data()[t * tqvec::kMaxStepChannels + j - 1] >= 0),
                "a step's channels must fill its first slots");
        last_channel_ = std::max(last_channel_, c);
      }
    }
    byte_.assign(byte.data(), byte.data() + steps);
    shift_.assign(shift.data(), shift.data() + steps);
    width_.assign(width.data(), width.data() + steps);
    channel_.assign(channel.data(), channel.data() + channel.size());
    offset_.assign(offset.data(), offset.data() + steps + 1);
    level_.assign(level.data(), level.data() + level.size());
    steps_ = tqvec::plan_steps(view());
    decoder_ = tqvec::row_decoder(view());
    std::vector<int> covered(static_cast<size_t>(last_channel_ + 1), 0);
    single_channel_ = last_channel_ >= 0;
    for (size_t t = 0; t < steps; ++t) {
      const int32_t c = channel_[t * tqvec::kMaxStepChannels], w = width_[t];
      single_channel_ = single_channel_ && c >= 0 && channel_[t * tqvec::kMaxStepChannels + 1] == -1 && w >= 3;
      if (c >= 0) ++covered[static_cast<size_t>(c)];
    }
    single_channel_ = single_channel_ && std::all_of(covered.begin(), covered.end(), [](int n) { return n == 1; });
  }

  PlanHandle(const PlanHandle&) = delete;  // its steps and decoder point into its own arrays
  PlanHandle& operator=(const PlanHandle&) = delete;

  tqvec::Plan view() const {
    return {static_cast<int>(byte_.size()), byte_.data(), shift_.data(), width_.data(), channel_.data(), offset_.data(),
            level_.data()};
  }
  const tqvec::PlanSteps* steps() const { return steps_.get(); }
  const tqvec::RowDecoder* decoder() const { return decoder_.get(); }
  int32_t last_byte() const { return last_byte_; }
  int32_t last_channel() const { return last_channel_; }
  // True when every channel 0 .. last_channel is read by exactly one step, of its own, of 3 to 8 bits.
  bool single_channel_steps() const { return single_channel_; }

 private:
  std::vector<int32_t> byte_, shift_, width_, channel_, offset_;
  std::vector<float> level_;
  std::shared_ptr<const tqvec::PlanSteps> steps_;
  std::shared_ptr<const tqvec::RowDecoder> decoder_;  // points into level_ (never changed after construction)
  int32_t last_byte_ = -1, last_channel_ = -1;
  bool single_channel_ = false;
};

// The rows a search reads: row-major codes (n, row_bytes) read by `plan`, with their scale / bias (n,) or empty,
// grouped by offsets (and list_rows, each in [0, n)), plus a layout for the SIMD kernels: "nibbles" (the
// fast-scan layout of the codes), "signs", "high-pairs" or "high-nibbles" (the two-stage scan's layouts: sign bits,
// the high 2 or the high 4 bits of each channel's code), or for the exact kernel "lists" (the rows copied in list
// order) or "" (none). `reference` (groups, channels) or empty: one vector per group that the two-stage layouts
// bound their estimates around (tqvec::arrange_signs), copied.
// Holds references to the arrays, which must not change while it lives.
class RowsHandle {
 public:
  RowsHandle(Array<uint8_t, nb::ndim<2>> packed, Array<float> scale, Array<float> bias, Array<int64_t, nb::ndim<1>> offsets,
             Array<int64_t> list_rows, const PlanHandle& plan, const std::string& layout, Array<float> reference)
      : packed_(packed), scale_(scale), bias_(bias), offsets_(offsets), list_rows_(list_rows) {
    const bool high_bits = layout == "high-pairs" || layout == "high-nibbles";
    require(layout.empty() || layout == "nibbles" || layout == "signs" || high_bits || layout == "lists",
            "layout must be '', 'nibbles', 'signs', 'high-pairs', 'high-nibbles' or 'lists'");
    if (high_bits) require(plan.single_channel_steps(), "high-pairs and high-nibbles need one channel per step of 3 to 8 bits");
    require(plan.last_byte() < static_cast<int64_t>(packed.shape(1)), "the plan reads past the end of a row");
    const int64_t n = static_cast<int64_t>(packed.shape(0));
    require(scale.size() == 0 || scale.size() == static_cast<size_t>(n), "scale must have one entry per row");
    require(bias.size() == 0 || bias.size() == static_cast<size_t>(n), "bias must have one entry per row");
    require(offsets.shape(0) >= 2, "offsets must have at least two entries");
    const int64_t n_groups = static_cast<int64_t>(offsets.shape(0)) - 1;
    const int64_t* off = offsets.data();
    for (int64_t g = 0; g < n_groups; ++g) require(off[g] >= 0 && off[g] <= off[g + 1], "offsets must be non-decreasing from 0");
    require(off[n_groups] <= (list_rows.size() ? static_cast<int64_t>(list_rows.size()) : n), "offsets reach past the rows");
    for (size_t i = 0; i < list_rows.size(); ++i)
      require(list_rows.data()[i] >= 0 && list_rows.data()[i] < n, "a list row lies outside the rows");
    require(reference.size() == 0 || reference.size() == static_cast<size_t>(n_groups * (plan.last_channel() + 1)),
            "reference must hold one vector of the plan's channels per group");
    rows_ = {packed.data(), n, static_cast<int64_t>(packed.shape(1)), optional_data(scale), optional_data(bias)};
    groups_ = {off, optional_data(list_rows), n_groups, nullptr, nullptr, 1};
    nb::gil_scoped_release release;
    if (layout == "nibbles") {
      blocks_ = tqvec::arrange(rows_, off, groups_.list_rows, n_groups);
      layout_ = blocks_->view();
    } else if (layout == "signs" || high_bits) {
      const int64_t channels = plan.last_channel() + 1;
      const float* ref = optional_data(reference);
      signs_ = layout == "signs" ? tqvec::arrange_signs(rows_, plan.view(), channels, off, groups_.list_rows, n_groups, ref)
                                 : tqvec::arrange_high_bits(rows_, plan.view(), channels, layout == "high-pairs" ? 2 : 4, off,
                                                            groups_.list_rows, n_groups, ref);
      const bool referenced = !signs_->reference.empty();
      sign_view_ = {signs_->blocks.view(), signs_->slack.data(), signs_->scale.data(),
                    referenced ? signs_->reference_error.data() : nullptr, referenced ? signs_->reference.data() : nullptr,
                    channels, signs_->codes.empty() ? nullptr : signs_->codes.data(), signs_->plan(), signs_->steps.get(),
                    signs_->sign_bits};
    } else if (layout == "lists" && groups_.list_rows) {
      ordered_ = tqvec::arrange_lists(rows_, groups_.list_rows, off[n_groups]);
      ordered_view_ = ordered_->view();
    }
  }

  const tqvec::Rows& rows() const { return rows_; }
  const tqvec::Groups& groups() const { return groups_; }
  const tqvec::Blocks* layout() const { return blocks_ ? &layout_ : nullptr; }
  const tqvec::SignBlocks* signs() const { return signs_ ? &sign_view_ : nullptr; }
  const tqvec::Rows* ordered() const { return ordered_ ? &ordered_view_ : nullptr; }
  size_t layout_nbytes() const {
    return blocks_ ? blocks_->nbytes() : signs_ ? signs_->nbytes() : ordered_ ? ordered_->nbytes() : 0;
  }

 private:
  Array<uint8_t, nb::ndim<2>> packed_;  // the arrays stay referenced while the handle lives
  Array<float> scale_, bias_;
  Array<int64_t, nb::ndim<1>> offsets_;
  Array<int64_t> list_rows_;
  tqvec::Rows rows_{};
  tqvec::Groups groups_{};
  std::optional<tqvec::BlockStore> blocks_;
  tqvec::Blocks layout_{};
  std::optional<tqvec::SignStore> signs_;
  tqvec::SignBlocks sign_view_{};
  std::optional<tqvec::ListOrder> ordered_;
  tqvec::Rows ordered_view_{};
};

// What an index does to its queries before the scan (tqvec::QueryTransform and tqvec::Coarse), holding its arrays.
class QueryHandle {
 public:
  QueryHandle(int64_t dim, Array<float> rotation, Array<float> signs, int rounds, bool normalize, Array<float> center,
              Array<float> centroids, Array<float> half_squared, bool residual, Array<float> base, double max_squared_norm)
      : rotation_(rotation), signs_(signs), center_(center), centroids_(centroids), half_squared_(half_squared), base_(base),
        max_squared_norm_(max_squared_norm) {
    require(dim >= 1, "dim must be positive");
    require(max_squared_norm > 0.0, "max_squared_norm must be positive");
    require(rounds >= 0, "rounds must be >= 0");
    const bool haar = rotation.size() > 0;
    require(haar != (signs.size() > 0), "give the rotation matrix or the Hadamard / FHT-Kac signs");
    require(!haar || rounds == 0, "a rotation matrix takes no FHT-Kac rounds");
    const int64_t out_dim = haar ? static_cast<int64_t>(rotation.size()) / dim
                            : rounds > 0 ? dim : static_cast<int64_t>(signs.size());
    if (haar)
      require(rotation.size() == static_cast<size_t>(out_dim * dim), "the rotation matrix must be (out_dim, dim)");
    else if (rounds > 0)
      require(signs.size() == static_cast<size_t>(rounds) * static_cast<size_t>(dim), "FHT-Kac signs must be (rounds, dim)");
    else
      require(out_dim >= dim && (out_dim & (out_dim - 1)) == 0, "Hadamard signs must be out_dim >= dim, a power of two");
    int64_t block = 1;
    while (2 * block <= dim) block *= 2;
    require(center.size() == 0 || center.size() == static_cast<size_t>(dim), "center must have dim entries");
    require(base.size() == 0 || base.size() == static_cast<size_t>(dim), "base must have dim entries");
    const int64_t n_lists = static_cast<int64_t>(centroids.size()) / dim;
    require(centroids.size() == static_cast<size_t>(n_lists * dim), "centroids must be (nlist, dim)");
    require(half_squared.size() == 0 || half_squared.size() == static_cast<size_t>(n_lists), "half_squared must have nlist entries");
    require(n_lists == 0 || center.size() == 0, "an inverted-file index has no flat center");
    transform_ = {dim, out_dim, optional_data(rotation), optional_data(signs), rounds, block, normalize, optional_data(center)};
    coarse_ = {n_lists, 0, optional_data(centroids), optional_data(half_squared), residual, optional_data(base)};
  }

  const tqvec::QueryTransform& transform() const { return transform_; }
  const tqvec::Coarse& coarse() const { return coarse_; }
  double max_squared_norm() const { return max_squared_norm_; }

 private:
  Array<float> rotation_, signs_, center_, centroids_, half_squared_, base_;  // referenced while the handle lives
  double max_squared_norm_;
  tqvec::QueryTransform transform_{};
  tqvec::Coarse coarse_{};
};

// The kernel's arguments for a search of `source` for queries (nq, dim) (rotated) with optional probes (nq, n_probe)
// and their constants, filling values / rows (nq, k) and, when not null, exact (nq,): the rows each query scored
// exactly. Checks them (ValueError).
tqvec::SearchArgs search_args(const PlanHandle& plan, const RowsHandle& source, const float* queries, int64_t nq, int64_t dim,
                              const int64_t* probe, const float* probe_constant, int64_t n_probe, int64_t k, int64_t rescore,
                              float confidence, int threads, float* values, int64_t* rows, int64_t* exact = nullptr) {
  require(plan.last_byte() < source.rows().row_bytes, "the plan reads past the end of a row");
  require(plan.last_channel() < dim, "the plan reads a channel the queries do not have");
  require(source.signs() == nullptr || source.signs()->channels == plan.last_channel() + 1,
          "the rows' sign layout was built for another plan");
  require(k >= 1 && rescore >= 0, "k must be positive and rescore non-negative");
  require(confidence > 0.0f, "confidence must be positive");
  tqvec::Groups groups = source.groups();
  if (probe) {
    groups.probe = probe;
    groups.probe_constant = probe_constant;
    groups.n_probe = n_probe;
  } else {
    require(groups.n_groups == 1, "several groups need probe");
  }
  return {plan.view(), plan.steps(), source.rows(), groups, queries, nq, dim, k, rescore, source.layout(),
          source.signs(), source.ordered(), confidence, threads, values, rows, exact};
}

inline tqvec::Isa isa_of(int max_isa) { return static_cast<tqvec::Isa>(std::clamp(max_isa, 0, 4)); }

// search_args' search, run without the GIL; returns the kernel's name.
const char* run_search(const PlanHandle& plan, const RowsHandle& source, const float* queries, int64_t nq, int64_t dim,
                       const int64_t* probe, const float* probe_constant, int64_t n_probe, int64_t k, int64_t rescore,
                       float confidence, int threads, int max_isa, float* values, int64_t* rows, int64_t* exact = nullptr) {
  const tqvec::SearchArgs args = search_args(plan, source, queries, nq, dim, probe, probe_constant, n_probe, k, rescore, confidence,
                                             threads, values, rows, exact);
  nb::gil_scoped_release release;
  return tqvec::search(args, isa_of(max_isa));
}

// A (nq, k) numpy array owning `data`.
template <class T>
nb::ndarray<nb::numpy, T, nb::ndim<2>> owned(T* data, int64_t nq, int64_t k) {
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  const size_t shape[2] = {static_cast<size_t>(nq), static_cast<size_t>(k)};
  return nb::ndarray<nb::numpy, T, nb::ndim<2>>(data, 2, shape, owner);
}

// The kernel search of rotated queries (nq, dim): (values (nq, k), rows (nq, k), kernel name, rows scored exactly per
// query (nq, 1) int64).
nb::tuple search(const PlanHandle& plan, const RowsHandle& source, Array<float, nb::ndim<2>> queries, Array<int64_t> probe,
                 Array<float> probe_constant, int64_t k, int64_t rescore, float confidence, int threads, int max_isa) {
  const int64_t nq = static_cast<int64_t>(queries.shape(0));
  int64_t n_probe = 1;
  if (probe.size()) {
    require(probe.ndim() == 2 && probe.shape(0) == static_cast<size_t>(nq), "probe must be (nq, nprobe)");
    require(probe_constant.size() == 0 || probe_constant.size() == probe.size(), "probe_constant must match probe");
    n_probe = static_cast<int64_t>(probe.shape(1));
  }
  require(k >= 1, "k must be positive");
  auto* values = new float[static_cast<size_t>(nq * k)];
  auto* rows = new int64_t[static_cast<size_t>(nq * k)];
  auto out_values = owned(values, nq, k);
  auto out_rows = owned(rows, nq, k);
  auto* exact = new int64_t[static_cast<size_t>(nq)];
  auto out_exact = owned(exact, nq, 1);
  const char* kernel = run_search(plan, source, queries.data(), nq, static_cast<int64_t>(queries.shape(1)), optional_data(probe),
                                  optional_data(probe_constant), n_probe, k, rescore, confidence, threads, max_isa, values, rows,
                                  exact);
  return nb::make_tuple(out_values, out_rows, kernel, out_exact);
}

// True when every squared norm in [first, last) is finite and at most `bound` (the rows a search accepts).
bool norms_within(const double* first, const double* last, double bound) {
  return std::all_of(first, last, [bound](double s) { return std::isfinite(s) && s <= bound; });
}

// ValueError worded as tqvec.validation words it, from the queries' squared norms (double): "contains NaN or Inf"
// when one is not finite, else the first row whose squared norm exceeds `bound`.
void check_query_norms(const std::vector<double>& squared, double bound) {
  if (norms_within(squared.data(), squared.data() + squared.size(), bound)) return;
  for (double s : squared)
    if (!std::isfinite(s)) throw std::invalid_argument("queries contains NaN or Inf");
  for (size_t i = 0; i < squared.size(); ++i)
    if (squared[i] > bound) {
      char message[160];
      std::snprintf(message, sizeof(message),
                    "queries row %zu has squared L2 norm %.3g, more than the %.2g that float32 scoring can hold", i, squared[i],
                    bound);
      throw std::invalid_argument(message);
    }
}

// search_queries' scratch buffers (tqvec::Scratch; the calling thread's, or a pool thread's for a chunk of an
// inverted-file batch): rotated queries, probed lists' constants, lists
struct RotatedSite;
struct ProbeConstantSite;
struct ProbeSite;

// An inverted-file batch is prepared and searched in chunks, one thread per chunk, when each thread has this many queries
// at least. Chunks are guided, largest first: each takes the queries left / (kGuidedShare threads), between 1 and
// kPairedMaxChunk (the preparation's block: they share each pass over the centroids, which small chunks repeat;
// bench/results/native_runs/guided-chunks), so that most queries share full blocks and the last, small chunks even
// out the threads.
constexpr int64_t kPairedMinQueriesPerThread = 2;
constexpr int64_t kPairedMaxChunk = 8;
constexpr int64_t kGuidedShare = 2;

// The first query of each chunk of a guided batch of nq queries on `threads` threads, then nq.
std::vector<int64_t> guided_chunks(int64_t nq, int threads) {
  std::vector<int64_t> starts{0};
  while (starts.back() < nq)
    starts.push_back(starts.back() + std::clamp<int64_t>((nq - starts.back()) / (kGuidedShare * threads), 1, kPairedMaxChunk));
  return starts;
}

// Prepares raw queries (nq, dim) as `prep` says (rotation, probed lists and their constants), searches `source` with
// them, all on the search's threads, and answers as the index does: (D (nq, k) float32, I (nq, k) int64 ids from
// `ids` (one per row), kernel name); D holds the scores, or for `l2` the distances |q|^2 - 2 score; no result:
// I -1, D -inf (+inf for l2). Equal distances come in id order.
nb::tuple search_queries(const PlanHandle& plan, const RowsHandle& source, const QueryHandle& prep,
                         Array<float, nb::ndim<2>> queries, Array<int64_t, nb::ndim<1>> ids, bool l2, int64_t n_probe,
                         int64_t k, int64_t rescore, float confidence, int threads, int max_isa) {
  const int64_t nq = static_cast<int64_t>(queries.shape(0)), dim = prep.transform().dim;
  require(static_cast<int64_t>(queries.shape(1)) == dim, "queries have the wrong dimension");
  require(static_cast<int64_t>(ids.shape(0)) == source.rows().n, "ids must name every row");
  require(k >= 1, "k must be positive");
  tqvec::Coarse coarse = prep.coarse();
  if (coarse.n_lists) {
    require(coarse.n_lists == source.groups().n_groups, "the rows are grouped in other lists than the centroids");
    require(n_probe >= 1 && n_probe <= coarse.n_lists, "n_probe must lie in [1, nlist]");
    coarse.n_probe = n_probe;
  } else {
    require(source.groups().n_groups == 1, "a flat search reads one group");
    n_probe = 1;
  }
  const int64_t out_dim = prep.transform().out_dim;
  const double bound = prep.max_squared_norm();
  std::vector<double> squared(static_cast<size_t>(nq));
  auto* distances = new float[static_cast<size_t>(nq * k)];
  auto* labels = new int64_t[static_cast<size_t>(nq * k)];
  auto out_distances = owned(distances, nq, k);
  auto out_labels = owned(labels, nq, k);
  const float none = l2 ? std::numeric_limits<float>::infinity() : -std::numeric_limits<float>::infinity();
  // Query i's answer from the kernel's rows and scores: ids, distances (l2) and padding, equal distances in id order
  auto answer = [&](int64_t i) {
    const float norm_squared = static_cast<float>(squared[i]);
    for (int64_t j = i * k; j < (i + 1) * k; ++j) {
      const int64_t row = labels[j];
      labels[j] = row >= 0 ? ids.data()[row] : -1;
      distances[j] = row < 0 ? none : l2 ? norm_squared - 2.0f * distances[j] : distances[j];
    }
    for (int64_t j = i * k; j < (i + 1) * k;) {  // equal distances in id order, as every tqvec search answers
      int64_t end = j + 1;
      while (end < (i + 1) * k && distances[end] == distances[j]) ++end;
      std::sort(labels + j, labels + end);
      j = end;
    }
  };
  const char* kernel;
  if (coarse.n_lists && threads > 1 && nq >= kPairedMinQueriesPerThread * threads) {
    // An inverted-file batch: each chunk of queries is prepared, searched and answered by one thread, in one parallel
    // region, with buffers for one chunk (a region for the preparation and another for the search paid the pool's
    // start twice, and the batch's rotated queries, zeroed and answered on the calling thread, kept the others
    // waiting). A chunk with a bad query is not searched; the check after the region raises, no result returned.
    const std::vector<int64_t> no_probe(1);  // placeholders for the checks: each chunk sets its own
    const std::vector<float> no_constant(1);
    const tqvec::SearchArgs whole = search_args(plan, source, nullptr, nq, out_dim, no_probe.data(), no_constant.data(), n_probe, k,
                                                rescore, confidence, 1, distances, labels);
    const std::vector<int64_t> starts = guided_chunks(nq, threads);
    const int64_t most = starts[1];  // the first chunk is the largest (this branch has nq >= 2 threads > 0)
    std::atomic<const char*> used{nullptr};
    {
      nb::gil_scoped_release release;
      tqvec::parallel_for(starts.size() - 1, threads, [&](size_t begin, size_t end) {
        const tqvec::Scratch<float, RotatedSite> rotated(static_cast<size_t>(most * out_dim));
        const tqvec::Scratch<float, ProbeConstantSite> constant(static_cast<size_t>(most * n_probe));
        const tqvec::Scratch<int64_t, ProbeSite> probe(static_cast<size_t>(most * n_probe));
        for (size_t c = begin; c < end; ++c) {
          const int64_t first = starts[c], g = starts[c + 1] - first;
          tqvec::prepare_queries(prep.transform(), coarse, queries.data() + first * dim, g, 1, isa_of(max_isa), squared.data() + first,
                                 rotated.get(), probe.get(), constant.get());
          if (!norms_within(squared.data() + first, squared.data() + first + g, bound)) continue;
          tqvec::SearchArgs part = whole;
          part.queries = rotated.get();
          part.nq = g;
          part.groups.probe = probe.get();
          part.groups.probe_constant = constant.get();
          part.out_values += first * k;
          part.out_rows += first * k;
          used = tqvec::search(part, isa_of(max_isa));
          for (int64_t i = first; i < first + g; ++i) answer(i);
        }
      }, 1, tqvec::Idle::kSpin);
    }
    check_query_norms(squared, bound);
    kernel = used.load();
  } else {
    // the calling thread's buffers (tqvec::Scratch), uninitialized: the preparation writes every entry (zeroing a
    // large batch's rotated queries on the calling thread kept the pool waiting)
    const tqvec::Scratch<float, RotatedSite> rotated(static_cast<size_t>(nq * out_dim));
    const tqvec::Scratch<float, ProbeConstantSite> constant(static_cast<size_t>(nq * n_probe));
    const tqvec::Scratch<int64_t, ProbeSite> probe(static_cast<size_t>(nq * n_probe));
    const tqvec::SearchArgs args = search_args(plan, source, rotated.get(), nq, out_dim, probe.get(), constant.get(), n_probe, k,
                                               rescore, confidence, threads, distances, labels);
    nb::gil_scoped_release release;  // once for the whole search (an error raised below takes the GIL back)
    tqvec::prepare_queries(prep.transform(), coarse, queries.data(), nq, threads, isa_of(max_isa), squared.data(), rotated.get(),
                           probe.get(), constant.get());
    check_query_norms(squared, bound);
    kernel = tqvec::search(args, isa_of(max_isa));
    tqvec::parallel_for(static_cast<size_t>(nq), threads, [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) answer(static_cast<int64_t>(i));
    }, 256, tqvec::Idle::kSpin);
  }
  return nb::make_tuple(out_distances, out_labels, kernel);
}

// The segments of coded tokens (see attention.h) from a list of (plan, codes (heads, >= n, row_bytes) uint8,
// scales (heads, >= n) float32, dim) tuples, laid side by side from channel 0; `codes_kept` and `scales_kept` hold
// the arrays (converted copies included) while the segments point into them.
std::vector<tqvec::CodedTokens> coded_segments(const nb::list& segments, int64_t heads, int64_t n, int64_t channels,
                                               std::vector<Array<uint8_t, nb::ndim<3>>>& codes_kept,
                                               std::vector<Array<float, nb::ndim<2>>>& scales_kept) {
  std::vector<tqvec::CodedTokens> out;
  int64_t first = 0;
  for (nb::handle item : segments) {
    auto t = nb::cast<nb::tuple>(item);
    require(t.size() == 4, "a segment is (plan, codes, scales, dim)");
    const auto& plan = nb::cast<const PlanHandle&>(t[0]);
    const auto codes = codes_kept.emplace_back(nb::cast<Array<uint8_t, nb::ndim<3>>>(t[1]));
    const auto scale = scales_kept.emplace_back(nb::cast<Array<float, nb::ndim<2>>>(t[2]));
    const auto dim = nb::cast<int64_t>(t[3]);
    require(static_cast<int64_t>(codes.shape(0)) == heads && static_cast<int64_t>(codes.shape(1)) >= n,
            "codes must be (heads, >= n, row_bytes)");
    require(static_cast<int64_t>(scale.shape(0)) == heads && static_cast<int64_t>(scale.shape(1)) >= n,
            "scales must be (heads, >= n)");
    require(static_cast<int64_t>(codes.shape(2)) > plan.last_byte(), "rows are shorter than their plan reads");
    require(dim > plan.last_channel() && first + dim <= channels, "fewer channels than the plans read");
    out.push_back({plan.decoder(), codes.data(), static_cast<int64_t>(codes.shape(2)),
                   static_cast<int64_t>(codes.shape(1) * codes.shape(2)), scale.data(), static_cast<int64_t>(scale.shape(1)),
                   first, dim});
    first += dim;
  }
  require(!out.empty(), "no coded segments");
  return out;
}

// A (dim, width) matrix shared by all heads, or one per head of a batch (heads_per_batch, dim, width): its data and
// the stride from one head's to the next (0 where shared).
std::pair<const float*, int64_t> per_head_matrix(const Array<float>& m, int64_t heads_per_batch, int64_t dim,
                                                 int64_t width, const char* message) {
  const bool shared = m.ndim() == 2 && static_cast<int64_t>(m.shape(0)) == dim && static_cast<int64_t>(m.shape(1)) == width;
  const bool per_head = m.ndim() == 3 && static_cast<int64_t>(m.shape(0)) == heads_per_batch &&
                        static_cast<int64_t>(m.shape(1)) == dim && static_cast<int64_t>(m.shape(2)) == width;
  require(shared || per_head, message);
  return {m.data(), shared ? 0 : dim * width};
}

// Tokens kept exactly (see attention.h): keys and values (heads, count, dim).
tqvec::ExactTokens exact_tokens(const Array<float, nb::ndim<3>>& keys, const Array<float, nb::ndim<3>>& values, int64_t heads,
                                int64_t dim, int64_t first_column) {
  require(static_cast<int64_t>(keys.shape(0)) == heads && static_cast<int64_t>(keys.shape(2)) == dim &&
              keys.shape(0) == values.shape(0) && keys.shape(1) == values.shape(1) && keys.shape(2) == values.shape(2),
          "exact keys and values must both be (heads, count, dim)");
  return {keys.data(), values.data(), static_cast<int64_t>(keys.shape(1)), first_column};
}

// One decode step of attention (see attention.h). key_segments / value_segments: lists of (plan, codes (heads,
// capacity, row_bytes), scales (heads, >= n), dim) whose dims lie side by side in the keys' and values' rotated
// channels (key_dim and value_dim in all); tokens [0, n) are read; queries: (heads, group, dim) scaled, not rotated;
// key_rotation (dim, key_dim) and value_back (value_dim, dim), or one per head of a batch; key_mean, value_mean
// (heads, dim); sinks and window (heads, count, dim); valid: (heads / heads_per_batch, sinks + n + window) uint8 or
// empty. Returns the output (heads * group, dim) float32.
nb::ndarray<nb::numpy, float, nb::ndim<2>> decode_step(
    const nb::list& key_segments, const nb::list& value_segments, Array<float, nb::ndim<3>> queries, Array<float> key_rotation,
    Array<float> value_back, int64_t key_dim, int64_t value_dim, int64_t n, Array<float, nb::ndim<2>> key_mean,
    Array<float, nb::ndim<2>> value_mean, Array<float, nb::ndim<3>> sink_keys, Array<float, nb::ndim<3>> sink_values,
    Array<float, nb::ndim<3>> window_keys, Array<float, nb::ndim<3>> window_values, Array<uint8_t> valid,
    int64_t heads_per_batch, int threads) {
  const int64_t heads = static_cast<int64_t>(queries.shape(0)), group = static_cast<int64_t>(queries.shape(1));
  const int64_t dim = static_cast<int64_t>(queries.shape(2));
  require(n >= 0 && heads_per_batch >= 1 && heads % heads_per_batch == 0, "bad token count or heads per batch");
  const auto [rotation, rotation_stride] =
      per_head_matrix(key_rotation, heads_per_batch, dim, key_dim, "key_rotation must be (dim, key_dim) or one per head");
  const auto [back, back_stride] =
      per_head_matrix(value_back, heads_per_batch, value_dim, dim, "value_back must be (value_dim, dim) or one per head");
  for (const auto* mean : {&key_mean, &value_mean})
    require(static_cast<int64_t>(mean->shape(0)) == heads && static_cast<int64_t>(mean->shape(1)) == dim,
            "means must be (heads, dim)");
  const tqvec::ExactTokens sinks = exact_tokens(sink_keys, sink_values, heads, dim, 0);
  const tqvec::ExactTokens window = exact_tokens(window_keys, window_values, heads, dim, sinks.count + n);
  require(valid.size() == 0 || static_cast<int64_t>(valid.size()) == heads / heads_per_batch * (window.first_column + window.count),
          "valid must be (batches, sinks + n + window)");
  std::vector<Array<uint8_t, nb::ndim<3>>> codes_kept;
  std::vector<Array<float, nb::ndim<2>>> scales_kept;
  auto keys = coded_segments(key_segments, heads, n, key_dim, codes_kept, scales_kept);
  auto values = coded_segments(value_segments, heads, n, value_dim, codes_kept, scales_kept);
  auto* out = new float[static_cast<size_t>(heads * group * dim)];
  auto result = owned(out, heads * group, dim);
  const tqvec::StepArgs args{{std::move(keys), std::move(values), nullptr, heads, group, key_dim, value_dim, n, nullptr, 0,
                              heads_per_batch, threads, nullptr, nullptr, nullptr},
                             queries.data(), dim, rotation, rotation_stride, back, back_stride, key_mean.data(),
                             value_mean.data(), sinks, window, optional_data(valid), out};
  {
    nb::gil_scoped_release release;
    tqvec::decode_step(args);
  }
  return result;
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "Fast-scan top-k search over packed TurboQuant codes (see tqvec/_fastscan.py).";
  // Plans live in the code tables of quantizers, which module-level caches (KV codecs, kernels) may hold until the
  // interpreter exits: they are still referenced then, not leaked, and nanobind's exit report would say otherwise.
  nb::set_leak_warnings(false);
  nb::class_<PlanHandle>(m, "Plan", "The checked steps that read one packed layout.")
      .def(nb::init<Array<int32_t, nb::ndim<1>>, Array<int32_t, nb::ndim<1>>, Array<int32_t, nb::ndim<1>>,
                    Array<int32_t, nb::ndim<2>>, Array<int32_t, nb::ndim<1>>, Array<float, nb::ndim<1>>>(),
           nb::arg("byte"), nb::arg("shift"), nb::arg("width"), nb::arg("channel"), nb::arg("offset"), nb::arg("level"));
  nb::class_<RowsHandle>(m, "Rows", "Rows to search: codes, side fields, groups and their fast-scan layout.")
      .def(nb::init<Array<uint8_t, nb::ndim<2>>, Array<float>, Array<float>, Array<int64_t, nb::ndim<1>>, Array<int64_t>,
                    const PlanHandle&, const std::string&, Array<float>>(),
           nb::arg("packed"), nb::arg("scale"), nb::arg("bias"), nb::arg("offsets"), nb::arg("list_rows"), nb::arg("plan"),
           nb::arg("layout"), nb::arg("reference"))
      .def_prop_ro("layout_nbytes", &RowsHandle::layout_nbytes, "Bytes of the fast-scan layout (0 when not arranged).");
  m.def("search", &search, nb::arg("plan"), nb::arg("rows"), nb::arg("queries"), nb::arg("probe"), nb::arg("probe_constant"),
        nb::arg("k"), nb::arg("rescore"), nb::arg("confidence"), nb::arg("threads"), nb::arg("max_isa"));
  nb::class_<QueryHandle>(m, "Queries", "What an index does to its queries before the scan.")
      .def(nb::init<int64_t, Array<float>, Array<float>, int, bool, Array<float>, Array<float>, Array<float>, bool, Array<float>,
                    double>(),
           nb::arg("dim"), nb::arg("rotation"), nb::arg("signs"), nb::arg("rounds"), nb::arg("normalize"), nb::arg("center"),
           nb::arg("centroids"), nb::arg("half_squared"), nb::arg("residual"), nb::arg("base"), nb::arg("max_squared_norm"));
  m.def("search_queries", &search_queries, nb::arg("plan"), nb::arg("rows"), nb::arg("prep"), nb::arg("queries"),
        nb::arg("ids"), nb::arg("l2"), nb::arg("n_probe"), nb::arg("k"), nb::arg("rescore"), nb::arg("confidence"),
        nb::arg("threads"), nb::arg("max_isa"));
  m.def("decode_step", &decode_step, nb::arg("key_segments"), nb::arg("value_segments"), nb::arg("queries"),
        nb::arg("key_rotation"), nb::arg("value_back"), nb::arg("key_dim"), nb::arg("value_dim"), nb::arg("n"),
        nb::arg("key_mean"), nb::arg("value_mean"), nb::arg("sink_keys"), nb::arg("sink_values"), nb::arg("window_keys"),
        nb::arg("window_values"), nb::arg("valid"), nb::arg("heads_per_batch"), nb::arg("threads"));
  m.def("has_avx2", &tqvec::has_avx2, "True when this CPU runs the AVX2 kernel.");
  m.def("has_avx512", &tqvec::has_avx512, "True when this CPU runs the AVX-512 kernel.");
  m.def("has_avx512_vnni", &tqvec::has_avx512_vnni, "True when this CPU runs the int8 batch kernel (AVX-512 VNNI).");
  m.def("has_amx", &tqvec::has_amx, "True when the int8 batch kernel runs its products on AMX tiles (AMX-INT8).");
}
