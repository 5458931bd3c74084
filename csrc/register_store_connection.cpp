// StoreConnection: the TCPStore wire in C++, without the GIL, and the errors it raises.
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bind.hpp"
#include "node_relay.hpp"
#include "register.hpp"
#include "store_connection.hpp"

namespace py = pybind11;

namespace inprocess::bindings {

namespace {

// The errors are the Python package's own classes, handed down once by
// inprocess.control (set_error_classes; the classes are control/store_errors.py), so that callers catch the same
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

}  // namespace

void register_store_connection(py::module_& m) {
  py::register_exception_translator(&translate);
  m.def("set_error_classes", &set_error_classes, py::arg("timeout"), py::arg("closed"), py::arg("protocol"),
        py::arg("overflow"), py::arg("cancelled"),
        "The Python classes the store connection and the relay raise (inprocess.control hands them "
        "down once).");

  py::class_<StoreConnection>(m, "StoreConnection",
                              "A connection to a torch TCPStore server in C++: the wire of "
                              "inprocess.control.tcpstore_client.TCPStoreClient, without the GIL.")
      .def(py::init([](const std::string& host, int port, const py::object& timeout, const py::object& connect_timeout,
                       bool retry_refused) {
             const double t = seconds(timeout, "timeout"), c = seconds(connect_timeout, "connect_timeout");
             return without_gil([&] { return new StoreConnection(host, port, t, c, retry_refused); });
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
            without_gil([&, v = value_bytes(value)] { c.set(key, v); });
          },
          py::arg("key"), py::arg("value"))
      .def(
          "append",
          [](StoreConnection& c, const std::string& key, const py::object& value) {
            without_gil([&, v = value_bytes(value)] { c.append(key, v); });
          },
          py::arg("key"), py::arg("value"))
      .def("add", &StoreConnection::add, py::arg("key"), py::arg("amount"), py::call_guard<py::gil_scoped_release>())
      .def(
          "compare_set",
          [](StoreConnection& c, const std::string& key, const py::object& expected, const py::object& desired) {
            return bytes_without_gil(
                [&, e = value_bytes(expected), d = value_bytes(desired)] { return c.compare_set(key, e, d); });
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
            const std::vector<std::string> out = without_gil([&] { return c.compare_set_many(moves); });
            py::list result;
            for (const auto& v : out) result.append(py::bytes(v));
            return result;
          },
          py::arg("items"), "compare_set of each (key, expected, desired), pipelined 256 to a round trip.")
      .def("check", &StoreConnection::check, py::arg("keys"), py::call_guard<py::gil_scoped_release>())
      .def(
          "wait",
          [](StoreConnection& c, const std::vector<std::string>& keys, const py::object& timeout) {
            without_gil([&, t = seconds(timeout, "timeout")] { c.wait(keys, t); });
          },
          py::arg("keys"), py::arg("timeout"), "Until every key exists; StoreTimeoutError after `timeout`.")
      .def(
          "wait_get",
          [](StoreConnection& c, const std::string& key, const py::object& timeout) {
            return bytes_without_gil([&, t = seconds(timeout, "timeout")] { return c.wait_get(key, t); });
          },
          py::arg("key"), py::arg("timeout"), "The value of `key`, waiting at most `timeout` for it to exist.")
      .def(
          "get",
          [](StoreConnection& c, const std::string& key) {
            return bytes_without_gil([&] { return c.wait_get(key, c.timeout_s()); });
          },
          py::arg("key"), "The value of `key`, waiting for it up to the connection's timeout (like torch).")
      .def("close", &StoreConnection::close, py::call_guard<py::gil_scoped_release>())
      .def("__repr__", [](const StoreConnection& c) {
        return "StoreConnection(" + c.address() + (c.closed() ? ", closed)" : ", open)");
      });
}

}  // namespace inprocess::bindings
