#include "gpu_worker/kv/offloaded/prefill.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/status.h"
#include "gpu_worker/kv/kv_cache_impl.h"

namespace infinigen::gpu_worker {
namespace offloaded {

Prefill::~Prefill() {
  append_.Wait().IgnoreError();
  if (!k_stage_.empty()) backend_.UnpinHost(k_stage_.data());
  if (!v_stage_.empty()) backend_.UnpinHost(v_stage_.data());
}

absl::Status Prefill::Allocate() {
  const size_t chunk = static_cast<size_t>(options_.max_chunk);
  const int max_seq = options_.max_seq_len;
  IG_ASSIGN_OR_RETURN(
      chunk_rows_, DeviceBuffer<float>::Make(&backend_, 2 * chunk * c_.kv_dim(),
                                             "prefill chunk rows"));
  if (layout_.staged) {
    IG_ASSIGN_OR_RETURN(
        chunk_stage_,
        DeviceBuffer<uint16_t>::Make(
            &backend_, 2 * chunk * c_.n_kv_heads * layout_.row_width,
            "prefill chunk staging"));
  }
  if (layout_.prefill_probs) {
    const size_t n = static_cast<size_t>(c_.n_heads) * max_seq;
    IG_ASSIGN_OR_RETURN(probs_, DeviceBuffer<float>::Make(
                                    &backend_, n, "attention probabilities"));
    probs_host_.assign(n, 0.0f);
  }
  k_host_.resize(chunk * c_.kv_dim());
  v_host_.resize(chunk * c_.kv_dim());
  const size_t stage =
      static_cast<size_t>(max_seq) * c_.n_kv_heads * layout_.row_width;
  // Two stages: one layer's append leaves from one while the next layer
  // fills the other.
  k_stage_.resize(2 * stage);
  v_stage_.resize(2 * stage);
  if (layout_.staged) {
    // A device's encoded prefill rows are queued here: pinned, so that the
    // copies run beside its work.
    for (std::vector<uint16_t>* stage_rows : {&k_stage_, &v_stage_}) {
      const absl::Status pinned = backend_.PinHost(
          stage_rows->data(), stage_rows->size() * sizeof(uint16_t));
      if (!pinned.ok()) {
        IG_LOG(WARNING) << "engine: the prefill's row stage stays pageable "
                           "(copies run slower): "
                        << pinned.message();
        break;
      }
    }
  }
  return absl::OkStatus();
}

void Prefill::Begin(const PrefillTarget& target, int first, int tokens) {
  target_ = target;
  first_ = first;
  tokens_ = tokens;
}

absl::Status Prefill::Attention(const PrefixLoader& prefix, int layer,
                                int pos, int rows, const float* q,
                                const float* k, const float* v, float* out) {
  KvPolicy& policy = *target_.policy;
  const int hd = c_.head_dim, kvd = c_.kv_dim();
  const int stride = decoded_.stride;
  // The chunk's rows encoded for the memory node: by the backend where it
  // can (a device then queues them to the pinned host stage, read at the
  // layer's end), else on the host. The policy sees the queries and keys
  // where they are, in the backend's memory.
  const size_t kv_values = static_cast<size_t>(rows) * kvd;
  const bool observes = policy.ObservesPrefill();
  const size_t at = static_cast<size_t>(pos) * c_.n_kv_heads *
                    layout_.row_width;
  const size_t row_values = static_cast<size_t>(rows) * c_.n_kv_heads *
                            layout_.row_width;
  const KvRowFormat format = policy.row_format();
  const int n_rows = rows * c_.n_kv_heads;
  // Where the encoded rows are for the backend: chunk_stage_ on a device,
  // the host stage itself on the host.
  uint16_t* k_stage = StageRows(k_stage_) + at;
  uint16_t* v_stage = StageRows(v_stage_) + at;
  const uint16_t* k_stored = k_stage;
  const uint16_t* v_stored = v_stage;
  uint16_t* k_enc = layout_.staged ? chunk_stage_.data() : k_stage;
  uint16_t* v_enc = layout_.staged ? chunk_stage_.data() + row_values : v_stage;
  if (backend_.EncodeKvRows(k, n_rows, hd, format, k_enc) &&
      backend_.EncodeKvRows(v, n_rows, hd, format, v_enc)) {
    if (layout_.staged) {
      backend_.QueueCopyToHost(k_stage, k_enc, row_values * sizeof(uint16_t));
      backend_.QueueCopyToHost(v_stage, v_enc, row_values * sizeof(uint16_t));
      k_stored = k_enc;
      v_stored = v_enc;
    }
  } else {
    IG_RETURN_IF_ERROR(
        backend_.CopyToHost(k_host_.data(), k, kv_values * sizeof(float)));
    IG_RETURN_IF_ERROR(
        backend_.CopyToHost(v_host_.data(), v, kv_values * sizeof(float)));
    policy.EncodeRows(k_host_.data(), n_rows, k_stage);
    policy.EncodeRows(v_host_.data(), n_rows, v_stage);
    if (layout_.staged) {
      backend_.CopyFromHost(chunk_stage_.data(), k_stored,
                            row_values * sizeof(uint16_t), chunk_stage_free_);
      backend_.CopyFromHost(chunk_stage_.data() + row_values, v_stored,
                            row_values * sizeof(uint16_t), chunk_stage_free_);
      k_stored = chunk_stage_.data();
      v_stored = chunk_stage_.data() + row_values;
    }
  }
  // A policy that reuses prefixes attends over the chunk's rows as the
  // memory node will hold them (encoded, then decoded on the backend), as it
  // reads a reused prefix's and as decode steps read every row: a prefill
  // computed here and one that attaches another sequence's stored rows give
  // the same result, bit for bit. The others attend over the exact rows.
  const float* k_att = k;
  const float* v_att = v;
  if (policy.ReusesPrefix()) {
    float* k_dec = chunk_rows_.data();
    float* v_dec = k_dec + static_cast<size_t>(rows) * kvd;
    backend_.DecodeKvRows(k_stored, n_rows, hd, format, k_dec);
    backend_.DecodeKvRows(v_stored, n_rows, hd, format, v_dec);
    k_att = k_dec;
    v_att = v_dec;
  }
  // The layer's keys and values so far, for its attention (and, fp32,
  // the policy's FinishPrefillLayer).
  for (int g = 0; g < c_.n_kv_heads; ++g) {
    const size_t dst = (static_cast<size_t>(g) * stride + pos) * hd;
    backend_.CopyRows(decoded_.k.data() + dst, hd, k_att + g * hd, kvd, rows,
                      hd);
    backend_.CopyRows(decoded_.v.data() + dst, hd, v_att + g * hd, kvd, rows,
                      hd);
    if (layout_.half_rows) {
      // The stored fp16 rows themselves (the values k_att decoded), moved
      // as float pairs: head_dim is even.
      const int w = hd / 2;
      backend_.CopyRows(reinterpret_cast<float*>(decoded_.k_half.data() + dst),
                        w, reinterpret_cast<const float*>(k_stored + g * hd),
                        kvd / 2, rows, w);
      backend_.CopyRows(reinterpret_cast<float*>(decoded_.v_half.data() + dst),
                        w, reinterpret_cast<const float*>(v_stored + g * hd),
                        kvd / 2, rows, w);
    }
  }
  // The chunk's stage was last read above.
  chunk_stage_free_ = backend_.MarkIssued();
  float* probs = nullptr;
  const size_t prob_values = static_cast<size_t>(c_.n_heads) * (pos + rows);
  if (layout_.prefill_probs) {
    // Zeroed through the host copy; CopyToHost below waits for this copy
    // before the host array changes again.
    probs = probs_.data();
    std::fill(probs_host_.begin(), probs_host_.begin() + prob_values, 0.0f);
    backend_.CopyFromHost(probs, probs_host_.data(),
                          prob_values * sizeof(float), backend_.MarkIssued());
  }
  if (layout_.half_rows) {
    QueueAttention(backend_, c_, q, nullptr, nullptr, stride, rows, pos + 1,
                   c_.AttentionWindow(layer), out, nullptr,
                   decoded_.k_half.data(), decoded_.v_half.data());
  } else {
    QueueAttention(backend_, c_, q, decoded_.k.data(), decoded_.v.data(),
                   stride, rows, pos + 1, c_.AttentionWindow(layer), out,
                   probs);
  }
  if (probs != nullptr) {
    IG_RETURN_IF_ERROR(backend_.CopyToHost(probs_host_.data(), probs,
                                           prob_values * sizeof(float)));
  }
  const auto t0 = std::chrono::steady_clock::now();
  policy.ObservePrefill(layer, observes ? q : nullptr,
                        observes ? k : nullptr, rows, pos,
                        probs != nullptr ? probs_host_.data() : nullptr);
  // Summaries of the whole blocks this sequence will share.
  IG_RETURN_IF_ERROR(
      prefix.Summarize(policy, layer, pos, rows, q, k, *target_.prefix));
  target_.stats->prefill_policy_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  return absl::OkStatus();
}

absl::Status Prefill::EndLayer(const PrefixLoader& prefix, int layer) {
  const int n = tokens_ - first_;
  const size_t at = static_cast<size_t>(first_) * c_.n_kv_heads *
                    layout_.row_width;
  // With the last layer, the summaries of the blocks to share.
  std::vector<std::string> meta;
  if (layer + 1 == c_.n_layers) meta = prefix.BlockMeta(*target_.prefix);
  // The rows a device encoded were queued to the stage; the previous
  // layer's append, from the other stage, must be in before the next layer
  // writes there.
  IG_RETURN_IF_ERROR(backend_.Synchronize());
  IG_RETURN_IF_ERROR(WaitAppend());
  // This layer's rows go to the node on a thread of their own while the
  // next layer computes.
  append_target_ = target_;
  append_layer_ = layer;
  append_first_ = first_;
  append_n_ = n;
  const uint16_t* k = StageRows(k_stage_) + at;
  const uint16_t* v = StageRows(v_stage_) + at;
  const kv_memory_service::SequenceId seq = target_.seq;
  const int first_block = target_.prefix->annotated_first;
  append_.Start([this, seq, layer, k, v, n, first_block,
                 meta = std::move(meta)]() -> absl::Status {
    IG_ASSIGN_OR_RETURN(
        appended_, AppendRows(client_, seq, c_.n_kv_heads, layout_.row_width,
                              layer, 1, k, v, n, &meta, first_block));
    return absl::OkStatus();
  });
  stage_ ^= 1;
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status finished = target_.policy->FinishPrefillLayer(
      layer, tokens_, decoded_.k.data(), decoded_.stride);
  target_.stats->prefill_policy_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  return finished;
}

absl::Status Prefill::WaitAppend() {
  if (!append_.running()) return absl::OkStatus();
  PrefillTarget& t = append_target_;
  IG_RETURN_IF_ERROR(append_.Wait(&t.stats->prefill_append_wait_seconds));
  t.presence->Mark(append_layer_, 1, append_first_, append_n_,
                   appended_.evicted);
  return absl::OkStatus();
}

}  // namespace offloaded
}  // namespace infinigen::gpu_worker
