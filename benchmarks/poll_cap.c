/* An LD_PRELOAD shim for `python benchmarks/nccl_release.py --modes poll_cap`: it caps the 500 ms
 * poll of NCCL's proxy threads at POLL_CAP_MS milliseconds (default 5), to show that this poll is
 * what an abort waits for. NCCL's proxy service thread polls with `asyncOpCount ? 0 : 500` and its
 * UDS thread with 500 (src/proxy.cc, v2.29.7-1, lines 1663 and 1835); each reads the abort flag only
 * between polls. Every other poll (a timeout other than 500 ms) is passed through unchanged. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <poll.h>
#include <stdlib.h>

typedef int (*poll_fn)(struct pollfd*, nfds_t, int);

int poll(struct pollfd* fds, nfds_t nfds, int timeout) {
  static poll_fn real = NULL;
  if (real == NULL) real = (poll_fn)dlsym(RTLD_NEXT, "poll");
  if (timeout == 500) {
    const char* cap = getenv("POLL_CAP_MS");
    timeout = cap != NULL ? atoi(cap) : 5;
  }
  return real(fds, nfds, timeout);
}
