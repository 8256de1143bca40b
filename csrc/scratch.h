// Per-thread buffers that a search's call sites reuse from call to call.
//
// A one-query search on a small index spent about a sixth of its native time in malloc and free (its tables, rotated
// query and candidate buffers, allocated and zeroed on every call). Scratch<T, Site> lends the calling thread's
// buffer of call site `Site` (a tag type) for n values of T, uninitialized, and keeps it for the thread's next call
// unless it grew past kKeptScratchBytes (a large batch's buffers are freed when the lease ends). Buffers start on a
// cache line (kScratchAlign): a 784-d query rotation on 16-byte-aligned rows (malloc's) took 1.15-1.2x as long here.
#pragma once

#include <algorithm>
#include <cstddef>
#include <new>
#include <memory>
#include <stdexcept>
#include <type_traits>

namespace tqvec {

// Bytes a call site's buffer may keep per thread between calls.
constexpr size_t kKeptScratchBytes = size_t{1} << 20;
// The alignment of every scratch buffer (a cache line).
constexpr size_t kScratchAlign = 64;

// The calling thread's buffer of call site `Site`, at least n values of T, for the lease's lifetime. One lease per
// site and thread at a time (a second raises std::logic_error: a nested use would share the storage).
template <class T, class Site>
class Scratch {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>, "scratch values are plain data");

 public:
  explicit Scratch(size_t n) : buffer_(slot()) {
    if (buffer_.leased) throw std::logic_error("a scratch buffer was leased twice on one thread");
    if (buffer_.size < n) {
      buffer_.data.reset();  // the old storage first: the peak stays one buffer
      buffer_.size = 0;      // and no stale size if the allocation below throws
      buffer_.data.reset(new (std::align_val_t(std::max(kScratchAlign, alignof(T)))) T[n]);
      buffer_.size = n;
    }
    buffer_.leased = true;
  }
  ~Scratch() {
    buffer_.leased = false;
    if (buffer_.size * sizeof(T) > kKeptScratchBytes) {
      buffer_.data.reset();
      buffer_.size = 0;
    }
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  T* get() const { return buffer_.data.get(); }
  T& operator[](size_t i) const { return buffer_.data[i]; }

 private:
  struct AlignedDelete {
    void operator()(T* p) const { ::operator delete[](p, std::align_val_t(std::max(kScratchAlign, alignof(T)))); }
  };
  struct Buffer {
    std::unique_ptr<T[], AlignedDelete> data;
    size_t size = 0;
    bool leased = false;
  };
  static Buffer& slot() {
    thread_local Buffer buffer;
    return buffer;
  }
  Buffer& buffer_;
};

}  // namespace tqvec
