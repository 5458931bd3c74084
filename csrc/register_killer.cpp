#include "register.hpp"

#include <pybind11/stl.h>

#include <exception>
#include <optional>
#include <string>
#include <system_error>

#include "heartbeat.hpp"
#include "killer.hpp"

namespace py = pybind11;

using inprocess::Phase;

namespace inprocess::bindings {

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
        "SIGTERM + SIGCONT, up to `grace_ns` for the death, then SIGKILL and up to `kill_wait_ns` to see it.");
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

}  // namespace inprocess::bindings
