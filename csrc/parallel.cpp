// The thread pool behind parallel.h: threads are started on first need (no more than any caller asked for) and
// then wait for jobs; a job is a caller's chunk counter, which the caller and the helpers that joined it drain.
// After fork() the child starts a pool of its own (the parent's threads do not exist there).
//
// Where the time of a 16-thread batch went on the device host's Xeon (bench/results/native_runs/pool-spin): waking
// sleeping helpers (each wake cost the waker ~10 us in these virtual machines, and the last helper joined 50-150 us
// into the job) and waiting, after the last chunk, for helpers that had joined without taking one (25-60 us). So a
// job lives on the heap, shared with the helpers that joined it, and the caller waits for its chunks only; the caller
// polls for its last chunks, and after a search's job the helpers poll for the next job (Idle::kSpin), as OpenMP's
// threads do, before they sleep.
#include "parallel.h"

#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TQVEC_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define TQVEC_PAUSE() asm volatile("yield")
#else
#define TQVEC_PAUSE() ((void)0)
#endif

namespace tqvec {
namespace {

using Clock = std::chrono::steady_clock;

struct Job {
  const std::function<void(size_t)>* body;
  size_t chunks;
  Idle idle;
  std::atomic<size_t> next{0};
  std::atomic<size_t> finished{0};  // chunks done
  int wanted = 0;                   // helpers that may still join (under the pool's mutex)
};

// The CPUs this process may run on.
int usable_cpus() {
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

// Whether threads may poll instead of sleeping at once: not under OMP_WAIT_POLICY=passive.
bool polling_allowed() {
  static const bool allowed = [] {
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    return policy == nullptr || strcasecmp(policy, "passive") != 0;
  }();
  return allowed;
}

struct Pool {
  std::mutex mutex;
  std::condition_variable work, done;
  std::deque<std::shared_ptr<Job>> queue;
  std::atomic<size_t> queued{0};  // queue.size(), for helpers that poll without the mutex
  std::atomic<int> started{0};    // helpers (changed under the mutex)
  std::atomic<int> callers{0};    // threads inside run_chunks with helpers
  int sleeping = 0;               // helpers waiting on `work` (under the mutex)
  const int cpus = usable_cpus();  // when the pool starts (a forked child starts its own)
  pid_t pid = getpid();

  // Whether threads may poll: allowed, and the helpers and the callers each have a CPU of their own (several callers
  // at once may otherwise be more threads than CPUs, and a thread that polls holds a CPU that one with work could use).
  bool may_poll() const { return polling_allowed() && started.load() + callers.load() <= cpus; }
};

// Polls until done() or kSpinMicroseconds have passed; returns done(). done() is read after every pause (a pause takes
// up to ~140 cycles), the clock after every 64.
template <class Done>
bool poll(Done done) {
  const auto until = Clock::now() + std::chrono::microseconds(kSpinMicroseconds);
  for (unsigned i = 1;; ++i) {
    if (done()) return true;
    TQVEC_PAUSE();
    if (i % 64 == 0 && Clock::now() >= until) return done();
  }
}

// Runs chunks of `job` until none is left; returns how many it ran.
size_t drain(Job& job) {
  size_t ran = 0;
  for (size_t c; (c = job.next.fetch_add(1)) < job.chunks; ++ran) (*job.body)(c);
  return ran;
}

void serve(Pool* pool) {
  std::unique_lock<std::mutex> lock(pool->mutex);
  bool spin = false;  // poll before sleeping: the last job asked for it
  for (;;) {
    if (spin && pool->queue.empty()) {
      lock.unlock();
      poll([pool] { return pool->queued.load(std::memory_order_acquire) != 0; });
      lock.lock();
    }
    ++pool->sleeping;
    pool->work.wait(lock, [pool] { return !pool->queue.empty(); });
    --pool->sleeping;
    std::shared_ptr<Job> job = pool->queue.front();
    if (--job->wanted == 0) {
      pool->queue.pop_front();
      pool->queued.store(pool->queue.size(), std::memory_order_release);
    }
    lock.unlock();
    const size_t ran = drain(*job);
    spin = job->idle == Idle::kSpin && pool->may_poll();
    const bool last = ran && job->finished.fetch_add(ran, std::memory_order_acq_rel) + ran == job->chunks;
    lock.lock();
    if (last) pool->done.notify_all();  // under the mutex: a caller between its check and its wait cannot miss it
  }
}

std::atomic<Pool*> current{nullptr};

Pool* pool_of_this_process() {
  Pool* pool = current.load();
  if (pool == nullptr || pool->pid != getpid()) {  // first use, or a forked child: a pool of its own
    Pool* fresh = new Pool;                        // never freed: detached threads wait on it for the process's life
    if (current.compare_exchange_strong(pool, fresh)) return fresh;
    delete fresh;
    return current.load();
  }
  return pool;
}

}  // namespace

void run_chunks(size_t chunks, int threads, const std::function<void(size_t)>& body, Idle idle) {
  const int helpers = static_cast<int>(std::min<size_t>(static_cast<size_t>(std::max(1, threads)), chunks)) - 1;
  if (helpers <= 0) {
    for (size_t c = 0; c < chunks; ++c) body(c);
    return;
  }
  Pool* pool = pool_of_this_process();
  pool->callers.fetch_add(1);
  // On the heap, shared with the helpers that join it: one that joins after the last chunk was taken finds none and
  // lets go, and the caller need not wait for it (body is only called for a chunk taken, before `finished` counts it).
  auto job = std::make_shared<Job>();
  job->body = &body;
  job->chunks = chunks;
  job->idle = idle;
  job->wanted = helpers;
  bool wake_all;
  {
    std::lock_guard<std::mutex> lock(pool->mutex);
    for (; pool->started.load() < helpers; pool->started.fetch_add(1)) std::thread(serve, pool).detach();
    pool->queue.push_back(job);
    pool->queued.store(pool->queue.size(), std::memory_order_release);
    wake_all = helpers >= pool->sleeping;
  }
  if (wake_all) {
    pool->work.notify_all();  // one call for all: each wake costs the caller time
  } else {
    for (int i = 0; i < helpers; ++i) pool->work.notify_one();  // only as many as the job wants: idle helpers that an
  }                                                              // earlier, wider job started stay asleep
  const size_t ran = drain(*job);
  job->finished.fetch_add(ran, std::memory_order_acq_rel);
  {
    std::lock_guard<std::mutex> lock(pool->mutex);
    for (auto it = pool->queue.begin(); it != pool->queue.end(); ++it)
      if (it->get() == job.get()) {  // every chunk is taken: helpers that have not joined yet need not
        pool->queue.erase(it);
        pool->queued.store(pool->queue.size(), std::memory_order_release);
        break;
      }
  }
  auto over = [&job] { return job->finished.load(std::memory_order_acquire) == job->chunks; };
  if (!(pool->may_poll() && poll(over))) {
    std::unique_lock<std::mutex> lock(pool->mutex);
    pool->done.wait(lock, over);
  }
  pool->callers.fetch_sub(1);
}

}  // namespace tqvec
