// The backend factory: CPU, or CUDA when the build has it and a device
// answers. The CUDA backend is a plugin (cuda/cuda_plugin.cc) loaded on
// first use, so that CPU-only processes never load cudart and cuBLAS.
#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/backend/cpu/cpu_backend.h"

namespace infinigen::gpu_worker {
namespace {

#ifdef INFINIGEN_WITH_CUDA
constexpr char kPlugin[] = "libinfinigen_cuda.so";
using CreateFn = Backend* (*)(int device, int* code, std::string* message);

// Where the plugin may be: $INFINIGEN_CUDA_PLUGIN alone when set; else next
// to the executable (an install or a bundle), then in its Bazel runfiles.
std::vector<std::string> PluginCandidates() {
  if (const char* env = std::getenv("INFINIGEN_CUDA_PLUGIN");
      env != nullptr && *env != '\0') {
    return {env};
  }
  std::vector<std::string> c;
  std::string exe(4096, '\0');
  const ssize_t n = readlink("/proc/self/exe", exe.data(), exe.size() - 1);
  if (n > 0) {
    exe.resize(n);
    const size_t slash = exe.rfind('/');
    c.push_back(exe.substr(0, slash == std::string::npos ? 0 : slash + 1) +
                kPlugin);
    c.push_back(exe + ".runfiles/infinigen/gpu_worker/backend/cuda/" + kPlugin);
  }
  if (const char* srcdir = std::getenv("TEST_SRCDIR"); srcdir != nullptr) {
    c.push_back(std::string(srcdir) +
                "/infinigen/gpu_worker/backend/cuda/" + kPlugin);
  }
  return c;
}

// The plugin's entry point, loaded once; Unavailable with what was tried.
absl::StatusOr<CreateFn> LoadPlugin() {
  static absl::Mutex mu;
  static CreateFn create = nullptr;
  static std::string* error = nullptr;
  absl::MutexLock lock(&mu);
  if (create != nullptr) return create;
  if (error != nullptr) return absl::UnavailableError(*error);
  std::vector<std::string> tried;
  for (const std::string& path : PluginCandidates()) {
    if (access(path.c_str(), R_OK) != 0) {
      tried.push_back(path + " (absent)");
      continue;
    }
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      tried.push_back(path + " (" + dlerror() + ")");
      continue;
    }
    create = reinterpret_cast<CreateFn>(
        dlsym(handle, "InfinigenCreateCudaBackend"));
    if (create != nullptr) return create;
    tried.push_back(path + " (no InfinigenCreateCudaBackend)");
    dlclose(handle);
  }
  error = new std::string(absl::StrCat(
      "the CUDA backend plugin ", kPlugin, " could not be loaded: ",
      absl::StrJoin(tried, "; "),
      " (set INFINIGEN_CUDA_PLUGIN to its path)"));
  return absl::UnavailableError(*error);
}

// Whether the CUDA driver answers with at least one device, asked of the
// driver library alone (small) before the plugin maps cudart and cuBLAS
// (large). Unavailable("no CUDA device: ...") otherwise.
absl::Status ProbeDriver() {
  void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (driver == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("no CUDA device: no CUDA driver (", dlerror(), ")"));
  }
  using InitFn = int (*)(unsigned int);
  using CountFn = int (*)(int*);
  auto init = reinterpret_cast<InitFn>(dlsym(driver, "cuInit"));
  auto count = reinterpret_cast<CountFn>(dlsym(driver, "cuDeviceGetCount"));
  int devices = 0;
  int rc = init == nullptr || count == nullptr ? -1 : init(0);
  if (rc == 0) rc = count(&devices);
  if (rc != 0 || devices == 0) {
    dlclose(driver);
    return absl::UnavailableError(
        rc != 0 ? absl::StrCat("no CUDA device: the CUDA driver failed "
                               "(CUresult ",
                               rc, ")")
                : std::string("no CUDA device: the CUDA driver sees none"));
  }
  return absl::OkStatus();  // the driver stays loaded: the plugin uses it
}
#endif

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(int device) {
#ifdef INFINIGEN_WITH_CUDA
  static const absl::Status* driver = new absl::Status(ProbeDriver());
  if (!driver->ok()) return *driver;
  absl::StatusOr<CreateFn> create = LoadPlugin();
  if (!create.ok()) return create.status();
  int code = 0;
  std::string message;
  Backend* backend = (*create)(device, &code, &message);
  if (backend == nullptr) {
    return absl::Status(static_cast<absl::StatusCode>(code), message);
  }
  return std::unique_ptr<Backend>(backend);
#else
  (void)device;
  return absl::UnavailableError(
      "this binary was built without CUDA (no toolkit at build time)");
#endif
}

absl::StatusOr<std::unique_ptr<Backend>> NewBackend(const std::string& kind) {
  if (kind == "cpu") return NewCpuBackend();
  if (kind == "cuda") return NewCudaBackend(0);
  if (kind == "auto") {
    auto cuda = NewCudaBackend(0);
    if (cuda.ok()) return cuda;
    IG_LOG(INFO) << "backend: CPU (" << cuda.status().message() << ")";
    return NewCpuBackend();
  }
  return absl::InvalidArgumentError("--backend must be cpu, cuda or auto, not '" +
                                    kind + "'");
}

}  // namespace infinigen::gpu_worker
