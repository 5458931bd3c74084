// Microbenchmarks of the native monitoring core (no Python involved):
//   1. the cost of one heartbeat write (ping, stamp_auto);
//   2. the time from a missed soft deadline to the watchdog's trigger;
//   3. the time from a missed hard deadline to the rank's death as seen by
//      its monitor (a forked child that stops making progress);
//   4. the time from a rank's own exit to its monitor seeing it.
// Prints median and 99th percentile per measurement, then one JSON line.
// See benchmarks/native_microbench.md for the commands and measured figures.

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "clock.hpp"
#include "heartbeat.hpp"
#include "killer.hpp"
#include "watchdog.hpp"

using namespace inprocess;

namespace {

constexpr int64_t kMs = 1'000'000;

struct Stats {
  std::string name;
  std::string unit;
  size_t samples = 0;
  double median = 0;
  double p99 = 0;
  double max = 0;
};

// Nearest-rank percentiles: no interpolation between samples.
Stats summarize(const std::string& name, const std::string& unit, std::vector<double> v) {
  Stats s;
  s.name = name;
  s.unit = unit;
  s.samples = v.size();
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  auto rank = [&](double q) {
    size_t i = static_cast<size_t>(q * static_cast<double>(v.size()) + 0.999999);
    return v[std::min(v.size(), std::max<size_t>(1, i)) - 1];
  };
  s.median = rank(0.50);
  s.p99 = rank(0.99);
  s.max = v.back();
  return s;
}

// Writes are timed in batches: one clock read costs about as much as the
// write itself, so timing writes one by one would measure the clock.
template <typename F>
std::vector<double> per_op_ns(F op, int batches, int per_batch) {
  std::vector<double> out;
  out.reserve(batches);
  for (int b = 0; b < batches; ++b) {
    const int64_t t0 = monotonic_ns();
    for (int i = 0; i < per_batch; ++i) op();
    const int64_t t1 = monotonic_ns();
    out.push_back(static_cast<double>(t1 - t0) / per_batch);
  }
  return out;
}

std::vector<Stats> bench_heartbeat_writes() {
  HeartbeatPage page = HeartbeatPage::create();
  const int batches = 2000, per_batch = 1000;
  std::vector<Stats> out;
  // Warm the page and the code paths.
  for (int i = 0; i < 100000; ++i) page.ping();
  out.push_back(summarize("heartbeat ping()", "ns/op", per_op_ns([&] { page.ping(); }, batches, per_batch)));
  out.push_back(
      summarize("heartbeat stamp_auto()", "ns/op", per_op_ns([&] { page.stamp_auto(); }, batches, per_batch)));
  volatile int64_t sink = 0;
  out.push_back(summarize("  of which monotonic_ns()", "ns/op",
                          per_op_ns([&] { sink = sink + monotonic_ns(); }, batches, per_batch)));
  return out;
}

// The main thread is "stuck": request_stamp does nothing, so every iteration
// runs into its soft deadline; each trial starts a new iteration.
std::vector<Stats> bench_soft_timeout(int trials) {
  HeartbeatPage page = HeartbeatPage::create();
  const int64_t soft = 10 * kMs, interval = 2 * kMs;
  page.set_timeouts(soft, 3600'000 * kMs);
  page.begin_iteration(-1, 1);
  page.set_flag(kHangProtectionOff, true);  // quiet until the first trial

  std::mutex mu;
  std::condition_variable cv;
  std::optional<SoftTimeoutEvent> last;
  int64_t callback_ns = 0;
  Watchdog watchdog(
      page.fd(), interval, [] {},
      [&](const SoftTimeoutEvent& e) {
        const int64_t now = monotonic_ns();
        std::lock_guard<std::mutex> lock(mu);
        last = e;
        callback_ns = now;
        cv.notify_all();
      });
  watchdog.start();

  std::vector<double> detect, callback;
  for (int i = 0; i < trials; ++i) {
    {
      std::lock_guard<std::mutex> lock(mu);
      last.reset();
    }
    page.begin_iteration(i, 1);
    page.set_flag(kHangProtectionOff, false);
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, std::chrono::seconds(2), [&] { return last && last->iteration == i; })) {
      std::fprintf(stderr, "soft timeout trial %d: no trigger within 2 s\n", i);
      continue;
    }
    detect.push_back(static_cast<double>(last->detected_ns - last->deadline_ns) / 1e3);
    callback.push_back(static_cast<double>(callback_ns - last->deadline_ns) / 1e3);
  }
  watchdog.stop(1000 * kMs);
  return {summarize("soft deadline -> watchdog detects", "us", detect),
          summarize("soft deadline -> on_soft_timeout runs", "us", callback)};
}

// A child that makes progress for a while, then stops: either it spins (a
// rank stuck in native code holding the GIL, which competes with its monitor
// for a CPU) or it sleeps (a rank blocked in a call). Only atomics, the clock
// and pause() are used after fork.
[[noreturn]] void child_progress_then_stall(HeartbeatLayout* p, int64_t progress_for_ns, bool spin) {
  const int64_t until = monotonic_ns() + progress_for_ns;
  while (monotonic_ns() < until) p->auto_progress_ns.store(monotonic_ns(), std::memory_order_release);
  if (spin) {
    volatile uint64_t counter = 0;
    for (;;) counter = counter + 1;
  }
  for (;;) pause();
}

void reap(pid_t pid) {
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
}

std::vector<Stats> bench_hard_timeout(int trials, bool spin) {
  HeartbeatPage page = HeartbeatPage::create();
  const int64_t hard = 20 * kMs, grace = 1000 * kMs;
  page.set_timeouts(10 * kMs, hard);
  std::vector<double> detect, death, term_to_death;
  for (int i = 0; i < trials; ++i) {
    page.begin_iteration(i, 1);
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("fork");
      break;
    }
    if (pid == 0) child_progress_then_stall(page.layout(), 5 * kMs, spin);
    const int pidfd = pidfd_open(pid);
    std::optional<GuardEvent> e;
    {
      HardTimeoutGuard guard(page.fd(), pidfd, grace);
      guard.start();
      e = guard.wait_event(5000 * kMs);
      guard.stop(1000 * kMs);
    }
    if (!e || e->kind != GuardEventKind::kHardTimeout || !e->kill.dead()) {
      std::fprintf(stderr, "hard timeout trial %d: no kill seen\n", i);
      kill(pid, SIGKILL);
    } else {
      detect.push_back(static_cast<double>(e->detected_ns - e->deadline_ns) / 1e3);
      death.push_back(static_cast<double>(e->kill.dead_ns - e->deadline_ns) / 1e3);
      term_to_death.push_back(static_cast<double>(e->kill.dead_ns - e->kill.term_sent_ns) / 1e3);
    }
    close(pidfd);
    reap(pid);
  }
  const std::string how = spin ? " (rank spins)" : " (rank sleeps)";
  return {summarize("hard deadline -> monitor detects" + how, "us", detect),
          summarize("hard deadline -> death seen" + how, "us", death),
          summarize("  of which SIGTERM -> death seen" + how, "us", term_to_death)};
}

// The child writes the time of its own exit to a shared word, then exits.
std::vector<Stats> bench_exit_seen(int trials) {
  HeartbeatPage page = HeartbeatPage::create();
  page.set_timeouts(0, 0);  // no deadline: the guard only waits for the death
  auto* exit_at = static_cast<std::atomic<int64_t>*>(
      mmap(nullptr, sizeof(std::atomic<int64_t>), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (exit_at == MAP_FAILED) {
    std::perror("mmap");
    return {};
  }
  std::vector<double> seen;
  for (int i = 0; i < trials; ++i) {
    exit_at->store(0);
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("fork");
      break;
    }
    if (pid == 0) {
      const timespec nap{0, 5 * kMs};  // let the guard start waiting first
      nanosleep(&nap, nullptr);
      exit_at->store(monotonic_ns());
      _exit(0);
    }
    const int pidfd = pidfd_open(pid);
    std::optional<GuardEvent> e;
    {
      HardTimeoutGuard guard(page.fd(), pidfd, 0, kDefaultKillWaitNs, 3600'000 * kMs);
      guard.start();
      e = guard.wait_event(5000 * kMs);
      guard.stop(1000 * kMs);
    }
    if (e && e->kind == GuardEventKind::kExited && exit_at->load() != 0) {
      seen.push_back(static_cast<double>(e->detected_ns - exit_at->load()) / 1e3);
    } else {
      std::fprintf(stderr, "exit trial %d: death not reported\n", i);
      kill(pid, SIGKILL);
    }
    close(pidfd);
    reap(pid);
  }
  munmap(exit_at, sizeof(std::atomic<int64_t>));
  return {summarize("rank exits -> death seen by monitor", "us", seen)};
}

}  // namespace

int main(int argc, char** argv) {
  int trials = 100;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--trials") == 0 && i + 1 < argc) {
      trials = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: %s [--trials N]   (N latency trials per measurement, default 100)\n", argv[0]);
      return 2;
    }
  }

  std::vector<Stats> all;
  for (auto* group : {+[](int) { return bench_heartbeat_writes(); }, +[](int n) { return bench_soft_timeout(n); },
                      +[](int n) { return bench_hard_timeout(n, false); },
                      +[](int n) { return bench_hard_timeout(n, true); }, +[](int n) { return bench_exit_seen(n); }}) {
    for (Stats& s : group(trials)) all.push_back(s);
  }

  std::printf("%-52s %8s %12s %12s %12s  %s\n", "measurement", "samples", "median", "p99", "max", "unit");
  for (const Stats& s : all) {
    std::printf("%-52s %8zu %12.1f %12.1f %12.1f  %s\n", s.name.c_str(), s.samples, s.median, s.p99, s.max,
                s.unit.c_str());
  }
  std::printf("{\"benchmark\": \"inprocess_microbench\", \"trials\": %d, \"results\": [", trials);
  for (size_t i = 0; i < all.size(); ++i) {
    const Stats& s = all[i];
    std::printf("%s{\"name\": \"%s\", \"unit\": \"%s\", \"samples\": %zu, \"median\": %.1f, \"p99\": %.1f, "
                "\"max\": %.1f}",
                i ? ", " : "", s.name.c_str(), s.unit.c_str(), s.samples, s.median, s.p99, s.max);
  }
  std::printf("]}\n");
  return 0;
}
