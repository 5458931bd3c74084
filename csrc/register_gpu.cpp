#include <pybind11/stl.h>

#include <string>

#include "gpu/cuda_driver.hpp"
#include "gpu/deadline_worker.hpp"
#include "gpu/nccl_comms.hpp"
#include "gpu/nvml_device.hpp"
#include "register.hpp"

namespace py = pybind11;

namespace inprocess::bindings {

using gpu::CudaDriver;
using gpu::CudaOutcome;
using gpu::CurrentDevice;
using gpu::GpuStatus;
using gpu::NcclLibrary;
using gpu::NcclOutcome;
using gpu::NvmlLibrary;
using gpu::NvmlReport;

// Every call here can block (dlopen, a driver call until its deadline): all
// of them run without the GIL.
using nogil = py::call_guard<py::gil_scoped_release>;

void register_gpu(py::module_& m) {
  py::enum_<GpuStatus>(m, "GpuStatus")
      .value("DONE", GpuStatus::kDone)
      .value("TIMED_OUT", GpuStatus::kTimedOut)
      .value("ERROR", GpuStatus::kError)
      .value("NO_CONTEXT", GpuStatus::kNoContext)
      .value("CORRUPTED", GpuStatus::kCorrupted);

  m.def("abandoned_gpu_calls", &gpu::DeadlineWorker::abandoned_total,
        "GPU library calls abandoned at their deadline in this process (their threads may still be inside).");
  m.def("is_sticky_cuda_error", &gpu::is_sticky_cuda_error, py::arg("code"),
        "True for a CUresult after which the CUDA context cannot be used again.");

  py::class_<CudaOutcome>(m, "CudaOutcome")
      .def_readonly("status", &CudaOutcome::status)
      .def_readonly("code", &CudaOutcome::code)
      .def_readonly("error_name", &CudaOutcome::error_name)
      .def_readonly("step", &CudaOutcome::step)
      .def_readonly("context_lost", &CudaOutcome::context_lost)
      .def_readonly("value", &CudaOutcome::value)
      .def_readonly("text", &CudaOutcome::text)
      .def_readonly("elapsed_ns", &CudaOutcome::elapsed_ns)
      .def("__repr__", [](const CudaOutcome& o) {
        return "CudaOutcome(status=" + py::str(py::cast(o.status)).cast<std::string>() + ", step=" + o.step +
               ", code=" + std::to_string(o.code) + ", error_name=" + o.error_name +
               ", context_lost=" + (o.context_lost ? "True" : "False") + ")";
      });

  py::class_<CudaDriver, std::shared_ptr<CudaDriver>>(m, "CudaDriver", "The CUDA driver by dlopen; deadline-bounded calls.")
      .def_static("open", &CudaDriver::open, py::arg("path") = "", nogil(),
                  "libcuda.so.1 (the loaded copy first) or `path`; RuntimeError when missing or incomplete.")
      .def_property_readonly("path", &CudaDriver::path)
      .def_property_readonly("was_loaded_before", &CudaDriver::was_loaded_before)
      .def("init", &CudaDriver::init, py::arg("timeout_ns"), nogil())
      .def("device_count", &CudaDriver::device_count, py::arg("timeout_ns"), nogil())
      .def("pci_bus_id", &CudaDriver::pci_bus_id, py::arg("device"), py::arg("timeout_ns"), nogil())
      .def("synchronize_stream", &CudaDriver::synchronize_stream, py::arg("device"), py::arg("stream"),
           py::arg("timeout_ns"), nogil())
      .def("synchronize_context", &CudaDriver::synchronize_context, py::arg("device"), py::arg("timeout_ns"), nogil())
      .def("probe", &CudaDriver::probe, py::arg("device"), py::arg("bytes"), py::arg("timeout_ns"), nogil());

  py::class_<NcclOutcome>(m, "NcclOutcome")
      .def_readonly("status", &NcclOutcome::status)
      .def_readonly("results", &NcclOutcome::results)
      .def_readonly("message", &NcclOutcome::message)
      .def_readonly("elapsed_ns", &NcclOutcome::elapsed_ns)
      .def("__repr__", [](const NcclOutcome& o) {
        return "NcclOutcome(status=" + py::str(py::cast(o.status)).cast<std::string>() + ", message=" + o.message +
               ")";
      });

  py::class_<CurrentDevice, std::shared_ptr<CurrentDevice>>(
      m, "CurrentDevice", "Makes a device current on a thread through the CUDA driver, never creating a context.")
      .def_static("open", &CurrentDevice::open, py::arg("path") = "", nogil(),
                  "libcuda.so.1 (the loaded copy first) or `path`; RuntimeError when missing or incomplete.")
      .def("bind", &CurrentDevice::bind, py::arg("device"), nogil(),
           "Makes `device` current on the calling thread where its primary context is active: '' when done, "
           "else why not.");

  py::class_<NcclLibrary, std::shared_ptr<NcclLibrary>>(m, "NcclLibrary",
                                                        "The process's libnccl; communicators by pointer.")
      .def_static("find_loaded", &NcclLibrary::find_loaded, nogil(), "The libnccl already loaded, else None.")
      .def_static("open", &NcclLibrary::open, py::arg("path"), nogil(),
                  "An explicit file; ValueError when another libnccl is loaded already.")
      .def_property_readonly("path", &NcclLibrary::path)
      .def_property_readonly("was_loaded_before", &NcclLibrary::was_loaded_before)
      .def_property_readonly("version", &NcclLibrary::version)
      .def_property_readonly("has_revoke", &NcclLibrary::has_revoke)
      .def("error_string", &NcclLibrary::error_string, py::arg("result"))
      .def("symbols", &NcclLibrary::symbols)
      .def("abort", &NcclLibrary::abort, py::arg("comms"), py::arg("grouped"), py::arg("timeout_ns"), nogil())
      .def("revoke", &NcclLibrary::revoke, py::arg("comms"), py::arg("blocking"), py::arg("timeout_ns"), nogil())
      .def("use_device", &NcclLibrary::use_device, py::arg("driver"), py::arg("device"), nogil(),
           "Later calls run on a worker thread with `device` current (also made current on the calling thread); "
           "'' when it could be, else why not.")
      .def_property_readonly("device", &NcclLibrary::device)
      .def("async_errors", &NcclLibrary::async_errors, py::arg("comms"), py::arg("timeout_ns"), nogil());

  py::class_<NvmlReport>(m, "NvmlReport")
      .def_readonly("status", &NvmlReport::status)
      .def_readonly("error", &NvmlReport::error)
      .def_readonly("error_string", &NvmlReport::error_string)
      .def_readonly("step", &NvmlReport::step)
      .def_readonly("gpu_lost", &NvmlReport::gpu_lost)
      .def_readonly("ecc_volatile_uncorrected", &NvmlReport::ecc_volatile_uncorrected)
      .def_readonly("remapped_rows_pending", &NvmlReport::remapped_rows_pending)
      .def_readonly("remapped_rows_failure", &NvmlReport::remapped_rows_failure)
      .def_readonly("retired_pages_pending", &NvmlReport::retired_pages_pending)
      .def_readonly("recovery_action", &NvmlReport::recovery_action)
      .def_readonly("nvlinks", &NvmlReport::nvlinks)
      .def_readonly("elapsed_ns", &NvmlReport::elapsed_ns);

  py::class_<NvmlLibrary, std::shared_ptr<NvmlLibrary>>(m, "NvmlLibrary", "NVML by dlopen; deadline-bounded queries.")
      .def_static("open", &NvmlLibrary::open, py::arg("path") = "", nogil())
      .def_property_readonly("path", &NvmlLibrary::path)
      .def("query", &NvmlLibrary::query, py::arg("device"), py::arg("timeout_ns"), nogil());
}

}  // namespace inprocess::bindings
