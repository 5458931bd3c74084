#include "gpu/cuda_driver.hpp"

#include <time.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "clock.hpp"

namespace inprocess::gpu {

using namespace inprocess::cuda;

struct CudaDriver::Api {
#define INPROCESS_DECLARE_FIELD(name, type) As<type> name = nullptr;
  INPROCESS_CUDA_FUNCTIONS(INPROCESS_DECLARE_FIELD)
#undef INPROCESS_DECLARE_FIELD
};

bool is_sticky_cuda_error(int code) noexcept {
  switch (code) {
    case 214:  // CUDA_ERROR_ECC_UNCORRECTABLE
    case 220:  // CUDA_ERROR_NVLINK_UNCORRECTABLE
    case 226:  // CUDA_ERROR_CONTAINED
    case 700:  // CUDA_ERROR_ILLEGAL_ADDRESS
    case 702:  // CUDA_ERROR_LAUNCH_TIMEOUT
    case 709:  // CUDA_ERROR_CONTEXT_IS_DESTROYED
    case 710:  // CUDA_ERROR_ASSERT
    case 714:  // CUDA_ERROR_HARDWARE_STACK_ERROR
    case 715:  // CUDA_ERROR_ILLEGAL_INSTRUCTION
    case 716:  // CUDA_ERROR_MISALIGNED_ADDRESS
    case 717:  // CUDA_ERROR_INVALID_ADDRESS_SPACE
    case 718:  // CUDA_ERROR_INVALID_PC
    case 719:  // CUDA_ERROR_LAUNCH_FAILED
    case 721:  // CUDA_ERROR_TENSOR_MEMORY_LEAK
    case 810:  // CUDA_ERROR_MPS_CLIENT_TERMINATED
    case 911:  // CUDA_ERROR_EXTERNAL_DEVICE
      return true;
    default:
      return false;
  }
}

namespace {

void sleep_ns(int64_t ns) {
  timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  nanosleep(&ts, nullptr);
}

// What a job writes; shared with the job, which may outlive the call.
struct JobState {
  CudaOutcome outcome;
};

void fail(const CudaDriver::Api& api, CudaOutcome& out, const char* step, CUresult code) {
  out.status = GpuStatus::kError;
  out.code = code;
  out.step = step;
  out.context_lost = is_sticky_cuda_error(code);
  const char* name = nullptr;
  if (api.cuGetErrorName(code, &name) == kSuccess && name != nullptr) {
    out.error_name = name;
  } else {
    out.error_name = "CUDA error " + std::to_string(code);
  }
}

// Makes the device's primary context current for `body`, if it is active;
// otherwise fills in the outcome and leaves `body` out.
template <class Body>
void with_primary_context(const CudaDriver::Api& api, JobState& s, int ordinal, Body body) {
  CudaOutcome& out = s.outcome;
  CUresult r = api.cuInit(0);
  if (r != kSuccess) return fail(api, out, "cuInit", r);
  CUdevice dev = 0;
  if ((r = api.cuDeviceGet(&dev, ordinal)) != kSuccess) return fail(api, out, "cuDeviceGet", r);
  unsigned int flags = 0;
  int active = 0;
  if ((r = api.cuDevicePrimaryCtxGetState(dev, &flags, &active)) != kSuccess) {
    return fail(api, out, "cuDevicePrimaryCtxGetState", r);
  }
  if (active == 0) {
    out.status = GpuStatus::kNoContext;
    out.step = "cuDevicePrimaryCtxGetState";
    return;
  }
  CUcontext ctx = nullptr;
  if ((r = api.cuDevicePrimaryCtxRetain(&ctx, dev)) != kSuccess) return fail(api, out, "cuDevicePrimaryCtxRetain", r);
  if ((r = api.cuCtxSetCurrent(ctx)) != kSuccess) {
    fail(api, out, "cuCtxSetCurrent", r);
  } else {
    body();
    // CUDA_ERROR_UNKNOWN (999) from a call on a context that was working is
    // the driver saying it does not know the state of the context (cuda.h
    // 12.9 line 3116: "an unknown internal error has occurred"): it cannot be
    // trusted again in this process. Outside a context (cuInit, a first
    // retain) 999 means the device's compute mode is PROHIBITED (cuda.h
    // 12.9 lines 5940, 6291) and says nothing about a context.
    if (out.status == GpuStatus::kError && out.code == kErrorUnknown) out.context_lost = true;
    api.cuCtxSetCurrent(nullptr);
  }
  api.cuDevicePrimaryCtxRelease_v2(dev);
}

}  // namespace

CudaDriver::CudaDriver(std::shared_ptr<DynamicLibrary> library, std::shared_ptr<Api> api)
    : library_(std::move(library)), api_(std::move(api)) {}

std::shared_ptr<CudaDriver> CudaDriver::open(const std::string& path) {
  auto library = DynamicLibrary::open(path.empty() ? kDefaultLibrary : path);
  auto api = std::make_shared<Api>();
  SymbolTable table(*library);
#define INPROCESS_RESOLVE(name, type) table.resolve(#name, api->name, true);
  INPROCESS_CUDA_FUNCTIONS(INPROCESS_RESOLVE)
#undef INPROCESS_RESOLVE
  table.throw_if_missing("the CUDA driver");
  return std::shared_ptr<CudaDriver>(new CudaDriver(std::move(library), std::move(api)));
}

template <class Body>
CudaOutcome CudaDriver::run(int64_t timeout_ns, const char* first_step, Body body) {
  const int64_t started = monotonic_ns();
  const int64_t deadline = add_saturated(started, std::max<int64_t>(timeout_ns, 0));
  auto state = std::make_shared<JobState>();
  std::shared_ptr<Api> api = api_;
  const bool finished = worker_.run([state, api, deadline, body] { body(*api, *state, deadline); },
                                    add_saturated(std::max<int64_t>(timeout_ns, 0), kReportGraceNs));
  CudaOutcome out;
  if (finished) {
    out = state->outcome;
  } else {
    out.status = GpuStatus::kTimedOut;
    out.step = first_step;  // the job's own progress is not read: it may still be writing it
  }
  out.elapsed_ns = monotonic_ns() - started;
  return out;
}

CudaOutcome CudaDriver::init(int64_t timeout_ns) {
  return run(timeout_ns, "cuInit", [](const Api& api, JobState& s, int64_t) {
    CUresult r = api.cuInit(0);
    if (r != kSuccess) return fail(api, s.outcome, "cuInit", r);
    int version = 0;
    if ((r = api.cuDriverGetVersion(&version)) != kSuccess) return fail(api, s.outcome, "cuDriverGetVersion", r);
    s.outcome.value = version;
  });
}

CudaOutcome CudaDriver::device_count(int64_t timeout_ns) {
  return run(timeout_ns, "cuDeviceGetCount", [](const Api& api, JobState& s, int64_t) {
    CUresult r = api.cuInit(0);
    if (r != kSuccess) return fail(api, s.outcome, "cuInit", r);
    int count = 0;
    if ((r = api.cuDeviceGetCount(&count)) != kSuccess) return fail(api, s.outcome, "cuDeviceGetCount", r);
    s.outcome.value = count;
  });
}

CudaOutcome CudaDriver::pci_bus_id(int device, int64_t timeout_ns) {
  return run(timeout_ns, "cuDeviceGetPCIBusId", [device](const Api& api, JobState& s, int64_t) {
    CUresult r = api.cuInit(0);
    if (r != kSuccess) return fail(api, s.outcome, "cuInit", r);
    CUdevice dev = 0;
    if ((r = api.cuDeviceGet(&dev, device)) != kSuccess) return fail(api, s.outcome, "cuDeviceGet", r);
    char id[64] = {0};
    if ((r = api.cuDeviceGetPCIBusId(id, sizeof(id) - 1, dev)) != kSuccess) {
      return fail(api, s.outcome, "cuDeviceGetPCIBusId", r);
    }
    s.outcome.text = id;
  });
}

CudaOutcome CudaDriver::synchronize_stream(int device, uint64_t stream, int64_t timeout_ns) {
  return run(timeout_ns, "cuStreamQuery", [device, stream](const Api& api, JobState& s, int64_t deadline) {
    with_primary_context(api, s, device, [&] {
      // Starts fine-grained for work about to finish; backs off so that a
      // long wait costs a few hundred wake-ups a second, not a core.
      int64_t backoff = 20'000;
      for (;;) {
        const CUresult r = api.cuStreamQuery(reinterpret_cast<CUstream>(static_cast<uintptr_t>(stream)));
        if (r == kSuccess) return;
        if (r != kErrorNotReady) return fail(api, s.outcome, "cuStreamQuery", r);
        const int64_t left = deadline - monotonic_ns();
        if (left <= 0) {
          s.outcome.status = GpuStatus::kTimedOut;
          s.outcome.step = "cuStreamQuery";
          return;
        }
        sleep_ns(std::min(backoff, left));
        backoff = std::min<int64_t>(backoff * 2, 2'000'000);
      }
    });
  });
}

CudaOutcome CudaDriver::synchronize_context(int device, int64_t timeout_ns) {
  return run(timeout_ns, "cuCtxSynchronize", [device](const Api& api, JobState& s, int64_t) {
    with_primary_context(api, s, device, [&] {
      const CUresult r = api.cuCtxSynchronize();
      if (r != kSuccess) fail(api, s.outcome, "cuCtxSynchronize", r);
    });
  });
}

CudaOutcome CudaDriver::probe(int device, int64_t bytes, int64_t timeout_ns) {
  const size_t size = static_cast<size_t>(std::clamp<int64_t>(bytes, 4, int64_t{1} << 30));
  return run(timeout_ns, "cuMemAlloc_v2", [device, size](const Api& api, JobState& s, int64_t) {
    with_primary_context(api, s, device, [&] {
      std::vector<unsigned char> written(size), read(size);
      for (size_t i = 0; i < size; ++i) written[i] = static_cast<unsigned char>((i * 131u + 7u) & 0xffu);
      CUdeviceptr ptr = 0;
      CUresult r = api.cuMemAlloc_v2(&ptr, size);
      if (r != kSuccess) return fail(api, s.outcome, "cuMemAlloc_v2", r);
      if ((r = api.cuMemcpyHtoD_v2(ptr, written.data(), size)) != kSuccess) {
        fail(api, s.outcome, "cuMemcpyHtoD_v2", r);
      } else if ((r = api.cuMemcpyDtoH_v2(read.data(), ptr, size)) != kSuccess) {
        fail(api, s.outcome, "cuMemcpyDtoH_v2", r);
      } else if (std::memcmp(written.data(), read.data(), size) != 0) {
        // A device gone from the bus reads back all ones; any difference
        // means its memory cannot be trusted.
        s.outcome.status = GpuStatus::kCorrupted;
        s.outcome.step = "compare";
        s.outcome.context_lost = true;
      }
      r = api.cuMemFree_v2(ptr);
      if (r != kSuccess && s.outcome.status == GpuStatus::kDone) fail(api, s.outcome, "cuMemFree_v2", r);
    });
  });
}

}  // namespace inprocess::gpu
