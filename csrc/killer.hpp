#pragma once

// Monitor-process side of native monitoring: liveness of a rank through a
// pidfd, the SIGTERM/SIGCONT/grace/SIGKILL sequence, and the thread that
// enforces the hard timeout read from the rank's heartbeat page.
//
// A pidfd names one process, not a number: once the process is gone a signal
// through it fails with ESRCH instead of reaching whoever reused the pid, and
// it becomes readable the moment the process exits, so death is an event to
// wait on rather than something to poll for.

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

namespace inprocess {

// Opens a pidfd (close-on-exec) for `pid`. Throws std::system_error; on a
// kernel without pidfd_open (before Linux 5.3) the message says so.
int pidfd_open(pid_t pid);

// Waits until the process behind `pidfd` has exited (is a zombie or reaped),
// for at most `timeout_ns` (>= 0). Returns at once when it dies; restarts
// after EINTR with the remaining time. Throws std::system_error when `pidfd`
// is not a pidfd.
bool wait_for_exit(int pidfd, int64_t timeout_ns);

enum class KillOutcome : int32_t {
  kAlreadyExited = 0,     // dead before the sequence began: no signal was sent
  kExitedDuringGrace = 1, // died after SIGTERM + SIGCONT, within the grace time
  kKilled = 2,            // still alive after the grace: SIGKILL sent, death seen
  kKillUnconfirmed = 3,   // SIGKILL sent, but no death within kill_wait (e.g. stuck in a driver, state D)
  kSignalFailed = 4,      // a signal could not be sent (KillResult::error holds errno, e.g. EPERM, EBADF)
};

// What kill_sequence did, with CLOCK_MONOTONIC timestamps (0: did not happen).
struct KillResult {
  KillOutcome outcome = KillOutcome::kSignalFailed;
  int error = 0;
  int64_t started_ns = 0;
  int64_t term_sent_ns = 0;
  int64_t kill_sent_ns = 0;
  int64_t dead_ns = 0;  // the pidfd reported the death
  int64_t finished_ns = 0;

  int64_t elapsed_ns() const noexcept { return finished_ns - started_ns; }
  bool dead() const noexcept { return dead_ns != 0; }
};

constexpr int64_t kDefaultKillWaitNs = 5'000'000'000;  // after SIGKILL, how long to wait to see the death

// SIGTERM + SIGCONT, wait up to `grace_ns` for the death, then SIGKILL and wait
// up to `kill_wait_ns` to see it. SIGCONT lets a stopped rank (SIGSTOP, a
// debugger detached badly) act on SIGTERM during the grace; it comes second
// so that a stopped rank whose SIGTERM is fatal (no handler: the default) dies
// without running again. Sent first, it let such a rank run between the two
// signals: a rank frozen on its way to a restart barrier arrived there, healthy,
// before the SIGTERM ended it, and the job needed a second restart to exclude it
// (a loaded machine, tests/test_fault_matrix.py's rank frozen at the barrier;
// tests/test_native_killer.py shows it with the rank scheduled first).
//
// Only system calls happen here (pidfd_send_signal, ppoll, clock_gettime): no
// allocation, no lock, no CUDA/NCCL/Python, so it can run from any thread of
// a monitor whatever state the rest of the process is in.
KillResult kill_sequence(int pidfd, int64_t grace_ns, int64_t kill_wait_ns = kDefaultKillWaitNs) noexcept;

// The same for a pid: opens a pidfd first, so that a pid recycled during the
// sequence is never signalled. A pid that no longer exists is kAlreadyExited.
KillResult kill_pid_sequence(pid_t pid, int64_t grace_ns, int64_t kill_wait_ns = kDefaultKillWaitNs) noexcept;

enum class GuardEventKind : int32_t {
  kExited = 0,       // the rank died by itself (or after a kill whose death was unconfirmed)
  kHardTimeout = 1,  // the hard timeout passed; the kill sequence ran (see GuardEvent::kill)
};

struct GuardEvent {
  GuardEventKind kind = GuardEventKind::kExited;
  int64_t detected_ns = 0;       // kExited: death seen; kHardTimeout: the deadline was found passed
  int64_t last_progress_ns = 0;  // the progress the deadline counted from (kHardTimeout)
  int64_t deadline_ns = 0;       // last_progress_ns + hard_timeout_ns (kHardTimeout)
  int64_t iteration = 0;         // from the page when the event happened
  int32_t phase = 0;
  KillResult kill{};  // kHardTimeout only
};

// A thread that watches one rank: its pidfd for death, its heartbeat page for
// the hard timeout. The deadline is min(auto, manual if kManualArmed) progress
// + hard_timeout_ns from the page; the thread sleeps exactly until it (or the
// rank's death, or stop()), re-reads the page, and runs kill_sequence only
// when it has really passed. There is no polling interval:
//  - progress only moves forward and arming the manual clock stamps it, so a
//    deadline computed now is the earliest one possible;
//  - while kHangProtectionOff is set, the next check is one hard timeout later:
//    leaving the block restamps progress, so no deadline can pass sooner;
//  - while the page has no hard timeout (0), it re-reads every idle_recheck_ns.
// Events go to the owner through wait_event(). After the rank's death the
// thread ends.
class HardTimeoutGuard {
 public:
  // Maps the page behind `heartbeat_fd` and duplicates `pidfd`: the caller
  // keeps its own descriptors.
  HardTimeoutGuard(int heartbeat_fd, int pidfd, int64_t grace_ns, int64_t kill_wait_ns = kDefaultKillWaitNs,
                   int64_t idle_recheck_ns = 1'000'000'000);
  HardTimeoutGuard(const HardTimeoutGuard&) = delete;
  HardTimeoutGuard& operator=(const HardTimeoutGuard&) = delete;
  // Asks the thread to stop and never blocks: a thread still inside a kill
  // sequence finishes it on its own (its state is shared, not owned here).
  ~HardTimeoutGuard();

  void start();
  // Asks the thread to stop and joins it; false if it did not end within
  // `timeout_ns` (only possible while a kill sequence runs).
  bool stop(int64_t timeout_ns);
  // The next event, or nothing after `timeout_ns`; returns at once when the
  // thread has ended and every event was taken.
  std::optional<GuardEvent> wait_event(int64_t timeout_ns);
  bool running() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
  std::mutex lifecycle_;  // serialises start/stop/destruction, which own thread_
  std::thread thread_;
};

}  // namespace inprocess
