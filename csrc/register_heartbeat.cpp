#include "register.hpp"

#include "heartbeat.hpp"

namespace py = pybind11;

using inprocess::HeartbeatPage;
using inprocess::HeartbeatSnapshot;
using inprocess::Phase;

namespace inprocess::bindings {

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
      .def("set_phase", &HeartbeatPage::set_phase, py::arg("phase"))
      .def("set_timeouts", &HeartbeatPage::set_timeouts, py::arg("soft_ns"), py::arg("hard_ns"))
      .def("set_flag", &HeartbeatPage::set_flag, py::arg("flag"), py::arg("on"))
      .def("begin_iteration", &HeartbeatPage::begin_iteration, py::arg("iteration"), py::arg("world_size"))
      .def("snapshot", &HeartbeatPage::snapshot);
}

}  // namespace inprocess::bindings
