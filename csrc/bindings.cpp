// The only pybind11 code of the project: module inprocess._native.
// Every call that can block releases the GIL (design principle 7); the
// heartbeat writes release it too, so a ping never waits behind another thread.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "clock.hpp"
#include "heartbeat.hpp"

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
  m.attr("FLAG_ARRIVED_AT_BARRIER") = py::int_(static_cast<uint32_t>(inprocess::kArrivedAtBarrier));

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
      .def("ping", &HeartbeatPage::ping, py::call_guard<py::gil_scoped_release>())
      .def("stamp_auto", &HeartbeatPage::stamp_auto, py::call_guard<py::gil_scoped_release>())
      .def("set_iteration", &HeartbeatPage::set_iteration, py::arg("iteration"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_phase", &HeartbeatPage::set_phase, py::arg("phase"), py::call_guard<py::gil_scoped_release>())
      .def("set_timeouts", &HeartbeatPage::set_timeouts, py::arg("soft_ns"), py::arg("hard_ns"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_flag", &HeartbeatPage::set_flag, py::arg("flag"), py::arg("on"),
           py::call_guard<py::gil_scoped_release>())
      .def("begin_iteration", &HeartbeatPage::begin_iteration, py::arg("iteration"), py::arg("world_size"),
           py::call_guard<py::gil_scoped_release>())
      .def("snapshot", &HeartbeatPage::snapshot, py::call_guard<py::gil_scoped_release>());
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
  register_testing(m);
}
