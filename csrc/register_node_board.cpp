#include "register.hpp"

#include <pybind11/stl.h>

#include <cmath>
#include <optional>
#include <utility>

#include "node_board.hpp"

namespace py = pybind11;

using inprocess::NodeBoard;

namespace inprocess::bindings {

namespace {

// A deadline CLOCK_MONOTONIC is always past: the wait reads its condition once, with no system call.
constexpr int64_t kLookOnly = 0;

// Seconds from Python -> a CLOCK_MONOTONIC deadline. Zero or negative means
// "check once"; beyond the int64 range of nanoseconds (inf included), no deadline.

int64_t board_deadline(double timeout_s) {
  if (std::isnan(timeout_s)) throw py::value_error("timeout_s must be a number of seconds, not nan");
  if (timeout_s >= 9.2e9) return NodeBoard::kNoDeadline;
  if (timeout_s <= 0) return kLookOnly;
  return NodeBoard::deadline_after(static_cast<int64_t>(timeout_s * 1e9));
}

// Runs `wait(deadline)`, a board wait, without the GIL. It looks first with
// the GIL held (kLookOnly), so that an answer already posted costs no GIL
// hand-off: in a process of several threads a released GIL goes to another
// thread, and taking it back waits for that thread's switch interval. A signal interrupts the futex; the Python
// handlers then run (in the main thread) and may raise, so Ctrl-C and
// SIGTERM handlers work during a wait of any length. Otherwise the wait
// resumes against the same deadline.
template <class Wait>
int64_t wait_releasing_gil(int64_t deadline, Wait wait) {
  const int64_t looked = wait(kLookOnly);
  if (looked != NodeBoard::kTimeout || deadline == kLookOnly) return looked;
  for (;;) {
    int64_t result;
    {
      py::gil_scoped_release nogil;
      result = wait(deadline);
    }
    if (result != NodeBoard::kInterrupted) return result;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

}  // namespace

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
            return wait_releasing_gil(board_deadline(timeout_s),
                                      [&](int64_t deadline) { return b.wait_event(iteration, deadline, true); });
          },
          py::arg("iteration"), py::arg("timeout_s"), "0 restart, 1 complete, -1 timeout, -2 closed.")
      .def("arrive", &NodeBoard::arrive, py::arg("slot"), py::arg("barrier"), py::arg("expected"),
           py::arg("initial_rank") = -1, py::arg("life") = 0,
           "initial_rank >= 0 leaves that rank's seat (in life `life`) to the agent; -1: the rank took it itself.")
      .def(
          "slot_seat",
          [](const NodeBoard& b, int64_t slot) -> std::optional<std::pair<int64_t, int64_t>> {
            const auto s = b.slot_seat(slot);
            if (!s) return std::nullopt;
            return std::make_pair(s->initial_rank, s->life);
          },
          py::arg("slot"), "(initial_rank, life) of the seat posted with the latest arrival, or None.")
      .def("refuse_seat", &NodeBoard::refuse_seat, py::arg("slot"), py::arg("barrier"),
           "The agent could not take the slot's seat at `barrier`: its wait_outcome returns 3.")
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
            return wait_releasing_gil(board_deadline(timeout_s),
                                      [&](int64_t deadline) { return b.wait_arrivals(seen_seq, deadline, true); });
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
            return wait_releasing_gil(board_deadline(timeout_s),
                                      [&](int64_t deadline) { return b.wait_outcome(slot, barrier, deadline, true); });
          },
          py::arg("slot"), py::arg("barrier"), py::arg("timeout_s"),
          "1 the slot leads the barrier, 2 a decision for it is posted, 3 its seat was refused, -1 timeout, -2 closed.")
      .def(
          "wait_news",
          [](const NodeBoard& b, int64_t decision_after, int64_t event_after, double timeout_s) {
            return wait_releasing_gil(board_deadline(timeout_s),
                                      [&](int64_t deadline) { return b.wait_news(decision_after, event_after, deadline, true); });
          },
          py::arg("decision_after"), py::arg("event_after"), py::arg("timeout_s"),
          "1 once a decision after barrier `decision_after` or an event word above `event_after` is posted "
          "(-1: nothing yet), -1 timeout, -2 closed.");
}

}  // namespace inprocess::bindings
