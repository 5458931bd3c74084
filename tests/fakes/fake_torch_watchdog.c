/* A fake of what torch's ProcessGroupNCCL watchdog thread does when a CUDA
 * error reaches it (torch 2.13, torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp,
 * pytorch/pytorch main as read for this fake):
 *
 * - Watchdog::runLoop polls every work's CUDA events, then sleeps
 *   kWatchdogThreadSleepMillis (100 ms); WorkNCCL::finishedGPUExecutionInternal
 *   queries the end event and C10_CUDA_CHECK throws on any error but
 *   "not ready". Here: cuStreamQuery of the fake libcuda, every 100 ms.
 * - Watchdog::run catches it, logs "Process group watchdog thread terminated
 *   with exception: ...", and, if rethrowCUDAErrors_ (getCvarBool of
 *   TORCH_NCCL_RETHROW_CUDA_ERRORS, default true: ProcessGroupNCCL.hpp line
 *   110, Watchdog::Watchdog), rethrows out of the thread's function:
 *   std::terminate, which calls abort(): SIGABRT. Otherwise the thread ends
 *   and the process goes on. (torch also rethrows a message that begins with
 *   "CUDA Error"; c10's CUDA messages begin with "CUDA error", so not those.)
 *
 * The fake libcuda is the one INPROCESS_LIBCUDA names (the copy the code
 * under test loaded). fake_torch_watchdog_start() starts the thread. */
#include <ctype.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*stream_query_fn)(void*);

/* torch's getCvarBool (torch/csrc/distributed/c10d/Utils.hpp line 151,
 * torch 2.13.0); a value it refuses aborts in torch too (TORCH_CHECK). */
static int rethrow_cuda_errors(void) {
  const char* raw = getenv("TORCH_NCCL_RETHROW_CUDA_ERRORS");
  if (raw == NULL) return 1;
  char value[16] = {0};
  for (size_t i = 0; i + 1 < sizeof(value) && raw[i] != '\0'; ++i) value[i] = (char)tolower((unsigned char)raw[i]);
  const char* truths[] = {"y", "yes", "1", "t", "true"};
  const char* falsehoods[] = {"n", "no", "0", "f", "false"};
  for (size_t i = 0; i < 5; ++i) {
    if (strcmp(value, truths[i]) == 0) return 1;
    if (strcmp(value, falsehoods[i]) == 0) return 0;
  }
  return 1;
}

static void* watchdog(void* arg) {
  stream_query_fn query = (stream_query_fn)arg;
  const struct timespec poll = {0, 100 * 1000 * 1000}; /* kWatchdogThreadSleepMillis */
  for (;;) {
    const int r = query(NULL);
    if (r != 0 && r != 600) {
      fprintf(stderr, "[PG ID 0 PG GUID 0 Rank 0] Process group watchdog thread terminated with exception: "
                      "CUDA error: fake CUDA error %d\n", r);
      if (rethrow_cuda_errors()) {
        fprintf(stderr, "terminate called after throwing an instance of 'c10::DistBackendError'\n");
        abort();
      }
      return NULL;
    }
    nanosleep(&poll, NULL);
  }
}

int fake_torch_watchdog_start(void) {
  const char* path = getenv("INPROCESS_LIBCUDA");
  void* cuda = dlopen(path ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (cuda == NULL) return -1;
  stream_query_fn query = (stream_query_fn)dlsym(cuda, "cuStreamQuery");
  if (query == NULL) return -1;
  pthread_t thread;
  if (pthread_create(&thread, NULL, watchdog, (void*)query) != 0) return -1;
  pthread_detach(thread);
  return 0;
}
