#pragma once

// Runs a blocking GPU library call on a native thread and waits for it no
// longer than a deadline (design principle 7). A call into a wedged driver
// cannot be cancelled: past the deadline the caller gets "timed out" and the
// worker thread is abandoned (it ends if the call ever returns); the next
// call gets a fresh thread. Jobs must own what they touch (capture shared
// state by value), since an abandoned job outlives its caller's frame.
//
// One thread is kept waiting between calls, so a call costs a wake-up, not a
// thread creation (the abort path's own overhead, benchmarks/README.md).

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

namespace inprocess::gpu {

class DeadlineWorker {
 public:
  explicit DeadlineWorker(std::string name);
  DeadlineWorker(const DeadlineWorker&) = delete;
  DeadlineWorker& operator=(const DeadlineWorker&) = delete;
  // Never blocks: a thread still inside a call is left to finish it.
  ~DeadlineWorker();

  // True when `job` returned within `timeout_ns` (>= 0); false when it was
  // abandoned. Calls are serialised.
  bool run(std::function<void()> job, int64_t timeout_ns);

  // Worker threads abandoned at a deadline in this process, all workers.
  static uint64_t abandoned_total();

  struct Thread;

 private:
  std::shared_ptr<Thread> fresh_thread();
  std::string name_;
  std::mutex mu_;
  std::shared_ptr<Thread> thread_;
};

}  // namespace inprocess::gpu
