// StoreConnection and NodeRelay: a node agent's store traffic without the GIL.
#include "register.hpp"

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "node_board.hpp"
#include "node_relay.hpp"
#include "store_connection.hpp"

namespace py = pybind11;

namespace inprocess::bindings {

namespace {

// The errors are the Python package's own classes, handed down once by
// inprocess.control.store_errors (set_error_classes), so that callers catch the same
// exceptions as with the Python client and relay. This module names no module of the
// package. Until they are handed down, the built-in classes they derive from are raised.
struct ErrorClasses {
  py::handle timeout = PyExc_TimeoutError;
  py::handle closed = PyExc_ConnectionError;
  py::handle protocol = PyExc_RuntimeError;
  py::handle overflow = PyExc_RuntimeError;
  py::handle cancelled = PyExc_TimeoutError;
};

ErrorClasses& error_classes() {
  static ErrorClasses classes;  // references held for the process's life, as pybind11's own exception types
  return classes;
}

void set_error_classes(const py::type& timeout, const py::type& closed, const py::type& protocol,
                       const py::type& overflow, const py::type& cancelled) {
  for (const py::type* cls : {&timeout, &closed, &protocol, &overflow, &cancelled}) {
    if (!PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(cls->ptr()),
                          reinterpret_cast<PyTypeObject*>(PyExc_Exception))) {
      throw py::type_error("set_error_classes: " + py::repr(*cls).cast<std::string>() + " is not an Exception class");
    }
  }
  ErrorClasses& c = error_classes();
  c.timeout = timeout.inc_ref();
  c.closed = closed.inc_ref();
  c.protocol = protocol.inc_ref();
  c.overflow = overflow.inc_ref();
  c.cancelled = cancelled.inc_ref();
}

[[noreturn]] void raise_python(py::handle cls, const char* message) {
  PyErr_SetString(cls.ptr(), message);
  throw py::error_already_set();
}

void translate(std::exception_ptr p) {
  const ErrorClasses& c = error_classes();
  try {
    if (p) std::rethrow_exception(p);
  } catch (const StoreTimeout& e) {
    raise_python(c.timeout, e.what());
  } catch (const StoreClosed& e) {
    raise_python(c.closed, e.what());
  } catch (const StoreProtocolViolation& e) {
    raise_python(c.protocol, e.what());
  } catch (const RelayOverflow& e) {
    raise_python(c.overflow, e.what());
  } catch (const RelayCancelled& e) {
    raise_python(c.cancelled, e.what());
  }
}

double seconds(const py::handle& value, const char* name) {
  double s;
  if (py::isinstance(value, py::module_::import("datetime").attr("timedelta"))) {
    s = value.attr("total_seconds")().cast<double>();
  } else if (PyFloat_Check(value.ptr()) || (PyLong_Check(value.ptr()) && !PyBool_Check(value.ptr()))) {
    s = value.cast<double>();
  } else {
    throw py::type_error(std::string(name) + " must be a datetime.timedelta or a number of seconds, got " +
                         py::repr(value).cast<std::string>());
  }
  if (!(s >= 0)) throw py::value_error(std::string(name) + " must be >= 0, got " + py::repr(value).cast<std::string>());
  return s;
}

std::string value_bytes(const py::handle& value) {
  if (PyBytes_Check(value.ptr())) return value.cast<std::string>();
  if (PyUnicode_Check(value.ptr())) return value.cast<std::string>();  // UTF-8
  if (PyByteArray_Check(value.ptr()) || PyMemoryView_Check(value.ptr())) {
    return py::bytes(py::reinterpret_borrow<py::object>(value)).cast<std::string>();
  }
  throw py::type_error("a store value is str or bytes, got " +
                       py::str(py::type::handle_of(value).attr("__name__")).cast<std::string>());
}

// A cancel check that takes the GIL back only for the call, between chunks of a wait.
NodeRelay::Cancelled cancel_check(const py::object& cancelled) {
  if (cancelled.is_none()) return {};
  return [&cancelled]() {
    py::gil_scoped_acquire gil;
    return cancelled().cast<bool>();
  };
}

}  // namespace

void register_node_relay(py::module_& m) {
  py::register_exception_translator(&translate);
  m.def("set_error_classes", &set_error_classes, py::arg("timeout"), py::arg("closed"), py::arg("protocol"),
        py::arg("overflow"), py::arg("cancelled"),
        "The Python classes the store connection and the relay raise (inprocess.control.store_errors hands them "
        "down once).");

  py::class_<StoreConnection>(m, "StoreConnection",
                              "A connection to a torch TCPStore server in C++: the wire of "
                              "inprocess.control.tcpstore_client.TCPStoreClient, without the GIL.")
      .def(py::init([](const std::string& host, int port, const py::object& timeout, const py::object& connect_timeout,
                       bool retry_refused) {
             const double t = seconds(timeout, "timeout");
             const double c = seconds(connect_timeout, "connect_timeout");
             py::gil_scoped_release nogil;
             return new StoreConnection(host, port, t, c, retry_refused);
           }),
           py::arg("host"), py::arg("port"), py::arg("timeout") = 300.0, py::arg("connect_timeout") = 60.0,
           py::arg("retry_refused") = true)
      .def_property_readonly("host", &StoreConnection::host)
      .def_property_readonly("port", &StoreConnection::port)
      .def_property_readonly("address", &StoreConnection::address)
      .def_property_readonly("timeout",
                             [](const StoreConnection& c) {
                               return py::module_::import("datetime").attr("timedelta")(py::arg("seconds") = c.timeout_s());
                             })
      .def_property_readonly("closed", &StoreConnection::closed)
      .def_property_readonly("bytes_sent", &StoreConnection::bytes_sent, "Request bytes sent since the handshake.")
      .def_property_readonly("bytes_received", &StoreConnection::bytes_received,
                             "Reply bytes received since the handshake.")
      .def(
          "set",
          [](StoreConnection& c, const std::string& key, const py::object& value) {
            const std::string v = value_bytes(value);
            py::gil_scoped_release nogil;
            c.set(key, v);
          },
          py::arg("key"), py::arg("value"))
      .def(
          "append",
          [](StoreConnection& c, const std::string& key, const py::object& value) {
            const std::string v = value_bytes(value);
            py::gil_scoped_release nogil;
            c.append(key, v);
          },
          py::arg("key"), py::arg("value"))
      .def("add", &StoreConnection::add, py::arg("key"), py::arg("amount"), py::call_guard<py::gil_scoped_release>())
      .def(
          "compare_set",
          [](StoreConnection& c, const std::string& key, const py::object& expected, const py::object& desired) {
            const std::string e = value_bytes(expected), d = value_bytes(desired);
            std::string out;
            {
              py::gil_scoped_release nogil;
              out = c.compare_set(key, e, d);
            }
            return py::bytes(out);
          },
          py::arg("key"), py::arg("expected"), py::arg("desired"))
      .def(
          "compare_set_many",
          [](StoreConnection& c, const py::iterable& items) {
            std::vector<CompareSet> moves;
            for (const py::handle item : items) {
              const auto t = item.cast<py::tuple>();
              if (t.size() != 3) throw py::value_error("compare_set_many takes (key, expected, desired) triples");
              moves.push_back(CompareSet{t[0].cast<std::string>(), value_bytes(t[1]), value_bytes(t[2])});
            }
            std::vector<std::string> out;
            {
              py::gil_scoped_release nogil;
              out = c.compare_set_many(moves);
            }
            py::list result;
            for (const auto& v : out) result.append(py::bytes(v));
            return result;
          },
          py::arg("items"), "compare_set of each (key, expected, desired), pipelined 256 to a round trip.")
      .def("check", &StoreConnection::check, py::arg("keys"), py::call_guard<py::gil_scoped_release>())
      .def(
          "wait",
          [](StoreConnection& c, const std::vector<std::string>& keys, const py::object& timeout) {
            const double t = seconds(timeout, "timeout");
            py::gil_scoped_release nogil;
            c.wait(keys, t);
          },
          py::arg("keys"), py::arg("timeout"), "Until every key exists; StoreTimeoutError after `timeout`.")
      .def(
          "wait_get",
          [](StoreConnection& c, const std::string& key, const py::object& timeout) {
            const double t = seconds(timeout, "timeout");
            std::string out;
            {
              py::gil_scoped_release nogil;
              out = c.wait_get(key, t);
            }
            return py::bytes(out);
          },
          py::arg("key"), py::arg("timeout"), "The value of `key`, waiting at most `timeout` for it to exist.")
      .def(
          "get",
          [](StoreConnection& c, const std::string& key) {
            std::string out;
            {
              py::gil_scoped_release nogil;
              out = c.wait_get(key, c.timeout_s());
            }
            return py::bytes(out);
          },
          py::arg("key"), "The value of `key`, waiting for it up to the connection's timeout (like torch).")
      .def("close", &StoreConnection::close, py::call_guard<py::gil_scoped_release>())
      .def("__repr__", [](const StoreConnection& c) {
        return "StoreConnection(" + c.address() + (c.closed() ? ", closed)" : ", open)");
      });

  py::class_<RelayLayout>(m, "RelayLayout",
                          "The templates of what a NodeRelay sends, parsed once (native_relay.relay_layout builds them).")
      .def(py::init([](const py::dict& layout) {
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
             return new RelayLayout(std::move(l));
           }),
           py::arg("layout"));

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
            std::string out;
            {
              py::gil_scoped_release nogil;
              out = r.relay_decision(store, barrier, check, chunk_s, mark_check);
            }
            return py::bytes(out);
          },
          py::arg("store"), py::arg("barrier"), py::arg("cancelled"), py::arg("chunk_s"),
          py::arg("check_mark") = py::none(),
          "`check_mark(raw)` is shown each lost mark before it is posted, and raises to refuse it.")
      .def(
          "relay_event",
          [](NodeRelay& r, StoreConnection& store, int64_t iteration, const py::object& cancelled, double chunk_s) {
            const auto check = cancel_check(cancelled);
            std::string out;
            {
              py::gil_scoped_release nogil;
              out = r.relay_event(store, iteration, check, chunk_s);
            }
            return py::bytes(out);
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
