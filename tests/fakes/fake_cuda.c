/* A fake CUDA driver (libcuda.so.1) for tests without a GPU. It answers the
 * calls inprocess makes, with the failure chosen by FAKE_CUDA_MODE, read at
 * every call:
 *   ok                      two devices, primary contexts active, work done at once
 *   no_context              primary contexts inactive (nothing created yet)
 *   stream_never_completes  cuStreamQuery: CUDA_ERROR_NOT_READY for ever
 *   sync_hangs              cuCtxSynchronize never returns
 *   sticky                  CUDA_ERROR_ILLEGAL_ADDRESS (700) from every call on the context
 *   oom                     cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY (2), not sticky
 *   vanish                  the device drops off the bus mid-probe: reads back all ones
 *   probe_hangs             cuMemcpyDtoH never returns
 *   unknown                 cuCtxSynchronize: CUDA_ERROR_UNKNOWN (999) on a working context
 *   prohibited              cuDevicePrimaryCtxRetain: CUDA_ERROR_UNKNOWN (999), the answer of a
 *                           device in CU_COMPUTEMODE_PROHIBITED (cuda.h 12.9 line 5940)
 *   device_unavailable      cuDevicePrimaryCtxRetain: CUDA_ERROR_DEVICE_UNAVAILABLE (46), a device
 *                           held by another process in EXCLUSIVE_PROCESS mode (cuda.h 12.9 line 2527)
 *
 * The devices are those CUDA_VISIBLE_DEVICES lets the process see, as the
 * real driver numbers them: unset, both; "0", "1" or "GPU-..." entries, one
 * per entry (up to two); set to "" or to no valid entry, none, and cuInit
 * answers CUDA_ERROR_NO_DEVICE (100; cuda.h 12.9 line 2535: "no CUDA-capable
 * devices were detected"). The real driver reads the variable once, at
 * cuInit; this fake reads it at every call so that one test process can try
 * several settings.
 * Built with -DFAKE_CUDA_OMIT_STREAM_QUERY it lacks cuStreamQuery (a missing symbol). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

static long g_allocations;
static long g_retained;
static long g_stream_queries;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_context_token;

static int mode_is(const char* m) {
  const char* mode = getenv("FAKE_CUDA_MODE");
  return strcmp(mode ? mode : "ok", m) == 0;
}

static void hang_forever(void) {
  for (;;) pause();
}

static void add(long* counter, long delta) {
  pthread_mutex_lock(&g_mu);
  *counter += delta;
  pthread_mutex_unlock(&g_mu);
}

static long get(const long* counter) {
  pthread_mutex_lock(&g_mu);
  long v = *counter;
  pthread_mutex_unlock(&g_mu);
  return v;
}

/* For the tests (ctypes). */
long fake_cuda_allocations(void) { return get(&g_allocations); }
long fake_cuda_retained_contexts(void) { return get(&g_retained); }
long fake_cuda_stream_queries(void) { return get(&g_stream_queries); }

/* How many devices CUDA_VISIBLE_DEVICES leaves visible, of the fake's two.
 * The driver stops at the first entry it cannot parse (the CUDA C
 * Programming Guide, "CUDA Environment Variables": "only the devices whose
 * index is present in the sequence are visible ... if one of the indices is
 * invalid, only the devices whose index precedes the invalid index are
 * visible"). */
static int visible_devices(void) {
  const char* visible = getenv("CUDA_VISIBLE_DEVICES");
  if (visible == NULL) return 2;
  int count = 0;
  const char* p = visible;
  while (*p != '\0' && count < 2) {
    while (*p == ' ') ++p;
    const int index = (*p == '0' || *p == '1') && (p[1] == '\0' || p[1] == ',' || p[1] == ' ');
    if (index || strncmp(p, "GPU-", 4) == 0) {
      ++count;
    } else {
      break;
    }
    while (*p != '\0' && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return count;
}

CUresult cuInit(unsigned int flags) {
  (void)flags;
  if (visible_devices() == 0) return 100; /* CUDA_ERROR_NO_DEVICE */
  return 0;
}

CUresult cuDriverGetVersion(int* version) {
  *version = 12090;
  return 0;
}

CUresult cuDeviceGetCount(int* count) {
  if (visible_devices() == 0) return 3; /* CUDA_ERROR_NOT_INITIALIZED: cuInit failed */
  *count = visible_devices();
  return 0;
}

CUresult cuDeviceGet(int* device, int ordinal) {
  if (visible_devices() == 0) return 3; /* CUDA_ERROR_NOT_INITIALIZED */
  if (ordinal < 0 || ordinal >= visible_devices()) return 101; /* CUDA_ERROR_INVALID_DEVICE */
  *device = ordinal;
  return 0;
}

CUresult cuDeviceGetPCIBusId(char* bus_id, int len, int device) {
  snprintf(bus_id, (size_t)len, "00000000:%02X:00.0", 0x10 + device);
  return 0;
}

CUresult cuDevicePrimaryCtxGetState(int device, unsigned int* flags, int* active) {
  (void)device;
  *flags = 0;
  *active = mode_is("no_context") ? 0 : 1;
  return 0;
}

CUresult cuDevicePrimaryCtxRetain(void** ctx, int device) {
  (void)device;
  if (mode_is("prohibited")) return 999;        /* CUDA_ERROR_UNKNOWN */
  if (mode_is("device_unavailable")) return 46; /* CUDA_ERROR_DEVICE_UNAVAILABLE */
  *ctx = &g_context_token;
  add(&g_retained, 1);
  return 0;
}

CUresult cuDevicePrimaryCtxRelease_v2(int device) {
  (void)device;
  add(&g_retained, -1);
  return 0;
}

CUresult cuCtxSetCurrent(void* ctx) {
  (void)ctx;
  return 0;
}

CUresult cuCtxSynchronize(void) {
  if (mode_is("sync_hangs")) hang_forever();
  if (mode_is("sticky")) return 700;
  if (mode_is("unknown")) return 999;
  return 0;
}

#ifndef FAKE_CUDA_OMIT_STREAM_QUERY
CUresult cuStreamQuery(void* stream) {
  (void)stream;
  add(&g_stream_queries, 1);
  if (mode_is("stream_never_completes")) return 600; /* CUDA_ERROR_NOT_READY */
  if (mode_is("sticky")) return 700;
  return 0;
}
#endif

CUresult cuMemAlloc_v2(CUdeviceptr* ptr, size_t size) {
  if (mode_is("sticky")) return 700;
  if (mode_is("oom")) return 2;
  void* p = malloc(size);
  if (p == NULL) return 2;
  *ptr = (CUdeviceptr)(size_t)p;
  add(&g_allocations, 1);
  return 0;
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
  free((void*)(size_t)ptr);
  add(&g_allocations, -1);
  return 0;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t size) {
  memcpy((void*)(size_t)dst, src, size);
  return 0;
}

CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t size) {
  if (mode_is("probe_hangs")) hang_forever();
  if (mode_is("vanish")) {
    memset(dst, 0xff, size);
    return 0;
  }
  memcpy(dst, (const void*)(size_t)src, size);
  return 0;
}

static const char* name_of(CUresult error) {
  switch (error) {
    case 0: return "CUDA_SUCCESS";
    case 2: return "CUDA_ERROR_OUT_OF_MEMORY";
    case 3: return "CUDA_ERROR_NOT_INITIALIZED";
    case 46: return "CUDA_ERROR_DEVICE_UNAVAILABLE";
    case 100: return "CUDA_ERROR_NO_DEVICE";
    case 101: return "CUDA_ERROR_INVALID_DEVICE";
    case 600: return "CUDA_ERROR_NOT_READY";
    case 700: return "CUDA_ERROR_ILLEGAL_ADDRESS";
    case 999: return "CUDA_ERROR_UNKNOWN";
    default: return NULL;
  }
}

CUresult cuGetErrorName(CUresult error, const char** out) {
  *out = name_of(error);
  return *out ? 0 : 1;
}

CUresult cuGetErrorString(CUresult error, const char** out) {
  *out = name_of(error);
  return *out ? 0 : 1;
}
