#pragma once

// NCCL communicators by pointer: abort (several as one group), revoke where
// the loaded NCCL has ncclCommRevoke, async errors. Only the libnccl this
// process already loaded (torch's) may act on torch's communicators: the
// loader finds it among the loaded objects and never maps a second copy.
// Every call runs on a DeadlineWorker thread: a hung abort returns "timed
// out" to the caller instead of hanging it.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gpu/deadline_worker.hpp"
#include "gpu/dynamic_library.hpp"
#include "gpu/gpu_status.hpp"
#include "gpu/nccl_api.hpp"

namespace inprocess::gpu {

struct NcclOutcome {
  GpuStatus status = GpuStatus::kDone;
  std::vector<int> results;  // per communicator, in the order given (abort/revoke: the call's result;
                             // async_errors: the communicator's async error)
  std::string message;       // what failed, for the exception or the log
  int64_t elapsed_ns = 0;
};

class NcclLibrary {
 public:
  static constexpr const char* kLoadedPrefix = "libnccl.so";
  // Added to a timeout before a call is abandoned (see NcclLibrary::run).
  static constexpr int64_t kReportGraceNs = 20'000'000;

  // The libnccl already loaded in this process, or nullptr when none is.
  static std::shared_ptr<NcclLibrary> find_loaded();
  // An explicit file (tests, benchmarks, tools). Refuses with
  // std::invalid_argument when another libnccl file is already loaded: its
  // communicators must never meet a second copy. Throws std::runtime_error
  // when the file cannot be loaded or lacks a required symbol.
  static std::shared_ptr<NcclLibrary> open(const std::string& path);

  const std::string& path() const { return library_->path(); }
  bool was_loaded_before() const { return library_->was_loaded_before(); }
  int version() const { return version_; }
  bool has_revoke() const;
  std::string error_string(int result) const;
  // Every symbol this layer uses and whether the library has it.
  std::vector<std::pair<std::string, bool>> symbols() const;

  // ncclCommAbort of each communicator; `grouped`: between ncclGroupStart and
  // ncclGroupEnd, so that NCCL tears them down together (aborting one by one
  // can hang while an operation on another still waits for it), where the
  // NCCL takes aborts in a group (2.22 and later; one by one before). The pointers are
  // freed by NCCL: their owner must not use them again.
  NcclOutcome abort(const std::vector<uint64_t>& comms, bool grouped, int64_t timeout_ns);
  // ncclCommRevoke of each, then until none reports ncclInProgress: in-flight
  // operations are stopped, and the communicators stay valid for their
  // owner's own abort or destroy. kError when the library has no revoke.
  NcclOutcome revoke(const std::vector<uint64_t>& comms, int64_t timeout_ns);
  NcclOutcome async_errors(const std::vector<uint64_t>& comms, int64_t timeout_ns);

  struct Api;

 private:
  NcclLibrary(std::shared_ptr<DynamicLibrary> library, std::shared_ptr<Api> api);
  template <class Body>
  NcclOutcome run(size_t count, int64_t timeout_ns, const char* what, Body body);

  std::shared_ptr<DynamicLibrary> library_;
  std::shared_ptr<Api> api_;
  int version_ = 0;
  DeadlineWorker worker_{"inprocess-nccl"};
};

}  // namespace inprocess::gpu
