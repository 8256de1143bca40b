// Fork-join over chunks of work, on a pool of threads started once per process (see parallel.cpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>

namespace tqvec {

// Runs body(c) for every chunk c in [0, chunks) on the calling thread and up to `threads` - 1 pool threads; each
// thread takes the next chunk when it is done with one, so uneven chunks balance. Returns when all are done.
// Several callers may run at once (they share the pool); body must not throw.
void run_chunks(size_t chunks, int threads, const std::function<void(size_t)>& body);

// Runs f(begin, end) over consecutive ranges of [0, n) of at most `grain` indices (see run_chunks).
template <class F>
void parallel_for(size_t n, int threads, F&& f, size_t grain = 1) {
  grain = std::max<size_t>(1, grain);
  const size_t chunks = (n + grain - 1) / grain;
  if (threads <= 1 || chunks <= 1) {
    if (n) f(size_t{0}, n);
    return;
  }
  run_chunks(chunks, threads, [&](size_t c) { f(c * grain, std::min(n, (c + 1) * grain)); });
}

}  // namespace tqvec
