/* A fake NCCL (libnccl.so.2) for tests without a GPU. Communicators are made
 * by fake_nccl_comm_create(); fake_nccl_collective_wait() models a collective
 * that cannot complete: it blocks until its communicator is aborted or
 * revoked. FAKE_NCCL_MODE, read at every call:
 *   ok                 aborts and revokes take effect at once (grouped ones at ncclGroupEnd)
 *   abort_hangs        ncclCommAbort never returns
 *   revoke_stuck       revoked communicators report ncclInProgress for ever
 * FAKE_NCCL_VERSION (default 22807) is what ncclGetVersion says;
 * FAKE_NCCL_ASYNC_ERROR what ncclCommGetAsyncError reports (default 0).
 * Built with -DFAKE_NCCL_NO_REVOKE it lacks ncclCommRevoke (an NCCL before
 * 2.28.7); with -DFAKE_NCCL_OMIT_ABORT it lacks ncclCommAbort. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int ncclResult_t;

struct ncclComm {
  int aborted;
  int revoked;
  int revoke_polls; /* ncclInProgress answers left after a revoke */
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
/* Group state is per thread, as in NCCL: a thread stuck inside a group does
 * not hold the groups of other threads. */
static __thread int g_group_depth;
static __thread struct ncclComm* g_pending[64];
static __thread int g_pending_count;
static long g_group_ends;

static int mode_is(const char* m) {
  const char* mode = getenv("FAKE_NCCL_MODE");
  return strcmp(mode ? mode : "ok", m) == 0;
}

__attribute__((unused)) static void hang_forever(void) {
  for (;;) pause();
}

struct ncclComm* fake_nccl_comm_create(void) { return (struct ncclComm*)calloc(1, sizeof(struct ncclComm)); }
void fake_nccl_comm_free(struct ncclComm* c) { free(c); }

/* Bit 0: aborted, bit 1: revoked. */
int fake_nccl_comm_state(struct ncclComm* c) {
  pthread_mutex_lock(&g_mu);
  int s = (c->aborted ? 1 : 0) | (c->revoked ? 2 : 0);
  pthread_mutex_unlock(&g_mu);
  return s;
}

long fake_nccl_group_ends(void) {
  pthread_mutex_lock(&g_mu);
  long n = g_group_ends;
  pthread_mutex_unlock(&g_mu);
  return n;
}

/* 1 once `c` is aborted or revoked, 0 after timeout_ms. */
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
  int released = c->aborted || c->revoked;
  while (!released) {
    if (pthread_cond_timedwait(&g_cv, &g_mu, &deadline) != 0) break;
    released = c->aborted || c->revoked;
  }
  released = c->aborted || c->revoked;
  pthread_mutex_unlock(&g_mu);
  return released;
}

ncclResult_t ncclGetVersion(int* version) {
  const char* v = getenv("FAKE_NCCL_VERSION");
  *version = v ? atoi(v) : 22807;
  return 0;
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case 0: return "no error";
    case 2: return "unhandled system error";
    case 5: return "invalid usage";
    case 6: return "remote process exited or there was a network error";
    case 7: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

#ifndef FAKE_NCCL_OMIT_ABORT
ncclResult_t ncclCommAbort(struct ncclComm* c) {
  if (mode_is("abort_hangs")) hang_forever();
  pthread_mutex_lock(&g_mu);
  if (g_group_depth > 0 && g_pending_count < 64) {
    g_pending[g_pending_count++] = c; /* takes effect at ncclGroupEnd, as a group */
  } else {
    c->aborted = 1;
    pthread_cond_broadcast(&g_cv);
  }
  pthread_mutex_unlock(&g_mu);
  return 0;
}
#endif

ncclResult_t ncclCommGetAsyncError(struct ncclComm* c, ncclResult_t* error) {
  pthread_mutex_lock(&g_mu);
  if (c->revoked && (mode_is("revoke_stuck") || c->revoke_polls > 0)) {
    if (c->revoke_polls > 0) c->revoke_polls--;
    *error = 7; /* ncclInProgress */
  } else {
    const char* e = getenv("FAKE_NCCL_ASYNC_ERROR");
    *error = e ? atoi(e) : 0;
  }
  pthread_mutex_unlock(&g_mu);
  return 0;
}

ncclResult_t ncclGroupStart(void) {
  pthread_mutex_lock(&g_mu);
  g_group_depth++;
  pthread_mutex_unlock(&g_mu);
  return 0;
}

ncclResult_t ncclGroupEnd(void) {
  pthread_mutex_lock(&g_mu);
  if (g_group_depth == 0) {
    pthread_mutex_unlock(&g_mu);
    return 5; /* ncclInvalidUsage */
  }
  if (--g_group_depth == 0) {
    for (int i = 0; i < g_pending_count; ++i) g_pending[i]->aborted = 1;
    g_pending_count = 0;
    g_group_ends++;
    pthread_cond_broadcast(&g_cv);
  }
  pthread_mutex_unlock(&g_mu);
  return 0;
}

#ifndef FAKE_NCCL_NO_REVOKE
ncclResult_t ncclCommRevoke(struct ncclComm* c, int flags) {
  if (flags != 0) return 4; /* ncclInvalidArgument */
  pthread_mutex_lock(&g_mu);
  c->revoked = 1;
  c->revoke_polls = 2;
  pthread_cond_broadcast(&g_cv);
  pthread_mutex_unlock(&g_mu);
  return 0;
}
#endif
