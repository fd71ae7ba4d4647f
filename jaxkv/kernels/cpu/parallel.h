// Work split over XLA's intra-op thread pool (the FFI's ThreadPool context): what every kernel
// of jaxkv/kernels/cpu uses to run on all the cores the process is given.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jaxkv {

namespace ffi = xla::ffi;

// Calls fn(begin, end) on disjoint chunks covering [0, n), chunks of at least `grain` items,
// on the calling thread and the pool's threads, and returns once every chunk has run.
//
// Deadlock-free when the caller is itself a pool thread: chunks are taken from a shared counter,
// so the caller alone finishes the work if no scheduled task ever starts, and the caller waits
// for the chunks to be done, never for the tasks to start (a late task finds none and returns;
// the state it reads is shared-owned, so it outlives the call).
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t grain, const F& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t max_chunks = (n + grain - 1) / grain;
  const int64_t workers = std::max<int64_t>(pool.num_threads(), 1) + 1;
  const int64_t chunks = std::min<int64_t>(max_chunks, workers * 4);
  if (chunks <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mutex;
    std::condition_variable all_done;
  };
  auto state = std::make_shared<State>();
  const F* body = &fn;  // read only while chunks remain, i.e. before this call returns
  auto run_chunks = [state, body, n, chunks]() {
    for (int64_t c; (c = state->next.fetch_add(1)) < chunks;) {
      (*body)(n * c / chunks, n * (c + 1) / chunks);
      if (state->done.fetch_add(1) + 1 == chunks) {
        std::lock_guard<std::mutex> lock(state->mutex);
        state->all_done.notify_all();
      }
    }
  };
  // Schedule(F&&) stores an F: hand it a copy (an lvalue would make F a reference type).
  for (int64_t t = 0; t < std::min(workers - 1, chunks - 1); ++t) pool.Schedule(decltype(run_chunks)(run_chunks));
  run_chunks();
  std::unique_lock<std::mutex> lock(state->mutex);
  state->all_done.wait(lock, [&] { return state->done.load() == chunks; });
}

}  // namespace jaxkv
