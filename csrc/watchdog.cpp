#include "watchdog.hpp"

#include <sys/prctl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <limits>
#include <stdexcept>
#include <utility>

#include "clock.hpp"
#include "heartbeat.hpp"

namespace inprocess {
namespace {


// CLOCK_MONOTONIC deadline → steady_clock time point. Measured as an offset
// from "now" on both clocks rather than assuming they share an epoch.
std::chrono::steady_clock::time_point to_steady(int64_t deadline_ns) {
  return steady_deadline(deadline_ns - monotonic_ns());
}

}  // namespace

struct Watchdog::State {
  State(HeartbeatPage p, int64_t interval, RequestStamp request, OnSoftTimeout on_timeout)
      : page(std::move(p)),
        interval_ns(interval),
        request_stamp(std::move(request)),
        on_soft_timeout(std::move(on_timeout)) {}

  HeartbeatPage page;
  const int64_t interval_ns;
  RequestStamp request_stamp;
  OnSoftTimeout on_soft_timeout;

  std::mutex mu;
  std::condition_variable cv;
  bool started = false;
  bool stop_requested = false;
  bool finished = false;

  std::atomic<uint64_t> stamp_requests{0};
  std::atomic<uint64_t> soft_timeouts{0};

  void run() {
    // The default 50 us timer slack would be added to every wake-up at a
    // deadline; this thread sleeps rarely enough that precision is free.
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
    const HeartbeatLayout* p = page.layout();
    int64_t next_stamp = monotonic_ns();
    bool fired = false;
    int64_t fired_iteration = 0;

    std::unique_lock<std::mutex> lock(mu);
    while (!stop_requested) {
      int64_t now = monotonic_ns();
      if (now >= next_stamp) {
        lock.unlock();
        request_stamp();
        lock.lock();
        stamp_requests.fetch_add(1, std::memory_order_relaxed);
        // A fixed cadence; after a long stall (suspend, overload) restart it
        // from now instead of firing a burst of requests to catch up.
        next_stamp = add_saturated(next_stamp, interval_ns);
        if (next_stamp <= now) next_stamp = add_saturated(now, interval_ns);
        now = monotonic_ns();
      }
      int64_t wake = next_stamp;

      // Flags and iteration with acquire: begin_iteration() and leaving
      // disable_hang_protection() restamp progress before publishing them.
      const uint32_t flags = p->flags.load(std::memory_order_acquire);
      const int64_t iteration = p->iteration.load(std::memory_order_acquire);
      const int64_t soft = p->soft_timeout_ns.load(std::memory_order_acquire);
      const bool done_this_iteration = fired && fired_iteration == iteration;
      if (soft > 0 && !(flags & kHangProtectionOff) && !done_this_iteration) {
        const int64_t auto_ns = p->auto_progress_ns.load(std::memory_order_acquire);
        int64_t progress = auto_ns;
        bool manual = false;
        if (flags & kManualArmed) {
          const int64_t manual_ns = p->manual_progress_ns.load(std::memory_order_acquire);
          if (manual_ns < auto_ns) {
            progress = manual_ns;
            manual = true;
          }
        }
        const int64_t deadline = add_saturated(progress, soft);
        if (now >= deadline) {
          SoftTimeoutEvent event{};
          event.iteration = iteration;
          event.detected_ns = now;
          event.deadline_ns = deadline;
          event.last_progress_ns = progress;
          event.manual = manual;
          fired = true;
          fired_iteration = iteration;
          soft_timeouts.fetch_add(1, std::memory_order_relaxed);
          lock.unlock();
          on_soft_timeout(event);
          lock.lock();
        } else {
          // Sleep exactly until the deadline: progress made meanwhile only
          // moves it later, which the re-check at wake-up sees.
          wake = std::min(wake, deadline);
        }
      }
      // A new iteration is noticed at the next stamp tick at the latest
      // (interval < soft timeout, validated by the Python configuration).
      cv.wait_until(lock, to_steady(wake), [this] { return stop_requested; });
    }
    finished = true;
    cv.notify_all();
  }
};

Watchdog::Watchdog(int heartbeat_fd, int64_t interval_ns, RequestStamp request_stamp,
                   OnSoftTimeout on_soft_timeout) {
  if (interval_ns <= 0) throw std::invalid_argument("Watchdog: interval_ns must be > 0");
  if (!request_stamp || !on_soft_timeout) throw std::invalid_argument("Watchdog: both callbacks are required");
  state_ = std::make_shared<State>(HeartbeatPage::attach(heartbeat_fd), interval_ns, std::move(request_stamp),
                                   std::move(on_soft_timeout));
}

Watchdog::~Watchdog() {
  if (!stop(1'000'000'000)) {
    std::lock_guard<std::mutex> lifecycle(lifecycle_);
    thread_.detach();  // the thread holds its own reference to the state
  }
}

void Watchdog::start() {
  std::lock_guard<std::mutex> lifecycle(lifecycle_);
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->started) throw std::logic_error("Watchdog can be started once");
    state_->started = true;
  }
  std::shared_ptr<State> state = state_;
  try {
    thread_ = std::thread([state] { state->run(); });
  } catch (...) {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->finished = true;
    throw;
  }
}

bool Watchdog::stop(int64_t timeout_ns) {
  std::lock_guard<std::mutex> lifecycle(lifecycle_);
  if (!thread_.joinable()) return true;
  const auto until = steady_deadline(timeout_ns);
  {
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->stop_requested = true;
    state_->cv.notify_all();
    if (!state_->cv.wait_until(lock, until, [this] { return state_->finished; })) return false;
  }
  thread_.join();
  return true;
}

bool Watchdog::running() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->started && !state_->finished;
}

uint64_t Watchdog::stamp_requests() const noexcept {
  return state_->stamp_requests.load(std::memory_order_relaxed);
}

uint64_t Watchdog::soft_timeouts() const noexcept { return state_->soft_timeouts.load(std::memory_order_relaxed); }

}  // namespace inprocess
