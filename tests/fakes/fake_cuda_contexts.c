/* A fake CUDA driver (libcuda.so.1) that keeps what the NCCL abort path
 * touches: each device's primary context (active or not) and each thread's
 * current context. It follows the CUDA Driver API reference:
 *
 * - cuDevicePrimaryCtxRetain "retains the primary context on the device,
 *   creating it if necessary": an inactive device gets its context here, and
 *   the test counts it (fake_cuda_contexts_created);
 * - cuDevicePrimaryCtxGetState says whether the primary context is active,
 *   creating nothing;
 * - cuCtxSetCurrent binds a context to the calling thread; cuCtxGetCurrent
 *   gives it, NULL when the thread has none; cuCtxGetDevice its device.
 *
 * The CUDA runtime (cudart, linked statically into NCCL) reads and sets the
 * calling thread's device through these (tests/fakes/fake_nccl.c, with
 * FAKE_NCCL_LIBCUDA naming this library).
 *
 * FAKE_CUDA_DEVICES: how many devices (default 8). FAKE_CUDA_ACTIVE_DEVICES:
 * a comma-separated list of the devices whose primary context exists from the
 * start (what torch created for the rank's own device); default none. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
enum { kSuccess = 0, kInvalidValue = 1, kInvalidDevice = 101, kInvalidContext = 201 };
#define MAX_DEVICES 16

struct context {
  int device;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static struct context g_contexts[MAX_DEVICES];
static int g_active[MAX_DEVICES];
static long g_created[MAX_DEVICES];
static long g_retains[MAX_DEVICES];
static int g_initialised;
static __thread struct context* t_current;

static int device_count(void) {
  const char* n = getenv("FAKE_CUDA_DEVICES");
  int count = n ? atoi(n) : 8;
  return count < 0 ? 0 : (count > MAX_DEVICES ? MAX_DEVICES : count);
}

static void initialise(void) { /* called with g_mu held */
  if (g_initialised) return;
  g_initialised = 1;
  for (int d = 0; d < MAX_DEVICES; ++d) g_contexts[d].device = d;
  const char* active = getenv("FAKE_CUDA_ACTIVE_DEVICES");
  if (active == NULL) return;
  char buffer[256];
  strncpy(buffer, active, sizeof(buffer) - 1);
  buffer[sizeof(buffer) - 1] = '\0';
  for (char* part = strtok(buffer, ","); part != NULL; part = strtok(NULL, ",")) {
    int d = atoi(part);
    if (d >= 0 && d < MAX_DEVICES) g_active[d] = 1;
  }
}

/* For the tests (ctypes). */
long fake_cuda_contexts_created(int device) {
  pthread_mutex_lock(&g_mu);
  long n = device >= 0 && device < MAX_DEVICES ? g_created[device] : 0;
  pthread_mutex_unlock(&g_mu);
  return n;
}

int fake_cuda_context_active(int device) {
  pthread_mutex_lock(&g_mu);
  initialise();
  int a = device >= 0 && device < MAX_DEVICES ? g_active[device] : 0;
  pthread_mutex_unlock(&g_mu);
  return a;
}

/* The device of the calling thread's current context, -1 when it has none. */
int fake_cuda_thread_device(void) { return t_current ? t_current->device : -1; }

CUresult cuInit(unsigned int flags) {
  (void)flags;
  return kSuccess;
}

CUresult cuDeviceGetCount(int* count) {
  *count = device_count();
  return kSuccess;
}

CUresult cuDeviceGet(int* device, int ordinal) {
  if (ordinal < 0 || ordinal >= device_count()) return kInvalidDevice;
  *device = ordinal;
  return kSuccess;
}

CUresult cuDevicePrimaryCtxGetState(int device, unsigned int* flags, int* active) {
  if (device < 0 || device >= device_count()) return kInvalidDevice;
  pthread_mutex_lock(&g_mu);
  initialise();
  *flags = 0;
  *active = g_active[device];
  pthread_mutex_unlock(&g_mu);
  return kSuccess;
}

CUresult cuDevicePrimaryCtxRetain(void** ctx, int device) {
  if (device < 0 || device >= device_count()) return kInvalidDevice;
  pthread_mutex_lock(&g_mu);
  initialise();
  if (!g_active[device]) {
    g_active[device] = 1; /* "creating it if necessary" */
    g_created[device]++;
  }
  g_retains[device]++;
  *ctx = &g_contexts[device];
  pthread_mutex_unlock(&g_mu);
  return kSuccess;
}

CUresult cuDevicePrimaryCtxRelease_v2(int device) {
  if (device < 0 || device >= device_count()) return kInvalidDevice;
  pthread_mutex_lock(&g_mu);
  if (g_retains[device] > 0) g_retains[device]--;
  pthread_mutex_unlock(&g_mu);
  return kSuccess;
}

CUresult cuCtxSetCurrent(void* ctx) {
  t_current = (struct context*)ctx;
  return kSuccess;
}

CUresult cuCtxGetCurrent(void** ctx) {
  *ctx = t_current;
  return kSuccess;
}

CUresult cuCtxGetDevice(int* device) {
  if (t_current == NULL) return kInvalidContext;
  *device = t_current->device;
  return kSuccess;
}
