/* A stand-in for the NVIDIA driver library (libcuda.so.1) that reports CUDA
 * 12.4 and offers nothing else, for device_probe_old_driver_test: the CUDA
 * 13 runtime linked into our binaries must then refuse it as too old. The
 * runtime finds every entry point through cuGetProcAddress. */
#include <string.h>

typedef int CUresult;
enum { kSuccess = 0, kNotFound = 500 };

CUresult cuDriverGetVersion(int* version) {
  *version = 12040;
  return kSuccess;
}

CUresult cuInit(unsigned flags) {
  (void)flags;
  return kSuccess;
}

CUresult cuGetProcAddress_v2(const char* symbol, void** function, int version,
                             unsigned long long flags, void* status) {
  (void)version;
  (void)flags;
  (void)status;
  *function = NULL;
  if (strcmp(symbol, "cuDriverGetVersion") == 0) {
    *function = (void*)cuDriverGetVersion;
  } else if (strcmp(symbol, "cuInit") == 0) {
    *function = (void*)cuInit;
  } else if (strcmp(symbol, "cuGetProcAddress") == 0) {
    *function = (void*)cuGetProcAddress_v2;
  }
  return *function != NULL ? kSuccess : kNotFound;
}

CUresult cuGetProcAddress(const char* symbol, void** function, int version,
                          unsigned long long flags) {
  return cuGetProcAddress_v2(symbol, function, version, flags, NULL);
}
