#include "gpu/nvml_device.hpp"

#include <algorithm>
#include <stdexcept>

#include "clock.hpp"

namespace inprocess::gpu {

using namespace inprocess::nvml;

struct NvmlLibrary::Api {
#define INPROCESS_DECLARE_FIELD(name, type) As<type> name = nullptr;
  INPROCESS_NVML_FUNCTIONS(INPROCESS_DECLARE_FIELD)
#undef INPROCESS_DECLARE_FIELD
};

namespace {

struct JobState {
  NvmlReport report;
};

bool unsupported(nvmlReturn_t r) {
  return r == kErrorNotSupported || r == kErrorInvalidArgument || r == kErrorNotFound;
}

// Records a failed step; false when the query must stop.
bool check(const NvmlLibrary::Api& api, NvmlReport& out, const char* step, nvmlReturn_t r) {
  if (r == kSuccess) return true;
  if (unsupported(r)) return true;  // the field stays -1
  out.status = GpuStatus::kError;
  out.error = r;
  out.step = step;
  out.gpu_lost = r == kErrorGpuIsLost;
  const char* s = api.nvmlErrorString(r);
  out.error_string = s != nullptr ? s : "NVML error " + std::to_string(r);
  return false;
}

void query_device(const NvmlLibrary::Api& api, NvmlReport& out, nvmlDevice_t dev) {
  unsigned long long ecc = 0;
  nvmlReturn_t r = api.nvmlDeviceGetTotalEccErrors(dev, kMemoryErrorTypeUncorrected, kVolatileEcc, &ecc);
  if (!check(api, out, "nvmlDeviceGetTotalEccErrors", r)) return;
  if (r == kSuccess) out.ecc_volatile_uncorrected = static_cast<int64_t>(ecc);

  unsigned int corrected = 0, uncorrected = 0, pending = 0, failure = 0;
  r = api.nvmlDeviceGetRemappedRows(dev, &corrected, &uncorrected, &pending, &failure);
  if (!check(api, out, "nvmlDeviceGetRemappedRows", r)) return;
  if (r == kSuccess) {
    out.remapped_rows_pending = pending;
    out.remapped_rows_failure = failure;
  }

  int retired_pending = 0;
  r = api.nvmlDeviceGetRetiredPagesPendingStatus(dev, &retired_pending);
  if (!check(api, out, "nvmlDeviceGetRetiredPagesPendingStatus", r)) return;
  if (r == kSuccess) out.retired_pages_pending = retired_pending == kFeatureEnabled ? 1 : 0;

  FieldValue field{};
  field.fieldId = kFieldGpuRecoveryAction;
  r = api.nvmlDeviceGetFieldValues(dev, 1, &field);
  if (!check(api, out, "nvmlDeviceGetFieldValues", r)) return;
  if (r == kSuccess) {
    if (field.nvmlReturn == kSuccess) {
      out.recovery_action = static_cast<int64_t>(field.value.uiVal);
    } else if (!check(api, out, "nvmlDeviceGetFieldValues(GPU_RECOVERY_ACTION)", field.nvmlReturn)) {
      return;
    }
  }

  out.nvlinks.assign(kMaxNvLinks, -1);
  for (unsigned link = 0; link < kMaxNvLinks; ++link) {
    int active = 0;
    r = api.nvmlDeviceGetNvLinkState(dev, link, &active);
    if (!check(api, out, "nvmlDeviceGetNvLinkState", r)) return;
    if (r == kSuccess) out.nvlinks[link] = active == kFeatureEnabled ? 1 : 0;
  }
  while (!out.nvlinks.empty() && out.nvlinks.back() == -1) out.nvlinks.pop_back();
}

}  // namespace

NvmlLibrary::NvmlLibrary(std::shared_ptr<DynamicLibrary> library, std::shared_ptr<Api> api)
    : library_(std::move(library)), api_(std::move(api)) {}

std::shared_ptr<NvmlLibrary> NvmlLibrary::open(const std::string& path) {
  auto library = DynamicLibrary::open(path.empty() ? kDefaultLibrary : path);
  auto api = std::make_shared<Api>();
  SymbolTable table(*library);
#define INPROCESS_RESOLVE(name, type) table.resolve(#name, api->name, true);
  INPROCESS_NVML_FUNCTIONS(INPROCESS_RESOLVE)
#undef INPROCESS_RESOLVE
  table.throw_if_missing("NVML");
  return std::shared_ptr<NvmlLibrary>(new NvmlLibrary(std::move(library), std::move(api)));
}

NvmlReport NvmlLibrary::query(const std::string& device, int64_t timeout_ns) {
  const auto colon = device.find(':');
  const std::string kind = colon == std::string::npos ? "" : device.substr(0, colon);
  const std::string id = colon == std::string::npos ? "" : device.substr(colon + 1);
  if ((kind != "index" && kind != "uuid" && kind != "pci") || id.empty()) {
    throw std::invalid_argument("device " + device + ": expected index:N, uuid:GPU-... or pci:BUS-ID");
  }
  unsigned index = 0;
  if (kind == "index") {
    size_t used = 0;
    unsigned long parsed = 0;
    try {
      parsed = std::stoul(id, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != id.size()) throw std::invalid_argument("device " + device + ": the index is not a number");
    index = static_cast<unsigned>(parsed);
  }

  const int64_t started = monotonic_ns();
  auto state = std::make_shared<JobState>();
  std::shared_ptr<Api> api = api_;
  const bool finished = worker_.run(
      [state, api, kind, id, index] {
        NvmlReport& out = state->report;
        const Api& a = *api;
        if (!check(a, out, "nvmlInit_v2", a.nvmlInit_v2())) return;
        nvmlDevice_t dev = nullptr;
        nvmlReturn_t r;
        const char* step;
        if (kind == "index") {
          r = a.nvmlDeviceGetHandleByIndex_v2(index, &dev);
          step = "nvmlDeviceGetHandleByIndex_v2";
        } else if (kind == "uuid") {
          r = a.nvmlDeviceGetHandleByUUID(id.c_str(), &dev);
          step = "nvmlDeviceGetHandleByUUID";
        } else {
          r = a.nvmlDeviceGetHandleByPciBusId_v2(id.c_str(), &dev);
          step = "nvmlDeviceGetHandleByPciBusId_v2";
        }
        if (r != kSuccess) {
          // Here "not found" is an error too: the device is not there.
          out.status = GpuStatus::kError;
          out.error = r;
          out.step = step;
          out.gpu_lost = r == kErrorGpuIsLost;
          const char* s = a.nvmlErrorString(r);
          out.error_string = s != nullptr ? s : "NVML error " + std::to_string(r);
        } else {
          query_device(a, out, dev);
        }
        a.nvmlShutdown();
      },
      std::max<int64_t>(timeout_ns, 0));
  NvmlReport out;
  if (finished) {
    out = state->report;
  } else {
    out.status = GpuStatus::kTimedOut;
    out.step = "NVML query";
  }
  out.elapsed_ns = monotonic_ns() - started;
  return out;
}

}  // namespace inprocess::gpu
