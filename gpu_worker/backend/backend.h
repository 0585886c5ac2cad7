// Backend: the arithmetic of a transformer layer, on one kind of device.
//
// The engine owns every buffer and calls these operations in order. Every
// pointer given to an operation is either backend memory (AllocateDevice:
// the engine's activations, KV working set and staging; AllocateShared for
// memory host code also touches) or lies inside a range registered with
// RegisterConstant (the model's weights, which a device backend copies to
// the device once). Operations may run asynchronously: host code reads or
// writes shared memory only after Synchronize() has returned, and device
// memory never, only through CopyFromHost and CopyToHost. Rows fetched
// from the memory node arrive in host memory and reach the backend through
// CopyFromHost, which a device backend runs on a copy queue beside the
// operations (pinned with PinHost for full speed). Matrices are
// row-major. Implementations are not required to be thread-safe: one engine
// drives one backend.
#ifndef INFINIGEN_GPU_WORKER_BACKEND_BACKEND_H_
#define INFINIGEN_GPU_WORKER_BACKEND_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu_worker/backend/gather_rows.h"
#include "gpu_worker/backend/kv_rows.h"
#include "gpu_worker/backend/speculation_params.h"
#include "speculator/speculator.h"

namespace infinigen::gpu_worker {

// Causal attention of n queries over a key/value cache.
struct AttentionParams {
  const float* q;    // [n, n_heads, head_dim]
  const float* k;    // [n_kv_heads, kv_stride, head_dim]
  const float* v;    // [n_kv_heads, kv_stride, head_dim]
  float* out;        // [n, n_heads, head_dim]
  int n = 0;         // queries
  int n_heads = 0;
  int n_kv_heads = 0;  // query head h reads KV head h / (n_heads / n_kv_heads)
  int head_dim = 0;
  int kv_stride = 0;   // rows between consecutive KV heads
  // Query i sees KV rows [0, kv_len0 + i): the first query sees kv_len0 rows.
  int kv_len0 = 0;
  float scale = 1.0f;  // applied to q.k before the softmax
  // Optional [n_heads, kv_len0 + n - 1]: each query's attention
  // probabilities are added here (H2O's accumulated attention).
  float* prob_sums = nullptr;
  // > 0: a sliding window; query i sees only the last `window` of its rows,
  // [max(0, kv_len0 + i - window), kv_len0 + i).
  int window = 0;
  // Where set (k and v null), the K and V rows are fp16 bits in the same
  // layout: a local cache kept at half the bytes (Backend::HalfKvCache).
  // Without prob_sums.
  const uint16_t* k_half = nullptr;
  const uint16_t* v_half = nullptr;
};

// Decode attention of one KV head's query heads straight over the rows a
// fetch left in host memory, as stored: `count` stored rows (`format`, see
// kv_rows.h; row_width uint16 each), then the new token's exact row.
struct StoredRowsAttention {
  const float* q = nullptr;      // [group, head_dim]
  const uint16_t* k = nullptr;   // [count, row_width] stored K rows
  const uint16_t* v = nullptr;   // [count, row_width] stored V rows
  // Where set, stored row t is row indices[t] of k and v instead of row t
  // (the rows read where the memory node keeps them: one-sided reads).
  const int32_t* indices = nullptr;
  const float* k_new = nullptr;  // [head_dim]: the new token's K row
  const float* v_new = nullptr;  // [head_dim]
  float* out = nullptr;          // [group, head_dim]
  int group = 0;                 // query heads of this KV head
  int count = 0;
  int head_dim = 0;
  int row_width = 0;
  KvRowFormat format = KvRowFormat::kHalf;
  float scale = 1.0f;  // applied to q.k before the softmax
  // Optional [group, prob_stride]: each query head's count + 1 attention
  // probabilities are added here (H2O's accumulated attention).
  float* prob_sums = nullptr;
  int prob_stride = 0;
};

// Decode attention of one token's query heads over the rows a fetch staged
// in the backend's memory (K rows of every KV head in plan order, then the
// V rows, as stored), every KV head at once: head g's rows are [head_offsets
// [g], head_offsets[g + 1]) of k_rows and v_rows, then the new token's
// exact row. head_offsets is backend memory (a plan made there needs no
// host copy of it). With a row cache's slots (slots set), plan row r lies
// at row slots[r] of slot_k and slot_v where slots[r] >= 0, else at row
// -1 - slots[r] of k_rows and v_rows (the fetch's staged misses).
struct StagedRowsAttention {
  const float* q = nullptr;         // [n_heads, head_dim]
  const uint16_t* k_rows = nullptr;  // [rows, row_width] stored K rows
  const uint16_t* v_rows = nullptr;  // [rows, row_width] stored V rows
  const int32_t* head_offsets = nullptr;  // [n_kv_heads + 1]
  long rows = 0;                     // head_offsets[n_kv_heads]
  const int32_t* slots = nullptr;    // [rows], backend memory, or null
  const uint16_t* slot_k = nullptr;  // [slot_rows, row_width]
  const uint16_t* slot_v = nullptr;
  long slot_rows = 0;
  long staged_rows = 0;              // with slots: rows k_rows holds
  const float* k_new = nullptr;      // [n_kv_heads, head_dim]
  const float* v_new = nullptr;      // [n_kv_heads, head_dim]
  float* out = nullptr;              // [n_heads, head_dim]
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  // No head has more rows (for splitting a head's rows over blocks).
  int max_head_rows = 0;
  KvRowFormat format = KvRowFormat::kHalf;
  float scale = 1.0f;  // applied to q.k before the softmax
};

// The reference: each head's rows decoded, then a softmax attention over
// them and the new row, on the host (every pointer host memory).
void AttendStagedRowsOnHost(const StagedRowsAttention& p);

// Each KV head's highest-ranked tokens among n_tokens speculated scores, in
// the backend's memory (the plan of a selecting layer, made where its
// scores are). KV head g takes head_offsets[g + 1] - head_offsets[g]
// tokens, written in ascending position order at indices +
// head_offsets[g]. The rank: a KV head of one query head ranks its logits;
// of several (GQA), the largest of its query heads' log-softmax
// (speculator::CombineHeadScores); ties go to the lower position, NaN ranks
// below every number (speculator::SelectTopKPerHead).
struct TopKParams {
  const float* scores = nullptr;  // [n_heads][n_tokens], backend memory
  int n_heads = 0;
  int n_kv_heads = 0;
  int n_tokens = 0;
  // Host memory, [n_kv_heads + 1]: 0, then ascending, each head's count at
  // most n_tokens.
  const int32_t* head_offsets = nullptr;
  int32_t* indices = nullptr;  // backend memory [head_offsets[n_kv_heads]]
  // Backend memory [n_kv_heads][n_tokens] the combined rank is written to
  // (GQA only; may be null with one query head per KV head).
  float* combined = nullptr;
  // The host implementation's threads (null: the caller's alone).
  const speculator::TaskRunner* run = nullptr;
};

// The operations only the KV policies use, on the backend's memory: a new
// policy's kernel widens this small interface, not the layer arithmetic
// below. Each has a host default (right for the CPU); a device backend
// overrides them with its kernels.
class PolicyOps {
 public:
  virtual ~PolicyOps() = default;
  // rows [n_rows, head_dim] = the stored KV rows `in` (`format`, see
  // kv_rows.h) decoded. Default: DecodeKvRows on the host.
  virtual void DecodeKvRows(const uint16_t* in, int n_rows, int head_dim,
                            KvRowFormat format, float* rows);
  // out [n_rows, KvRowWidth(format, head_dim)] = rows [n_rows, head_dim]
  // (fp32) encoded as the memory node stores them, the same bits as
  // EncodeKvRows (kv_rows.h). Returns false, doing nothing, where the
  // backend cannot encode the format: the caller then encodes on the host.
  // Default: EncodeKvRows on the host.
  virtual bool EncodeKvRows(const float* rows, int n_rows, int head_dim,
                            KvRowFormat format, uint16_t* out);
  // InfiniGen's speculated scores (speculation_params.h). Default:
  // speculator::SpeculateScores on the host, over speculator::HostTasks.
  virtual void SpeculateScores(const SpeculationParams& p);
  // InfiniGen's partial key rows: keys [n_rows, n_cols] -> n_rows rows of
  // speculator::PartialKeyRowBytes(n_cols) bytes (speculator/
  // partial_keys.h), row r at rows + r * row_stride (bytes; at least a
  // row's). Default: speculator::QuantizePartialKeys on the host.
  virtual void QuantizePartialKeys(const float* keys, int n_rows, int n_cols,
                                   uint8_t* rows, size_t row_stride);

  // InfiniGen's prompt column sums (speculator::AddSkewedColumnSums): adds
  // to sums [heads / per_kv][d] each token's |x_{t,h} . A_{h / per_kv}|,
  // x [n, heads, d] a prefill chunk's queries or keys, skew_t
  // [heads / per_kv][d][d] the KV heads' A^T, all backend memory, so that a
  // device's prefill rows stay where they are. Default: on the host, the
  // same arithmetic.
  virtual void AddSkewedColumnSums(const float* x, int n, int heads,
                                   int per_kv, int d, const float* skew_t,
                                   float* sums);

  // Per-head top-k of speculated scores (TopKParams). Default: the
  // speculator's CombineHeadScores and SelectTopKPerHead on the host.
  virtual void SelectTopK(const TopKParams& p);
  // Attention over fetched rows read where they lie (StoredRowsAttention),
  // without decoding them into a buffer first. Returns false, doing
  // nothing, where the backend cannot (the format, or rows not in its
  // memory): the caller then decodes them (DecodeKvRows) and runs
  // Attention. Default: false.
  virtual bool AttendStoredRows(const StoredRowsAttention& p) { return false; }
  // Attention over a fetch's staged rows, every KV head in one operation
  // (StagedRowsAttention). Returns false, doing nothing, where the backend
  // cannot: the caller then decodes each head's rows (DecodeKvRows) and
  // runs Attention. Default: false (a host backend attends over fetched
  // rows where they lie: AttendStoredRows).
  virtual bool AttendStagedRows(const StagedRowsAttention& p) {
    return false;
  }
  // A row cache's misses into its slots (ScatterRowsParams, gather_rows.h),
  // queued with the operations. Default: copies on the host.
  virtual void ScatterRows(const ScatterRowsParams& p);
  // One-sided reads (gather_rows.h): the plan's K and V rows read from
  // p.k_rows and p.v_rows, which lie in host memory pinned with PinHost
  // (a device reads it over the bus), into backend memory p.out, queued
  // with the operations (an operation issued after it sees the rows).
  // p.indices and p.head_offsets are backend memory; without indices (a
  // leading plan) each head's first rows, which a device copies as one
  // strided block (DMA, no kernel). Returns false, doing
  // nothing, where the backend cannot (no such reads, or the rows not in
  // one pinned range): the caller then has the node gather them. Default:
  // false.
  virtual bool GatherRows(const GatherRowsParams& p) { return false; }
};

// The layer arithmetic and the memory it runs on, with the policies'
// operations (PolicyOps).
class Backend : public PolicyOps {
 public:
  ~Backend() override = default;
  virtual std::string name() const = 0;

  // Memory both the backend's operations and host code can use (host code
  // after Synchronize()). CPU: aligned host memory; CUDA: managed memory.
  // Returns nullptr when out of memory.
  virtual void* AllocateShared(size_t bytes);
  virtual void FreeShared(void* p);
  // Memory only the backend's operations and copies touch (never host
  // code): the KV working set, staging and activations that stay on the
  // device. CPU: the same as AllocateShared; CUDA: cudaMalloc. Returns
  // nullptr when out of memory.
  virtual void* AllocateDevice(size_t bytes) { return AllocateShared(bytes); }
  virtual void FreeDevice(void* p) { FreeShared(p); }
  // True when the operations read host memory directly (the CPU backend):
  // rows fetched into host memory then need no CopyFromHost.
  virtual bool OperatesOnHostMemory() const { return false; }
  // Declares host memory [p, p + count) unchanged for the backend's lifetime
  // (weights); operations may then be given pointers anywhere inside it.
  virtual absl::Status RegisterConstant(const float* p, size_t count) {
    return absl::OkStatus();
  }
  // Waits for every operation issued so far; returns the first error any of
  // them hit (a device backend's errors are sticky).
  virtual absl::Status Synchronize() { return absl::OkStatus(); }

  // y[n, out] = x[n, in] . w[out, in]^T (+ bias[out] if not null).
  virtual void Linear(const float* x, int n, int in, const float* w,
                      const float* bias, int out, float* y) = 0;
  // y_b[n, out] = x_b[n, in] . w_b[out, in]^T for b < batch, with x_b = x +
  // b * x_stride, w_b = w + b * w_stride and y_b = y + b * y_stride
  // (floats): the policies' per-head products as one operation, in fp32 on
  // every backend. Default: one Linear per b.
  virtual void LinearBatched(const float* x, long x_stride, int n, int in,
                             const float* w, long w_stride, int out, float* y,
                             long y_stride, int batch);
  // y[n, dim] = x / rms(x) * gain, per row.
  virtual void RmsNorm(const float* x, int n, int dim, const float* gain,
                       float eps, float* y) = 0;
  // y[n, dim] = (x - mean) / std * gain + bias, per row.
  virtual void LayerNorm(const float* x, int n, int dim, const float* gain,
                         const float* bias, float eps, float* y) = 0;
  // Rotary embedding in place, half-split layout: dims j and j + head_dim/2
  // of each head rotate by positions[i] * theta^(-2j/head_dim).
  // x is [n, n_heads, head_dim].
  virtual void Rope(float* x, int n, int n_heads, int head_dim,
                    const int* positions, float theta) = 0;
  virtual void Attention(const AttentionParams& p) = 0;
  // gate[i] = silu(gate[i]) * up[i], for i < count.
  virtual void SwiGlu(float* gate, const float* up, long count) = 0;
  // gate[i] = gelu(gate[i]) * up[i] with GELU's tanh form,
  // 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) (Gemma's MLP).
  virtual void GeluTanhGate(float* gate, const float* up, long count) = 0;
  // x[i] *= s.
  virtual void Scale(float* x, long count, float s) = 0;
  // x[i] = max(x[i], 0).
  virtual void Relu(float* x, long count) = 0;
  // x[i] += y[i].
  virtual void Add(float* x, const float* y, long count) = 0;
  // dst[i] = src[i] (the ranges do not overlap).
  virtual void Copy(float* dst, const float* src, long count) = 0;
  // `rows` rows of `width` floats: row r from src + r * src_stride to
  // dst + r * dst_stride (strides >= width; the ranges do not overlap), as
  // one operation: K and V rows between a chunk's [token][head] layout and
  // a cache's [head][position] one. Default: one Copy per row.
  virtual void CopyRows(float* dst, long dst_stride, const float* src,
                        long src_stride, int rows, long width);
  // CopyRows into fp16 rows (round to nearest even, as FloatToHalf).
  // Default: a host loop.
  virtual void CopyRowsToHalf(uint16_t* dst, long dst_stride,
                              const float* src, long src_stride, int rows,
                              long width);
  // Whether the local cache keeps its K and V rows in fp16
  // (AttentionParams::k_half) rather than fp32: a device computing in fp16,
  // whose attention converts K and V to fp16 anyway. Default: false.
  virtual bool HalfKvCache() const { return false; }
  // --- Host memory to the backend, beside the operations.
  // A point in the order of the operations issued so far (0: none).
  using Mark = uint64_t;
  virtual Mark MarkIssued() { return 0; }
  // Copies `bytes` of host memory at src into shared memory dst. The copy
  // starts once every operation issued before `after` has finished (so it
  // may overwrite what they read) and every operation issued after this
  // call sees the data; on a device it runs on a copy queue, overlapping
  // the operations issued in between. The caller leaves src unchanged
  // until WaitCopies() returns. Default: memcpy now.
  virtual void CopyFromHost(void* dst, const void* src, size_t bytes,
                            Mark after);
  // Waits until every CopyFromHost issued so far has read its source;
  // returns the first error (sticky, like Synchronize).
  virtual absl::Status WaitCopies() { return absl::OkStatus(); }
  // Waits for every operation and copy issued so far, then copies `bytes`
  // of backend memory at src (shared or device) into host memory dst;
  // returns the first error (sticky, like Synchronize). The way host code
  // reads what device memory holds. Default: memcpy.
  virtual absl::Status CopyToHost(void* dst, const void* src, size_t bytes);
  // Queues a copy of `bytes` of backend memory at src into host memory dst
  // after every operation issued so far, without waiting: dst holds them
  // once Synchronize() or CopyToHost() has next returned (errors are
  // theirs). Asynchronous where dst was pinned with PinHost. Default:
  // memcpy now (the default operations have finished when they return).
  virtual void QueueCopyToHost(void* dst, const void* src, size_t bytes);
  // Pins host memory [p, p + bytes) so that copies from it run at full
  // speed (CUDA: cudaHostRegister), until UnpinHost(p); it must stay mapped
  // until then. Memory someone else pinned already is accepted as is (and
  // left to them to unpin). Unpinned host memory copies too, slower. An
  // error leaves p unpinned and the backend usable; unpinning memory that
  // PinHost did not pin does nothing. Default: nothing to do.
  virtual absl::Status PinHost(void* p, size_t bytes) {
    return absl::OkStatus();
  }
  virtual void UnpinHost(void* p) {}
};

// A Backend that forwards every call to another one it owns, as leveldb's
// EnvWrapper does for Env: instrumented and fault-injecting backends (in
// tests) derive from it and override only the calls they watch.
class BackendWrapper : public Backend {
 public:
  explicit BackendWrapper(std::unique_ptr<Backend> target)
      : target_(std::move(target)) {}
  Backend* target() const { return target_.get(); }

  std::string name() const override { return target_->name(); }
  void* AllocateShared(size_t bytes) override {
    return target_->AllocateShared(bytes);
  }
  void FreeShared(void* p) override { target_->FreeShared(p); }
  void* AllocateDevice(size_t bytes) override {
    return target_->AllocateDevice(bytes);
  }
  void FreeDevice(void* p) override { target_->FreeDevice(p); }
  bool OperatesOnHostMemory() const override {
    return target_->OperatesOnHostMemory();
  }
  absl::Status RegisterConstant(const float* p, size_t count) override {
    return target_->RegisterConstant(p, count);
  }
  absl::Status Synchronize() override { return target_->Synchronize(); }
  void Linear(const float* x, int n, int in, const float* w, const float* bias,
              int out, float* y) override {
    target_->Linear(x, n, in, w, bias, out, y);
  }
  void RmsNorm(const float* x, int n, int dim, const float* gain, float eps,
               float* y) override {
    target_->RmsNorm(x, n, dim, gain, eps, y);
  }
  void LayerNorm(const float* x, int n, int dim, const float* gain,
                 const float* bias, float eps, float* y) override {
    target_->LayerNorm(x, n, dim, gain, bias, eps, y);
  }
  void Rope(float* x, int n, int n_heads, int head_dim, const int* positions,
            float theta) override {
    target_->Rope(x, n, n_heads, head_dim, positions, theta);
  }
  void Attention(const AttentionParams& p) override { target_->Attention(p); }
  void GeluTanhGate(float* gate, const float* up, long count) override {
    target_->GeluTanhGate(gate, up, count);
  }
  void Scale(float* x, long count, float s) override {
    target_->Scale(x, count, s);
  }
  void SwiGlu(float* gate, const float* up, long count) override {
    target_->SwiGlu(gate, up, count);
  }
  void Relu(float* x, long count) override { target_->Relu(x, count); }
  void Add(float* x, const float* y, long count) override {
    target_->Add(x, y, count);
  }
  void Copy(float* dst, const float* src, long count) override {
    target_->Copy(dst, src, count);
  }
  void CopyRows(float* dst, long dst_stride, const float* src,
                long src_stride, int rows, long width) override {
    target_->CopyRows(dst, dst_stride, src, src_stride, rows, width);
  }
  void CopyRowsToHalf(uint16_t* dst, long dst_stride, const float* src,
                      long src_stride, int rows, long width) override {
    target_->CopyRowsToHalf(dst, dst_stride, src, src_stride, rows, width);
  }
  bool HalfKvCache() const override { return target_->HalfKvCache(); }
  void DecodeKvRows(const uint16_t* in, int n_rows, int head_dim,
                    KvRowFormat format, float* rows) override {
    target_->DecodeKvRows(in, n_rows, head_dim, format, rows);
  }
  bool EncodeKvRows(const float* rows, int n_rows, int head_dim,
                    KvRowFormat format, uint16_t* out) override {
    return target_->EncodeKvRows(rows, n_rows, head_dim, format, out);
  }
  void SpeculateScores(const SpeculationParams& p) override {
    target_->SpeculateScores(p);
  }
  void QuantizePartialKeys(const float* keys, int n_rows, int n_cols,
                           uint8_t* rows, size_t row_stride) override {
    target_->QuantizePartialKeys(keys, n_rows, n_cols, rows, row_stride);
  }
  void AddSkewedColumnSums(const float* x, int n, int heads, int per_kv,
                           int d, const float* skew_t, float* sums) override {
    target_->AddSkewedColumnSums(x, n, heads, per_kv, d, skew_t, sums);
  }
  void LinearBatched(const float* x, long x_stride, int n, int in,
                     const float* w, long w_stride, int out, float* y,
                     long y_stride, int batch) override {
    target_->LinearBatched(x, x_stride, n, in, w, w_stride, out, y, y_stride,
                           batch);
  }
  void SelectTopK(const TopKParams& p) override { target_->SelectTopK(p); }
  bool AttendStoredRows(const StoredRowsAttention& p) override {
    return target_->AttendStoredRows(p);
  }
  bool AttendStagedRows(const StagedRowsAttention& p) override {
    return target_->AttendStagedRows(p);
  }
  void ScatterRows(const ScatterRowsParams& p) override {
    target_->ScatterRows(p);
  }
  bool GatherRows(const GatherRowsParams& p) override {
    return target_->GatherRows(p);
  }
  Mark MarkIssued() override { return target_->MarkIssued(); }
  void CopyFromHost(void* dst, const void* src, size_t bytes,
                    Mark after) override {
    target_->CopyFromHost(dst, src, bytes, after);
  }
  absl::Status WaitCopies() override { return target_->WaitCopies(); }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    return target_->CopyToHost(dst, src, bytes);
  }
  void QueueCopyToHost(void* dst, const void* src, size_t bytes) override {
    target_->QueueCopyToHost(dst, src, bytes);
  }
  absl::Status PinHost(void* p, size_t bytes) override {
    return target_->PinHost(p, bytes);
  }
  void UnpinHost(void* p) override { target_->UnpinHost(p); }

 private:
  std::unique_ptr<Backend> target_;
};

// `count` values of T in a backend's device memory (AllocateDevice),
// uninitialized; freed with the buffer. Move-only; the backend must outlive
// it. Host code never reads or writes through data().
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // ResourceExhausted when the backend has no memory for it.
  static absl::StatusOr<DeviceBuffer> Make(Backend* backend, size_t count,
                                           const char* what) {
    DeviceBuffer b;
    if (count == 0) return b;
    void* p = backend->AllocateDevice(count * sizeof(T));
    if (p == nullptr) {
      return absl::ResourceExhaustedError(
          std::string("out of backend memory for ") + what + " (" +
          std::to_string(count * sizeof(T)) + " bytes)");
    }
    b.backend_ = backend;
    b.data_ = static_cast<T*>(p);
    b.count_ = count;
    return b;
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Release();
      backend_ = o.backend_;
      data_ = o.data_;
      count_ = o.count_;
      o.backend_ = nullptr;
      o.data_ = nullptr;
      o.count_ = 0;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Release(); }

  T* data() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

 private:
  void Release() {
    if (data_ != nullptr) backend_->FreeDevice(data_);
    data_ = nullptr;
  }
  Backend* backend_ = nullptr;
  T* data_ = nullptr;
  size_t count_ = 0;
};

// The CUDA backend on `device` (cuBLAS and the kernels of
// gpu_worker/backend/cuda/).
// Unavailable when the binary was built without CUDA or no device answers,
// with the reason.
absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(int device = 0);

// "cpu", "cuda" (an error if it cannot start) or "auto" (CUDA when a device
// answers, else CPU with one log line saying why).
absl::StatusOr<std::unique_ptr<Backend>> NewBackend(const std::string& kind);

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_BACKEND_BACKEND_H_
