// The local cache (--policy=ideal, and the sliding-window layers of the
// hybrid): every row in the backend's memory.
#include <algorithm>
#include <memory>
#include <vector>

#include "common/status.h"
#include "gpu_worker/kv/kv_cache_impl.h"

namespace infinigen::gpu_worker {

namespace {

// Rows a layer keeps per KV head: every position for a global layer; for
// a sliding-window layer (window W) a buffer of 2W - 1 + max_chunk rows
// that slides: when a chunk or a step's row would not fit, the last W - 1
// rows (all the next queries can see before their own) move to its start.
// The rows a move copies and the rows it keeps never overlap, and a
// layer's bytes do not grow with the context.
int LocalLayerRows(const model::ModelConfig& c, const KvCacheOptions& o,
                   int layer, bool only_windows) {
  const int window = c.AttentionWindow(layer);
  if (only_windows && window <= 0) return 0;  // the hybrid offloads it
  if (window <= 0) return o.max_seq_len;
  return std::min<int64_t>(o.max_seq_len,
                           int64_t{2} * window - 1 + o.max_chunk);
}

// Every slot's cache, K and V [layer][kv_head][row][head_dim], in the
// backend's device memory: a global layer's row is its position; a
// sliding-window layer's rows are positions [base, base + rows) of its
// sliding buffer (LocalLayerRows).
class LocalKvCache final : public KvCache {
 public:
  // only_windows: hold the sliding-window layers only (the hybrid cache's
  // part; the global layers get no rows).
  LocalKvCache(const model::Weights& weights, Backend* backend,
               const KvCacheOptions& options, bool only_windows)
      : config_(weights.config),
        backend_(*backend),
        options_(options),
        stats_(options.batch),
        base_(options.batch, std::vector<int>(weights.config.n_layers, 0)) {
    half_ = options.half_local_kv;
    size_t offset = 0;
    for (int l = 0; l < config_.n_layers; ++l) {
      rows_.push_back(LocalLayerRows(config_, options_, l, only_windows));
      layer_offset_.push_back(offset);
      offset += static_cast<size_t>(config_.n_kv_heads) * rows_.back() *
                config_.head_dim;
    }
    slot_size_ = offset;
  }

  absl::Status Init() {
    for (int i = 0; i < options_.batch; ++i) {
      if (half_) {
        IG_RETURN_IF_ERROR(Allocate(k_half_, v_half_));
      } else {
        IG_RETURN_IF_ERROR(Allocate(k_, v_));
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<int> BeginPrefill(int slot, int first,
                                   absl::Span<const int> tokens,
                                   bool reuse) override {
    slot_ = slot;
    if (first == 0) std::fill(base_[slot].begin(), base_[slot].end(), 0);
    return 0;
  }

  absl::Status PrefillAttention(int layer, int pos, int rows, const float* q,
                                const float* k, const float* v,
                                float* out) override {
    MakeRoom(slot_, layer, pos, rows);
    const int base = base_[slot_][layer];
    // Each KV head's rows of the chunk, [token][head] to [head][row].
    const int hd = config_.head_dim, kvd = config_.kv_dim();
    for (int g = 0; g < config_.n_kv_heads; ++g) {
      const size_t dst =
          (static_cast<size_t>(g) * rows_[layer] + (pos - base)) * hd;
      for (const bool value : {false, true}) {
        const float* src = (value ? v : k) + g * hd;
        if (half_) {
          backend_.CopyRowsToHalf(HalfRows(slot_, layer, value) + dst, hd,
                                  src, kvd, rows, hd);
        } else {
          backend_.CopyRows(Rows(slot_, layer, value) + dst, hd, src, kvd,
                            rows, hd);
        }
      }
    }
    Attend(slot_, layer, q, rows, pos - base + 1, out);
    return absl::OkStatus();
  }

  absl::Status EndPrefillLayer(int layer) override { return absl::OkStatus(); }
  absl::Status EndPrefill() override { return absl::OkStatus(); }

  absl::StatusOr<KvStepPtr> BeginStep(
      absl::Span<const int> slots, absl::Span<const int> positions) override {
    if (step_open_) {
      return absl::FailedPreconditionError(
          "kv cache: a decode step is already open");
    }
    step_.Open(slots, positions);
    step_open_ = true;
    return KvStepPtr(&step_);
  }
  absl::Status Reset(int slot) override {
    std::fill(base_[slot].begin(), base_[slot].end(), 0);
    return absl::OkStatus();
  }
  absl::Status Flush() override { return absl::OkStatus(); }
  bool offloaded() const override { return false; }
  const FetchStats& fetch_stats(int slot) const override {
    return stats_[slot];
  }
  int64_t worker_bytes() const override { return bytes_; }
  int64_t node_bytes() const override { return 0; }

 private:
  // A step stores each new token's K and V in its slot and attends over
  // the slot's positions so far.
  class Step final : public KvStep {
   public:
    explicit Step(LocalKvCache& cache) : cache_(cache) {
      slots_.reserve(cache.options_.batch);
      positions_.reserve(cache.options_.batch);
    }
    void Open(absl::Span<const int> slots, absl::Span<const int> positions) {
      slots_.assign(slots.begin(), slots.end());
      positions_.assign(positions.begin(), positions.end());
    }

    const FetchSchedule& schedule() const override { return schedule_; }
    absl::Status LayerInput(int layer, const float* xb) override {
      return absl::OkStatus();
    }
    absl::Status DecodeAttention(int layer, const float* q, const float* k,
                                 const float* v, float* out) override {
      const model::ModelConfig& c = cache_.config_;
      const size_t qd = static_cast<size_t>(c.q_dim());
      for (size_t i = 0; i < slots_.size(); ++i) {
        const int slot = slots_[i], pos = positions_[i];
        cache_.MakeRoom(slot, layer, pos, 1);
        const int base = cache_.base_[slot][layer];
        cache_.Store(slot, layer, pos - base, k, v, static_cast<int>(i));
        cache_.Attend(slot, layer, q + i * qd, 1, pos - base + 1,
                      out + i * qd);
      }
      return absl::OkStatus();
    }
    absl::Status LayerDone(int layer) override { return absl::OkStatus(); }
    absl::Status End() override { return absl::OkStatus(); }

   private:
    void Close() override { cache_.step_open_ = false; }

    LocalKvCache& cache_;
    std::vector<int> slots_, positions_;
    const FetchSchedule schedule_ = FetchSchedule::None();
  };

  // One slot's K and V buffers of slot_size_ values each.
  template <typename T>
  absl::Status Allocate(std::vector<DeviceBuffer<T>>& k,
                        std::vector<DeviceBuffer<T>>& v) {
    IG_ASSIGN_OR_RETURN(DeviceBuffer<T> kb,
                        DeviceBuffer<T>::Make(&backend_, slot_size_,
                                              "the local K cache"));
    IG_ASSIGN_OR_RETURN(DeviceBuffer<T> vb,
                        DeviceBuffer<T>::Make(&backend_, slot_size_,
                                              "the local V cache"));
    bytes_ += static_cast<int64_t>(kb.bytes() + vb.bytes());
    k.push_back(std::move(kb));
    v.push_back(std::move(vb));
    return absl::OkStatus();
  }

  // A layer's K (value = false) or V rows of a slot: fp32, or fp16 (half_).
  float* Rows(int slot, int layer, bool value) {
    return (value ? v_ : k_)[slot].data() + layer_offset_[layer];
  }
  uint16_t* HalfRows(int slot, int layer, bool value) {
    return (value ? v_half_ : k_half_)[slot].data() + layer_offset_[layer];
  }

  // Queues attention of n queries over the slot's layer rows, the first
  // query seeing kv_len0 of them.
  void Attend(int slot, int layer, const float* q, int n, int kv_len0,
              float* out) {
    if (half_) {
      QueueAttention(backend_, config_, q, nullptr, nullptr, rows_[layer], n,
                     kv_len0, config_.AttentionWindow(layer), out, nullptr,
                     HalfRows(slot, layer, false),
                     HalfRows(slot, layer, true));
    } else {
      QueueAttention(backend_, config_, q, Rows(slot, layer, false),
                     Rows(slot, layer, true), rows_[layer], n, kv_len0,
                     config_.AttentionWindow(layer), out, nullptr);
    }
  }

  // Before positions [pos, pos + n) are stored in a sliding-window layer:
  // when they would pass the end of its buffer, its last window - 1 rows
  // before pos move to the start (queued like the other operations).
  void MakeRoom(int slot, int layer, int pos, int n) {
    const int window = config_.AttentionWindow(layer);
    int& base = base_[slot][layer];
    if (window <= 0 || pos + n - base <= rows_[layer]) return;
    const int keep = std::min(window - 1, pos - base);
    const int from = pos - keep - base;  // >= keep: the ranges are apart
    base = pos - keep;
    if (keep == 0) return;
    // fp16 rows move as pairs of values (head_dim is even): as floats of
    // half the width.
    const int hd = half_ ? config_.head_dim / 2 : config_.head_dim;
    for (int g = 0; g < config_.n_kv_heads; ++g) {
      const size_t head = static_cast<size_t>(g) * rows_[layer] * hd;
      for (const bool value : {false, true}) {
        float* buffer =
            half_ ? reinterpret_cast<float*>(HalfRows(slot, layer, value))
                  : Rows(slot, layer, value);
        backend_.CopyRows(buffer + head, hd,
                          buffer + head + static_cast<size_t>(from) * hd, hd,
                          keep, hd);
      }
    }
  }

  // Row `row` of k and v ([row][kv_head][head_dim]) as buffer row `at` of
  // every KV head: one copy each, heads rows_[layer] rows apart.
  void Store(int slot, int layer, int at, const float* k, const float* v,
             int row) {
    const int hd = config_.head_dim, kvd = config_.kv_dim();
    const size_t dst = static_cast<size_t>(at) * hd;
    const size_t src = static_cast<size_t>(row) * kvd;
    const long head_stride = static_cast<long>(rows_[layer]) * hd;
    for (const bool value : {false, true}) {
      const float* from = (value ? v : k) + src;
      if (half_) {
        backend_.CopyRowsToHalf(HalfRows(slot, layer, value) + dst,
                                head_stride, from, hd, config_.n_kv_heads,
                                hd);
      } else {
        backend_.CopyRows(Rows(slot, layer, value) + dst, head_stride, from,
                          hd, config_.n_kv_heads, hd);
      }
    }
  }

  const model::ModelConfig& config_;
  Backend& backend_;
  const KvCacheOptions options_;
  std::vector<int> rows_;             // [layer]: LocalLayerRows
  std::vector<size_t> layer_offset_;  // [layer]: values into a slot's buffer
  size_t slot_size_ = 0;              // values of one slot's K (or V)
  bool half_ = false;                 // KvCacheOptions::half_local_kv
  // [slot]: fp32 rows, or (half_) fp16 ones.
  std::vector<DeviceBuffer<float>> k_, v_;
  std::vector<DeviceBuffer<uint16_t>> k_half_, v_half_;
  std::vector<FetchStats> stats_;           // always empty: nothing fetched
  // [slot][layer]: the position of buffer row 0 (sliding-window layers).
  std::vector<std::vector<int>> base_;
  int64_t bytes_ = 0;
  int slot_ = 0;  // the slot being prefilled
  bool step_open_ = false;
  Step step_{*this};  // the decode step, reused
};

}  // namespace

int64_t LocalKvCacheBytes(const model::ModelConfig& c,
                          const KvCacheOptions& options, bool only_windows) {
  int64_t rows = 0;
  for (int l = 0; l < c.n_layers; ++l) {
    rows += LocalLayerRows(c, options, l, only_windows);
  }
  return int64_t{2} * options.batch * rows * c.n_kv_heads * c.head_dim *
         static_cast<int64_t>(options.half_local_kv ? sizeof(uint16_t)
                                                    : sizeof(float));
}

absl::StatusOr<std::unique_ptr<KvCache>> NewLocalKvCache(
    const model::Weights& weights, Backend* backend,
    const KvCacheOptions& options, bool only_windows) {
  auto cache =
      std::make_unique<LocalKvCache>(weights, backend, options, only_windows);
  IG_RETURN_IF_ERROR(cache->Init());
  return std::unique_ptr<KvCache>(std::move(cache));
}

}  // namespace infinigen::gpu_worker
