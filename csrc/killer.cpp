#include "killer.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>

#include "clock.hpp"
#include "heartbeat.hpp"

// Older C library headers lack the numbers; these two are the same on every
// architecture that uses the unified syscall table (Linux 5.1+).
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace inprocess {
namespace {

constexpr int64_t kNsPerSec = 1'000'000'000;

// The raw system calls. syscall(2) only stores errno besides trapping, so
// both are as async-signal-safe as the kernel calls themselves.
int sys_pidfd_open(pid_t pid) noexcept {
  // pidfds are always close-on-exec; flags 0 asks for a plain process pidfd.
  return static_cast<int>(syscall(SYS_pidfd_open, pid, 0u));
}

int sys_pidfd_send_signal(int pidfd, int sig) noexcept {
  return static_cast<int>(syscall(SYS_pidfd_send_signal, pidfd, sig, nullptr, 0u));
}

enum class Wake { kExited, kOther, kTimeout, kError };

// Waits for the pidfd (or `other_fd`, when >= 0) to become readable, until
// `deadline_ns` on CLOCK_MONOTONIC (< 0: no deadline). ppoll takes a
// nanosecond timeout, so the wake-up is as exact as the scheduler allows.
// A signal (EINTR) restarts the wait with what is left of the same deadline.
Wake wait_readable(int pidfd, int other_fd, int64_t deadline_ns) noexcept {
  for (;;) {
    pollfd fds[2] = {{pidfd, POLLIN, 0}, {other_fd, POLLIN, 0}};
    const nfds_t count = other_fd >= 0 ? 2 : 1;
    timespec remaining{};
    timespec* timeout = nullptr;
    if (deadline_ns >= 0) {
      const int64_t left = std::max<int64_t>(0, deadline_ns - monotonic_ns());
      remaining.tv_sec = static_cast<time_t>(left / kNsPerSec);
      remaining.tv_nsec = static_cast<long>(left % kNsPerSec);
      timeout = &remaining;
    }
    const int ready = ppoll(fds, count, timeout, nullptr);
    if (ready < 0) {
      if (errno == EINTR) continue;
      return Wake::kError;
    }
    if (fds[0].revents & POLLNVAL) {
      errno = EBADF;
      return Wake::kError;
    }
    // POLLIN: exited; POLLHUP (newer kernels): exited and reaped.
    if (fds[0].revents != 0) return Wake::kExited;
    if (count == 2 && fds[1].revents != 0) return Wake::kOther;
    if (ready == 0) {
      // The kernel may round the timeout; only report a timeout that is real.
      if (deadline_ns >= 0 && monotonic_ns() < deadline_ns) continue;
      return Wake::kTimeout;
    }
  }
}


KillResult finish(KillResult r, KillOutcome outcome, int error = 0) noexcept {
  r.outcome = outcome;
  r.error = error;
  r.finished_ns = monotonic_ns();
  return r;
}

}  // namespace

int pidfd_open(pid_t pid) {
  const int fd = sys_pidfd_open(pid);
  if (fd >= 0) return fd;
  const int err = errno;
  if (err == ENOSYS) {
    throw std::system_error(err, std::generic_category(),
                            "pidfd_open: this kernel has no pidfds (Linux >= 5.3 needed); a monitor cannot "
                            "see its rank's death at once nor signal it without a pid-reuse race");
  }
  throw std::system_error(err, std::generic_category(), "pidfd_open(" + std::to_string(pid) + ")");
}

bool wait_for_exit(int pidfd, int64_t timeout_ns) {
  if (timeout_ns < 0) throw std::invalid_argument("wait_for_exit: timeout_ns must be >= 0");
  const int64_t deadline = add_saturated(monotonic_ns(), timeout_ns);
  // Signal 0 sends nothing: it tells a process already reaped (ESRCH) from a
  // descriptor that is no pidfd (EBADF, EINVAL), which poll would report as
  // "readable" and so as a death.
  if (sys_pidfd_send_signal(pidfd, 0) != 0) {
    if (errno == ESRCH) return true;
    throw std::system_error(errno, std::generic_category(),
                            "wait_for_exit: fd " + std::to_string(pidfd) + " is not a pidfd");
  }
  switch (wait_readable(pidfd, -1, deadline)) {
    case Wake::kExited:
      return true;
    case Wake::kTimeout:
    case Wake::kOther:
      return false;
    case Wake::kError:
      break;
  }
  throw std::system_error(errno, std::generic_category(), "wait_for_exit: ppoll");
}

KillResult kill_sequence(int pidfd, int64_t grace_ns, int64_t kill_wait_ns) noexcept {
  KillResult r{};
  r.started_ns = monotonic_ns();
  grace_ns = std::max<int64_t>(0, grace_ns);
  kill_wait_ns = std::max<int64_t>(0, kill_wait_ns);

  // Already gone? A reaped process answers ESRCH, a zombie makes the pidfd
  // readable; either way nothing must be sent.
  if (sys_pidfd_send_signal(pidfd, 0) != 0) {
    if (errno != ESRCH) return finish(r, KillOutcome::kSignalFailed, errno);
    r.dead_ns = monotonic_ns();
    return finish(r, KillOutcome::kAlreadyExited);
  }
  if (wait_readable(pidfd, -1, 0) == Wake::kExited) {
    r.dead_ns = monotonic_ns();
    return finish(r, KillOutcome::kAlreadyExited);
  }

  // From here ESRCH means it died while we were signalling it.
  if (sys_pidfd_send_signal(pidfd, SIGTERM) != 0) {
    if (errno != ESRCH) return finish(r, KillOutcome::kSignalFailed, errno);
    r.dead_ns = monotonic_ns();
    return finish(r, KillOutcome::kAlreadyExited);
  }
  r.term_sent_ns = monotonic_ns();
  // SIGCONT second (header): a stopped process whose SIGTERM is fatal has died of it already
  // (ESRCH here, or a zombie that takes the signal); one with a handler runs it once continued.
  if (sys_pidfd_send_signal(pidfd, SIGCONT) != 0 && errno != ESRCH) {
    return finish(r, KillOutcome::kSignalFailed, errno);
  }

  switch (wait_readable(pidfd, -1, add_saturated(r.term_sent_ns, grace_ns))) {
    case Wake::kExited:
      r.dead_ns = monotonic_ns();
      return finish(r, KillOutcome::kExitedDuringGrace);
    case Wake::kError:
      return finish(r, KillOutcome::kSignalFailed, errno);
    case Wake::kTimeout:
    case Wake::kOther:
      break;
  }

  if (sys_pidfd_send_signal(pidfd, SIGKILL) != 0) {
    if (errno != ESRCH) return finish(r, KillOutcome::kSignalFailed, errno);
    r.dead_ns = monotonic_ns();
    return finish(r, KillOutcome::kExitedDuringGrace);
  }
  r.kill_sent_ns = monotonic_ns();

  // SIGKILL cannot be caught, but a task in uninterruptible sleep (a wedged
  // driver call) dies only when it leaves it: bound the wait and say so.
  switch (wait_readable(pidfd, -1, add_saturated(r.kill_sent_ns, kill_wait_ns))) {
    case Wake::kExited:
      r.dead_ns = monotonic_ns();
      return finish(r, KillOutcome::kKilled);
    case Wake::kError:
      return finish(r, KillOutcome::kKillUnconfirmed, errno);
    case Wake::kTimeout:
    case Wake::kOther:
      break;
  }
  return finish(r, KillOutcome::kKillUnconfirmed);
}

KillResult kill_pid_sequence(pid_t pid, int64_t grace_ns, int64_t kill_wait_ns) noexcept {
  const int pidfd = sys_pidfd_open(pid);
  if (pidfd < 0) {
    KillResult r{};
    r.started_ns = monotonic_ns();
    if (errno == ESRCH) {
      r.dead_ns = r.started_ns;
      return finish(r, KillOutcome::kAlreadyExited);
    }
    return finish(r, KillOutcome::kSignalFailed, errno);
  }
  const KillResult r = kill_sequence(pidfd, grace_ns, kill_wait_ns);
  ::close(pidfd);
  return r;
}

// ---------------------------------------------------------------------------
// HardTimeoutGuard

// Everything the guard's thread touches. It is shared between the owner and
// the thread so that an owner that gives up waiting (stop's deadline, its
// destructor) never pulls memory or descriptors from under a kill in progress.
struct HardTimeoutGuard::State {
  State(HeartbeatPage p, int own_pidfd, int own_stop_fd, int64_t grace, int64_t kill_wait, int64_t idle_recheck)
      : page(std::move(p)),
        pidfd(own_pidfd),
        stop_fd(own_stop_fd),
        grace_ns(grace),
        kill_wait_ns(kill_wait),
        idle_recheck_ns(idle_recheck) {}
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() {
    ::close(pidfd);
    ::close(stop_fd);
  }

  HeartbeatPage page;
  const int pidfd;
  const int stop_fd;  // eventfd: stop() makes it readable, which ends any wait of the thread
  const int64_t grace_ns;
  const int64_t kill_wait_ns;
  const int64_t idle_recheck_ns;

  std::mutex mu;
  std::condition_variable cv;
  std::deque<GuardEvent> events;
  bool started = false;
  bool finished = false;

  void post(const GuardEvent& event) {
    std::lock_guard<std::mutex> lock(mu);
    events.push_back(event);
    cv.notify_all();
  }

  void mark_finished() {
    std::lock_guard<std::mutex> lock(mu);
    finished = true;
    cv.notify_all();
  }

  GuardEvent exited_event() const {
    GuardEvent e{};
    e.kind = GuardEventKind::kExited;
    e.detected_ns = monotonic_ns();
    const HeartbeatLayout* p = page.layout();
    e.iteration = p->iteration.load(std::memory_order_acquire);
    e.phase = p->phase.load(std::memory_order_acquire);
    return e;
  }

  // After a kill whose death was not seen: the death is still worth
  // reporting when it comes, but there is no deadline left to enforce.
  void wait_for_death_or_stop() {
    if (wait_readable(pidfd, stop_fd, -1) == Wake::kExited) post(exited_event());
  }

  void run() {
    // The default 50 us timer slack would be added to every wake-up at a
    // deadline; this thread sleeps rarely enough that precision is free.
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
    const HeartbeatLayout* p = page.layout();
    for (;;) {
      const int64_t now = monotonic_ns();
      // Flags first, with acquire: leaving disable_hang_protection() restamps
      // progress before it clears the flag, so a cleared flag read here comes
      // with the fresh progress.
      const uint32_t flags = p->flags.load(std::memory_order_acquire);
      const int64_t hard = p->hard_timeout_ns.load(std::memory_order_acquire);
      int64_t wake;
      if (hard <= 0) {
        wake = add_saturated(now, idle_recheck_ns);
      } else if (flags & kHangProtectionOff) {
        wake = add_saturated(now, hard);
      } else {
        int64_t progress = p->auto_progress_ns.load(std::memory_order_acquire);
        if (flags & kManualArmed) {
          progress = std::min(progress, p->manual_progress_ns.load(std::memory_order_acquire));
        }
        const int64_t deadline = add_saturated(progress, hard);
        if (now >= deadline) {
          enforce(progress, deadline, now);
          return;
        }
        wake = deadline;
      }
      switch (wait_readable(pidfd, stop_fd, wake)) {
        case Wake::kExited:
          post(exited_event());
          return;
        case Wake::kOther:
        case Wake::kError:  // an unusable pidfd: nothing left to watch
          return;
        case Wake::kTimeout:
          break;
      }
    }
  }

  void enforce(int64_t progress, int64_t deadline, int64_t detected) {
    const HeartbeatLayout* p = page.layout();
    GuardEvent e{};
    e.kind = GuardEventKind::kHardTimeout;
    e.detected_ns = detected;
    e.last_progress_ns = progress;
    e.deadline_ns = deadline;
    e.iteration = p->iteration.load(std::memory_order_acquire);
    e.phase = p->phase.load(std::memory_order_acquire);
    e.kill = kill_sequence(pidfd, grace_ns, kill_wait_ns);
    if (e.kill.outcome == KillOutcome::kAlreadyExited) {
      // It died on its own at the deadline: no signal reached it.
      GuardEvent exited = exited_event();
      exited.detected_ns = e.kill.dead_ns;
      post(exited);
      return;
    }
    post(e);
    if (!e.kill.dead()) wait_for_death_or_stop();
  }
};

HardTimeoutGuard::HardTimeoutGuard(int heartbeat_fd, int pidfd, int64_t grace_ns, int64_t kill_wait_ns,
                                   int64_t idle_recheck_ns) {
  if (grace_ns < 0 || kill_wait_ns < 0) throw std::invalid_argument("HardTimeoutGuard: negative grace or kill wait");
  if (idle_recheck_ns <= 0) throw std::invalid_argument("HardTimeoutGuard: idle_recheck_ns must be > 0");
  // Same check as wait_for_exit: a regular fd would look "exited" at once.
  if (sys_pidfd_send_signal(pidfd, 0) != 0 && errno != ESRCH) {
    throw std::system_error(errno, std::generic_category(),
                            "HardTimeoutGuard: fd " + std::to_string(pidfd) + " is not a pidfd");
  }
  HeartbeatPage page = HeartbeatPage::attach(heartbeat_fd);
  const int own_pidfd = fcntl(pidfd, F_DUPFD_CLOEXEC, 0);
  if (own_pidfd < 0) throw std::system_error(errno, std::generic_category(), "HardTimeoutGuard: dup(pidfd)");
  const int stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (stop_fd < 0) {
    const int err = errno;
    ::close(own_pidfd);
    throw std::system_error(err, std::generic_category(), "HardTimeoutGuard: eventfd");
  }
  state_ = std::make_shared<State>(std::move(page), own_pidfd, stop_fd, grace_ns, kill_wait_ns, idle_recheck_ns);
}

HardTimeoutGuard::~HardTimeoutGuard() {
  std::lock_guard<std::mutex> lifecycle(lifecycle_);
  if (!thread_.joinable()) return;
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(state_->stop_fd, &one, sizeof one);
  bool finished;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    finished = state_->finished;
  }
  if (finished) {
    thread_.join();
  } else {
    thread_.detach();  // it holds its own reference to the state
  }
}

void HardTimeoutGuard::start() {
  std::lock_guard<std::mutex> lifecycle(lifecycle_);
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    // One thread per guard: its stop descriptor stays readable once stopped.
    if (state_->started) throw std::logic_error("HardTimeoutGuard can be started once");
    state_->started = true;
  }
  std::shared_ptr<State> state = state_;
  try {
    thread_ = std::thread([state] {
      state->run();
      state->mark_finished();
    });
  } catch (...) {
    state_->mark_finished();
    throw;
  }
}

bool HardTimeoutGuard::stop(int64_t timeout_ns) {
  std::lock_guard<std::mutex> lifecycle(lifecycle_);
  if (!thread_.joinable()) return true;
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(state_->stop_fd, &one, sizeof one);
  const auto until = steady_deadline(timeout_ns);
  {
    std::unique_lock<std::mutex> lock(state_->mu);
    if (!state_->cv.wait_until(lock, until, [this] { return state_->finished; })) return false;
  }
  thread_.join();
  return true;
}

std::optional<GuardEvent> HardTimeoutGuard::wait_event(int64_t timeout_ns) {
  if (timeout_ns < 0) throw std::invalid_argument("wait_event: timeout_ns must be >= 0");
  const auto until = steady_deadline(timeout_ns);
  std::unique_lock<std::mutex> lock(state_->mu);
  // A guard never started has nothing to report either.
  state_->cv.wait_until(lock, until,
                        [&] { return !state_->events.empty() || state_->finished || !state_->started; });
  if (state_->events.empty()) return std::nullopt;
  GuardEvent e = state_->events.front();
  state_->events.pop_front();
  return e;
}

bool HardTimeoutGuard::running() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->started && !state_->finished;
}

}  // namespace inprocess
