/* The locking of torch's ProcessGroupNCCL that the NCCL release depends on
 * (torch 2.13-era sources: github.com/cyyever/pytorch, a fork of
 * pytorch/pytorch, torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp at commit
 * 0b10febc2dd0 and init.cpp at 03a5d6dea676):
 *
 * - getCommPtr() looks the communicator up by the calling thread's current
 *   device (at::cuda::current_device()) through getNCCLComm(), which takes the
 *   group's mutex_; NCCLComm::getNcclComm() throws once the communicator was
 *   aborted and, for a non-blocking one, waits until it is ready.
 * - init.cpp binds getCommPtr as "_comm_ptr" without a call_guard: it runs
 *   holding the GIL. Called through ctypes.PyDLL, fake_pg_comm_ptr does too.
 * - isInitialized() ("_is_initialized", bound with gil_scoped_release) takes
 *   the same mutex_; abortComms() holds it for the whole of its aborts.
 */
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>

#define DEVICES 16

struct pg {
  pthread_mutex_t mu; /* ProcessGroupNCCL::mutex_ */
  long comm[DEVICES]; /* devNCCLCommMap_, by device */
  int initialized[DEVICES];
  int not_ready[DEVICES]; /* a non-blocking communicator still in progress */
  int aborted[DEVICES];
};

struct pg* fake_pg_new(void) {
  struct pg* p = (struct pg*)calloc(1, sizeof(struct pg));
  pthread_mutex_init(&p->mu, NULL);
  return p;
}

void fake_pg_set_comm(struct pg* p, int device, long comm, int initialized, int not_ready) {
  pthread_mutex_lock(&p->mu);
  p->comm[device] = comm;
  p->initialized[device] = initialized;
  p->not_ready[device] = not_ready;
  pthread_mutex_unlock(&p->mu);
}

void fake_pg_lock(struct pg* p) { pthread_mutex_lock(&p->mu); }
void fake_pg_unlock(struct pg* p) { pthread_mutex_unlock(&p->mu); }

void fake_pg_mark_aborted(struct pg* p, int device) { p->aborted[device] = 1; /* caller holds mu */ }
int fake_pg_aborted(struct pg* p, int device) { return p->aborted[device]; }
long fake_pg_comm(struct pg* p, int device) { return p->comm[device]; }

/* getCommPtr(): 0 when there is no communicator on `device`, -1 when it was aborted. */
long fake_pg_comm_ptr(struct pg* p, int device) {
  if (device < 0 || device >= DEVICES) return 0;
  pthread_mutex_lock(&p->mu);
  long comm = p->comm[device];
  if (comm != 0 && p->aborted[device]) comm = -1;
  /* getNcclComm's waitReady(): polls until the communicator leaves ncclInProgress. */
  while (comm > 0 && p->not_ready[device]) {
    pthread_mutex_unlock(&p->mu);
    sched_yield();
    pthread_mutex_lock(&p->mu);
  }
  if (comm > 0) p->initialized[device] = 1;
  pthread_mutex_unlock(&p->mu);
  return comm;
}

/* isInitialized(): every communicator of the group initialized (false with none). */
int fake_pg_is_initialized(struct pg* p) {
  pthread_mutex_lock(&p->mu);
  int any = 0, all = 1;
  for (int d = 0; d < DEVICES; ++d) {
    if (p->comm[d] == 0) continue;
    any = 1;
    all = all && p->initialized[d];
  }
  pthread_mutex_unlock(&p->mu);
  return any && all;
}
