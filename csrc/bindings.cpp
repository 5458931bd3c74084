// The only pybind11 code of the project: module inprocess._native.
// Every call that can block releases the GIL (design principle 7). The
// heartbeat page's methods are a few atomic loads and stores: they keep the
// GIL, since releasing and re-taking it would cost several times the write
// and could hand the GIL to another thread in the middle of a ping().
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>
#include <unordered_set>

#include "clock.hpp"
#include "heartbeat.hpp"
#include "killer.hpp"
#include "node_board.hpp"
#include "watchdog.hpp"

namespace py = pybind11;
using inprocess::HeartbeatPage;
using inprocess::HeartbeatSnapshot;
using inprocess::Phase;

namespace {

void register_clock(py::module_& m) {
  m.def("monotonic_ns", &inprocess::monotonic_ns,
        "CLOCK_MONOTONIC in nanoseconds (the clock of every heartbeat timestamp).");
}

void register_heartbeat(py::module_& m) {
  py::enum_<Phase>(m, "Phase")
      .value("STARTING", Phase::kStarting)
      .value("INITIAL_BARRIER", Phase::kInitialBarrier)
      .value("RUNNING", Phase::kRunning)
      .value("ABORTING", Phase::kAborting)
      .value("FINALIZING", Phase::kFinalizing)
      .value("HEALTH_CHECK", Phase::kHealthCheck)
      .value("RESTART_BARRIER", Phase::kRestartBarrier)
      .value("COMPLETION", Phase::kCompletion)
      .value("TERMINATED", Phase::kTerminated)
      .value("DONE", Phase::kDone);

  m.attr("FLAG_MANUAL_ARMED") = py::int_(static_cast<uint32_t>(inprocess::kManualArmed));
  m.attr("FLAG_HANG_PROTECTION_OFF") = py::int_(static_cast<uint32_t>(inprocess::kHangProtectionOff));

  py::class_<HeartbeatSnapshot>(m, "HeartbeatSnapshot")
      .def_readonly("pid", &HeartbeatSnapshot::pid)
      .def_readonly("created_ns", &HeartbeatSnapshot::created_ns)
      .def_readonly("auto_progress_ns", &HeartbeatSnapshot::auto_progress_ns)
      .def_readonly("manual_progress_ns", &HeartbeatSnapshot::manual_progress_ns)
      .def_readonly("iteration", &HeartbeatSnapshot::iteration)
      .def_property_readonly("phase", [](const HeartbeatSnapshot& s) { return static_cast<Phase>(s.phase); })
      .def_readonly("flags", &HeartbeatSnapshot::flags)
      .def_readonly("soft_timeout_ns", &HeartbeatSnapshot::soft_timeout_ns)
      .def_readonly("hard_timeout_ns", &HeartbeatSnapshot::hard_timeout_ns)
      .def_readonly("phase_since_ns", &HeartbeatSnapshot::phase_since_ns)
      .def_readonly("world_size", &HeartbeatSnapshot::world_size);

  py::class_<HeartbeatPage>(m, "HeartbeatPage")
      .def_static("create", &HeartbeatPage::create, "Create a fresh page (memfd, 0600, no name in /dev/shm).")
      .def_static("attach", &HeartbeatPage::attach, py::arg("fd"), "Map the page behind an inherited descriptor.")
      .def_property_readonly("fd", &HeartbeatPage::fd)
      .def_property_readonly("closed", &HeartbeatPage::closed)
      .def("close", &HeartbeatPage::close)
      .def("ping", &HeartbeatPage::ping)
      .def("stamp_auto", &HeartbeatPage::stamp_auto)
      .def("set_iteration", &HeartbeatPage::set_iteration, py::arg("iteration"))
      .def("set_phase", &HeartbeatPage::set_phase, py::arg("phase"))
      .def("set_timeouts", &HeartbeatPage::set_timeouts, py::arg("soft_ns"), py::arg("hard_ns"))
      .def("set_flag", &HeartbeatPage::set_flag, py::arg("flag"), py::arg("on"))
      .def("begin_iteration", &HeartbeatPage::begin_iteration, py::arg("iteration"), py::arg("world_size"))
      .def("snapshot", &HeartbeatPage::snapshot);
}

// ---------------------------------------------------------------------------
// Killer (monitor-process side)

void register_killer(py::module_& m) {
  // std::system_error carries an errno: raise it as OSError so that Python
  // sees ProcessLookupError, PermissionError, ... rather than RuntimeError.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::system_error& e) {
      py::tuple args = py::make_tuple(e.code().value(), e.what());
      PyErr_SetObject(PyExc_OSError, args.ptr());
    }
  });

  py::enum_<inprocess::KillOutcome>(m, "KillOutcome")
      .value("ALREADY_EXITED", inprocess::KillOutcome::kAlreadyExited)
      .value("EXITED_DURING_GRACE", inprocess::KillOutcome::kExitedDuringGrace)
      .value("KILLED", inprocess::KillOutcome::kKilled)
      .value("KILL_UNCONFIRMED", inprocess::KillOutcome::kKillUnconfirmed)
      .value("SIGNAL_FAILED", inprocess::KillOutcome::kSignalFailed);

  using inprocess::KillResult;
  py::class_<KillResult>(m, "KillResult", "What kill_sequence did; CLOCK_MONOTONIC ns, 0 where it did not happen.")
      .def_readonly("outcome", &KillResult::outcome)
      .def_readonly("error", &KillResult::error)
      .def_readonly("started_ns", &KillResult::started_ns)
      .def_readonly("term_sent_ns", &KillResult::term_sent_ns)
      .def_readonly("kill_sent_ns", &KillResult::kill_sent_ns)
      .def_readonly("dead_ns", &KillResult::dead_ns)
      .def_readonly("finished_ns", &KillResult::finished_ns)
      .def_property_readonly("elapsed_ns", &KillResult::elapsed_ns)
      .def_property_readonly("dead", &KillResult::dead)
      .def("__repr__", [](const KillResult& r) {
        return "KillResult(outcome=" + py::str(py::cast(r.outcome)).cast<std::string>() +
               ", elapsed_ns=" + std::to_string(r.elapsed_ns()) + ", error=" + std::to_string(r.error) + ")";
      });

  m.def("pidfd_open", &inprocess::pidfd_open, py::arg("pid"),
        "Open a pidfd (close-on-exec) for `pid`; the caller owns it. OSError where unsupported or gone.");
  m.def("wait_for_exit", &inprocess::wait_for_exit, py::arg("pidfd"), py::arg("timeout_ns"),
        py::call_guard<py::gil_scoped_release>(),
        "Wait up to `timeout_ns` for the process behind `pidfd` to exit; True as soon as it has.");
  m.def("kill_sequence", &inprocess::kill_sequence, py::arg("pidfd"), py::arg("grace_ns"),
        py::arg("kill_wait_ns") = inprocess::kDefaultKillWaitNs, py::call_guard<py::gil_scoped_release>(),
        "SIGCONT + SIGTERM, up to `grace_ns` for the death, then SIGKILL and up to `kill_wait_ns` to see it.");
  m.def("kill_pid_sequence", &inprocess::kill_pid_sequence, py::arg("pid"), py::arg("grace_ns"),
        py::arg("kill_wait_ns") = inprocess::kDefaultKillWaitNs, py::call_guard<py::gil_scoped_release>(),
        "kill_sequence for a pid, through a pidfd opened first (a recycled pid is never signalled).");

  py::enum_<inprocess::GuardEventKind>(m, "GuardEventKind")
      .value("EXITED", inprocess::GuardEventKind::kExited)
      .value("HARD_TIMEOUT", inprocess::GuardEventKind::kHardTimeout);

  using inprocess::GuardEvent;
  py::class_<GuardEvent>(m, "GuardEvent")
      .def_readonly("kind", &GuardEvent::kind)
      .def_readonly("detected_ns", &GuardEvent::detected_ns)
      .def_readonly("last_progress_ns", &GuardEvent::last_progress_ns)
      .def_readonly("deadline_ns", &GuardEvent::deadline_ns)
      .def_readonly("iteration", &GuardEvent::iteration)
      .def_property_readonly("phase", [](const GuardEvent& e) { return static_cast<Phase>(e.phase); })
      .def_property_readonly("kill",
                             [](const GuardEvent& e) -> std::optional<KillResult> {
                               if (e.kind != inprocess::GuardEventKind::kHardTimeout) return std::nullopt;
                               return e.kill;
                             })
      .def("__repr__", [](const GuardEvent& e) {
        return "GuardEvent(kind=" + py::str(py::cast(e.kind)).cast<std::string>() +
               ", detected_ns=" + std::to_string(e.detected_ns) + ", iteration=" + std::to_string(e.iteration) + ")";
      });

  using inprocess::HardTimeoutGuard;
  py::class_<HardTimeoutGuard>(m, "HardTimeoutGuard",
                               "Watches one rank (pidfd + heartbeat page) and kills it on a hard timeout.")
      .def(py::init<int, int, int64_t, int64_t, int64_t>(), py::arg("heartbeat_fd"), py::arg("pidfd"),
           py::arg("grace_ns"), py::arg("kill_wait_ns") = inprocess::kDefaultKillWaitNs,
           py::arg("idle_recheck_ns") = int64_t{1'000'000'000})
      .def("start", &HardTimeoutGuard::start)
      .def("stop", &HardTimeoutGuard::stop, py::arg("timeout_ns"), py::call_guard<py::gil_scoped_release>())
      .def("wait_event", &HardTimeoutGuard::wait_event, py::arg("timeout_ns"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("running", &HardTimeoutGuard::running);
}

// ---------------------------------------------------------------------------
// Node board (agent, ranks and monitors of one node)

using inprocess::NodeBoard;

// Seconds from Python -> a CLOCK_MONOTONIC deadline. Negative means "check
// once"; beyond the int64 range of nanoseconds (inf included), no deadline.
int64_t board_deadline(double timeout_s) {
  if (std::isnan(timeout_s)) throw py::value_error("timeout_s must be a number of seconds, not nan");
  if (timeout_s >= 9.2e9) return NodeBoard::kNoDeadline;
  return NodeBoard::deadline_after(timeout_s <= 0 ? 0 : static_cast<int64_t>(timeout_s * 1e9));
}

// Runs a board wait without the GIL. A signal interrupts the futex; the
// Python handlers then run (in the main thread) and may raise, so Ctrl-C and
// SIGTERM handlers work during a wait of any length. Otherwise the wait
// resumes against the same deadline.
template <class Wait>
int64_t wait_releasing_gil(Wait wait) {
  for (;;) {
    int64_t result;
    {
      py::gil_scoped_release nogil;
      result = wait();
    }
    if (result != NodeBoard::kInterrupted) return result;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

void register_node_board(py::module_& m) {
  py::class_<NodeBoard>(m, "NodeBoard",
                        "Shared memory of one node: the restart control plane between the node agent and its ranks.")
      .def_static("create", &NodeBoard::create, py::arg("slots"), py::arg("decision_capacity"),
                  "Create a fresh board (memfd, 0600); the caller is recorded as the agent.")
      .def_static("attach", &NodeBoard::attach, py::arg("fd"),
                  "Map the board behind `fd` through a duplicate: the caller keeps its own descriptor.")
      .def_property_readonly("fd", &NodeBoard::fd)
      .def_property_readonly("slots", &NodeBoard::slots)
      .def_property_readonly("decision_capacity", &NodeBoard::decision_capacity)
      .def_property_readonly("agent_pid", &NodeBoard::agent_pid)
      .def_property_readonly("closed", &NodeBoard::closed, "Closed by the agent: every wait returns -2.")
      .def("close", &NodeBoard::close, "Close the board for every process: waits return -2.")
      .def("unmap", &NodeBoard::unmap, "Unmap this view and close its descriptor.")
      .def("post_event", &NodeBoard::post_event, py::arg("iteration"), py::arg("complete"))
      .def("event", &NodeBoard::event, "The raw event word: -1, else 2 * iteration + complete.")
      .def(
          "wait_event",
          [](const NodeBoard& b, int64_t iteration, double timeout_s) {
            const int64_t deadline = board_deadline(timeout_s);
            return wait_releasing_gil([&] { return b.wait_event(iteration, deadline, true); });
          },
          py::arg("iteration"), py::arg("timeout_s"), "0 restart, 1 complete, -1 timeout, -2 closed.")
      .def("arrive", &NodeBoard::arrive, py::arg("slot"), py::arg("barrier"), py::arg("expected"))
      .def(
          "slot_arrival",
          [](const NodeBoard& b, int64_t slot) -> std::optional<std::pair<int64_t, int64_t>> {
            const auto a = b.slot_arrival(slot);
            if (!a) return std::nullopt;
            return std::make_pair(a->barrier, a->expected);
          },
          py::arg("slot"), "(barrier, expected) of the slot's latest arrival, or None.")
      .def("arrival_seq", &NodeBoard::arrival_seq)
      .def(
          "wait_arrivals",
          [](const NodeBoard& b, int64_t seen_seq, double timeout_s) {
            const int64_t deadline = board_deadline(timeout_s);
            return wait_releasing_gil([&] { return b.wait_arrivals(seen_seq, deadline, true); });
          },
          py::arg("seen_seq"), py::arg("timeout_s"), "The new arrival sequence, -1 timeout, -2 closed.")
      .def("set_leader", &NodeBoard::set_leader, py::arg("slot"), py::arg("barrier"))
      .def("leads", &NodeBoard::leads, py::arg("slot"), "The barrier the slot was named to lead, -1 if none.")
      .def("mark_forwarded", &NodeBoard::mark_forwarded, py::arg("slot"), py::arg("barrier"))
      .def("forwarded", &NodeBoard::forwarded, py::arg("slot"), "The last barrier the agent counted the slot at, -1 if none.")
      .def(
          "post_decision",
          [](NodeBoard& b, int64_t barrier, const py::bytes& data) {
            // Straight from the bytes object's buffer: no copy into a std::string.
            char* buffer = nullptr;
            Py_ssize_t size = 0;
            if (PyBytes_AsStringAndSize(data.ptr(), &buffer, &size) != 0) throw py::error_already_set();
            b.post_decision(barrier, buffer, static_cast<size_t>(size));
          },
          py::arg("barrier"), py::arg("data"), "Larger than decision_capacity: recorded as an overflow.")
      .def(
          "read_decision",
          [](const NodeBoard& b) -> py::object {
            const auto d = b.read_decision();
            if (!d) return py::none();
            py::object data = d->overflow ? py::object(py::none()) : py::object(py::bytes(d->data));
            return py::make_tuple(d->barrier, data);
          },
          "(barrier, bytes) of the latest decision, bytes None on overflow; None before the first.")
      .def(
          "wait_outcome",
          [](const NodeBoard& b, int64_t slot, int64_t barrier, double timeout_s) {
            const int64_t deadline = board_deadline(timeout_s);
            return wait_releasing_gil([&] { return b.wait_outcome(slot, barrier, deadline, true); });
          },
          py::arg("slot"), py::arg("barrier"), py::arg("timeout_s"),
          "1 the slot leads the barrier, 2 a decision for it is posted, -1 timeout, -2 closed.")
      .def("beat", &NodeBoard::beat)
      .def("beats", &NodeBoard::beats);
}

// ---------------------------------------------------------------------------
// Watchdog (training-process side)

// The target of the automatic-progress pending call. Shared with every
// queued call, so a call that runs after its watchdog is gone still stamps a
// mapped page.
struct AutoStamp {
  explicit AutoStamp(HeartbeatPage p) : page(std::move(p)) {}
  HeartbeatPage page;
  std::atomic<bool> pending{false};
};

// Runs in the main thread at a bytecode boundary: proof that it runs Python.
int run_auto_stamp(void* arg) {
  std::unique_ptr<std::shared_ptr<AutoStamp>> holder(static_cast<std::shared_ptr<AutoStamp>*>(arg));
  (*holder)->page.stamp_auto();
  (*holder)->pending.store(false, std::memory_order_release);
  return 0;
}

// Why a pending call alone is not enough: up to Python 3.11, a pending call
// added from a thread other than the main one does not set the eval breaker
// (COMPUTE_EVAL_BREAKER asks whether the *calling* thread may run pending
// calls), so a main thread busy in a Python loop would never look at it. A
// thread that waits for the GIL makes the main thread look: after the switch
// interval it raises the GIL drop request, and the main thread runs pending
// calls before it hands the GIL over. When the main thread sleeps with the
// GIL released, the nudge takes the GIL at once and no stamp is made, as it
// should be. This thread, not the watchdog, is the one that may wait on the
// GIL (forever, if the main thread holds it in native code).
struct GilNudge {
  std::mutex mu;
  std::condition_variable cv;
  bool requested = false;
  bool stop_requested = false;
  bool finished = false;

  void run() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [this] { return requested || stop_requested; });
      if (stop_requested) break;
      requested = false;
      lock.unlock();
      {
        py::gil_scoped_acquire gil;
      }
      lock.lock();
    }
    finished = true;
    cv.notify_all();
  }

  // Never blocks: a nudge still waiting for the GIL absorbs this one.
  void request() {
    std::lock_guard<std::mutex> lock(mu);
    requested = true;
    cv.notify_all();
  }
};

// From the watchdog thread, without the GIL (Py_AddPendingCall needs none).
// At most one call is queued: a stuck main thread must not fill the
// interpreter's small pending-call queue, which signal handling shares. The
// nudge is sent on every tick, so a call queued while the main thread slept
// runs soon after it returns to Python.
void request_auto_stamp(const std::shared_ptr<AutoStamp>& stamp, GilNudge& nudge) {
  if (!stamp->pending.exchange(true, std::memory_order_acq_rel)) {
    auto* holder = new (std::nothrow) std::shared_ptr<AutoStamp>(stamp);
    if (holder == nullptr || Py_AddPendingCall(&run_auto_stamp, holder) != 0) {
      delete holder;
      stamp->pending.store(false, std::memory_order_release);
      return;
    }
  }
  nudge.request();
}

thread_local bool t_in_soft_timeout_callback = false;

// The Python side of on_soft_timeout: the callable and the count of
// callback threads still running it.
struct SoftTimeoutDispatch {
  explicit SoftTimeoutDispatch(py::function cb) : callback(std::move(cb)) {}
  SoftTimeoutDispatch(const SoftTimeoutDispatch&) = delete;
  SoftTimeoutDispatch& operator=(const SoftTimeoutDispatch&) = delete;
  ~SoftTimeoutDispatch() {
    // The last reference may go away in a thread without the GIL. After the
    // interpreter is gone the reference is left alone rather than touched.
    if (callback && Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      callback.release().dec_ref();
    } else {
      callback.release();
    }
  }

  py::function callback;
  std::mutex mu;
  std::condition_variable cv;
  int in_flight = 0;
};

void run_soft_timeout_callback(std::shared_ptr<SoftTimeoutDispatch> dispatch, inprocess::SoftTimeoutEvent event) {
  {
    py::gil_scoped_acquire gil;
    t_in_soft_timeout_callback = true;
    try {
      dispatch->callback(event);
    } catch (py::error_already_set& e) {
      // Like an exception in a threading.Thread: reported, not fatal.
      e.discard_as_unraisable("inprocess._native.Watchdog on_soft_timeout");
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      PyErr_WriteUnraisable(dispatch->callback.ptr());
    }
    t_in_soft_timeout_callback = false;
  }
  std::lock_guard<std::mutex> lock(dispatch->mu);
  --dispatch->in_flight;
  dispatch->cv.notify_all();
}

// From the watchdog thread: a fresh thread waits for the GIL, so the
// watchdog itself never does (a main thread holding the GIL forever must not
// stop detection, nor the monitor's hard timeout that follows).
void dispatch_soft_timeout(const std::shared_ptr<SoftTimeoutDispatch>& dispatch,
                           const inprocess::SoftTimeoutEvent& event) {
  {
    std::lock_guard<std::mutex> lock(dispatch->mu);
    ++dispatch->in_flight;
  }
  try {
    std::thread(run_soft_timeout_callback, dispatch, event).detach();
  } catch (const std::system_error&) {
    std::lock_guard<std::mutex> lock(dispatch->mu);
    --dispatch->in_flight;
    dispatch->cv.notify_all();
  }
}

class PyWatchdog;

// Live watchdogs, stopped at interpreter exit: a callback thread must not
// start waiting for the GIL of an interpreter being finalised. Leaked on
// purpose so that it outlives every static destructor.
std::mutex& watchdogs_mutex() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::unordered_set<PyWatchdog*>& live_watchdogs() {
  static auto* set = new std::unordered_set<PyWatchdog*>;
  return *set;
}

class PyWatchdog {
 public:
  PyWatchdog(int heartbeat_fd, int64_t interval_ns, py::function on_soft_timeout)
      : stamp_(std::make_shared<AutoStamp>(HeartbeatPage::attach(heartbeat_fd))),
        nudge_(std::make_shared<GilNudge>()),
        dispatch_(std::make_shared<SoftTimeoutDispatch>(std::move(on_soft_timeout))) {
    std::shared_ptr<AutoStamp> stamp = stamp_;
    std::shared_ptr<GilNudge> nudge = nudge_;
    std::shared_ptr<SoftTimeoutDispatch> dispatch = dispatch_;
    core_ = std::make_unique<inprocess::Watchdog>(
        heartbeat_fd, interval_ns, [stamp, nudge] { request_auto_stamp(stamp, *nudge); },
        [dispatch](const inprocess::SoftTimeoutEvent& e) { dispatch_soft_timeout(dispatch, e); });
    std::lock_guard<std::mutex> lock(watchdogs_mutex());
    live_watchdogs().insert(this);
  }
  PyWatchdog(const PyWatchdog&) = delete;
  PyWatchdog& operator=(const PyWatchdog&) = delete;

  // Runs with the GIL held (object deallocation): released while stopping,
  // since callback threads need it to finish.
  ~PyWatchdog() {
    py::gil_scoped_release nogil;
    {
      std::lock_guard<std::mutex> lock(watchdogs_mutex());
      live_watchdogs().erase(this);
    }
    stop(1'000'000'000);
    core_.reset();
    // It holds its own reference to the nudge state.
    if (nudge_thread_.joinable()) nudge_thread_.detach();
  }

  void start() {
    std::lock_guard<std::mutex> lock(lifecycle_);
    core_->start();  // throws when started before: the nudge thread is not started twice
    std::shared_ptr<GilNudge> nudge = nudge_;
    nudge_thread_ = std::thread([nudge] { nudge->run(); });
  }

  // Without the GIL. After True, no callback runs any more (except the one
  // calling stop(), if any).
  bool stop(int64_t timeout_ns) {
    std::lock_guard<std::mutex> lock(lifecycle_);
    constexpr int64_t kLongest = 1'000'000'000'000'000'000;  // ~30 years: the time point cannot overflow
    const auto until =
        std::chrono::steady_clock::now() + std::chrono::nanoseconds(std::clamp<int64_t>(timeout_ns, 0, kLongest));
    bool stopped = core_->stop(timeout_ns);
    if (nudge_thread_.joinable()) {
      std::unique_lock<std::mutex> nudge_lock(nudge_->mu);
      nudge_->stop_requested = true;
      nudge_->cv.notify_all();
      if (nudge_->cv.wait_until(nudge_lock, until, [this] { return nudge_->finished; })) {
        nudge_lock.unlock();
        nudge_thread_.join();
      } else {
        stopped = false;  // still waiting for a GIL held elsewhere; joined by a later stop
      }
    }
    const int own = t_in_soft_timeout_callback ? 1 : 0;
    std::unique_lock<std::mutex> dispatch_lock(dispatch_->mu);
    stopped = dispatch_->cv.wait_until(dispatch_lock, until, [&] { return dispatch_->in_flight <= own; }) && stopped;
    return stopped;
  }

  bool running() const { return core_->running(); }
  uint64_t stamp_requests() const { return core_->stamp_requests(); }
  uint64_t soft_timeouts() const { return core_->soft_timeouts(); }

 private:
  std::shared_ptr<AutoStamp> stamp_;
  std::shared_ptr<GilNudge> nudge_;
  std::shared_ptr<SoftTimeoutDispatch> dispatch_;
  std::unique_ptr<inprocess::Watchdog> core_;
  std::mutex lifecycle_;  // start/stop from several Python threads (stop runs without the GIL)
  std::thread nudge_thread_;
};

void stop_live_watchdogs() {
  py::gil_scoped_release nogil;
  std::lock_guard<std::mutex> lock(watchdogs_mutex());
  for (PyWatchdog* w : live_watchdogs()) w->stop(500'000'000);
}

void register_watchdog(py::module_& m) {
  using inprocess::SoftTimeoutEvent;
  py::class_<SoftTimeoutEvent>(m, "SoftTimeoutEvent")
      .def_readonly("iteration", &SoftTimeoutEvent::iteration)
      .def_readonly("detected_ns", &SoftTimeoutEvent::detected_ns)
      .def_readonly("deadline_ns", &SoftTimeoutEvent::deadline_ns)
      .def_readonly("last_progress_ns", &SoftTimeoutEvent::last_progress_ns)
      .def_readonly("manual", &SoftTimeoutEvent::manual)
      .def("__repr__", [](const SoftTimeoutEvent& e) {
        return "SoftTimeoutEvent(iteration=" + std::to_string(e.iteration) +
               ", late_ns=" + std::to_string(e.detected_ns - e.deadline_ns) +
               ", manual=" + (e.manual ? std::string("True") : std::string("False")) + ")";
      });

  py::class_<PyWatchdog>(m, "Watchdog",
                         "GIL-free soft-timeout detection and automatic-progress stamping for one rank.")
      .def(py::init<int, int64_t, py::function>(), py::arg("heartbeat_fd"), py::arg("interval_ns"),
           py::arg("on_soft_timeout"))
      .def("start", &PyWatchdog::start)
      .def("stop", &PyWatchdog::stop, py::arg("timeout_ns"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("running", &PyWatchdog::running)
      .def_property_readonly("stamp_requests", &PyWatchdog::stamp_requests)
      .def_property_readonly("soft_timeouts", &PyWatchdog::soft_timeouts);

  py::module_::import("atexit").attr("register")(py::cpp_function(&stop_live_watchdogs));
}

void register_testing(py::module_& m) {
  auto t = m.def_submodule("testing", "Fault injection helpers for the test suite.");
  t.def(
      "spin_holding_gil",
      [](double seconds) {
        // Deliberately keeps the GIL: models a rank stuck in native code.
        const int64_t end = inprocess::monotonic_ns() + static_cast<int64_t>(seconds * 1e9);
        volatile uint64_t sink = 0;
        while (inprocess::monotonic_ns() < end) sink = sink + 1;
      },
      py::arg("seconds"), "Busy-wait for `seconds` without releasing the GIL.");
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "Native core of inprocess: shared-memory heartbeats and GIL-free monitoring.";
  register_clock(m);
  register_heartbeat(m);
  register_killer(m);
  register_node_board(m);
  register_watchdog(m);
  register_testing(m);
}
