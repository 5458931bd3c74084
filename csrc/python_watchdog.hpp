#pragma once

// The watchdog as the Python interpreter sees it: the native core's Watchdog
// (csrc/watchdog.*, no Python) wired to the interpreter of this process.
//  - automatic progress: a pending call (Py_AddPendingCall) that stamps the
//    heartbeat page when the main thread next runs bytecode, and a thread that
//    nudges the GIL so the main thread looks at its pending calls;
//  - the soft timeout: a Python callable run in a fresh thread, so the
//    watchdog thread itself never waits for the GIL;
//  - interpreter exit: every live watchdog is stopped from an atexit hook.
//
// This is part of the extension module, not of inprocess_core: it is the one
// place outside the register_*.cpp files that knows about Python.

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>

#include "watchdog.hpp"

namespace inprocess::python {

struct AutoStamp;
struct GilNudge;
struct SoftTimeoutDispatch;

class PythonWatchdog {
 public:
  // Called with the GIL held (the constructor of the Python object).
  PythonWatchdog(int heartbeat_fd, int64_t interval_ns, pybind11::function on_soft_timeout);
  PythonWatchdog(const PythonWatchdog&) = delete;
  PythonWatchdog& operator=(const PythonWatchdog&) = delete;
  // Runs with the GIL held (object deallocation): released while stopping,
  // since callback threads need it to finish.
  ~PythonWatchdog();

  void start();
  // Without the GIL. After True, no callback runs any more (except the one
  // calling stop(), if any).
  bool stop(int64_t timeout_ns);

  bool running() const;
  uint64_t stamp_requests() const;
  uint64_t soft_timeouts() const;

 private:
  std::shared_ptr<AutoStamp> stamp_;
  std::shared_ptr<GilNudge> nudge_;
  std::shared_ptr<SoftTimeoutDispatch> dispatch_;
  std::unique_ptr<Watchdog> core_;
  std::mutex lifecycle_;  // start/stop from several Python threads (stop runs without the GIL)
  std::thread nudge_thread_;
};

// Stops every live watchdog (bounded wait each); registered with atexit by
// the watchdog's bindings, so that no callback thread starts waiting for the
// GIL of an interpreter being finalised. Called with the GIL held.
void stop_live_watchdogs();

}  // namespace inprocess::python
