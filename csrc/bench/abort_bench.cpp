// Abort latency of the native NCCL path: from the request to communicators
// released, on the fake libnccl (tests/fakes/fake_nccl.c). What it measures is
// inprocess's own overhead (handing the abort to the worker thread, the
// grouped ncclCommAbort calls, the wake-ups), not NCCL's teardown.
//
//   abort_bench [path/to/libnccl.so.2] [runs] [communicators] [blocked (1)]
//
// Each run: `communicators` fake communicators, one thread blocked in a
// "collective" on each (it returns once its communicator is aborted); then
// NcclLibrary::abort(grouped). Reported: request -> abort call returned, and
// request -> the last blocked collective woke up (released). With blocked = 0
// no collective waits: the abort returned is then the hand-off to the deadline
// worker, the grouped calls and the hand-back alone, without woken threads
// competing with them for the cores.
#include <dlfcn.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "clock.hpp"
#include "gpu/nccl_comms.hpp"

#ifndef INPROCESS_FAKE_NCCL
#define INPROCESS_FAKE_NCCL ""
#endif

using inprocess::monotonic_ns;

namespace {

struct Percentiles {
  double p50_us, p99_us, max_us;
};

Percentiles summarise(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))] / 1e3; };
  return {at(0.5), at(0.99), v.back() / 1e3};
}

// The floor of any design that runs the abort on a thread of its own: a bare
// condition-variable round trip to a thread asleep since its last one. Sampled
// in the same runs as the abort, interleaved, as the machine's wake-up latency
// changes from minute to minute.
class WakeUpFloor {
 public:
  WakeUpFloor() : peer_([this] { serve(); }) {}
  ~WakeUpFloor() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    peer_.join();
  }
  int64_t sample() {
    const int64_t requested = monotonic_ns();
    std::unique_lock<std::mutex> lock(mu_);
    job_ = true;
    done_ = false;
    cv_.notify_all();
    cv_.wait(lock, [&] { return done_; });
    return monotonic_ns() - requested;
  }

 private:
  void serve() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return job_ || stop_; });
      if (stop_) return;
      job_ = false;
      done_ = true;
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  bool job_ = false, done_ = false, stop_ = false;
  std::thread peer_;
};

void print_row(const char* name, const Percentiles& p) {
  std::printf("%-40s %10.1f %10.1f %10.1f\n", name, p.p50_us, p.p99_us, p.max_us);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : INPROCESS_FAKE_NCCL;
  const int runs = argc > 2 ? std::atoi(argv[2]) : 2000;
  const int count = argc > 3 ? std::atoi(argv[3]) : 4;
  const bool blocked = argc > 4 ? std::atoi(argv[4]) != 0 : true;
  if (path.empty() || runs < 1 || count < 1) {
    std::fprintf(stderr, "usage: %s path/to/fake/libnccl.so.2 [runs] [communicators] [blocked (1)]\n", argv[0]);
    return 2;
  }
  auto nccl = inprocess::gpu::NcclLibrary::open(path);
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  using Create = void* (*)();
  using Free = void (*)(void*);
  using Wait = int (*)(void*, int);
  auto create = reinterpret_cast<Create>(dlsym(handle, "fake_nccl_comm_create"));
  auto destroy = reinterpret_cast<Free>(dlsym(handle, "fake_nccl_comm_free"));
  auto wait = reinterpret_cast<Wait>(dlsym(handle, "fake_nccl_collective_wait"));
  if (create == nullptr || destroy == nullptr || wait == nullptr) {
    std::fprintf(stderr, "%s is not the fake libnccl (no fake_nccl_* symbols)\n", path.c_str());
    return 2;
  }

  std::vector<int64_t> returned, released, floor_samples;
  WakeUpFloor floor_probe;
  returned.reserve(runs);
  released.reserve(runs);
  for (int run = 0; run < runs; ++run) {
    std::vector<uint64_t> comms;
    for (int i = 0; i < count; ++i) comms.push_back(reinterpret_cast<uint64_t>(create()));
    std::vector<std::atomic<int64_t>> woke(count);
    std::vector<std::thread> collectives;
    for (int i = 0; i < (blocked ? count : 0); ++i) {
      collectives.emplace_back([&, i] {
        wait(reinterpret_cast<void*>(comms[i]), 10'000);
        woke[i].store(monotonic_ns());
      });
    }
    timespec settle{0, 300'000};  // every collective inside its wait; the worker asleep
    nanosleep(&settle, nullptr);
    const int64_t requested = monotonic_ns();
    const auto outcome = nccl->abort(comms, true, 1'000'000'000);
    const int64_t done = monotonic_ns();
    for (auto& t : collectives) t.join();
    if (outcome.status != inprocess::gpu::GpuStatus::kDone) {
      std::fprintf(stderr, "run %d: abort failed: %s\n", run, outcome.message.c_str());
      return 1;
    }
    int64_t last = 0;
    for (auto& w : woke) last = std::max(last, w.load());
    returned.push_back(done - requested);
    if (blocked) released.push_back(last - requested);
    for (auto c : comms) destroy(reinterpret_cast<void*>(c));
    nanosleep(&settle, nullptr);  // the probe's thread asleep as long as the worker was
    floor_samples.push_back(floor_probe.sample());
  }
  const auto r = summarise(returned);
  const auto floor = summarise(floor_samples);
  std::printf("abort latency on the fake libnccl, %d runs, %d communicators, %s\n", runs, count,
              blocked ? "one blocked collective each" : "no collective waiting");
  std::printf("%-40s %10s %10s %10s\n", "", "p50 us", "p99 us", "max us");
  print_row("request -> abort returned", r);
  const auto l = blocked ? summarise(released) : Percentiles{0, 0, 0};
  if (blocked) print_row("request -> collectives released", l);
  print_row("floor: a sleeping thread's round trip", floor);
  std::printf("{\"bench\": \"abort_latency_fake\", \"runs\": %d, \"communicators\": %d, \"blocked\": %s, "
              "\"returned_p50_us\": %.1f, \"returned_p99_us\": %.1f, ", runs, count, blocked ? "true" : "false",
              r.p50_us, r.p99_us);
  if (blocked) std::printf("\"released_p50_us\": %.1f, \"released_p99_us\": %.1f, ", l.p50_us, l.p99_us);
  std::printf("\"floor_p50_us\": %.1f, \"floor_p99_us\": %.1f}\n", floor.p50_us, floor.p99_us);
  return 0;
}
