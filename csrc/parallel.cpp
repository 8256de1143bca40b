// The thread pool behind parallel.h: threads are started on first need (no more than any caller asked for) and
// then wait for jobs; a job is a caller's chunk counter, which the caller and the helpers that joined it drain.
// After fork() the child starts a pool of its own (the parent's threads do not exist there).
#include "parallel.h"

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace tqvec {
namespace {

struct Job {
  const std::function<void(size_t)>* body;
  size_t chunks;
  std::atomic<size_t> next{0};
  size_t finished = 0;  // chunks done (under the pool's mutex)
  int wanted = 0;       // helpers that may still join (under the mutex)
  int helping = 0;      // helpers inside the job (under the mutex)
};

struct Pool {
  std::mutex mutex;
  std::condition_variable work, done;
  std::deque<Job*> queue;
  int started = 0;
  pid_t pid = getpid();
};

// Runs chunks of `job` until none is left; returns how many it ran.
size_t drain(Job& job) {
  size_t ran = 0;
  for (size_t c; (c = job.next.fetch_add(1)) < job.chunks; ++ran) (*job.body)(c);
  return ran;
}

void serve(Pool* pool) {
  std::unique_lock<std::mutex> lock(pool->mutex);
  for (;;) {
    pool->work.wait(lock, [pool] { return !pool->queue.empty(); });
    Job* job = pool->queue.front();
    if (--job->wanted == 0) pool->queue.pop_front();
    ++job->helping;
    lock.unlock();
    const size_t ran = drain(*job);
    lock.lock();
    job->finished += ran;
    if (--job->helping == 0 && job->finished == job->chunks) pool->done.notify_all();
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

void run_chunks(size_t chunks, int threads, const std::function<void(size_t)>& body) {
  const int helpers = static_cast<int>(std::min<size_t>(static_cast<size_t>(std::max(1, threads)), chunks)) - 1;
  if (helpers <= 0) {
    for (size_t c = 0; c < chunks; ++c) body(c);
    return;
  }
  Pool* pool = pool_of_this_process();
  Job job;
  job.body = &body;
  job.chunks = chunks;
  job.wanted = helpers;
  {
    std::lock_guard<std::mutex> lock(pool->mutex);
    for (; pool->started < helpers; ++pool->started) std::thread(serve, pool).detach();
    pool->queue.push_back(&job);
  }
  for (int i = 0; i < helpers; ++i) pool->work.notify_one();  // only as many as the job wants: idle helpers that an
                                                               // earlier, wider job started stay asleep
  const size_t ran = drain(job);
  std::unique_lock<std::mutex> lock(pool->mutex);
  job.finished += ran;
  for (auto it = pool->queue.begin(); it != pool->queue.end(); ++it)
    if (*it == &job) {  // helpers that have not joined yet never will: every chunk is taken
      pool->queue.erase(it);
      break;
    }
  pool->done.wait(lock, [&job] { return job.helping == 0 && job.finished == job.chunks; });
}

}  // namespace tqvec
