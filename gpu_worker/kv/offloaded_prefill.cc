#include "gpu_worker/kv/offloaded_kv_cache.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/status.h"
#include "kv_memory_service/client/prefix_keys.h"

namespace infinigen::gpu_worker {
namespace offloaded {

// --- Prefill: layer by layer; each layer's rows leave before the next.

absl::StatusOr<int> OffloadedKvCache::BeginPrefill(
    int slot, int first, absl::Span<const int> tokens, bool reuse) {
  const int n = static_cast<int>(tokens.size());
  if (first != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "forward: policy %s prefills a sequence in one call (slot %d holds "
        "%d tokens already)",
        PolicyName(options_.kv.policy->kind), slot, first));
  }
  IG_RETURN_IF_ERROR(FinishAppends());
  // A failed prefill's last append (its slot was reset).
  WaitPrefillAppend().IgnoreError();
  Sequence& s = sequences_[slot];
  int cached = 0;
  if (s.seq == 0) {
    const auto t0 = std::chrono::steady_clock::now();
    IG_ASSIGN_OR_RETURN(cached, OpenSequence(s, tokens, reuse));
    s.stats.open_seconds += std::chrono::duration<double>(
                                std::chrono::steady_clock::now() - t0)
                                .count();
  }
  prefill_slot_ = slot;
  prefill_first_ = cached;
  prefill_tokens_ = n;
  if (cached > 0) IG_RETURN_IF_ERROR(IssuePrefixFetch(s, 0));
  return cached;
}

absl::Status OffloadedKvCache::PrefillAttention(int layer, int pos, int rows,
                                                const float* q,
                                                const float* k,
                                                const float* v, float* out) {
  Sequence& s = sequences_[prefill_slot_];
  if (rows > options_.max_chunk) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "kv cache: a prefill chunk of %d rows exceeds max_chunk %d", rows,
        options_.max_chunk));
  }
  const int hd = c_.head_dim, kvd = c_.kv_dim();
  // A reused prefix: the layer's cached rows first, fetched.
  if (pos == prefill_first_ && s.cached > 0) {
    IG_RETURN_IF_ERROR(LoadPrefix(s, layer));
  }
  // The chunk's rows encoded for the memory node: by the backend where it
  // can (a device then queues them to the pinned host stage, read at the
  // layer's end), else on the host. The policy sees the queries and keys
  // on the host where it observes them.
  const size_t kv_values = static_cast<size_t>(rows) * kvd;
  const bool observes = s.policy->ObservesPrefill();
  if (observes) {
    IG_RETURN_IF_ERROR(backend_.CopyToHost(
        q_host_.data(), q,
        static_cast<size_t>(rows) * c_.q_dim() * sizeof(float)));
    IG_RETURN_IF_ERROR(
        backend_.CopyToHost(k_host_.data(), k, kv_values * sizeof(float)));
  }
  const size_t at = static_cast<size_t>(pos) * c_.n_kv_heads *
                    layout_.row_width;
  const size_t row_values = static_cast<size_t>(rows) * c_.n_kv_heads *
                            layout_.row_width;
  const KvRowFormat format = s.policy->row_format();
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
    if (!observes) {
      IG_RETURN_IF_ERROR(
          backend_.CopyToHost(k_host_.data(), k, kv_values * sizeof(float)));
    }
    IG_RETURN_IF_ERROR(
        backend_.CopyToHost(v_host_.data(), v, kv_values * sizeof(float)));
    s.policy->EncodeRows(k_host_.data(), n_rows, k_stage);
    s.policy->EncodeRows(v_host_.data(), n_rows, v_stage);
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
  if (s.policy->ReusesPrefix()) {
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
    const size_t dst = (static_cast<size_t>(g) * stride_ + pos) * hd;
    backend_.CopyRows(k_rows_.data() + dst, hd, k_att + g * hd, kvd, rows, hd);
    backend_.CopyRows(v_rows_.data() + dst, hd, v_att + g * hd, kvd, rows, hd);
    if (layout_.half_rows) {
      // The stored fp16 rows themselves (the values k_att decoded), moved
      // as float pairs: head_dim is even.
      const int w = hd / 2;
      backend_.CopyRows(reinterpret_cast<float*>(k_rows_half_.data() + dst),
                        w, reinterpret_cast<const float*>(k_stored + g * hd),
                        kvd / 2, rows, w);
      backend_.CopyRows(reinterpret_cast<float*>(v_rows_half_.data() + dst),
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
    probs = prefill_probs_.data();
    std::fill(prefill_probs_host_.begin(),
              prefill_probs_host_.begin() + prob_values, 0.0f);
    backend_.CopyFromHost(probs, prefill_probs_host_.data(),
                          prob_values * sizeof(float), backend_.MarkIssued());
  }
  if (layout_.half_rows) {
    QueueAttention(backend_, c_, q, nullptr, nullptr, stride_, rows, pos + 1,
                   c_.AttentionWindow(layer), out, nullptr,
                   k_rows_half_.data(), v_rows_half_.data());
  } else {
    QueueAttention(backend_, c_, q, k_rows_.data(), v_rows_.data(), stride_,
                   rows, pos + 1, c_.AttentionWindow(layer), out, probs);
  }
  if (probs != nullptr) {
    IG_RETURN_IF_ERROR(backend_.CopyToHost(prefill_probs_host_.data(), probs,
                                           prob_values * sizeof(float)));
  }
  s.policy->ObservePrefill(layer, observes ? q_host_.data() : nullptr,
                           observes ? k_host_.data() : nullptr, rows, pos,
                           probs != nullptr ? prefill_probs_host_.data()
                                            : nullptr);
  // Summaries of the whole blocks this sequence will share.
  if (!s.block_state.empty()) {
    const int block = options_.kv.prefix_block_tokens;
    const size_t per_block = static_cast<size_t>(c_.n_layers) * state_floats_;
    const size_t blocks = s.block_state.size() / per_block;
    for (int i = 0; i < rows;) {
      const int b = (pos + i) / block - s.annotated_first;
      const int run = std::min(rows - i, (b + s.annotated_first + 1) * block -
                                             (pos + i));
      if (b >= 0 && static_cast<size_t>(b) < blocks) {
        s.policy->SummarizePrefill(
            layer, q_host_.data() + static_cast<size_t>(i) * c_.q_dim(),
            k_host_.data() + static_cast<size_t>(i) * kvd, run,
            &s.block_state[b * per_block +
                           static_cast<size_t>(layer) * state_floats_]);
      }
      i += run;
    }
  }
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::EndPrefillLayer(int layer) {
  Sequence& s = sequences_[prefill_slot_];
  const int n = prefill_tokens_ - prefill_first_;
  const size_t at = static_cast<size_t>(prefill_first_) * c_.n_kv_heads *
                    layout_.row_width;
  // With the last layer, the summaries of the blocks to share.
  std::vector<std::string> meta;
  if (layer + 1 == c_.n_layers && !s.block_state.empty()) {
    const size_t per_block = static_cast<size_t>(c_.n_layers) * state_floats_;
    for (size_t b = 0; b < s.block_state.size() / per_block; ++b) {
      meta.emplace_back(
          reinterpret_cast<const char*>(&s.block_state[b * per_block]),
          per_block * sizeof(float));
    }
  }
  // The rows a device encoded were queued to the stage; the previous
  // layer's append, from the other stage, must be in before the next layer
  // writes there.
  IG_RETURN_IF_ERROR(backend_.Synchronize());
  IG_RETURN_IF_ERROR(WaitPrefillAppend());
  // This layer's rows go to the node on a thread of their own while the
  // next layer computes.
  PrefillAppend& a = prefill_append_;
  a.slot = prefill_slot_;
  a.layer = layer;
  a.first = prefill_first_;
  a.n = n;
  const uint16_t* k = StageRows(k_stage_) + at;
  const uint16_t* v = StageRows(v_stage_) + at;
  a.thread = std::thread([this, &s, &a, k, v, meta = std::move(meta)] {
    a.status = AppendRows(s, a.layer, 1, k, v, a.n, &a.result, &meta,
                          s.annotated_first);
  });
  prefill_stage_ ^= 1;
  return s.policy->FinishPrefillLayer(layer, prefill_tokens_, k_rows_.data(),
                                      stride_);
}

absl::Status OffloadedKvCache::WaitPrefillAppend() {
  PrefillAppend& a = prefill_append_;
  if (!a.thread.joinable()) return absl::OkStatus();
  const auto t0 = std::chrono::steady_clock::now();
  a.thread.join();
  sequences_[a.slot].stats.prefill_append_wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  if (!a.status.ok()) return a.status;
  MarkAppended(sequences_[a.slot], a.layer, 1, a.first, a.n, a.result);
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::EndPrefill() {
  const absl::Status appended = WaitPrefillAppend();
  prefill_slot_ = -1;
  return appended;
}

absl::Status OffloadedKvCache::AppendRows(Sequence& s, int first_layer,
                                          int n_layers, const uint16_t* k,
                                          const uint16_t* v, int n,
                                          AppendResult* result,
                                          const std::vector<std::string>* meta,
                                          int meta_first_block) {
  AppendBlock block;
  if (meta != nullptr && !meta->empty()) {
    block.prefix_meta = *meta;
    block.prefix_meta_first_block = meta_first_block;
  }
  block.first_layer = first_layer;
  block.n_layers = n_layers;
  block.n_tokens = n;
  const size_t size = static_cast<size_t>(n_layers) * n * c_.n_kv_heads *
                      layout_.row_width;
  block.k = absl::MakeConstSpan(k, size);
  block.v = absl::MakeConstSpan(v, size);
  absl::StatusOr<AppendResult> appended =
      options_.kv.kv_client->Append(s.seq, block);
  if (!appended.ok()) return AtNode(appended.status());
  *result = *std::move(appended);
  return absl::OkStatus();
}

void OffloadedKvCache::MarkAppended(Sequence& s, int first_layer,
                                    int n_layers, int first, int n,
                                    const AppendResult& result) {
  // The new positions are present; then drop what the pool evicted.
  for (int l = first_layer; l < first_layer + n_layers; ++l) {
    for (int g = 0; g < c_.n_kv_heads; ++g) {
      uint8_t* pr =
          &s.present[(static_cast<size_t>(l) * c_.n_kv_heads + g) * max_seq_];
      std::fill(pr + first, pr + first + n, 1);
    }
    s.present_count[l] += static_cast<long>(n) * c_.n_kv_heads;
  }
  for (const auto& e : result.evicted) {
    uint8_t& pr =
        s.present[(static_cast<size_t>(e.layer) * c_.n_kv_heads + e.kv_head) *
                      max_seq_ +
                  e.position];
    if (pr) {
      pr = 0;
      --s.present_count[e.layer];
    }
  }
}

}  // namespace offloaded
}  // namespace infinigen::gpu_worker
