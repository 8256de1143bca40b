// Python bindings of the fast-scan search (module tqvec._native); the Python side is tqvec/_fastscan.py.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>

#include "fastscan.h"

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

nb::tuple search(Array<uint8_t, nb::ndim<2>> packed, Array<int32_t, nb::ndim<1>> step_byte,
                 Array<int32_t, nb::ndim<1>> step_shift, Array<int32_t, nb::ndim<1>> step_width,
                 Array<int32_t, nb::ndim<2>> step_channel, Array<int32_t, nb::ndim<1>> step_offset,
                 Array<float, nb::ndim<1>> step_level,
                 Array<float, nb::ndim<2>> queries, Array<float> scale, Array<float> bias,
                 Array<int64_t, nb::ndim<1>> offsets, Array<int64_t> list_rows, Array<int64_t> probe,
                 Array<float> probe_constant, int64_t k, int64_t rescore, int threads, bool allow_simd) {
  const int64_t n = static_cast<int64_t>(packed.shape(0)), row_bytes = static_cast<int64_t>(packed.shape(1));
  const size_t steps = step_byte.shape(0);
  const int64_t nq = static_cast<int64_t>(queries.shape(0)), dim = static_cast<int64_t>(queries.shape(1));
  require(step_shift.shape(0) == steps && step_width.shape(0) == steps, "step arrays differ in length");
  require(step_channel.shape(0) == steps && step_channel.shape(1) == tqvec::kMaxStepChannels, "step_channel must be (steps, 4)");
  require(step_offset.shape(0) == steps + 1 && step_offset.data()[0] == 0, "step_offset must be (steps + 1,) from 0");
  require(step_level.shape(0) == tqvec::kMaxStepChannels * static_cast<size_t>(step_offset.data()[steps]),
          "step_level must hold 4 levels per table entry");
  for (size_t t = 0; t < steps; ++t) {
    const int32_t b = step_byte.data()[t], s = step_shift.data()[t], w = step_width.data()[t];
    require(w >= 1 && w <= 8 && s >= 0 && s < 8 && b >= 0 && b + (s + w > 8 ? 1 : 0) < row_bytes, "step outside the row");
    require(step_offset.data()[t + 1] - step_offset.data()[t] == (1 << w), "a step table must have 2^width entries");
    for (int j = 0; j < tqvec::kMaxStepChannels; ++j) {
      const int32_t c = step_channel.data()[t * tqvec::kMaxStepChannels + j];
      require(c >= -1 && c < dim, "step channel outside the query");
      require(j == 0 || c == -1 || step_channel.data()[t * tqvec::kMaxStepChannels + j - 1] >= 0,
              "a step's channels must fill its first slots");
    }
  }
  require(scale.size() == 0 || scale.size() == static_cast<size_t>(n), "scale must have one entry per row");
  require(bias.size() == 0 || bias.size() == static_cast<size_t>(n), "bias must have one entry per row");
  const int64_t n_groups = static_cast<int64_t>(offsets.shape(0)) - 1;
  require(n_groups >= 1, "offsets must have at least two entries");
  const int64_t* off = offsets.data();
  // list_rows entries are trusted to lie in [0, n): tqvec/_fastscan.py checks them once per index snapshot
  for (int64_t g = 0; g < n_groups; ++g) require(off[g] >= 0 && off[g] <= off[g + 1], "offsets must be non-decreasing from 0");
  require(off[n_groups] <= (list_rows.size() ? static_cast<int64_t>(list_rows.size()) : n), "offsets reach past the rows");
  int64_t n_probe = 1;
  if (probe.size()) {
    require(probe.ndim() == 2 && probe.shape(0) == static_cast<size_t>(nq), "probe must be (nq, nprobe)");
    n_probe = static_cast<int64_t>(probe.shape(1));
    require(probe_constant.size() == 0 || probe_constant.size() == probe.size(), "probe_constant must match probe");
  } else {
    require(n_groups == 1, "several groups need probe");
  }
  require(k >= 1 && rescore >= 0, "k must be positive and rescore non-negative");

  auto* values = new float[static_cast<size_t>(nq * k)];
  auto* rows = new int64_t[static_cast<size_t>(nq * k)];
  nb::capsule own_values(values, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  nb::capsule own_rows(rows, [](void* p) noexcept { delete[] static_cast<int64_t*>(p); });

  tqvec::SearchArgs args{
      {static_cast<int>(steps), step_byte.data(), step_shift.data(), step_width.data(), step_channel.data(),
       step_offset.data(), step_level.data()},
      {packed.data(), n, row_bytes, optional_data(scale), optional_data(bias)},
      {off, optional_data(list_rows), n_groups, optional_data(probe), optional_data(probe_constant), n_probe},
      queries.data(), nq, dim, k, rescore, threads, values, rows};
  std::string kernel;
  {
    nb::gil_scoped_release release;
    kernel = tqvec::search(args, allow_simd);
  }
  const size_t shape[2] = {static_cast<size_t>(nq), static_cast<size_t>(k)};
  return nb::make_tuple(nb::ndarray<nb::numpy, float, nb::ndim<2>>(values, 2, shape, own_values),
                        nb::ndarray<nb::numpy, int64_t, nb::ndim<2>>(rows, 2, shape, own_rows), kernel);
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "Fast-scan top-k search over packed TurboQuant codes (see tqvec/_fastscan.py).";
  m.def("search", &search, nb::arg("packed"), nb::arg("step_byte"), nb::arg("step_shift"), nb::arg("step_width"),
        nb::arg("step_channel"), nb::arg("step_offset"), nb::arg("step_level"), nb::arg("queries"), nb::arg("scale"), nb::arg("bias"),
        nb::arg("offsets"), nb::arg("list_rows"), nb::arg("probe"), nb::arg("probe_constant"), nb::arg("k"),
        nb::arg("rescore"), nb::arg("threads"), nb::arg("allow_simd"));
  m.def("has_avx2", &tqvec::has_avx2, "True when this CPU runs the AVX2 kernel.");
}
