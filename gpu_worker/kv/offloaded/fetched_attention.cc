#include "gpu_worker/kv/offloaded/fetched_attention.h"

#include <algorithm>
#include <cmath>

#include "common/status.h"

namespace infinigen::gpu_worker {
namespace offloaded {

absl::Status DecodedRows::Allocate(Backend& backend,
                                   const model::ModelConfig& c,
                                   const Layout& layout) {
  const size_t values = static_cast<size_t>(c.n_kv_heads) * stride *
                        c.head_dim;
  IG_ASSIGN_OR_RETURN(k, DeviceBuffer<float>::Make(&backend, values,
                                                   "decoded K rows"));
  IG_ASSIGN_OR_RETURN(v, DeviceBuffer<float>::Make(&backend, values,
                                                   "decoded V rows"));
  if (layout.half_rows) {
    IG_ASSIGN_OR_RETURN(k_half, DeviceBuffer<uint16_t>::Make(
                                    &backend, values, "fp16 K rows"));
    IG_ASSIGN_OR_RETURN(v_half, DeviceBuffer<uint16_t>::Make(
                                    &backend, values, "fp16 V rows"));
  }
  return absl::OkStatus();
}

bool FetchedAttention::InPlace(const LayerFetch& f, const StoredRowsAt& at,
                               const RowAttention& a) {
  const kv_memory_service::OwnedFetchPlan& plan = f.plan;
  const int width = layout_.row_width;
  for (int g = 0; g < c_.n_kv_heads; ++g) {
    const int begin = plan.head_offsets[g];
    HeadRowsAt h;
    if (at.head_values > 0) {
      h.k = at.k + g * at.head_values;
      h.v = at.v + g * at.head_values;
      if (at.by_index) h.indices = plan.indices.data() + begin;
    } else {
      h.k = at.k + static_cast<size_t>(begin) * width;
      h.v = at.v + static_cast<size_t>(begin) * width;
    }
    // The format is the same for every head: the first answer holds.
    if (!AttendHead(f, g, h, a)) return false;
  }
  return true;
}

bool FetchedAttention::InPlace(const LayerFetch& f,
                               absl::Span<const HeadRowsAt> heads,
                               const RowAttention& a) {
  for (int g = 0; g < c_.n_kv_heads; ++g) {
    if (!AttendHead(f, g, heads[g], a)) return false;
  }
  return true;
}

bool FetchedAttention::AttendHead(const LayerFetch& f, int g,
                                  const HeadRowsAt& h, const RowAttention& a) {
  const int hd = c_.head_dim, group = c_.n_heads / c_.n_kv_heads;
  const kv_memory_service::OwnedFetchPlan& plan = f.plan;
  StoredRowsAttention p;
  p.q = a.q + static_cast<size_t>(g) * group * hd;
  p.k = h.k;
  p.v = h.v;
  p.indices = h.indices;
  p.k_new = a.k_new + static_cast<size_t>(g) * hd;
  p.v_new = a.v_new + static_cast<size_t>(g) * hd;
  p.out = a.out + static_cast<size_t>(g) * group * hd;
  p.group = group;
  p.count = plan.head_offsets[g + 1] - plan.head_offsets[g];
  p.head_dim = hd;
  p.row_width = layout_.row_width;
  p.format = a.format;
  p.scale = 1.0f / std::sqrt(static_cast<float>(hd));
  if (a.prob_sums != nullptr) {
    p.prob_sums =
        a.prob_sums + static_cast<size_t>(g) * group * decoded_.stride;
    p.prob_stride = decoded_.stride;
  }
  return backend_.AttendStoredRows(p);
}

bool FetchedAttention::Staged(LayerFetch& f, const RowAttention& a) {
  return StagedOver(f, nullptr, a);
}

bool FetchedAttention::FromSlots(LayerFetch& f, const SlotRowsAt& at,
                                 const RowAttention& a) {
  return StagedOver(f, &at, a);
}

bool FetchedAttention::StagedOver(LayerFetch& f, const SlotRowsAt* at,
                                  const RowAttention& a) {
  if (a.prob_sums != nullptr) return false;
  const std::vector<int32_t>& offsets = f.plan.head_offsets;
  StagedRowsAttention p;
  p.q = a.q;
  p.k_rows = f.staged.data();
  p.rows = offsets.back();
  // The staging holds the plan's rows, or with slots the misses alone.
  const long staged = at != nullptr ? at->staged_rows : p.rows;
  p.v_rows = p.k_rows + staged * layout_.row_width;
  if (at != nullptr) {
    p.slots = at->slots;
    p.slot_k = at->slot_k;
    p.slot_v = at->slot_v;
    p.slot_rows = at->slot_rows;
    p.staged_rows = at->staged_rows;
  }
  p.head_offsets = f.plan_dev.data() + layout_.plan_room;
  p.k_new = a.k_new;
  p.v_new = a.v_new;
  p.out = a.out;
  p.n_heads = c_.n_heads;
  p.n_kv_heads = c_.n_kv_heads;
  p.head_dim = c_.head_dim;
  for (int g = 0; g < c_.n_kv_heads; ++g) {
    p.max_head_rows = std::max(p.max_head_rows, offsets[g + 1] - offsets[g]);
  }
  p.format = a.format;
  p.scale = 1.0f / std::sqrt(static_cast<float>(c_.head_dim));
  if (!backend_.AttendStagedRows(p)) return false;
  f.staged_free = backend_.MarkIssued();
  return true;
}

void FetchedAttention::Decoded(LayerFetch& f, const uint16_t* rows,
                               const RowAttention& a) {
  const int hd = c_.head_dim, group = c_.n_heads / c_.n_kv_heads;
  const kv_memory_service::OwnedFetchPlan& plan = f.plan;
  const int total = plan.head_offsets.back();
  const int width = layout_.row_width;
  const int stride = decoded_.stride;
  const uint16_t* k_rows = rows;
  const uint16_t* v_rows = k_rows + static_cast<size_t>(total) * width;
  // Each KV head's rows, decoded where attention reads them, then the new
  // token's exact (unstored) row.
  for (int g = 0; g < c_.n_kv_heads; ++g) {
    const int begin = plan.head_offsets[g];
    const int count = plan.head_offsets[g + 1] - begin;
    float* kg = decoded_.k.data() + static_cast<size_t>(g) * stride * hd;
    float* vg = decoded_.v.data() + static_cast<size_t>(g) * stride * hd;
    if (count > 0) {
      backend_.DecodeKvRows(k_rows + static_cast<size_t>(begin) * width,
                            count, hd, a.format, kg);
      backend_.DecodeKvRows(v_rows + static_cast<size_t>(begin) * width,
                            count, hd, a.format, vg);
    }
    backend_.Copy(kg + static_cast<size_t>(count) * hd, a.k_new + g * hd, hd);
    backend_.Copy(vg + static_cast<size_t>(count) * hd, a.v_new + g * hd, hd);
  }
  f.staged_free = backend_.MarkIssued();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int g = 0; g < c_.n_kv_heads; ++g) {
    const int count = plan.head_offsets[g + 1] - plan.head_offsets[g];
    float* kg = decoded_.k.data() + static_cast<size_t>(g) * stride * hd;
    float* vg = decoded_.v.data() + static_cast<size_t>(g) * stride * hd;
    for (int h = g * group; h < (g + 1) * group; ++h) {
      AttentionParams p;
      p.q = a.q + h * hd;
      p.k = kg;
      p.v = vg;
      p.out = a.out + h * hd;
      p.n = 1;
      p.n_heads = 1;
      p.n_kv_heads = 1;
      p.head_dim = hd;
      p.kv_stride = stride;
      p.kv_len0 = count + 1;
      p.scale = scale;
      if (a.prob_sums != nullptr) {
        p.prob_sums = a.prob_sums + static_cast<size_t>(h) * stride;
      }
      backend_.Attention(p);
    }
  }
}

void FetchedAttention::Gathered(LayerFetch& f, const RowAttention& a) {
  const uint16_t* rows = f.fetched(layout_.staged);
  if (!layout_.staged) {
    StoredRowsAt at;
    at.k = rows;
    at.v = rows + f.rows() * layout_.row_width;
    if (InPlace(f, at, a)) return;
  } else if (Staged(f, a)) {
    return;
  }
  Decoded(f, rows, a);
}

}  // namespace offloaded
}  // namespace infinigen::gpu_worker
