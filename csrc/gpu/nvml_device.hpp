#pragma once

// NVML (libnvidia-ml.so.1) by dlopen: one deadline-bounded query of what
// says a GPU cannot be trusted: volatile uncorrectable ECC errors, row
// remapping pending or failed, pages pending retirement, the driver's
// recovery action, NVLink states, and a GPU that fell off the bus. A hung
// NVML call makes the query time out; it never hangs the caller.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu/deadline_worker.hpp"
#include "gpu/dynamic_library.hpp"
#include "gpu/gpu_status.hpp"
#include "gpu/nvml_api.hpp"

namespace inprocess::gpu {

// -1 in a field: this device or driver does not report it.
struct NvmlReport {
  GpuStatus status = GpuStatus::kDone;
  int error = 0;             // the nvmlReturn_t of the failed step (kError)
  std::string error_string;  // nvmlErrorString
  std::string step;          // the NVML call that failed or timed out
  bool gpu_lost = false;     // NVML_ERROR_GPU_IS_LOST: fallen off the bus or otherwise inaccessible
  int64_t ecc_volatile_uncorrected = -1;
  int64_t remapped_rows_pending = -1;
  int64_t remapped_rows_failure = -1;
  int64_t retired_pages_pending = -1;
  int64_t recovery_action = -1;  // NVML_GPU_RECOVERY_ACTION_*: 0 none
  std::vector<int> nvlinks;      // per link: 1 active, 0 inactive, -1 absent
  int64_t elapsed_ns = 0;
};

class NvmlLibrary {
 public:
  static constexpr const char* kDefaultLibrary = "libnvidia-ml.so.1";

  // `path` empty: libnvidia-ml.so.1, the loaded copy when there is one.
  static std::shared_ptr<NvmlLibrary> open(const std::string& path);
  const std::string& path() const { return library_->path(); }

  // `device`: "index:N" (NVML's own order, not CUDA's), "uuid:GPU-...", or
  // "pci:0000:00:00.0". Throws std::invalid_argument for another form.
  NvmlReport query(const std::string& device, int64_t timeout_ns);

  struct Api;

 private:
  NvmlLibrary(std::shared_ptr<DynamicLibrary> library, std::shared_ptr<Api> api);
  std::shared_ptr<DynamicLibrary> library_;
  std::shared_ptr<Api> api_;
  DeadlineWorker worker_{"inprocess-nvml"};
};

}  // namespace inprocess::gpu
