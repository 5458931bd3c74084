#include "gpu/nccl_comms.hpp"

#include <sys/stat.h>
#include <time.h>

#include <algorithm>
#include <stdexcept>

#include "clock.hpp"

namespace inprocess::gpu {

using namespace inprocess::nccl;
using namespace inprocess::nccl::driver;

struct CurrentDevice::Api {
#define INPROCESS_DECLARE_FIELD(name, type) As<type> name = nullptr;
  INPROCESS_CURRENT_DEVICE_FUNCTIONS(INPROCESS_DECLARE_FIELD)
#undef INPROCESS_DECLARE_FIELD
};

struct NcclLibrary::Api {
#define INPROCESS_DECLARE_FIELD(name, type) As<type> name = nullptr;
  INPROCESS_NCCL_FUNCTIONS(INPROCESS_DECLARE_FIELD)
  INPROCESS_NCCL_OPTIONAL_FUNCTIONS(INPROCESS_DECLARE_FIELD)
#undef INPROCESS_DECLARE_FIELD
};

namespace {

bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {}, sb {};
  if (stat(a.c_str(), &sa) != 0 || stat(b.c_str(), &sb) != 0) return a == b;
  return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

std::shared_ptr<NcclLibrary::Api> resolve(const DynamicLibrary& library) {
  auto api = std::make_shared<NcclLibrary::Api>();
  SymbolTable table(library);
#define INPROCESS_RESOLVE(name, type) table.resolve(#name, api->name, true);
#define INPROCESS_RESOLVE_OPTIONAL(name, type) table.resolve(#name, api->name, false);
  INPROCESS_NCCL_FUNCTIONS(INPROCESS_RESOLVE)
  INPROCESS_NCCL_OPTIONAL_FUNCTIONS(INPROCESS_RESOLVE_OPTIONAL)
#undef INPROCESS_RESOLVE
#undef INPROCESS_RESOLVE_OPTIONAL
  table.throw_if_missing("NCCL");
  return api;
}

struct JobState {
  NcclOutcome outcome;
};

// The device this worker thread was bound to (-1: none yet). A worker thread
// serves one NcclLibrary; a fresh one replaces a thread abandoned at a deadline.
thread_local int t_bound_device = -1;

}  // namespace

CurrentDevice::CurrentDevice(std::shared_ptr<DynamicLibrary> library, std::shared_ptr<Api> api)
    : library_(std::move(library)), api_(std::move(api)) {}

std::shared_ptr<CurrentDevice> CurrentDevice::open(const std::string& path) {
  auto library = DynamicLibrary::open(path.empty() ? kDriver : path);
  auto api = std::make_shared<Api>();
  SymbolTable table(*library);
#define INPROCESS_RESOLVE(name, type) table.resolve(#name, api->name, true);
  INPROCESS_CURRENT_DEVICE_FUNCTIONS(INPROCESS_RESOLVE)
#undef INPROCESS_RESOLVE
  table.throw_if_missing("the CUDA driver");
  return std::shared_ptr<CurrentDevice>(new CurrentDevice(library, api));
}

std::string CurrentDevice::bind(int device) const {
  CUdevice handle = 0;
  CUresult r = api_->cuDeviceGet(&handle, device);
  if (r != 0) return "cuDeviceGet(" + std::to_string(device) + ") returned " + std::to_string(r);
  unsigned int flags = 0;
  int active = 0;
  r = api_->cuDevicePrimaryCtxGetState(handle, &flags, &active);
  if (r != 0) return "cuDevicePrimaryCtxGetState returned " + std::to_string(r);
  // Retaining an inactive primary context would create it: never here.
  if (active == 0) return "device " + std::to_string(device) + " has no active primary context";
  CUcontext context = nullptr;
  if ((r = api_->cuDevicePrimaryCtxRetain(&context, handle)) != 0) {
    return "cuDevicePrimaryCtxRetain returned " + std::to_string(r);
  }
  CUcontext current = nullptr;
  if (api_->cuCtxGetCurrent(&current) == 0 && current == context) {
    api_->cuDevicePrimaryCtxRelease_v2(handle);  // current already: one retain per thread is enough
    return "";
  }
  // The retain is kept for the thread's lifetime: the context stays current on it.
  if ((r = api_->cuCtxSetCurrent(context)) != 0) return "cuCtxSetCurrent returned " + std::to_string(r);
  return "";
}

namespace {

bool accepted(ncclResult_t r) { return r == kSuccess || r == kInProgress; }

}  // namespace

NcclLibrary::NcclLibrary(std::shared_ptr<DynamicLibrary> library, std::shared_ptr<Api> api)
    : library_(std::move(library)), api_(std::move(api)) {
  int version = 0;
  if (api_->ncclGetVersion(&version) == kSuccess) version_ = version;
  path_ = DynamicLibrary::file_of(reinterpret_cast<const void*>(api_->ncclCommAbort));
  if (path_.empty()) path_ = library_->path();
}

std::shared_ptr<NcclLibrary> NcclLibrary::find_loaded() {
  // torch's own NCCL first: another package's libnccl.so (cupy, vLLM) may
  // have been loaded before it, and torch's communicators must meet only the
  // NCCL that made them.
  if (const auto torch_cuda = find_loaded_object(kTorchCuda)) {
    auto library = DynamicLibrary::open_loaded(*torch_cuda);
    if (!library) return nullptr;
    if (library->symbol("ncclGetVersion") == nullptr) return nullptr;  // torch built without NCCL
    return std::shared_ptr<NcclLibrary>(new NcclLibrary(library, resolve(*library)));
  }
  const auto loaded = find_loaded_object(kLoadedPrefix);
  if (!loaded) return nullptr;
  auto library = DynamicLibrary::open_loaded(*loaded);
  if (!library) return nullptr;
  return std::shared_ptr<NcclLibrary>(new NcclLibrary(library, resolve(*library)));
}

std::shared_ptr<NcclLibrary> NcclLibrary::open(const std::string& path) {
  if (const auto torch_nccl = find_loaded(); torch_nccl && !same_file(torch_nccl->path(), path)) {
    throw std::invalid_argument("torch's NCCL is " + torch_nccl->path() + ": refusing to load a second copy from " +
                                path);
  }
  const auto loaded = find_loaded_object(kLoadedPrefix);
  if (loaded && !same_file(*loaded, path)) {
    throw std::invalid_argument("another libnccl is already loaded in this process (" + *loaded +
                                "): refusing to load a second copy from " + path);
  }
  auto library = DynamicLibrary::open(path);
  return std::shared_ptr<NcclLibrary>(new NcclLibrary(library, resolve(*library)));
}

bool NcclLibrary::has_revoke() const { return api_->ncclCommRevoke != nullptr; }

std::string NcclLibrary::error_string(int result) const {
  const char* s = api_->ncclGetErrorString(result);
  return s != nullptr ? s : "NCCL result " + std::to_string(result);
}

std::vector<std::pair<std::string, bool>> NcclLibrary::symbols() const {
  std::vector<std::pair<std::string, bool>> out;
#define INPROCESS_LIST(name, type) out.emplace_back(#name, api_->name != nullptr);
  INPROCESS_NCCL_FUNCTIONS(INPROCESS_LIST)
  INPROCESS_NCCL_OPTIONAL_FUNCTIONS(INPROCESS_LIST)
#undef INPROCESS_LIST
  return out;
}

template <class Body>
NcclOutcome NcclLibrary::run(size_t count, int64_t timeout_ns, const char* what, Body body) {
  const int64_t started = monotonic_ns();
  const int64_t deadline = add_saturated(started, std::max<int64_t>(timeout_ns, 0));
  auto state = std::make_shared<JobState>();
  state->outcome.results.assign(count, -1);
  std::shared_ptr<Api> api = api_;
  std::shared_ptr<CurrentDevice> driver;
  int device = -1;
  {
    std::lock_guard<std::mutex> lock(device_mu_);
    driver = driver_;
    device = device_;
  }
  // The grace lets a job that watches the deadline itself (revoke's wait for
  // quiescence) report how it ended instead of being abandoned at the same instant.
  const bool finished = worker_.run(
      [state, api, deadline, body, driver, device] {
        if (driver && device >= 0 && t_bound_device != device) {
          // Before any NCCL call: its blocking group end saves and restores this thread's device.
          const std::string why = driver->bind(device);
          if (why.empty()) {
            t_bound_device = device;
          } else {
            state->outcome.message = "device " + std::to_string(device) + " not made current: " + why;
          }
        }
        body(*api, *state, deadline);
      },
                                    add_saturated(std::max<int64_t>(timeout_ns, 0), kReportGraceNs));
  NcclOutcome out;
  if (finished) {
    out = state->outcome;
  } else {
    out.status = GpuStatus::kTimedOut;
    out.results.assign(count, -1);
    out.message = std::string(what) + " did not return within the deadline";
  }
  out.elapsed_ns = monotonic_ns() - started;
  return out;
}

NcclOutcome NcclLibrary::abort(const std::vector<uint64_t>& comms, bool grouped, int64_t timeout_ns) {
  grouped = grouped && version_ >= kGroupAbortVersion;
  return run(comms.size(), timeout_ns, "ncclCommAbort", [comms, grouped](const Api& api, JobState& s, int64_t) {
    NcclOutcome& out = s.outcome;
    ncclResult_t r = kSuccess;
    bool in_group = grouped;
    if (in_group && (r = api.ncclGroupStart()) != kSuccess) {
      out.status = GpuStatus::kError;
      out.message = "ncclGroupStart returned " + std::to_string(r);
      in_group = false;  // still abort them one by one: leaving them alive is worse
    }
    for (size_t i = 0; i < comms.size(); ++i) {
      out.results[i] = api.ncclCommAbort(reinterpret_cast<ncclComm_t>(static_cast<uintptr_t>(comms[i])));
      if (!accepted(out.results[i])) {
        out.status = GpuStatus::kError;
        out.message = "ncclCommAbort returned " + std::to_string(out.results[i]) + " for communicator " +
                      std::to_string(i);
      }
    }
    if (in_group && (r = api.ncclGroupEnd()) != kSuccess && !accepted(r)) {
      out.status = GpuStatus::kError;
      out.message = "ncclGroupEnd returned " + std::to_string(r);
    }
  });
}

NcclOutcome NcclLibrary::revoke(const std::vector<uint64_t>& comms, const std::vector<bool>& blocking,
                                int64_t timeout_ns) {
  if (!has_revoke()) {
    NcclOutcome out;
    out.status = GpuStatus::kError;
    out.results.assign(comms.size(), -1);
    out.message = "this NCCL (" + std::to_string(version_) + ") has no ncclCommRevoke (NCCL 2.28.7 and later)";
    return out;
  }
  if (blocking.size() != comms.size()) {
    throw std::invalid_argument("revoke: " + std::to_string(comms.size()) + " communicators but " +
                                std::to_string(blocking.size()) + " blocking flags");
  }
  return run(comms.size(), timeout_ns, "ncclCommRevoke", [comms, blocking](const Api& api, JobState& s, int64_t deadline) {
    NcclOutcome& out = s.outcome;
    auto comm = [&](size_t i) { return reinterpret_cast<ncclComm_t>(static_cast<uintptr_t>(comms[i])); };
    // Non-blocking first: their ncclGroupEnd returns ncclInProgress at once and
    // NCCL finishes them on threads of its own while the blocking group runs.
    for (const bool group_blocking : {false, true}) {
      bool any = false;
      for (size_t i = 0; i < comms.size(); ++i) any = any || blocking[i] == group_blocking;
      if (!any) continue;
      ncclResult_t r = api.ncclGroupStart();
      const bool in_group = r == kSuccess;
      if (!in_group) {
        out.status = GpuStatus::kError;
        out.message = "ncclGroupStart returned " + std::to_string(r);
      }
      for (size_t i = 0; i < comms.size(); ++i) {
        if (blocking[i] != group_blocking) continue;
        out.results[i] = api.ncclCommRevoke(comm(i), 0);
        if (!accepted(out.results[i])) {
          out.status = GpuStatus::kError;
          out.message = "ncclCommRevoke returned " + std::to_string(out.results[i]) + " for communicator " +
                        std::to_string(i);
        }
      }
      if (in_group && !accepted(r = api.ncclGroupEnd())) {
        out.status = GpuStatus::kError;
        out.message = "ncclGroupEnd returned " + std::to_string(r) + " (revoke of the " +
                      (group_blocking ? "blocking" : "non-blocking") + " communicators)";
      }
    }
    // Revoked communicators report ncclInProgress until they are quiescent.
    int64_t backoff = 10'000;
    for (;;) {
      bool pending = false;
      for (size_t i = 0; i < comms.size(); ++i) {
        ncclResult_t state = kSuccess;
        if (api.ncclCommGetAsyncError(comm(i), &state) == kSuccess && state == kInProgress) pending = true;
      }
      if (!pending) return;
      const int64_t left = deadline - monotonic_ns();
      if (left <= 0) {
        out.status = GpuStatus::kTimedOut;
        out.message = "revoked communicators still in progress at the deadline";
        return;
      }
      const int64_t nap = std::min(backoff, left);
      timespec ts{static_cast<time_t>(nap / 1'000'000'000), static_cast<long>(nap % 1'000'000'000)};
      nanosleep(&ts, nullptr);
      backoff = std::min<int64_t>(backoff * 2, 1'000'000);
    }
  });
}

std::string NcclLibrary::use_device(std::shared_ptr<CurrentDevice> driver, int device) {
  std::string why;
  if (driver && device >= 0) why = driver->bind(device);
  std::lock_guard<std::mutex> lock(device_mu_);
  driver_ = std::move(driver);
  device_ = device;
  return why;
}

int NcclLibrary::device() const {
  std::lock_guard<std::mutex> lock(device_mu_);
  return device_;
}

NcclOutcome NcclLibrary::async_errors(const std::vector<uint64_t>& comms, int64_t timeout_ns) {
  return run(comms.size(), timeout_ns, "ncclCommGetAsyncError", [comms](const Api& api, JobState& s, int64_t) {
    NcclOutcome& out = s.outcome;
    for (size_t i = 0; i < comms.size(); ++i) {
      ncclResult_t error = kSuccess;
      const ncclResult_t r =
          api.ncclCommGetAsyncError(reinterpret_cast<ncclComm_t>(static_cast<uintptr_t>(comms[i])), &error);
      if (r != kSuccess) {
        out.status = GpuStatus::kError;
        out.message = "ncclCommGetAsyncError returned " + std::to_string(r) + " for communicator " + std::to_string(i);
      }
      out.results[i] = r == kSuccess ? error : r;
    }
  });
}

}  // namespace inprocess::gpu
