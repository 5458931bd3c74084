#include "register.hpp"

#include <pybind11/functional.h>

#include <string>

#include "python_watchdog.hpp"
#include "watchdog.hpp"

namespace py = pybind11;

using inprocess::python::PythonWatchdog;

namespace inprocess::bindings {

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

  py::class_<PythonWatchdog>(m, "Watchdog",
                             "GIL-free soft-timeout detection and automatic-progress stamping for one rank.")
      .def(py::init<int, int64_t, py::function>(), py::arg("heartbeat_fd"), py::arg("interval_ns"),
           py::arg("on_soft_timeout"))
      .def("start", &PythonWatchdog::start)
      .def("stop", &PythonWatchdog::stop, py::arg("timeout_ns"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("running", &PythonWatchdog::running)
      .def_property_readonly("stamp_requests", &PythonWatchdog::stamp_requests)
      .def_property_readonly("soft_timeouts", &PythonWatchdog::soft_timeouts);

  py::module_::import("atexit").attr("register")(py::cpp_function(&python::stop_live_watchdogs));
}

}  // namespace inprocess::bindings
