#include "gpu_worker/kv/offloaded/row_source.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <numeric>

#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/status.h"
#include "gpu_worker/kv/offloaded/row_cache.h"

namespace infinigen::gpu_worker {
namespace offloaded {
namespace {

using kv_memory_service::SequenceId;
using PlanKind = LayerFetch::PlanKind;

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
      .count();
}

absl::Status AtNode(const RowSourceContext& ctx, const absl::Status& status) {
  return kv_memory_service::AtNode(ctx.node_address, status);
}

// Waits for the node's gather into `f`'s buffer, timed into `stats`.
absl::Status WaitGather(const RowSourceContext& ctx, LayerFetch& f,
                        FetchStats& stats) {
  const auto t0 = std::chrono::steady_clock::now();
  const absl::Status fetched = f.handle.Wait();
  stats.wait_seconds += SecondsSince(t0);
  return AtNode(ctx, fetched);
}

// Waits for whatever holds either buffer (the step's last gathers and
// notes).
absl::Status WaitBoth(const RowSourceContext& ctx, FetchPair& fetches) {
  for (LayerFetch& f : fetches) {
    IG_RETURN_IF_ERROR(AtNode(ctx, f.handle.Wait()));
  }
  return absl::OkStatus();
}

// The plan's indices on the host where they stayed on the backend, or
// written out where the plan was leading (the node's gather needs them),
// the layer's note then left to the gather.
absl::Status PlanToHost(const RowSourceContext& ctx, LayerFetch& f,
                        int layer, BackendNotes& notes) {
  kv_memory_service::OwnedFetchPlan& plan = f.plan;
  const PlanKind kind = f.kind;
  f.kind = PlanKind::kIndices;
  if (kind == PlanKind::kIndices) return absl::OkStatus();
  plan.indices.resize(plan.head_offsets.back());
  if (kind == PlanKind::kLeading) {
    for (size_t g = 0; g + 1 < plan.head_offsets.size(); ++g) {
      std::iota(plan.indices.begin() + plan.head_offsets[g],
                plan.indices.begin() + plan.head_offsets[g + 1], 0);
    }
    return absl::OkStatus();
  }
  notes.Drop(layer);
  return ctx.backend->CopyToHost(plan.indices.data(), f.plan_dev.data(),
                                 plan.indices.size() * sizeof(int32_t));
}

class NodeGatherSource final : public RowSource {
 public:
  NodeGatherSource(const RowSourceContext& ctx, SequenceId seq)
      : ctx_(ctx), seq_(seq) {}
  bool one_sided() const override { return false; }

  absl::Status Issue(LayerFetch& f, int layer, int position,
                     FetchStats& stats) override {
    f.one_sided = false;
    // A note of one-sided reads may still hold the buffer (they ended).
    IG_RETURN_IF_ERROR(AtNode(ctx_, f.handle.Wait()));
    f.handle = ctx_.client->FetchAsync(seq_, layer, f.plan.view(),
                                       f.buffer.get());
    return absl::OkStatus();
  }

  absl::StatusOr<bool> Upload(FetchPair& fetches, int layer,
                              FetchStats& stats) override {
    LayerFetch& f = fetches.For(layer);
    IG_RETURN_IF_ERROR(WaitGather(ctx_, f, stats));
    const Layout& z = *ctx_.layout;
    if (z.staged) {
      // K rows of every head, then V rows, as stored.
      const size_t values = 2 * f.plan.indices.size() * z.row_width;
      ctx_.backend->CopyFromHost(f.staged.data(), f.buffer->data(),
                                 values * sizeof(uint16_t), f.staged_free);
      f.UploadOffsets(*ctx_.backend, z.plan_room);
    }
    f.uploaded = true;
    return true;
  }

  absl::Status Attend(LayerFetch& f, int layer,
                      const RowAttention& a) override {
    ctx_.attention->Gathered(f, a);
    return absl::OkStatus();
  }

 private:
  const RowSourceContext& ctx_;
  const SequenceId seq_;
};

// A device's row cache slots: the K and V slot arrays in its memory, and,
// per fetch buffer, the slots of its plan's rows and of its misses on
// their way there. The misses are staged, then moved into their slots on
// the device (Backend::ScatterRows); attention reads each planned row from
// its slot, or a skipped head's from the staging (FetchedAttention::
// FromSlots). One per sequence, owned by its CachedGatherSource.
class DeviceSlots {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceSlots>> Make(
      const RowSourceContext& ctx, long slot_rows) {
    auto d = std::unique_ptr<DeviceSlots>(new DeviceSlots(ctx, slot_rows));
    const size_t values =
        static_cast<size_t>(std::max(1L, slot_rows)) * ctx.layout->row_width;
    IG_ASSIGN_OR_RETURN(d->k_, DeviceBuffer<uint16_t>::Make(
                                   ctx.backend, values, "row cache K slots"));
    IG_ASSIGN_OR_RETURN(d->v_, DeviceBuffer<uint16_t>::Make(
                                   ctx.backend, values, "row cache V slots"));
    const size_t room = std::max<size_t>(1, 2 * ctx.layout->plan_rows);
    for (int i = 0; i < 2; ++i) {
      IG_ASSIGN_OR_RETURN(d->where_[i], DeviceBuffer<int32_t>::Make(
                                            ctx.backend, room,
                                            "row cache slot indices"));
      d->where_host_[i].assign(room, 0);
      // Pinned, the copies run asynchronously; pageable, they still copy.
      d->pinned_[i] = ctx.backend
                          ->PinHost(d->where_host_[i].data(),
                                    room * sizeof(int32_t))
                          .ok();
    }
    return d;
  }
  ~DeviceSlots() {
    // The copies out of the pinned indices have read them (an error is
    // the backend's, sticky, and reported by its next call).
    if (pinned_[0] || pinned_[1]) ctx_.backend->WaitCopies().IgnoreError();
    for (int i = 0; i < 2; ++i) {
      if (pinned_[i]) ctx_.backend->UnpinHost(where_host_[i].data());
    }
  }

  // `layer`'s misses (fetched into f's buffer, split by `cache`) staged and
  // moved into their slots, and the plan's slots uploaded with its head
  // offsets.
  absl::Status Upload(LayerFetch& f, const RowCache& cache, int layer) {
    Backend& b = *ctx_.backend;
    const int width = ctx_.layout->row_width;
    const size_t rows = f.rows();
    const size_t misses = cache.misses(layer).indices.size();
    // The host copy of this buffer's slots was last read by a copy issued
    // two layers back.
    IG_RETURN_IF_ERROR(b.WaitCopies());
    std::vector<int32_t>& host = where_host_[layer & 1];
    cache.SlotsOf(layer, host.data(), host.data() + rows);
    int32_t* dev = where_[layer & 1].data();
    b.CopyFromHost(dev, host.data(), (rows + misses) * sizeof(int32_t),
                   f.staged_free);
    b.CopyFromHost(f.staged.data(), f.buffer->data(),
                   2 * misses * width * sizeof(uint16_t), f.staged_free);
    f.UploadOffsets(b, ctx_.layout->plan_room);
    ScatterRowsParams p;
    p.k_rows = f.staged.data();
    p.v_rows = f.staged.data() + misses * width;
    p.slots = dev + rows;
    p.n_rows = static_cast<long>(misses);
    p.row_width = width;
    p.slot_k = k_.data();
    p.slot_v = v_.data();
    p.slot_rows = slot_rows_;
    b.ScatterRows(p);
    at_[layer & 1] = SlotRowsAt{k_.data(), v_.data(), slot_rows_, dev,
                                static_cast<long>(misses)};
    return absl::OkStatus();
  }
  // Where `layer`'s rows lie once uploaded.
  const SlotRowsAt& At(int layer) const { return at_[layer & 1]; }

 private:
  DeviceSlots(const RowSourceContext& ctx, long slot_rows)
      : ctx_(ctx), slot_rows_(std::max(1L, slot_rows)) {}

  const RowSourceContext& ctx_;
  const long slot_rows_;
  DeviceBuffer<uint16_t> k_, v_;  // [slot_rows_][row_width]
  // Per fetch buffer: [plan rows] each row's slot, then [misses] each
  // miss's (RowCache::SlotsOf).
  std::array<DeviceBuffer<int32_t>, 2> where_;
  std::array<std::vector<int32_t>, 2> where_host_;
  std::array<bool, 2> pinned_ = {false, false};
  std::array<SlotRowsAt, 2> at_;
};

// The node gathers the rows the sequence's row cache does not hold; they
// land in the cache's slots, and attention reads every planned row from
// there, in plan order (RowCache): on a host backend where the cache keeps
// them, on a device in its memory (DeviceSlots). The node hears of the
// rows held through the idle fetch buffer (KvClient::NoteHeldAsync), where
// its data plane takes such notes.
class CachedGatherSource final : public RowSource {
 public:
  // On a device (a staged layout) Make gives it its DeviceSlots.
  CachedGatherSource(const RowSourceContext& ctx, SequenceId seq)
      : ctx_(ctx),
        seq_(seq),
        cache_(ctx.config->n_layers, ctx.config->n_kv_heads, ctx.max_seq_len,
               ctx.layout->row_width, ctx.layout->row_cache,
               ctx.layout->row_cache_replacement,
               /*hold_rows=*/!ctx.layout->staged),
        heads_(ctx.config->n_kv_heads),
        split_(ctx.config->n_layers, 0) {}
  static absl::StatusOr<std::unique_ptr<CachedGatherSource>> Make(
      const RowSourceContext& ctx, SequenceId seq) {
    auto source = std::make_unique<CachedGatherSource>(ctx, seq);
    if (ctx.layout->staged) {
      IG_ASSIGN_OR_RETURN(source->device_,
                          DeviceSlots::Make(ctx, source->cache_.max_rows()));
    }
    return source;
  }
  bool one_sided() const override { return false; }

  absl::Status Issue(LayerFetch& f, int layer, int position,
                     FetchStats& stats) override {
    f.one_sided = false;
    // The note of the rows held two layers back may still hold the buffer.
    IG_RETURN_IF_ERROR(AtNode(ctx_, f.handle.Wait()));
    IG_ASSIGN_OR_RETURN(const RowCache::Counts counts,
                        cache_.Split(layer, f.plan.view(), position));
    const size_t n_layers = ctx_.config->n_layers;
    for (std::vector<long>* v :
         {&stats.row_cache_layer_lookups, &stats.row_cache_layer_hits,
          &stats.selection_layer_repeats}) {
      if (v->size() < n_layers) v->resize(n_layers, 0);
    }
    const long rows = static_cast<long>(f.rows());
    stats.row_cache_lookups += rows;
    stats.row_cache_hits += counts.hits;
    stats.row_cache_layer_lookups[layer] += rows;
    stats.row_cache_layer_hits[layer] += counts.hits;
    stats.selection_layer_repeats[layer] += counts.repeats;
    f.handle = ctx_.client->FetchAsync(seq_, layer,
                                       cache_.misses(layer).view(),
                                       f.buffer.get());
    split_[layer] = 1;
    return absl::OkStatus();
  }

  absl::StatusOr<bool> Upload(FetchPair& fetches, int layer,
                              FetchStats& stats) override {
    LayerFetch& f = fetches.For(layer);
    IG_RETURN_IF_ERROR(WaitGather(ctx_, f, stats));
    f.uploaded = true;
    const Layout& z = *ctx_.layout;
    // A fetch the cache did not split (a reused prefix's rows, which the
    // prefill reads) is read from the buffer, or the staging, as it came.
    if (!split_[layer]) {
      if (z.staged) {
        ctx_.backend->CopyFromHost(
            f.staged.data(), f.buffer->data(),
            2 * f.plan.indices.size() * z.row_width * sizeof(uint16_t),
            f.staged_free);
        f.UploadOffsets(*ctx_.backend, z.plan_room);
      }
      return true;
    }
    split_[layer] = 0;
    if (device_ != nullptr) {
      IG_RETURN_IF_ERROR(device_->Upload(f, cache_, layer));
    } else {
      cache_.Fill(layer, f.buffer->data());
    }
    const kv_memory_service::OwnedFetchPlan& hits = cache_.hits(layer);
    if (!notes_ || hits.indices.empty()) return true;
    // The rows held were read all the same: the node's statistics and
    // eviction count them as the misses' gather's rows, as they would
    // count them fetched. Only the first
    // note waits, to learn whether the data plane takes notes at all. The
    // buffer is read (by attention over skipped heads) before the note
    // is sent; a note writes nothing into it.
    f.handle =
        ctx_.client->NoteHeldAsync(seq_, layer, hits.view(), f.buffer.get());
    if (!noted_once_) {
      noted_once_ = true;
      const absl::Status noted = f.handle.Wait();
      f.handle = kv_memory_service::FetchHandle();
      if (absl::IsUnimplemented(noted)) {
        notes_ = false;
        IG_LOG(INFO) << "kv cache: the row cache's hits are not noted to the "
                        "node (" << noted.message() << ")";
        return true;
      }
      IG_RETURN_IF_ERROR(AtNode(ctx_, noted));
    }
    return true;
  }

  absl::Status Attend(LayerFetch& f, int layer,
                      const RowAttention& a) override {
    if (device_ != nullptr) {
      // MakeLayout gives a device a row cache where no probabilities are
      // wanted, which the backend's staged attention then reads by slot.
      if (!ctx_.attention->FromSlots(f, device_->At(layer), a)) {
        return absl::InternalError(
            "kv cache: the backend refused to attend over the row cache's "
            "slots");
      }
      return absl::OkStatus();
    }
    for (int g = 0; g < ctx_.config->n_kv_heads; ++g) {
      const RowCache::HeadRows h = cache_.Head(layer, g, f.buffer->data());
      heads_[g] = HeadRowsAt{h.k, h.v, h.indices};
    }
    // MakeRowSource made sure the backend attends over stored rows.
    if (!ctx_.attention->InPlace(f, heads_, a)) {
      return absl::InternalError(
          "kv cache: the backend refused to attend over the row cache");
    }
    return absl::OkStatus();
  }

  absl::Status EndStep(FetchPair& fetches, FetchStats& stats) override {
    IG_RETURN_IF_ERROR(WaitBoth(ctx_, fetches));
    stats.row_cache_bytes = cache_.bytes();
    return absl::OkStatus();
  }

 private:
  const RowSourceContext& ctx_;
  const SequenceId seq_;
  RowCache cache_;
  std::unique_ptr<DeviceSlots> device_;  // on a device
  std::vector<HeadRowsAt> heads_;
  std::vector<char> split_;  // [layer]: its fetch in flight is the misses
  bool notes_ = true;        // the node takes notes, as far as known
  bool noted_once_ = false;  // the first note was waited for
};

// What both one-sided sources do: check each plan against the rows, note
// each read to the node, unpin the rows (a device's) at the end.
class OneSidedSource : public RowSource {
 public:
  OneSidedSource(const RowSourceContext& ctx, SequenceId seq,
                 const kv_memory_service::DirectRows& rows, bool pinned)
      : ctx_(ctx), seq_(seq), rows_(rows), pinned_(pinned) {}
  ~OneSidedSource() override {
    if (!pinned_) return;
    ctx_.backend->UnpinHost(const_cast<uint16_t*>(rows_.k));
    ctx_.backend->UnpinHost(const_cast<uint16_t*>(rows_.v));
  }
  bool one_sided() const override { return true; }

  absl::Status Issue(LayerFetch& f, int layer, int position,
                     FetchStats& stats) override {
    // Read before the node checks the plan (its note is waited for
    // later): every index must lie within the sequence's rows.
    f.one_sided = true;
    IG_RETURN_IF_ERROR(CheckPlan(f, layer, position));
    stats.rows_read_in_place += static_cast<long>(f.rows());
    return absl::OkStatus();
  }

  absl::StatusOr<bool> Upload(FetchPair& fetches, int layer,
                              FetchStats& stats) override {
    LayerFetch& f = fetches.For(layer);
    f.one_sided = false;
    const auto t0 = std::chrono::steady_clock::now();
    if (!Read(f, layer)) return false;
    if (f.kind == PlanKind::kOnBackend) {
      f.uploaded = true;  // noted with the step's appends
      return true;
    }
    // The node learns of the fetch (statistics, eviction candidates) and
    // checks that every position was at its own slot; the note goes out
    // through the idle fetch buffer and is waited for when the buffer is
    // next needed (two layers on) or at the step's end.
    const absl::Status noted = f.handle.Wait();
    stats.wait_seconds += SecondsSince(t0);
    IG_RETURN_IF_ERROR(AtNode(ctx_, noted));
    f.handle = f.kind == PlanKind::kLeading
                   ? ctx_.client->NoteLeadingFetchedAsync(
                         seq_, layer, f.plan.head_offsets, f.buffer.get())
                   : ctx_.client->NoteFetchedAsync(seq_, layer, f.plan.view(),
                                                   f.buffer.get());
    f.uploaded = true;
    return true;
  }

  absl::Status HandOff(FetchPair& fetches, int layer, BackendNotes& notes,
                       FetchStats& stats) override {
    const bool next_planned = fetches.For(layer + 1).one_sided;
    for (int l : {layer, layer + 1}) {
      if (l != layer && !next_planned) continue;
      LayerFetch& f = fetches.For(l);
      f.one_sided = false;
      IG_RETURN_IF_ERROR(PlanToHost(ctx_, f, l, notes));
      stats.rows_read_in_place -= static_cast<long>(f.rows());
      IG_RETURN_IF_ERROR(AtNode(ctx_, f.handle.Wait()));
      f.handle = ctx_.client->FetchAsync(seq_, l, f.plan.view(),
                                         f.buffer.get());
    }
    return absl::OkStatus();
  }

  absl::Status EndStep(FetchPair& fetches, FetchStats& stats) override {
    return WaitBoth(ctx_, fetches);  // the step's last notes
  }

 protected:
  // Makes the plan's rows readable where the source's attention reads
  // them; false where the backend cannot.
  virtual bool Read(LayerFetch& f, int layer) = 0;

  const RowSourceContext& ctx_;
  const SequenceId seq_;
  const kv_memory_service::DirectRows rows_;

 private:
  absl::Status CheckPlan(const LayerFetch& f, int layer, int position) const {
    const int max_tokens = rows_.max_tokens;
    // A plan made on the backend, or a leading one, names positions below
    // `position` only.
    if (f.kind != PlanKind::kIndices) {
      if (position <= max_tokens) return absl::OkStatus();
      return absl::InternalError(absl::StrFormat(
          "kv cache: layer %d's plan (%s) is for position %d, beyond the %d "
          "rows a head holds",
          layer,
          f.kind == PlanKind::kLeading ? "every row" : "made on the backend",
          position, max_tokens));
    }
    // The least and greatest position tell (a loop the compiler
    // vectorizes); the offender is looked up only to name it.
    const std::vector<int32_t>& indices = f.plan.indices;
    int32_t lo = 0, hi = 0;
    for (const int32_t p : indices) {
      lo = p < lo ? p : lo;
      hi = p > hi ? p : hi;
    }
    if (lo >= 0 && hi < max_tokens) return absl::OkStatus();
    for (const int32_t p : indices) {
      if (p < 0 || p >= max_tokens) {
        return absl::InternalError(absl::StrFormat(
            "kv cache: policy %s planned position %d of layer %d, outside "
            "the %d rows a head holds",
            ctx_.policy_name, p, layer, max_tokens));
      }
    }
    return absl::OkStatus();  // unreachable: lo or hi was out of range
  }

  const bool pinned_;
};

// The device reads each plan's rows from the node's memory into the
// fetch's staging.
class DeviceGatherSource final : public OneSidedSource {
 public:
  using OneSidedSource::OneSidedSource;

  absl::Status Attend(LayerFetch& f, int layer,
                      const RowAttention& a) override {
    ctx_.attention->Gathered(f, a);
    return absl::OkStatus();
  }

 private:
  bool Read(LayerFetch& f, int layer) override {
    const size_t n = f.rows();
    const size_t room = ctx_.layout->plan_room;
    // The plan reaches the device on the copy queue once the rows the
    // staging last held (and so this plan buffer's last reader) were used;
    // indices made on the backend are there already. Through the pinned
    // plan_host, laid out as plan_dev (the last copy out of it has
    // finished: the fetch was issued after the copies).
    int32_t* indices = f.plan_dev.data();
    int32_t* offsets = indices + room;
    if (n > 0 && f.kind == PlanKind::kIndices) {
      int32_t* host = f.plan_host.data();
      std::memcpy(host, f.plan.indices.data(), n * sizeof(int32_t));
      ctx_.backend->CopyFromHost(indices, host, n * sizeof(int32_t),
                                 f.staged_free);
    }
    f.UploadOffsets(*ctx_.backend, room);
    if (n == 0) return true;  // nothing to read
    const size_t at = static_cast<size_t>(layer) * rows_.layer_values;
    GatherRowsParams p;
    p.k_rows = rows_.k + at;
    p.v_rows = rows_.v + at;
    p.head_stride = rows_.max_tokens;
    // Null: each head's leading rows.
    p.indices = f.kind == PlanKind::kLeading ? nullptr : indices;
    p.head_offsets = offsets;
    p.n_heads = ctx_.config->n_kv_heads;
    p.n_rows = static_cast<long>(n);
    p.row_bytes =
        ctx_.layout->row_width * static_cast<int>(sizeof(uint16_t));
    p.out = f.staged.data();
    return ctx_.backend->GatherRows(p);
  }
};

// A host backend's attention reads the node's rows where they lie.
class InPlaceSource final : public OneSidedSource {
 public:
  using OneSidedSource::OneSidedSource;

  absl::Status Attend(LayerFetch& f, int layer,
                      const RowAttention& a) override {
    const size_t at = static_cast<size_t>(layer) * rows_.layer_values;
    StoredRowsAt where;
    where.k = rows_.k + at;
    where.v = rows_.v + at;
    where.head_values =
        static_cast<size_t>(rows_.max_tokens) * ctx_.layout->row_width;
    // A leading plan's rows are the head's first: no indices.
    where.by_index = f.kind != PlanKind::kLeading;
    // MakeRowSource made sure the backend reads the node's rows in place.
    if (!ctx_.attention->InPlace(f, where, a)) {
      return absl::InternalError(
          "kv cache: the backend refused to attend over the node's rows in "
          "place");
    }
    return absl::OkStatus();
  }

 private:
  bool Read(LayerFetch& f, int layer) override { return true; }
};

// Whether a host backend's attention reads stored rows of `format` by
// index where they lie: one new row and no stored one, the backend
// answers for the format and for rows read by index, touching nothing of
// the node.
bool AttendsNodeRows(const RowSourceContext& ctx, KvRowFormat format) {
  const int hd = ctx.config->head_dim;
  std::vector<float> q(hd, 0.0f), row(hd, 0.0f), out(hd);
  const int32_t no_index = 0;
  StoredRowsAttention p;
  p.q = q.data();
  p.k_new = p.v_new = row.data();
  p.out = out.data();
  p.group = 1;
  p.count = 0;
  p.head_dim = hd;
  p.row_width = ctx.layout->row_width;
  p.format = format;
  p.indices = &no_index;
  return ctx.backend->AttendStoredRows(p);
}

}  // namespace

absl::Status BackendNotes::Allocate(Backend& backend, int n_layers,
                                    size_t rows, bool& pin_warned) {
  rows_ = rows;
  indices_.assign(static_cast<size_t>(n_layers) * rows, 0);
  offsets_.assign(n_layers, {});
  layers_.reserve(n_layers);
  const absl::Status pinned =
      backend.PinHost(indices_.data(), indices_.size() * sizeof(int32_t));
  if (!pinned.ok() && !pin_warned) {
    IG_LOG(WARNING) << "engine: plan notes stay pageable (copies run "
                       "slower): "
                    << pinned.message();
    pin_warned = true;
  }
  return absl::OkStatus();
}

void BackendNotes::Release(Backend& backend) {
  if (!indices_.empty()) backend.UnpinHost(indices_.data());
}

void BackendNotes::Queue(Backend& backend, int layer, const int32_t* indices,
                         const std::vector<int32_t>& head_offsets) {
  backend.QueueCopyToHost(indices_.data() + static_cast<size_t>(layer) * rows_,
                          indices, head_offsets.back() * sizeof(int32_t));
  offsets_[layer] = head_offsets;
  layers_.push_back(layer);
}

void BackendNotes::Drop(int layer) {
  layers_.erase(std::remove(layers_.begin(), layers_.end(), layer),
                layers_.end());
}

absl::Status BackendNotes::Send(const RowSourceContext& ctx, SequenceId seq,
                                FetchPair& fetches) {
  for (const int layer : layers_) {
    const std::vector<int32_t>& offsets = offsets_[layer];
    kv_memory_service::FetchPlan plan;
    plan.indices = absl::MakeConstSpan(
        indices_.data() + static_cast<size_t>(layer) * rows_, offsets.back());
    plan.head_offsets = offsets;
    // Each fetch buffer carries one note at a time.
    LayerFetch& f = fetches.For(layer);
    IG_RETURN_IF_ERROR(AtNode(ctx, f.handle.Wait()));
    f.handle = ctx.client->NoteFetchedAsync(seq, layer, plan, f.buffer.get());
  }
  layers_.clear();
  return absl::OkStatus();
}

std::unique_ptr<RowSource> NodeGather(const RowSourceContext& ctx,
                                      SequenceId seq) {
  return std::make_unique<NodeGatherSource>(ctx, seq);
}

std::unique_ptr<RowSource> MakeRowSource(const RowSourceContext& ctx,
                                         SequenceId seq,
                                         bool one_sided_allowed,
                                         KvRowFormat format,
                                         bool& refusal_logged) {
  const bool staged = ctx.layout->staged;
  const bool attends_stored = !staged && AttendsNodeRows(ctx, format);
  // The node's gather, through the row cache where there is one: a host
  // backend's attention reads its rows in place, a device's by slot.
  auto gather = [&]() -> std::unique_ptr<RowSource> {
    if (ctx.layout->row_cache > 0 && (attends_stored || staged)) {
      absl::StatusOr<std::unique_ptr<CachedGatherSource>> cached =
          CachedGatherSource::Make(ctx, seq);
      if (cached.ok()) return *std::move(cached);
      IG_LOG(WARNING) << "kv cache: no row cache for this sequence: "
                      << cached.status().message();
    }
    return NodeGather(ctx, seq);
  };
  if (!one_sided_allowed || (!staged && !attends_stored)) return gather();
  absl::StatusOr<kv_memory_service::DirectRows> rows =
      ctx.client->GetDirectRows(seq);
  if (!rows.ok()) {
    // A node elsewhere, or rows it does not share: the node gathers.
    if (!refusal_logged) {
      IG_LOG(INFO) << "kv cache: --kv_direct_reads: the node gathers instead ("
                   << rows.status().message() << ")";
      refusal_logged = true;
    }
    return gather();
  }
  const size_t bytes = static_cast<size_t>(ctx.config->n_layers) *
                       rows->layer_values * sizeof(uint16_t);
  // The rows never move while the sequence is open; PinHost takes them
  // read-only in effect (nothing here writes through them).
  auto* k = const_cast<uint16_t*>(rows->k);
  auto* v = const_cast<uint16_t*>(rows->v);
  absl::Status pinned = ctx.backend->PinHost(k, bytes);
  if (pinned.ok()) {
    pinned = ctx.backend->PinHost(v, bytes);
    if (!pinned.ok()) ctx.backend->UnpinHost(k);
  }
  if (!pinned.ok()) {
    IG_LOG(WARNING) << "kv cache: the node's rows could not be pinned for "
                       "one-sided reads; the node gathers them: "
                    << pinned.message();
    return gather();
  }
  if (staged) {
    return std::make_unique<DeviceGatherSource>(ctx, seq, *rows, true);
  }
  return std::make_unique<InPlaceSource>(ctx, seq, *rows, true);
}

}  // namespace offloaded
}  // namespace infinigen::gpu_worker
