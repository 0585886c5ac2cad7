// CudaBackend's layer kernels (cuda_backend_class.h): the norms, RoPE,
// the gated MLPs' activations and the elementwise operations, each checked
// and launched on the compute stream.
#include "gpu_worker/backend/cuda/cuda_backend_class.h"

#include "absl/strings/str_format.h"
#include "gpu_worker/backend/cuda/kernels.h"

namespace infinigen::gpu_worker::cuda {

void CudaBackend::RmsNorm(const float* x, int n, int dim, const float* gain,
                          float eps, float* y) {
  constexpr const char* kOp = "RmsNorm";
  if (!Begin() || n == 0) return;
  if (n < 0 || dim <= 0) {
    return FailShape(kOp, absl::StrFormat("n=%d dim=%d", n, dim));
  }
  const long count = static_cast<long>(n) * dim;
  RmsNormParams p;
  p.x = In(x, count, kOp, "x");
  p.gain = In(gain, dim, kOp, "gain");
  p.y = Out(y, count, kOp, "y");
  p.n = n;
  p.dim = dim;
  p.eps = eps;
  if (ok()) Launched(LaunchRmsNorm(p, stream_), kOp);
}

void CudaBackend::LayerNorm(const float* x, int n, int dim, const float* gain,
                            const float* bias, float eps, float* y) {
  constexpr const char* kOp = "LayerNorm";
  if (!Begin() || n == 0) return;
  if (n < 0 || dim <= 0) {
    return FailShape(kOp, absl::StrFormat("n=%d dim=%d", n, dim));
  }
  const long count = static_cast<long>(n) * dim;
  LayerNormParams p;
  p.x = In(x, count, kOp, "x");
  p.gain = In(gain, dim, kOp, "gain");
  p.bias = In(bias, dim, kOp, "bias");
  p.y = Out(y, count, kOp, "y");
  p.n = n;
  p.dim = dim;
  p.eps = eps;
  if (ok()) Launched(LaunchLayerNorm(p, stream_), kOp);
}

void CudaBackend::Rope(float* x, int n, int n_heads, int head_dim,
                       const int* positions, float theta) {
  constexpr const char* kOp = "Rope";
  if (!Begin() || n == 0) return;
  if (n < 0 || n_heads <= 0 || head_dim <= 0 || head_dim % 2 != 0 ||
      !(theta > 0.0f)) {
    return FailShape(kOp, absl::StrFormat("n=%d n_heads=%d head_dim=%d "
                                          "(even) theta=%g",
                                          n, n_heads, head_dim, theta));
  }
  RopeParams p;
  p.x = Out(x, static_cast<long>(n) * n_heads * head_dim, kOp, "x");
  p.positions = In(positions, n, kOp, "positions");
  p.n = n;
  p.n_heads = n_heads;
  p.head_dim = head_dim;
  p.theta = theta;
  if (ok()) Launched(LaunchRope(p, stream_), kOp);
}

void CudaBackend::SwiGlu(float* gate, const float* up, long count) {
  Gate("SwiGlu", LaunchSwiGlu, gate, up, count);
}

void CudaBackend::GeluTanhGate(float* gate, const float* up, long count) {
  Gate("GeluTanhGate", LaunchGeluTanhGate, gate, up, count);
}

void CudaBackend::Gate(const char* op,
                       int (*launch)(const SwiGluParams&, void*), float* gate,
                       const float* up, long count) {
  if (!Begin() || count == 0) return;
  if (count < 0) return FailShape(op, absl::StrFormat("count=%d", count));
  SwiGluParams p;
  p.gate = Out(gate, count, op, "gate");
  p.up = In(up, count, op, "up");
  p.count = count;
  if (ok()) Launched(launch(p, stream_), op);
}

void CudaBackend::Scale(float* x, long count, float s) {
  constexpr const char* kOp = "Scale";
  if (!Begin() || count == 0) return;
  if (count < 0) return FailShape(kOp, absl::StrFormat("count=%d", count));
  ScaleParams p;
  p.x = Out(x, count, kOp, "x");
  p.count = count;
  p.s = s;
  if (ok()) Launched(LaunchScale(p, stream_), kOp);
}

void CudaBackend::Relu(float* x, long count) {
  constexpr const char* kOp = "Relu";
  if (!Begin() || count == 0) return;
  if (count < 0) return FailShape(kOp, absl::StrFormat("count=%d", count));
  ReluParams p;
  p.x = Out(x, count, kOp, "x");
  p.count = count;
  if (ok()) Launched(LaunchRelu(p, stream_), kOp);
}

void CudaBackend::Add(float* x, const float* y, long count) {
  constexpr const char* kOp = "Add";
  if (!Begin() || count == 0) return;
  if (count < 0) return FailShape(kOp, absl::StrFormat("count=%d", count));
  AddParams p;
  p.x = Out(x, count, kOp, "x");
  p.y = In(y, count, kOp, "y");
  p.count = count;
  if (ok()) Launched(LaunchAdd(p, stream_), kOp);
}

}  // namespace infinigen::gpu_worker::cuda
