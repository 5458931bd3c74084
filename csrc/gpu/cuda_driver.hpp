#pragma once

// The CUDA driver (libcuda.so.1) by dlopen: stream and context
// synchronisation with a deadline, a device health probe, and the
// classification of errors that leave the context unusable.
//
// Every call runs on a DeadlineWorker thread that makes the device's primary
// context current (the one torch uses; never a new context, and none is
// created where the primary context is inactive) and returns within the
// timeout plus a short grace, whatever the driver does.

#include <cstdint>
#include <memory>
#include <string>

#include "gpu/cuda_api.hpp"
#include "gpu/deadline_worker.hpp"
#include "gpu/dynamic_library.hpp"
#include "gpu/gpu_status.hpp"

namespace inprocess::gpu {

struct CudaOutcome {
  GpuStatus status = GpuStatus::kDone;
  int code = 0;               // the CUresult of the failed step (kError)
  std::string error_name;     // cuGetErrorName, e.g. "CUDA_ERROR_ILLEGAL_ADDRESS"
  std::string step;           // the driver call that failed or timed out
  bool context_lost = false;  // a sticky error, or the probe read back other data
  int64_t value = 0;          // init: driver version; device_count: the count
  std::string text;           // pci_bus_id: the bus id
  int64_t elapsed_ns = 0;
};

// Errors after which the context cannot be used again: the process must end
// for the device to be used (cuda.h says so for each of them).
bool is_sticky_cuda_error(int code) noexcept;

class CudaDriver {
 public:
  static constexpr const char* kDefaultLibrary = "libcuda.so.1";
  // The grace added to a timeout for the worker to report a poll loop's end.
  static constexpr int64_t kReportGraceNs = 50'000'000;

  // `path` empty: libcuda.so.1, the loaded copy when there is one. Throws
  // std::runtime_error when the library or one of its symbols is missing.
  static std::shared_ptr<CudaDriver> open(const std::string& path);

  const std::string& path() const { return library_->path(); }
  bool was_loaded_before() const { return library_->was_loaded_before(); }

  CudaOutcome init(int64_t timeout_ns);          // cuInit; value: the driver version
  CudaOutcome device_count(int64_t timeout_ns);  // value: the count
  CudaOutcome pci_bus_id(int device, int64_t timeout_ns);
  // Until `stream` (a CUstream, 0 for the legacy default stream) has no work
  // left: polls cuStreamQuery with a backoff from 20 us to 2 ms.
  CudaOutcome synchronize_stream(int device, uint64_t stream, int64_t timeout_ns);
  // cuCtxSynchronize of the device's primary context.
  CudaOutcome synchronize_context(int device, int64_t timeout_ns);
  // Allocates `bytes` on the device, writes a pattern, copies it back,
  // compares, frees.
  CudaOutcome probe(int device, int64_t bytes, int64_t timeout_ns);

  struct Api;

 private:
  CudaDriver(std::shared_ptr<DynamicLibrary> library, std::shared_ptr<Api> api);
  template <class Body>
  CudaOutcome run(int64_t timeout_ns, const char* first_step, Body body);

  std::shared_ptr<DynamicLibrary> library_;
  std::shared_ptr<Api> api_;
  DeadlineWorker worker_{"inprocess-cuda"};
};

}  // namespace inprocess::gpu
