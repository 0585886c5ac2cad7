#include "gpu_worker/kv/offloaded/prefix_loader.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_format.h"
#include "common/status.h"
#include "kv_memory_service/client/prefix_keys.h"

namespace infinigen::gpu_worker {
namespace offloaded {

PrefixLoader::PrefixLoader(const KvCacheOptions& options,
                           const KvPolicy& policy,
                           const kv_memory_service::SequenceGeometry& geometry,
                           const model::ModelConfig& config,
                           const Layout& layout)
    : block_(options.kv.prefix_block_tokens),
      c_(config),
      layout_(layout),
      geometry_(geometry),
      policy_name_(PolicyName(options.kv.policy->kind)) {
  if (block_ <= 0 || options.kv.model_identity.empty() ||
      !policy.ReusesPrefix()) {
    return;
  }
  // Rows are reusable between workers that store the same bits and read
  // the same summaries: same model, policy, row format and shape.
  identity_ = absl::StrFormat(
      "%s|policy=%s|rank_by_keys=%d|format=%d|layers=%d|kv_heads=%d|"
      "width=%d|dtype=%d",
      options.kv.model_identity, policy_name_,
      options.kv.policy->infinigen.rank_columns_by_keys ? 1 : 0,
      static_cast<int>(policy.row_format()), geometry.n_layers,
      geometry.n_kv_heads, geometry.head_dim, static_cast<int>(geometry.dtype));
  if (policy.prefix_summary() != nullptr) {
    state_floats_ = policy.prefix_summary()->floats();
  }
}

kv_memory_service::PrefixRequest PrefixLoader::Request(
    absl::Span<const int> tokens, bool reuse) const {
  kv_memory_service::PrefixRequest prefix;
  if (!reuse || identity_.empty()) return prefix;
  // Whole blocks only, at least one token left to compute (its logits
  // are the prefill's answer), no more than a layer's fetch holds.
  const int n = static_cast<int>(tokens.size());
  const int per_head = static_cast<int>(layout_.plan_rows) / c_.n_kv_heads;
  const int usable =
      std::min({n - 1, per_head, static_cast<int>(geometry_.max_tokens)});
  if (usable >= block_) {
    const std::vector<int32_t> ids(tokens.begin(),
                                   tokens.begin() + usable / block_ * block_);
    prefix.block_tokens = block_;
    prefix.keys = kv_memory_service::PrefixKeys(identity_, block_, ids);
  }
  return prefix;
}

absl::Status PrefixLoader::Attach(
    const kv_memory_service::OpenedSequence& opened,
    const kv_memory_service::PrefixRequest& request, KvPolicy& policy,
    PrefixState& state) const {
  const int block = block_;
  const int cached = opened.cached_tokens;
  const int blocks = block > 0 ? cached / block : 0;
  const size_t meta_bytes =
      static_cast<size_t>(c_.n_layers) * state_floats_ * sizeof(float);
  if (cached < 0 || cached > static_cast<int>(request.keys.size()) * block ||
      (block > 0 && cached % block != 0)) {
    return absl::InternalError(absl::StrFormat(
        "kv cache: the memory node attached %d cached tokens for %d blocks of "
        "%d", cached, request.keys.size(), block));
  }
  if (static_cast<int>(opened.prefix_meta.size()) != blocks) {
    return absl::InternalError(absl::StrFormat(
        "kv cache: %d attached blocks came with %d annotations", blocks,
        opened.prefix_meta.size()));
  }
  for (const std::string& meta : opened.prefix_meta) {
    if (meta.size() != meta_bytes) {
      return absl::DataLossError(absl::StrFormat(
          "kv cache: a reused prefix block's policy summary has %d bytes, "
          "%s expects %d",
          meta.size(), policy_name_, meta_bytes));
    }
  }
  // The attached blocks' prompt statistics, as if the policy had seen them.
  std::vector<float> summary(static_cast<size_t>(state_floats_));
  for (const std::string& meta : opened.prefix_meta) {
    for (int l = 0; l < c_.n_layers && state_floats_ > 0; ++l) {
      std::memcpy(summary.data(),
                  meta.data() + l * summary.size() * sizeof(float),
                  summary.size() * sizeof(float));
      policy.prefix_summary()->Add(l, summary.data());
    }
  }
  state.cached = cached;
  state.annotated_first = blocks;
  state.block_state.assign(
      state_floats_ > 0 ? (request.keys.size() - blocks) * c_.n_layers *
                              static_cast<size_t>(state_floats_)
                        : 0,
      0.0f);
  return absl::OkStatus();
}

absl::Status PrefixLoader::IssueFetch(kv_memory_service::KvClient& client,
                                      kv_memory_service::SequenceId seq,
                                      const PrefixState& state, int layer,
                                      LayerFetch& f) const {
  f.uploaded = false;
  kv_memory_service::OwnedFetchPlan& plan = f.plan;
  plan.indices.clear();
  plan.head_offsets.assign(1, 0);
  for (int g = 0; g < c_.n_kv_heads; ++g) {
    for (int p = 0; p < state.cached; ++p) plan.indices.push_back(p);
    plan.head_offsets.push_back(static_cast<int32_t>(plan.indices.size()));
  }
  f.handle = client.FetchAsync(seq, layer, plan.view(), f.buffer.get());
  return absl::OkStatus();
}

void PrefixLoader::Load(Backend& backend, const PrefixState& state,
                        const LayerFetch& f, const uint16_t* rows,
                        KvRowFormat format, DecodedRows& decoded) const {
  const int hd = c_.head_dim, width = layout_.row_width;
  const size_t total = f.plan.indices.size();
  const uint16_t* k_rows = rows;
  const uint16_t* v_rows = k_rows + total * width;
  for (int g = 0; g < c_.n_kv_heads; ++g) {
    const size_t begin = f.plan.head_offsets[g];
    const size_t at = static_cast<size_t>(g) * decoded.stride * hd;
    backend.DecodeKvRows(k_rows + begin * width, state.cached, hd, format,
                         decoded.k.data() + at);
    backend.DecodeKvRows(v_rows + begin * width, state.cached, hd, format,
                         decoded.v.data() + at);
    if (layout_.half_rows) {
      // fp16 rows as stored (width == head_dim, even), as float pairs.
      const long values = static_cast<long>(state.cached) * hd / 2;
      backend.Copy(reinterpret_cast<float*>(decoded.k_half.data() + at),
                   reinterpret_cast<const float*>(k_rows + begin * width),
                   values);
      backend.Copy(reinterpret_cast<float*>(decoded.v_half.data() + at),
                   reinterpret_cast<const float*>(v_rows + begin * width),
                   values);
    }
  }
}

absl::Status PrefixLoader::Summarize(KvPolicy& policy, int layer, int pos,
                                     int rows, const float* q, const float* k,
                                     PrefixState& state) const {
  if (state.block_state.empty()) return absl::OkStatus();
  const size_t per_block = static_cast<size_t>(c_.n_layers) * state_floats_;
  const size_t blocks = state.block_state.size() / per_block;
  for (int i = 0; i < rows;) {
    const int b = (pos + i) / block_ - state.annotated_first;
    const int run = std::min(
        rows - i, (b + state.annotated_first + 1) * block_ - (pos + i));
    if (b >= 0 && static_cast<size_t>(b) < blocks) {
      IG_RETURN_IF_ERROR(policy.prefix_summary()->Summarize(
          layer, q + static_cast<size_t>(i) * c_.q_dim(),
          k + static_cast<size_t>(i) * c_.kv_dim(), run,
          &state.block_state[b * per_block +
                             static_cast<size_t>(layer) * state_floats_]));
    }
    i += run;
  }
  return absl::OkStatus();
}

std::vector<std::string> PrefixLoader::BlockMeta(
    const PrefixState& state) const {
  std::vector<std::string> meta;
  if (state.block_state.empty()) return meta;
  const size_t per_block = static_cast<size_t>(c_.n_layers) * state_floats_;
  for (size_t b = 0; b < state.block_state.size() / per_block; ++b) {
    meta.emplace_back(
        reinterpret_cast<const char*>(&state.block_state[b * per_block]),
        per_block * sizeof(float));
  }
  return meta;
}

}  // namespace offloaded
}  // namespace infinigen::gpu_worker
