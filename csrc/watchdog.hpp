#pragma once

// Training-process side of native monitoring: a C++ thread that asks for
// automatic-progress stamps and detects the soft timeout without the GIL.
//
// The thread never stamps progress itself (that would prove only that the
// thread runs). It asks, through `request_stamp`, for a stamp to be made by
// the main thread when it next runs Python bytecode; a main thread stuck in
// native code, or sleeping in a call that released the GIL, then makes no
// automatic progress and the soft timeout passes. Detection reads only the
// heartbeat page, so it works while another thread holds the GIL forever.

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace inprocess {

struct SoftTimeoutEvent {
  int64_t iteration = 0;         // from the page: the iteration that stopped making progress
  int64_t detected_ns = 0;       // CLOCK_MONOTONIC when the watchdog saw the deadline passed
  int64_t deadline_ns = 0;       // last_progress_ns + soft_timeout_ns
  int64_t last_progress_ns = 0;  // the progress the deadline counted from
  bool manual = false;           // the manual clock (ping) was the stale one
};

class Watchdog {
 public:
  // Called from the watchdog thread every interval. Must return at once (the
  // bindings queue a pending call; they never wait for the main thread).
  using RequestStamp = std::function<void()>;
  // Called from the watchdog thread at most once per iteration. Must not
  // block and must not call stop() (the bindings hand it to a new thread).
  using OnSoftTimeout = std::function<void(const SoftTimeoutEvent&)>;

  // Maps its own view of the page behind `heartbeat_fd`, so that the page
  // object of the caller may be closed first.
  Watchdog(int heartbeat_fd, int64_t interval_ns, RequestStamp request_stamp, OnSoftTimeout on_soft_timeout);
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  // Stops the thread; never blocks longer than a second (then the thread is
  // left to end on its own, keeping its shared state alive).
  ~Watchdog();

  // Starts the thread; the first stamp is requested at once. Once only.
  void start();
  // Asks the thread to stop and joins it; false if it did not end within
  // `timeout_ns` (only possible while a callback blocks the thread).
  bool stop(int64_t timeout_ns);
  bool running() const;

  uint64_t stamp_requests() const noexcept;
  uint64_t soft_timeouts() const noexcept;

  struct State;

 private:
  std::shared_ptr<State> state_;
  std::mutex lifecycle_;  // serialises start/stop/destruction, which own thread_
  std::thread thread_;
};

}  // namespace inprocess
