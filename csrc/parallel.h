// Fork-join over chunks of work, on a pool of threads started once per process (see parallel.cpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>

namespace tqvec {

// What the pool's threads do after a job, while they wait for the next one.
enum class Idle {
  kSleep,  // sleep at once: for work that alternates with torch's own threads (attention between torch ops)
  kSpin,   // poll for the next job for up to kSpinMicroseconds first, as OpenMP's threads do (searches: a search's
           // parallel regions and back-to-back batch calls then start without waking sleeping threads)
};

// How long the pool's threads poll for a job after a kSpin job, and the calling thread for the last chunks of its own
// job, before they sleep. Neither polls where the pool's threads and the threads calling into it outnumber the CPUs the
// process had when the pool started, or where OMP_WAIT_POLICY is "passive" (the standard switch, read once per process).
constexpr long kSpinMicroseconds = 2000;

// Runs body(c) for every chunk c in [0, chunks) on the calling thread and up to `threads` - 1 pool threads; each
// thread takes the next chunk when it is done with one, so uneven chunks balance. Returns when all chunks are done
// (not waiting for pool threads that came too late to take one). Several callers may run at once (they share the
// pool); body must not throw.
void run_chunks(size_t chunks, int threads, const std::function<void(size_t)>& body, Idle idle = Idle::kSleep);

// Runs f(begin, end) over consecutive ranges of [0, n) of at most `grain` indices (see run_chunks).
template <class F>
void parallel_for(size_t n, int threads, F&& f, size_t grain = 1, Idle idle = Idle::kSleep) {
  grain = std::max<size_t>(1, grain);
  const size_t chunks = (n + grain - 1) / grain;
  if (threads <= 1 || chunks <= 1) {
    if (n) f(size_t{0}, n);
    return;
  }
  run_chunks(chunks, threads, [&](size_t c) { f(c * grain, std::min(n, (c + 1) * grain)); }, idle);
}

}  // namespace tqvec
