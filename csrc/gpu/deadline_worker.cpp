#include "gpu/deadline_worker.hpp"

#include <pthread.h>

#include <condition_variable>
#include <thread>

#include "clock.hpp"

namespace inprocess::gpu {

namespace {
std::atomic<uint64_t> g_abandoned{0};
}

struct DeadlineWorker::Thread {
  std::mutex mu;
  std::condition_variable cv;
  std::function<void()> job;
  bool has_job = false;
  bool done = false;
  bool stop = false;  // set when abandoned or when the worker goes away

  void loop() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [this] { return has_job || stop; });
      if (!has_job) return;  // stop, nothing left to run
      std::function<void()> current = std::move(job);
      lock.unlock();
      current();
      current = nullptr;  // release what the job owns outside the lock
      lock.lock();
      has_job = false;
      done = true;
      cv.notify_all();
      if (stop) return;
    }
  }
};

DeadlineWorker::DeadlineWorker(std::string name) : name_(std::move(name)) {}

DeadlineWorker::~DeadlineWorker() {
  std::lock_guard<std::mutex> guard(mu_);
  if (thread_) {
    std::lock_guard<std::mutex> lock(thread_->mu);
    thread_->stop = true;
    thread_->cv.notify_all();
  }
}

std::shared_ptr<DeadlineWorker::Thread> DeadlineWorker::fresh_thread() {
  auto state = std::make_shared<Thread>();
  std::thread t([state] { state->loop(); });
  // Thread names are at most 15 characters.
  pthread_setname_np(t.native_handle(), name_.substr(0, 15).c_str());
  t.detach();
  return state;
}

bool DeadlineWorker::run(std::function<void()> job, int64_t timeout_ns) {
  std::lock_guard<std::mutex> guard(mu_);
  if (!thread_) thread_ = fresh_thread();
  std::shared_ptr<Thread> t = thread_;
  std::unique_lock<std::mutex> lock(t->mu);
  t->job = std::move(job);
  t->has_job = true;
  t->done = false;
  t->cv.notify_all();
  if (t->cv.wait_until(lock, steady_deadline(timeout_ns), [&] { return t->done; })) return true;
  // Abandoned: the thread ends once the call returns, if it ever does.
  t->stop = true;
  thread_.reset();
  g_abandoned.fetch_add(1, std::memory_order_relaxed);
  return false;
}

uint64_t DeadlineWorker::abandoned_total() { return g_abandoned.load(std::memory_order_relaxed); }

}  // namespace inprocess::gpu
