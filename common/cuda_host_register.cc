#include "common/cuda_host_register.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>

#include "common/log.h"

namespace infinigen {
namespace {

// The few entry points used, by their C ABI (cudaError_t is an int enum).
using GetDeviceCountFn = int (*)(int*);
using HostRegisterFn = int (*)(void*, size_t, unsigned int);
using HostUnregisterFn = int (*)(void*);
using GetErrorStringFn = const char* (*)(int);
constexpr unsigned int kCudaHostRegisterPortable = 1;
constexpr unsigned int kCudaHostRegisterMapped = 2;
constexpr unsigned int kCudaHostRegisterReadOnly = 8;

struct CudaRuntime {
  HostRegisterFn host_register = nullptr;
  HostUnregisterFn host_unregister = nullptr;
  GetErrorStringFn error_string = nullptr;
  bool usable = false;
};

const CudaRuntime& Runtime() {
  static const CudaRuntime runtime = [] {
    CudaRuntime r;
    void* lib = nullptr;
    for (const char* name :
         {"libcudart.so.13", "libcudart.so.12", "libcudart.so",
          "/usr/local/cuda/lib64/libcudart.so"}) {
      lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) break;
    }
    if (lib == nullptr) {
      IG_LOG(INFO) << "shm data plane: no libcudart; fetch buffers are not "
                      "registered with CUDA";
      return r;
    }
    auto count = reinterpret_cast<GetDeviceCountFn>(
        dlsym(lib, "cudaGetDeviceCount"));
    r.host_register =
        reinterpret_cast<HostRegisterFn>(dlsym(lib, "cudaHostRegister"));
    r.host_unregister =
        reinterpret_cast<HostUnregisterFn>(dlsym(lib, "cudaHostUnregister"));
    r.error_string =
        reinterpret_cast<GetErrorStringFn>(dlsym(lib, "cudaGetErrorString"));
    if (count == nullptr || r.host_register == nullptr ||
        r.host_unregister == nullptr || r.error_string == nullptr) {
      IG_LOG(WARNING) << "shm data plane: libcudart lacks the host "
                         "registration calls; buffers stay pageable";
      return r;
    }
    int devices = 0;
    const int err = count(&devices);
    if (err != 0 || devices <= 0) {
      IG_LOG(INFO) << "shm data plane: no CUDA device ("
                   << (err != 0 ? r.error_string(err) : "0 devices")
                   << "); fetch buffers are not registered with CUDA";
      return r;
    }
    r.usable = true;
    return r;
  }();
  return runtime;
}

bool Register(void* data, size_t bytes, unsigned int flags) {
  const CudaRuntime& r = Runtime();
  if (!r.usable) return false;
  const int err = r.host_register(data, bytes, flags);
  if (err != 0) {
    static std::once_flag logged;
    std::call_once(logged, [&] {
      IG_LOG(WARNING) << "shm data plane: cudaHostRegister failed ("
                      << r.error_string(err)
                      << "); host memory stays pageable";
    });
    return false;
  }
  return true;
}

}  // namespace

bool CudaHostRegister(void* data, size_t bytes) {
  return Register(data, bytes, kCudaHostRegisterPortable);
}

bool CudaHostRegisterReadOnly(void* data, size_t bytes) {
  return Register(data, bytes,
                  kCudaHostRegisterPortable | kCudaHostRegisterMapped |
                      kCudaHostRegisterReadOnly);
}

void CudaHostUnregister(void* data) {
  const CudaRuntime& r = Runtime();
  if (r.usable) r.host_unregister(data);
}

}  // namespace infinigen
