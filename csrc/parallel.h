// A minimal fork-join helper shared by the native kernels.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <thread>
#include <vector>

namespace tqvec {

// Runs f(begin, end) over consecutive chunks of [0, n) of at most `grain` indices on up to `threads` threads
// (inline for one): each thread takes the next chunk when it is done with one, so uneven items balance.
template <class F>
void parallel_for(size_t n, int threads, F&& f, size_t grain = 1) {
  grain = std::max<size_t>(1, grain);
  const size_t chunks = (n + grain - 1) / grain;
  const size_t workers = std::min<size_t>(static_cast<size_t>(std::max(1, threads)), chunks);
  if (workers <= 1) {
    if (n) f(size_t{0}, n);
    return;
  }
  std::atomic<size_t> next{0};
  auto run = [&]() {
    for (size_t c; (c = next.fetch_add(1)) < chunks;) f(c * grain, std::min(n, (c + 1) * grain));
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < workers; ++t) pool.emplace_back(run);
  run();  // the calling thread works too
  for (auto& th : pool) th.join();
}

}  // namespace tqvec
