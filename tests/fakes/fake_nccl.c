/* A fake NCCL (libnccl.so.2) for tests without a GPU. It follows NCCL
 * v2.30.7-1 (github.com/NVIDIA/nccl, commit 73cf112295c3) where inprocess
 * depends on it:
 *
 * - ncclCommAbort and ncclCommRevoke set the communicator's abort flag at the
 *   call, then run a job that waits for the communicator's streams (src/init.cc
 *   lines 3025-3061 and 2965-3022; the jobs commReclaim/commDestroySync,
 *   lines 2729-2750, and commRevokeAsync, lines 2933-2963, synchronize the
 *   host and device streams). Outside a group the job runs at once; inside
 *   ncclGroupStart/End it runs at the group end, after every call of the group
 *   set its flag (src/group.cc, ncclAsyncLaunch lines 36-70).
 * - A kernel launched on a stream (fake_nccl_kernel_launch) ends only once
 *   its communicator's abort flag is set. Communicators made on one stream
 *   (torch 2.13 runs synchronous collectives on the current stream, and NCCL
 *   makes its own stream wait on it) see each other's kernels: a job waiting
 *   for the stream waits for every kernel on it.
 * - ncclCommAbort frees the communicator (commFree). Here its memory is kept
 *   but poisoned: any later call with it prints "use of a freed communicator"
 *   and aborts the process, where the real library would read freed memory.
 * - Blocking and non-blocking communicators cannot share a group (src/group.cc
 *   lines 54-62): the call returns ncclInvalidArgument and the group end
 *   fails without running any job. A non-blocking group end returns
 *   ncclInProgress and runs its jobs on a thread (lines 824-857); a
 *   communicator reports ncclInProgress until its job is done.
 * - The blocking group end saves the calling thread's device and sets it back
 *   (src/group.cc lines 859-863); each job sets its communicator's device
 *   (src/init.cc lines 2734, 2940). The device is kept, as NCCL's static
 *   cudart keeps it, in the CUDA driver's current context: with
 *   FAKE_NCCL_LIBCUDA naming the (fake) driver, cudaGetDevice reads the
 *   calling thread's current context (0 when there is none, creating
 *   nothing) and cudaSetDevice retains and sets the device's primary context
 *   (creating it where it is not active, as cudaSetDevice does since CUDA 12).
 *   Without FAKE_NCCL_LIBCUDA the device is a thread-local number.
 *
 * - ncclCommAbort returns only once the communicator's proxy threads have
 *   exited, and they read the abort flag only before each poll of 500 ms
 *   (src/proxy.cc v2.29.7-1, the service thread's poll at line 1663, the UDS
 *   thread's at line 1835): the kernels end at the call, the call itself
 *   lasts up to a poll boundary. FAKE_NCCL_TEARDOWN_MS (default 0) is that
 *   wait, spent after the kernels were released and the communicator freed.
 * - No NCCL call may run beside an abort: "make sure no thread is calling any
 *   NCCL operations while calling ncclCommAbort" (docs/userguide/source/
 *   usage/communicators.rst, Fault Tolerance, v2.30.7-1). ncclCommAbort calls
 *   running at once on different communicators are allowed here: torch aborts
 *   each group on a thread of its own, NCCL's source handles aborts from
 *   several threads since 2.19.1 (NVIDIA/nccl#992), though its documentation
 *   does not promise it (usage/threadsafety.rst). Any other call (a communicator's creation, a kernel launch,
 *   ncclCommGetAsyncError, ncclCommRevoke) made while an abort runs is
 *   counted (fake_nccl_calls_beside_abort) and, with
 *   FAKE_NCCL_ALONE_DURING_ABORT=1, aborts the process with "called while an
 *   abort runs".
 * - ncclCommGetAsyncError on a non-blocking communicator completes and frees
 *   the group job linked to it (src/init.cc v2.29.7-1 lines 3107-3110; linked
 *   by a non-blocking group end only, src/group.cc lines 796-823): two callers
 *   that do not share torch's communicator mutex can both complete it.
 *   fake_nccl_async_error_calls counts the calls per communicator.
 *
 * - A communicator holds device memory from its creation until its abort
 *   returns: ncclCommAbort's job stops the proxy threads first and frees the
 *   device buffers after (NCCL master 5067397c src/init.cc: commDestroySync
 *   calls ncclProxyStop at line 2762, then commFree at line 2778, which frees
 *   them once "all proxy threads have been joined", lines 301-302, 338).
 *   FAKE_NCCL_COMM_BYTES (default 0) is what each communicator holds;
 *   FAKE_CUDA_MEMORY_BYTES (default 0: unlimited) the device's memory. A
 *   creation that does not fit fails (fake_nccl_comm_create_on returns NULL:
 *   ncclCommInitRankConfig's cudaMalloc, ncclUnhandledCudaError).
 *   fake_cuda_mem_get_info answers as cudaMemGetInfo does for a device (what
 *   torch.cuda.mem_get_info reads): free and total bytes.
 *
 * FAKE_NCCL_MODE, read at every call:
 *   ok                 as above
 *   abort_hangs        ncclCommAbort never returns
 *   revoke_stuck       revoked communicators report ncclInProgress for ever
 * FAKE_NCCL_VERSION is what ncclGetVersion says (default 22807, or
 * FAKE_NCCL_DEFAULT_VERSION at build time); FAKE_NCCL_ASYNC_ERROR what
 * ncclCommGetAsyncError reports (default 0) unless fake_nccl_set_async_error
 * set one for the communicator. Built with -DFAKE_NCCL_NO_REVOKE it lacks
 * ncclCommRevoke (an NCCL before 2.28.7); with -DFAKE_NCCL_OMIT_ABORT it lacks
 * ncclCommAbort. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifndef FAKE_NCCL_DEFAULT_VERSION
#define FAKE_NCCL_DEFAULT_VERSION 22807
#endif

typedef int ncclResult_t;
enum { kSuccess = 0, kInvalidArgument = 4, kInvalidUsage = 5, kInProgress = 7 };

#define LIVE 0x4e43434cu  /* "NCCL" */
#define FREED 0xdeadbeefu

struct ncclComm {
  unsigned magic;
  int aborted;      /* ncclCommAbort was called: freed */
  int revoked;
  int abort_flag;   /* what a kernel of the communicator polls */
  int revoke_polls; /* ncclInProgress answers left after a revoke */
  int in_progress;  /* a non-blocking job not finished */
  int device;
  int blocking;
  int stream;       /* -1: a stream of its own */
  int kernels;      /* kernels launched and not ended */
  int has_error;
  ncclResult_t error;
  long bytes;       /* device memory held until the abort returns */
  long async_error_calls;
};

enum job_kind { JOB_ABORT, JOB_REVOKE };
struct job {
  struct ncclComm* comm;
  enum job_kind kind;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
/* Group state is per thread, as in NCCL (src/group.cc lines 27-32). */
static __thread int g_group_depth;
static __thread struct job g_jobs[64];
static __thread int g_job_count;
static __thread int g_group_blocking = -1;
static __thread ncclResult_t g_group_error;
static __thread int g_thread_device; /* without a driver */
static long g_group_ends;
static int g_streams_released; /* test clean-up: every stream wait returns */
static int g_aborts_running;    /* ncclCommAbort calls whose job has not finished */
static long g_calls_beside_abort;
#define MAX_DEVICES 16
static long g_device_bytes[MAX_DEVICES]; /* held by communicators, per device */

static int mode_is(const char* m) {
  const char* mode = getenv("FAKE_NCCL_MODE");
  return strcmp(mode ? mode : "ok", m) == 0;
}

__attribute__((unused)) static void hang_forever(void) {
  for (;;) pause();
}

static void check_live(const struct ncclComm* c, const char* call) {
  if (c != NULL && c->magic != LIVE) {
    fprintf(stderr, "fake NCCL: %s: use of a freed communicator %p\n", call, (const void*)c);
    fflush(stderr);
    abort();
  }
}

/* A call other than ncclCommAbort while an abort runs: counted, and fatal with
 * FAKE_NCCL_ALONE_DURING_ABORT=1. Called with g_mu held. */
static void check_alone(const char* call) {
  if (g_aborts_running == 0) return;
  g_calls_beside_abort++;
  const char* strict = getenv("FAKE_NCCL_ALONE_DURING_ABORT");
  if (strict != NULL && strcmp(strict, "1") == 0) {
    fprintf(stderr, "fake NCCL: %s called while an abort runs\n", call);
    fflush(stderr);
    abort();
  }
}

static long env_long(const char* name) {
  const char* v = getenv(name);
  return v ? atol(v) : 0;
}

/* ---- the device, through the (fake) CUDA driver, as cudart does ---- */

typedef int (*ctx_get_current_t)(void**);
typedef int (*ctx_get_device_t)(int*);
typedef int (*retain_t)(void**, int);
typedef int (*set_current_t)(void*);

static void* g_driver;
static pthread_once_t g_driver_once = PTHREAD_ONCE_INIT;

static void open_driver(void) {
  const char* path = getenv("FAKE_NCCL_LIBCUDA");
  if (path == NULL || path[0] == '\0') return;
  g_driver = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  if (g_driver == NULL) g_driver = dlopen(path, RTLD_NOW);
}

static void* driver(void) {
  pthread_once(&g_driver_once, open_driver);
  return g_driver;
}

static int cudart_get_device(void) {
  void* d = driver();
  if (d == NULL) return g_thread_device;
  void* ctx = NULL;
  ((ctx_get_current_t)dlsym(d, "cuCtxGetCurrent"))(&ctx);
  if (ctx == NULL) return 0; /* cudaGetDevice on a thread without a context: 0, nothing created */
  int device = 0;
  ((ctx_get_device_t)dlsym(d, "cuCtxGetDevice"))(&device);
  return device;
}

static void cudart_set_device(int device) {
  void* d = driver();
  if (d == NULL) {
    g_thread_device = device;
    return;
  }
  void* ctx = NULL;
  ((retain_t)dlsym(d, "cuDevicePrimaryCtxRetain"))(&ctx, device);
  ((set_current_t)dlsym(d, "cuCtxSetCurrent"))(ctx);
}

/* For the fake torch backend (tests/fakes/fake_torch_nccl.py): what
 * c10::cuda::current_device() answers on the calling thread. */
int fake_cudart_get_device(void) { return cudart_get_device(); }
/* And what c10::cuda::set_device (cudaSetDevice) does on it. */
void fake_cudart_set_device(int device) { cudart_set_device(device); }

/* ---- the test's side ---- */

static struct ncclComm* g_all[4096]; /* every communicator made: what shares a stream */
static int g_all_count;

static int device_slot(int device) { return device >= 0 && device < MAX_DEVICES ? device : 0; }

/* cudaMemGetInfo on `device`: 0, or 1 for a device index out of range. */
int fake_cuda_mem_get_info(int device, long* free_bytes, long* total_bytes) {
  if (device < 0 || device >= MAX_DEVICES) return 1;
  long total = env_long("FAKE_CUDA_MEMORY_BYTES");
  pthread_mutex_lock(&g_mu);
  long held = g_device_bytes[device];
  pthread_mutex_unlock(&g_mu);
  *total_bytes = total;
  *free_bytes = total > held ? total - held : 0;
  return 0;
}

struct ncclComm* fake_nccl_comm_create_on(int device, int blocking, int stream) {
  long bytes = env_long("FAKE_NCCL_COMM_BYTES");
  long total = env_long("FAKE_CUDA_MEMORY_BYTES");
  pthread_mutex_lock(&g_mu);
  check_alone("a communicator's creation (ncclCommInitRankConfig)");
  if (total > 0 && g_device_bytes[device_slot(device)] + bytes > total) {
    pthread_mutex_unlock(&g_mu);
    return NULL; /* cudaMalloc: out of memory */
  }
  g_device_bytes[device_slot(device)] += bytes;
  pthread_mutex_unlock(&g_mu);
  struct ncclComm* c = (struct ncclComm*)calloc(1, sizeof(struct ncclComm));
  c->magic = LIVE;
  c->device = device;
  c->blocking = blocking;
  c->stream = stream;
  c->bytes = bytes;
  pthread_mutex_lock(&g_mu);
  if (g_all_count < 4096) g_all[g_all_count++] = c;
  pthread_mutex_unlock(&g_mu);
  return c;
}

struct ncclComm* fake_nccl_comm_create(void) { return fake_nccl_comm_create_on(0, 1, -1); }

/* What the owner's destroy does: later calls with `c` fail loudly. The memory
 * stays allocated (poisoned) so that the test can still read the state. */
void fake_nccl_comm_free(struct ncclComm* c) {
  pthread_mutex_lock(&g_mu);
  c->magic = FREED;
  pthread_mutex_unlock(&g_mu);
}

/* Bit 0: aborted (freed by ncclCommAbort), bit 1: revoked, bit 2: poisoned. */
int fake_nccl_comm_state(struct ncclComm* c) {
  pthread_mutex_lock(&g_mu);
  int s = (c->aborted ? 1 : 0) | (c->revoked ? 2 : 0) | (c->magic != LIVE ? 4 : 0);
  pthread_mutex_unlock(&g_mu);
  return s;
}

void fake_nccl_set_async_error(struct ncclComm* c, int error) {
  pthread_mutex_lock(&g_mu);
  c->has_error = 1;
  c->error = error;
  pthread_mutex_unlock(&g_mu);
}

long fake_nccl_calls_beside_abort(void) {
  pthread_mutex_lock(&g_mu);
  long n = g_calls_beside_abort;
  pthread_mutex_unlock(&g_mu);
  return n;
}

int fake_nccl_aborts_running(void) {
  pthread_mutex_lock(&g_mu);
  int n = g_aborts_running;
  pthread_mutex_unlock(&g_mu);
  return n;
}

long fake_nccl_async_error_calls(struct ncclComm* c) {
  pthread_mutex_lock(&g_mu);
  long n = c->async_error_calls;
  pthread_mutex_unlock(&g_mu);
  return n;
}

long fake_nccl_group_ends(void) {
  pthread_mutex_lock(&g_mu);
  long n = g_group_ends;
  pthread_mutex_unlock(&g_mu);
  return n;
}

/* A kernel of `c` on its stream: it runs until `c`'s abort flag is set. */
void fake_nccl_kernel_launch(struct ncclComm* c) {
  pthread_mutex_lock(&g_mu);
  check_live(c, "kernel launch");
  check_alone("a kernel launch (a collective)");
  c->kernels++;
  pthread_mutex_unlock(&g_mu);
}

/* Ends every stream wait still hanging (test clean-up). */
void fake_nccl_release_streams(void) {
  pthread_mutex_lock(&g_mu);
  g_streams_released = 1;
  pthread_cond_broadcast(&g_cv);
  pthread_mutex_unlock(&g_mu);
}

/* 1 once `c` is aborted, revoked or its abort flag set, 0 after timeout_ms. */
int fake_nccl_collective_wait(struct ncclComm* c, int timeout_ms) {
  struct timespec deadline;
  clock_gettime(CLOCK_REALTIME, &deadline);
  deadline.tv_sec += timeout_ms / 1000;
  deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
  if (deadline.tv_nsec >= 1000000000L) {
    deadline.tv_sec += 1;
    deadline.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&g_mu);
  int released = c->aborted || c->revoked || c->abort_flag;
  while (!released) {
    if (pthread_cond_timedwait(&g_cv, &g_mu, &deadline) != 0) break;
    released = c->aborted || c->revoked || c->abort_flag;
  }
  released = c->aborted || c->revoked || c->abort_flag;
  pthread_mutex_unlock(&g_mu);
  return released;
}

/* ---- jobs ---- */

/* The stream `c` runs on is idle: every kernel on it (its own, and those of
 * the communicators sharing the stream) has its abort flag set. Called with
 * g_mu held. */
static int stream_idle(const struct ncclComm* c) {
  if (c->kernels > 0 && !c->abort_flag) return 0;
  if (c->stream < 0) return 1;
  for (int i = 0; i < g_all_count; ++i) {
    const struct ncclComm* o = g_all[i];
    if (o != c && o->stream == c->stream && o->kernels > 0 && !o->abort_flag && o->magic == LIVE) return 0;
  }
  return 1;
}

/* An abort's job has run (or was dropped by a failed group end): the
 * proxy threads' exit first, when `teardown` (see FAKE_NCCL_TEARDOWN_MS). */
static void abort_done(struct ncclComm* c, int teardown) {
  long ms = teardown ? env_long("FAKE_NCCL_TEARDOWN_MS") : 0;
  if (ms > 0) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
  }
  pthread_mutex_lock(&g_mu);
  if (teardown) { /* commFree, once the proxy threads were joined */
    g_device_bytes[device_slot(c->device)] -= c->bytes;
    c->bytes = 0;
  }
  g_aborts_running--;
  pthread_mutex_unlock(&g_mu);
}

static void run_job(struct job j) {
  cudart_set_device(j.comm->device);
  pthread_mutex_lock(&g_mu);
  while (!stream_idle(j.comm) && !g_streams_released) pthread_cond_wait(&g_cv, &g_mu);
  if (j.kind == JOB_ABORT) {
    j.comm->kernels = 0;
    j.comm->aborted = 1;
    j.comm->magic = FREED; /* commFree */
  } else {
    j.comm->kernels = 0;
    j.comm->revoked = 1;
    j.comm->revoke_polls = 2;
    j.comm->abort_flag = 0; /* commRevokeAsync resets the flags once quiescent */
  }
  j.comm->in_progress = 0;
  pthread_cond_broadcast(&g_cv);
  pthread_mutex_unlock(&g_mu);
  if (j.kind == JOB_ABORT) abort_done(j.comm, 1);
}

struct job_batch {
  struct job jobs[64];
  int count;
};

static void* run_batch(void* arg) {
  struct job_batch* b = (struct job_batch*)arg;
  for (int i = 0; i < b->count; ++i) run_job(b->jobs[i]);
  free(b);
  return NULL;
}

/* ncclAsyncLaunch: the job now (outside a group, inside the call's own
 * implicit group), else queued for the group end. */
static ncclResult_t launch(struct ncclComm* c, enum job_kind kind);

ncclResult_t ncclGroupStart(void) {
  g_group_depth++;
  return kSuccess;
}

/* ncclGroupEndInternal; `counted`: the caller's own ncclGroupEnd (not the
 * implicit group every ncclCommAbort/Revoke opens), for fake_nccl_group_ends. */
static ncclResult_t group_end(int counted) {
  if (g_group_depth == 0) return kInvalidUsage;
  if (--g_group_depth > 0) return kSuccess;
  ncclResult_t error = g_group_error;
  int blocking = g_group_blocking;
  struct job_batch local;
  struct job_batch* batch = blocking == 0 ? (struct job_batch*)calloc(1, sizeof(struct job_batch)) : &local;
  memcpy(batch->jobs, g_jobs, sizeof(struct job) * (size_t)g_job_count);
  batch->count = g_job_count;
  g_job_count = 0;
  g_group_blocking = -1;
  g_group_error = kSuccess;
  pthread_mutex_lock(&g_mu);
  if (counted) g_group_ends++;
  pthread_mutex_unlock(&g_mu);
  if (error != kSuccess || batch->count == 0) { /* groupCleanup: nothing runs */
    for (int i = 0; i < batch->count; ++i) {
      if (batch->jobs[i].kind == JOB_ABORT) abort_done(batch->jobs[i].comm, 0);
    }
    if (batch != &local) free(batch);
    return error;
  }
  if (blocking == 0) {
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < batch->count; ++i) batch->jobs[i].comm->in_progress = 1;
    pthread_mutex_unlock(&g_mu);
    pthread_t t;
    pthread_create(&t, NULL, run_batch, batch);
    pthread_detach(t);
    return kInProgress;
  }
  int saved = cudart_get_device();
  for (int i = 0; i < batch->count; ++i) run_job(batch->jobs[i]);
  cudart_set_device(saved);
  return kSuccess;
}

ncclResult_t ncclGroupEnd(void) { return group_end(1); }

static ncclResult_t launch(struct ncclComm* c, enum job_kind kind) {
  ncclGroupStart();
  int blocking = kind == JOB_ABORT ? 1 : c->blocking; /* destroyFlag: always blocking */
  ncclResult_t r = kSuccess;
  if (g_group_blocking == -1) {
    g_group_blocking = blocking;
  } else if (g_group_blocking != blocking) {
    r = kInvalidArgument; /* "Blocking and nonblocking communicators are not allowed in the same group." */
    g_group_error = r;
  }
  if (r == kSuccess && g_job_count < 64) g_jobs[g_job_count++] = (struct job){c, kind};
  ncclResult_t end = group_end(0);
  return r != kSuccess ? r : end;
}

/* ---- the API ---- */

ncclResult_t ncclGetVersion(int* version) {
  const char* v = getenv("FAKE_NCCL_VERSION");
  *version = v ? atoi(v) : FAKE_NCCL_DEFAULT_VERSION;
  return kSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case 0: return "no error";
    case 2: return "unhandled system error";
    case 4: return "invalid argument";
    case 5: return "invalid usage";
    case 6: return "remote process exited or there was a network error";
    case 7: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

#ifndef FAKE_NCCL_OMIT_ABORT
ncclResult_t ncclCommAbort(struct ncclComm* c) {
  if (c == NULL) return kSuccess;
  pthread_mutex_lock(&g_mu);
  g_aborts_running++; /* until its job has run (abort_done) */
  pthread_mutex_unlock(&g_mu);
  if (mode_is("abort_hangs")) hang_forever();
  pthread_mutex_lock(&g_mu);
  check_live(c, "ncclCommAbort");
  c->abort_flag = 1; /* setCommAbortFlags(comm, 1), before the job */
  pthread_cond_broadcast(&g_cv);
  pthread_mutex_unlock(&g_mu);
  return launch(c, JOB_ABORT);
}
#endif

ncclResult_t ncclCommGetAsyncError(struct ncclComm* c, ncclResult_t* error) {
  pthread_mutex_lock(&g_mu);
  check_live(c, "ncclCommGetAsyncError");
  check_alone("ncclCommGetAsyncError");
  c->async_error_calls++;
  if (c->in_progress || (c->revoked && (mode_is("revoke_stuck") || c->revoke_polls > 0))) {
    if (c->revoke_polls > 0) c->revoke_polls--;
    *error = kInProgress;
  } else if (c->has_error) {
    *error = c->error;
  } else {
    const char* e = getenv("FAKE_NCCL_ASYNC_ERROR");
    *error = e ? atoi(e) : 0;
  }
  pthread_mutex_unlock(&g_mu);
  return kSuccess;
}

#ifndef FAKE_NCCL_NO_REVOKE
ncclResult_t ncclCommRevoke(struct ncclComm* c, int flags) {
  if (c == NULL) return kSuccess;
  if (flags != 0) return kInvalidArgument;
  pthread_mutex_lock(&g_mu);
  check_live(c, "ncclCommRevoke");
  check_alone("ncclCommRevoke");
  if (c->revoked) { /* "Disallow revoke if revoke in progress" */
    pthread_mutex_unlock(&g_mu);
    return kInvalidArgument;
  }
  c->abort_flag = 1;
  pthread_cond_broadcast(&g_cv);
  pthread_mutex_unlock(&g_mu);
  return launch(c, JOB_REVOKE);
}
#endif
