#include "gpu/nccl_comms.hpp"

#include <sys/stat.h>
#include <time.h>

#include <algorithm>
#include <stdexcept>

#include "clock.hpp"

namespace inprocess::gpu {

using namespace inprocess::nccl;

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

bool accepted(ncclResult_t r) { return r == kSuccess || r == kInProgress; }

}  // namespace

NcclLibrary::NcclLibrary(std::shared_ptr<DynamicLibrary> library, std::shared_ptr<Api> api)
    : library_(std::move(library)), api_(std::move(api)) {
  int version = 0;
  if (api_->ncclGetVersion(&version) == kSuccess) version_ = version;
}

std::shared_ptr<NcclLibrary> NcclLibrary::find_loaded() {
  const auto loaded = find_loaded_object(kLoadedPrefix);
  if (!loaded) return nullptr;
  auto library = DynamicLibrary::open_loaded(*loaded);
  if (!library) return nullptr;
  return std::shared_ptr<NcclLibrary>(new NcclLibrary(library, resolve(*library)));
}

std::shared_ptr<NcclLibrary> NcclLibrary::open(const std::string& path) {
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
  // The grace lets a job that watches the deadline itself (revoke's wait for
  // quiescence) report how it ended instead of being abandoned at the same instant.
  const bool finished = worker_.run([state, api, deadline, body] { body(*api, *state, deadline); },
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

NcclOutcome NcclLibrary::revoke(const std::vector<uint64_t>& comms, int64_t timeout_ns) {
  if (!has_revoke()) {
    NcclOutcome out;
    out.status = GpuStatus::kError;
    out.results.assign(comms.size(), -1);
    out.message = "this NCCL (" + std::to_string(version_) + ") has no ncclCommRevoke (NCCL 2.28.7 and later)";
    return out;
  }
  return run(comms.size(), timeout_ns, "ncclCommRevoke", [comms](const Api& api, JobState& s, int64_t deadline) {
    NcclOutcome& out = s.outcome;
    for (size_t i = 0; i < comms.size(); ++i) {
      out.results[i] = api.ncclCommRevoke(reinterpret_cast<ncclComm_t>(static_cast<uintptr_t>(comms[i])), 0);
      if (!accepted(out.results[i])) {
        out.status = GpuStatus::kError;
        out.message = "ncclCommRevoke returned " + std::to_string(out.results[i]) + " for communicator " +
                      std::to_string(i);
      }
    }
    // Revoked communicators report ncclInProgress until they are quiescent.
    int64_t backoff = 10'000;
    for (;;) {
      bool pending = false;
      for (size_t i = 0; i < comms.size(); ++i) {
        ncclResult_t state = kSuccess;
        if (api.ncclCommGetAsyncError(reinterpret_cast<ncclComm_t>(static_cast<uintptr_t>(comms[i])), &state) ==
                kSuccess &&
            state == kInProgress) {
          pending = true;
        }
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
