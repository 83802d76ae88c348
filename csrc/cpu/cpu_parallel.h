// Work distribution on XLA's intra-op thread pool without oversubscription or deadlock.
#ifndef ATTNAUX_CSRC_CPU_CPU_PARALLEL_H_
#define ATTNAUX_CSRC_CPU_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace attnaux::cpu {

namespace ffi = xla::ffi;

// Runs body(task) for every task in [0, num_tasks), each exactly once. The calling thread works
// too; at most min(pool threads, num_tasks) - 1 helpers are scheduled, and all pull task indices
// from one atomic counter. The shared state is owned by a shared_ptr, so a helper that the pool
// starts only after everything is done finds no task and touches nothing else. The caller waits
// only for tasks that were already claimed (a claimed task is running), hence no deadlock even
// when the pool never runs the helpers. Which thread runs a task never changes what it computes:
// every task owns its outputs.
template <typename Body>
void ParallelFor(ffi::ThreadPool* pool, int64_t num_tasks, const Body& body) {
  if (num_tasks <= 0) return;
  int64_t threads = pool != nullptr ? pool->num_threads() : 0;
  int64_t helpers = std::min(threads, num_tasks) - 1;
  if (helpers <= 0) {
    for (int64_t t = 0; t < num_tasks; ++t) body(t);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t num_tasks = 0;
    const Body* body = nullptr;
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  state->num_tasks = num_tasks;
  state->body = &body;
  auto work = [](State& s) {
    for (;;) {
      int64_t t = s.next.fetch_add(1, std::memory_order_relaxed);
      if (t >= s.num_tasks) return;
      (*s.body)(t);
      if (s.done.fetch_add(1, std::memory_order_acq_rel) + 1 == s.num_tasks) {
        std::lock_guard<std::mutex> lock(s.mu);
        s.cv.notify_all();
      }
    }
  };
  for (int64_t i = 0; i < helpers; ++i) {
    pool->Schedule([state, work]() { work(*state); });
  }
  work(*state);
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load(std::memory_order_acquire) == num_tasks; });
}

}  // namespace attnaux::cpu

#endif  // ATTNAUX_CSRC_CPU_CPU_PARALLEL_H_
