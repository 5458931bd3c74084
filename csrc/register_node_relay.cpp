// RelayLayout and NodeRelay: a node agent's relay steps without the GIL.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bind.hpp"
#include "node_board.hpp"
#include "node_relay.hpp"
#include "register.hpp"
#include "store_connection.hpp"

namespace py = pybind11;

namespace inprocess::bindings {

namespace {

// A cancel check that takes the GIL back only for the call, between chunks of a wait.
NodeRelay::Cancelled cancel_check(const py::object& cancelled) {
  if (cancelled.is_none()) return {};
  return [&cancelled]() {
    py::gil_scoped_acquire gil;
    return cancelled().cast<bool>();
  };
}

// A RelayLayout from the templates native_relay.relay_layout builds, each checked.
RelayLayout relay_layout_from(const py::dict& layout) {
  auto text = [&](const char* name) { return layout[name].cast<std::string>(); };
  auto tmpl = [&](const char* name) { return KeyTemplate(text(name)); };
  RelayLayout l;
  l.arrivals = tmpl("arrivals");
  l.ready = tmpl("ready");
  l.ready_value = text("ready_value");
  l.event = tmpl("event");
  l.restart = text("restart");
  l.complete = text("complete");
  l.seat = tmpl("seat");
  l.seats_per_key = layout["seats_per_key"].cast<int64_t>();
  if (l.seats_per_key < 1) throw py::value_error("seats_per_key must be >= 1");
  l.seat_attempts = layout["seat_attempts"].cast<int64_t>();
  if (l.seat_attempts < 1) throw py::value_error("seat_attempts must be >= 1");
  l.seat_separator = text("seat_separator");
  if (l.seat_separator.empty()) throw py::value_error("seat_separator must not be empty");
  const auto expected = layout["seat_expected"].cast<std::vector<std::vector<std::string>>>();
  const auto desired = layout["seat_desired"].cast<std::vector<std::vector<std::string>>>();
  if (expected.size() != 2 || desired.size() != 2 || expected[0].size() != 2 || expected[1].size() != 2 ||
      desired[0].size() != 2 || desired[1].size() != 2) {
    throw py::value_error("seat_expected and seat_desired are 2 x 2: [first barrier][life 0]");
  }
  for (int f = 0; f < 2; ++f) {
    for (int z = 0; z < 2; ++z) {
      l.seat_expected[f][z] = KeyTemplate(expected[f][z]);
      l.seat_desired[f][z] = KeyTemplate(desired[f][z]);
    }
  }
  l.outcome_first = tmpl("outcome_first");
  l.outcome_later = tmpl("outcome_later");
  l.lost_mark = layout["lost_mark"].cast<std::string>();
  l.terminated_shift = layout["terminated_shift"].cast<int>();
  if (l.terminated_shift < 1 || l.terminated_shift > 62) throw py::value_error("terminated_shift out of 1..62");
  return l;
}

}  // namespace

void register_relay_layout(py::module_& m) {
  py::class_<RelayLayout>(m, "RelayLayout",
                          "The templates of what a NodeRelay sends, parsed once (native_relay.relay_layout builds them).")
      .def(py::init([](const py::dict& layout) { return new RelayLayout(relay_layout_from(layout)); }),
           py::arg("layout"));
}

void register_node_relay(py::module_& m) {
  py::class_<NodeRelay>(m, "NodeRelay",
                        "A node agent's relay steps over a NodeBoard and a StoreConnection, each without the GIL.")
      .def(py::init<NodeBoard&, RelayLayout>(), py::arg("board"), py::arg("layout"), py::keep_alive<1, 2>(),
           "`layout`: a RelayLayout (copied: a relay costs no parsing).")
      .def("forward", &NodeRelay::forward, py::arg("store"), py::call_guard<py::gil_scoped_release>())
      .def(
          "relay_decision",
          [](NodeRelay& r, StoreConnection& store, int64_t barrier, const py::object& cancelled, double chunk_s,
             const py::object& check_mark) {
            const auto check = cancel_check(cancelled);
            NodeRelay::MarkCheck mark_check;
            if (!check_mark.is_none()) {
              // Only where a leader was lost: the GIL is taken back for the mark's parse.
              mark_check = [&check_mark](const std::string& raw) {
                py::gil_scoped_acquire gil;
                check_mark(py::bytes(raw));
              };
            }
            return bytes_without_gil([&] { return r.relay_decision(store, barrier, check, chunk_s, mark_check); });
          },
          py::arg("store"), py::arg("barrier"), py::arg("cancelled"), py::arg("chunk_s"),
          py::arg("check_mark") = py::none(),
          "`check_mark(raw)` is shown each lost mark before it is posted, and raises to refuse it.")
      .def(
          "relay_event",
          [](NodeRelay& r, StoreConnection& store, int64_t iteration, const py::object& cancelled, double chunk_s) {
            const auto check = cancel_check(cancelled);
            return bytes_without_gil([&] { return r.relay_event(store, iteration, check, chunk_s); });
          },
          py::arg("store"), py::arg("iteration"), py::arg("cancelled"), py::arg("chunk_s"))
      .def_property_readonly("adds", &NodeRelay::adds)
      .def_property_readonly("calls", &NodeRelay::calls)
      .def_property_readonly("requests", &NodeRelay::requests)
      .def_property("forwarded", &NodeRelay::forwarded, &NodeRelay::set_forwarded)
      .def(
          "expand",
          [](const NodeRelay& r, const std::string& name, int64_t barrier, int64_t rank, int64_t life, int64_t term) {
            const RelayLayout& l = r.layout();
            const KeyTemplate::Values v{barrier, rank, life, term};
            const bool first = barrier == 0, life0 = life == 0;
            if (name == "arrivals") return l.arrivals.expand(v);
            if (name == "ready") return l.ready.expand(v);
            if (name == "event") return l.event.expand(v);
            if (name == "seat") return l.seat.expand(v);
            if (name == "seat_expected") return l.seat_expected[first][life0].expand(v);
            if (name == "seat_desired") return l.seat_desired[first][life0].expand(v);
            if (name == "outcome") return term == 0 ? l.outcome_first.expand(v) : l.outcome_later.expand(v);
            throw py::value_error("no template named '" + name + "'");
          },
          py::arg("name"), py::arg("barrier"), py::arg("rank") = 0, py::arg("life") = 0, py::arg("term") = 0,
          "What the relay sends for template `name`: to check it against the protocol's own functions.");
}

}  // namespace inprocess::bindings
