/* A fake NVML (libnvidia-ml.so.1) for tests without a GPU: two devices
 * (index 0 and 1, uuid GPU-fake-0/1, PCI 00000000:10:00.0 and :11:00.0, the
 * fake CUDA driver's bus ids), four NVLinks each. FAKE_NVML_MODE, read at
 * every call:
 *   ok               healthy
 *   ecc              2 volatile uncorrectable ECC errors
 *   ecc_more         3 volatile uncorrectable ECC errors (one more than "ecc"). NVML's
 *                    volatile counter counts since the driver was loaded (nvml.h,
 *                    12.9, line 1028, NVML_VOLATILE_ECC: "Volatile counts are reset
 *                    each time the driver loads"), errors already handled included
 *   remap_pending    a row remapping waits for a reset
 *   remap_failure    a row remapping failed
 *   retired_pending  pages wait for retirement
 *   recovery_reset   the driver asks for a GPU reset (recovery action 1)
 *   nvlink_down      link 1 inactive
 *   lost             NVML_ERROR_GPU_IS_LOST from the handle lookup (fallen off the bus)
 *   lost_mid         the handle works, then the ECC query says GPU_IS_LOST
 *   hang             the ECC query never returns
 *   old_driver       recovery action, remapping and NVLink not supported
 *   driver_missing   nvmlInit: NVML_ERROR_DRIVER_NOT_LOADED */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int nvmlReturn_t;
struct nvmlDevice_st {
  int index;
};
static struct nvmlDevice_st g_devices[2] = {{0}, {1}};
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static long g_init_depth;

typedef struct {
  unsigned int fieldId;
  unsigned int scopeId;
  long long timestamp;
  long long latencyUsec;
  int valueType;
  nvmlReturn_t nvmlReturn;
  union {
    unsigned int uiVal;
    unsigned long long ullVal;
  } value;
} fake_field_value;

static int mode_is(const char* m) {
  const char* mode = getenv("FAKE_NVML_MODE");
  return strcmp(mode ? mode : "ok", m) == 0;
}

static void hang_forever(void) {
  for (;;) pause();
}

long fake_nvml_init_depth(void) {
  pthread_mutex_lock(&g_mu);
  long d = g_init_depth;
  pthread_mutex_unlock(&g_mu);
  return d;
}

nvmlReturn_t nvmlInit_v2(void) {
  if (mode_is("driver_missing")) return 9;
  pthread_mutex_lock(&g_mu);
  g_init_depth++;
  pthread_mutex_unlock(&g_mu);
  return 0;
}

nvmlReturn_t nvmlShutdown(void) {
  pthread_mutex_lock(&g_mu);
  if (g_init_depth == 0) {
    pthread_mutex_unlock(&g_mu);
    return 1; /* NVML_ERROR_UNINITIALIZED */
  }
  g_init_depth--;
  pthread_mutex_unlock(&g_mu);
  return 0;
}

const char* nvmlErrorString(nvmlReturn_t r) {
  switch (r) {
    case 0: return "Success";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 6: return "Not Found";
    case 9: return "Driver Not Loaded";
    case 15: return "GPU is lost";
    default: return "Unknown Error";
  }
}

static nvmlReturn_t handle(int index, struct nvmlDevice_st** out) {
  if (mode_is("lost")) return 15;
  if (index < 0 || index > 1) return 2;
  *out = &g_devices[index];
  return 0;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, struct nvmlDevice_st** out) {
  return handle((int)index, out);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char* uuid, struct nvmlDevice_st** out) {
  if (strcmp(uuid, "GPU-fake-0") == 0) return handle(0, out);
  if (strcmp(uuid, "GPU-fake-1") == 0) return handle(1, out);
  return 6;
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char* bus, struct nvmlDevice_st** out) {
  if (strcmp(bus, "00000000:10:00.0") == 0) return handle(0, out);
  if (strcmp(bus, "00000000:11:00.0") == 0) return handle(1, out);
  return 6;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(struct nvmlDevice_st* d, int type, int counter, unsigned long long* count) {
  (void)d;
  if (type != 1 || counter != 0) return 2; /* only volatile uncorrected is asked for */
  if (mode_is("hang")) hang_forever();
  if (mode_is("lost_mid")) return 15;
  *count = mode_is("ecc") ? 2 : mode_is("ecc_more") ? 3 : 0;
  return 0;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(struct nvmlDevice_st* d, unsigned int* corrected, unsigned int* uncorrected,
                                       unsigned int* pending, unsigned int* failure) {
  (void)d;
  if (mode_is("old_driver")) return 3;
  *corrected = 1;
  *uncorrected = 0;
  *pending = mode_is("remap_pending") ? 1 : 0;
  *failure = mode_is("remap_failure") ? 1 : 0;
  return 0;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(struct nvmlDevice_st* d, int* pending) {
  (void)d;
  *pending = mode_is("retired_pending") ? 1 : 0;
  return 0;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(struct nvmlDevice_st* d, unsigned int link, int* active) {
  (void)d;
  if (mode_is("old_driver") || link >= 4) return 3;
  *active = (mode_is("nvlink_down") && link == 1) ? 0 : 1;
  return 0;
}

nvmlReturn_t nvmlDeviceGetFieldValues(struct nvmlDevice_st* d, int count, fake_field_value* values) {
  (void)d;
  for (int i = 0; i < count; ++i) {
    if (values[i].fieldId != 230 || mode_is("old_driver")) {
      values[i].nvmlReturn = 3;
      continue;
    }
    values[i].nvmlReturn = 0;
    values[i].valueType = 1; /* unsigned int */
    values[i].value.uiVal = mode_is("recovery_reset") ? 1 : 0;
  }
  return 0;
}
