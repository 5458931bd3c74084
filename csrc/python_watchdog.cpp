#include "python_watchdog.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <new>
#include <system_error>
#include <unordered_set>

#include "heartbeat.hpp"

namespace py = pybind11;

namespace inprocess::python {

// The target of the automatic-progress pending call. Shared with every
// queued call, so a call that runs after its watchdog is gone still stamps a
// mapped page.
struct AutoStamp {
  explicit AutoStamp(HeartbeatPage p) : page(std::move(p)) {}
  HeartbeatPage page;
  std::atomic<bool> pending{false};
};

// Runs in the main thread at a bytecode boundary: proof that it runs Python.
static int run_auto_stamp(void* arg) {
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
static void request_auto_stamp(const std::shared_ptr<AutoStamp>& stamp, GilNudge& nudge) {
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

static thread_local bool t_in_soft_timeout_callback = false;

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

static void run_soft_timeout_callback(std::shared_ptr<SoftTimeoutDispatch> dispatch, SoftTimeoutEvent event) {
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
static void dispatch_soft_timeout(const std::shared_ptr<SoftTimeoutDispatch>& dispatch,
                                  const SoftTimeoutEvent& event) {
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

// Live watchdogs, stopped at interpreter exit: a callback thread must not
// start waiting for the GIL of an interpreter being finalised. Leaked on
// purpose so that it outlives every static destructor.
static std::mutex& watchdogs_mutex() {
  static auto* mu = new std::mutex;
  return *mu;
}
static std::unordered_set<PythonWatchdog*>& live_watchdogs() {
  static auto* set = new std::unordered_set<PythonWatchdog*>;
  return *set;
}

PythonWatchdog::PythonWatchdog(int heartbeat_fd, int64_t interval_ns, py::function on_soft_timeout)
    : stamp_(std::make_shared<AutoStamp>(HeartbeatPage::attach(heartbeat_fd))),
      nudge_(std::make_shared<GilNudge>()),
      dispatch_(std::make_shared<SoftTimeoutDispatch>(std::move(on_soft_timeout))) {
  std::shared_ptr<AutoStamp> stamp = stamp_;
  std::shared_ptr<GilNudge> nudge = nudge_;
  std::shared_ptr<SoftTimeoutDispatch> dispatch = dispatch_;
  core_ = std::make_unique<Watchdog>(
      heartbeat_fd, interval_ns, [stamp, nudge] { request_auto_stamp(stamp, *nudge); },
      [dispatch](const SoftTimeoutEvent& e) { dispatch_soft_timeout(dispatch, e); });
  std::lock_guard<std::mutex> lock(watchdogs_mutex());
  live_watchdogs().insert(this);
}

PythonWatchdog::~PythonWatchdog() {
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

void PythonWatchdog::start() {
  std::lock_guard<std::mutex> lock(lifecycle_);
  core_->start();  // throws when started before: the nudge thread is not started twice
  std::shared_ptr<GilNudge> nudge = nudge_;
  nudge_thread_ = std::thread([nudge] { nudge->run(); });
}

bool PythonWatchdog::stop(int64_t timeout_ns) {
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

bool PythonWatchdog::running() const { return core_->running(); }
uint64_t PythonWatchdog::stamp_requests() const { return core_->stamp_requests(); }
uint64_t PythonWatchdog::soft_timeouts() const { return core_->soft_timeouts(); }

void stop_live_watchdogs() {
  py::gil_scoped_release nogil;
  std::lock_guard<std::mutex> lock(watchdogs_mutex());
  for (PythonWatchdog* w : live_watchdogs()) w->stop(500'000'000);
}

}  // namespace inprocess::python
