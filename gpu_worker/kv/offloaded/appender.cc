#include "gpu_worker/kv/offloaded/appender.h"

#include <chrono>
#include <utility>

namespace infinigen::gpu_worker {
namespace offloaded {

absl::StatusOr<kv_memory_service::AppendResult> AppendRows(
    kv_memory_service::KvClient& client, kv_memory_service::SequenceId seq,
    int n_kv_heads, int row_width, int first_layer, int n_layers,
    const uint16_t* k, const uint16_t* v, int n,
    const std::vector<std::string>* meta, int meta_first_block) {
  kv_memory_service::AppendBlock block;
  if (meta != nullptr && !meta->empty()) {
    block.prefix_meta = *meta;
    block.prefix_meta_first_block = meta_first_block;
  }
  block.first_layer = first_layer;
  block.n_layers = n_layers;
  block.n_tokens = n;
  const size_t size =
      static_cast<size_t>(n_layers) * n * n_kv_heads * row_width;
  block.k = absl::MakeConstSpan(k, size);
  block.v = absl::MakeConstSpan(v, size);
  absl::StatusOr<kv_memory_service::AppendResult> appended =
      client.Append(seq, block);
  if (!appended.ok()) {
    return kv_memory_service::AtNode(client.address(), appended.status());
  }
  return appended;
}

Appender::Appender(std::function<absl::Status(int slot)> append,
                   size_t max_slots)
    : append_(std::move(append)) {
  statuses_.reserve(max_slots);
  {
    absl::MutexLock lock(&mu_);
    slots_.reserve(max_slots);
  }
  thread_ = std::thread([this] { Loop(); });
}

Appender::~Appender() {
  Finish([](int, const absl::Status&) {}).IgnoreError();
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void Appender::Loop() {
  std::vector<int> slots;
  slots.reserve(statuses_.capacity());
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](Appender* a) ABSL_EXCLUSIVE_LOCKS_REQUIRED(a->mu_) {
            return a->stopping_ || (a->pending_ && !a->done_);
          },
          this));
      if (stopping_) return;
      slots.assign(slots_.begin(), slots_.end());
    }
    // Nobody reads statuses_ until done_.
    statuses_.clear();
    for (int slot : slots) statuses_.push_back(append_(slot));
    absl::MutexLock lock(&mu_);
    done_ = true;
  }
}

void Appender::Start(absl::Span<const int> slots) {
  absl::MutexLock lock(&mu_);
  slots_.assign(slots.begin(), slots.end());
  pending_ = true;
  done_ = false;
}

absl::Status Appender::Finish(
    absl::FunctionRef<void(int slot, const absl::Status& status)> done) {
  std::vector<int> slots;
  {
    absl::MutexLock lock(&mu_);
    if (!pending_) return absl::OkStatus();
    mu_.Await(absl::Condition(&done_));
    pending_ = false;
    slots.swap(slots_);
  }
  absl::Status first;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (!statuses_[i].ok() && first.ok()) first = statuses_[i];
    done(slots[i], statuses_[i]);
  }
  absl::MutexLock lock(&mu_);
  slots_.swap(slots);  // keep the capacity
  return first;
}

void LayerAppend::Start(std::function<absl::Status()> append) {
  thread_ = std::thread(
      [this, append = std::move(append)] { status_ = append(); });
}

absl::Status LayerAppend::Wait(double* waited) {
  if (!thread_.joinable()) return absl::OkStatus();
  const auto t0 = std::chrono::steady_clock::now();
  thread_.join();
  if (waited != nullptr) {
    *waited +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count();
  }
  return std::move(status_);
}

}  // namespace offloaded
}  // namespace infinigen::gpu_worker
