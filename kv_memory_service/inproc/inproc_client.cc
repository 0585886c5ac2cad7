#include "kv_memory_service/inproc/inproc_client.h"

#include <cstdlib>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/status.h"

namespace infinigen::kv_memory_service {
namespace {

// A fetch buffer in plain host memory, with room for the plan of the fetch
// in flight (kept at its largest capacity: no allocation once warm).
class InprocFetchBuffer final : public FetchBuffer {
 public:
  InprocFetchBuffer(const void* owner, uint16_t* data, size_t size)
      : FetchBuffer(owner, data, size), memory_(data) {}
  ~InprocFetchBuffer() override { std::free(memory_); }

  void Complete(absl::Status status) { CompleteFetch(std::move(status)); }

  // The queued fetch: its sequence, layer and a copy of its plan.
  SequenceId seq = 0;
  int32_t layer = 0;
  std::vector<int32_t> indices;
  std::vector<int32_t> head_offsets;

 private:
  uint16_t* const memory_;
};

class InprocKvClient final : public KvClient {
 public:
  explicit InprocKvClient(std::shared_ptr<KvStore> store)
      : store_(std::move(store)) {}

  ~InprocKvClient() override {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    if (fetcher_.joinable()) fetcher_.join();
  }

  absl::StatusOr<OpenedSequence> OpenSequence(
      const SequenceGeometry& geometry, const PrefixRequest& prefix) override {
    return store_->Open(geometry, 0, prefix);
  }
  absl::StatusOr<AppendResult> Append(SequenceId seq,
                                      const AppendBlock& block) override {
    return store_->Append(seq, block);
  }
  absl::StatusOr<std::unique_ptr<FetchBuffer>> NewFetchBuffer(
      size_t elements) override {
    if (elements == 0) {
      return absl::InvalidArgumentError("a fetch buffer needs at least 1 value");
    }
    IG_ASSIGN_OR_RETURN(uint16_t* data, AllocateFetchMemory(elements));
    return std::make_unique<InprocFetchBuffer>(this, data, elements);
  }
  absl::StatusOr<DirectRows> GetDirectRows(SequenceId seq) override {
    return store_->GetDirectRows(seq);
  }
  FetchHandle NoteHeldAsync(SequenceId seq, int32_t layer,
                            const FetchPlan& plan, FetchBuffer* via) override {
    return FetchHandle(store_->NoteHeld(seq, layer, plan));
  }
  FetchHandle NoteFetchedAsync(SequenceId seq, int32_t layer,
                               const FetchPlan& plan, FetchBuffer*) override {
    return FetchHandle(store_->NoteFetched(seq, layer, plan));
  }
  FetchHandle NoteLeadingFetchedAsync(SequenceId seq, int32_t layer,
                                      absl::Span<const int32_t> head_offsets,
                                      FetchBuffer*) override {
    return FetchHandle(store_->NoteLeadingFetched(seq, layer, head_offsets));
  }
  FetchHandle FetchAsync(SequenceId seq, int32_t layer, const FetchPlan& plan,
                         FetchBuffer* dest) override {
    auto claimed = FetchBuffer::Claim<InprocFetchBuffer>(this, dest);
    if (!claimed.ok()) return FetchHandle(claimed.status());
    InprocFetchBuffer* buffer = *claimed;
    // A small fetch costs less than waking a thread: gathered here.
    if (plan.indices.size() < kAsyncRows) {
      buffer->Complete(store_->Gather(seq, layer, plan, buffer->span()));
      return FetchHandle(buffer);
    }
    buffer->seq = seq;
    buffer->layer = layer;
    buffer->indices.assign(plan.indices.begin(), plan.indices.end());
    buffer->head_offsets.assign(plan.head_offsets.begin(),
                                plan.head_offsets.end());
    absl::MutexLock lock(&mu_);
    if (!fetcher_.joinable()) fetcher_ = std::thread([this] { Fetcher(); });
    queue_.push_back(buffer);
    return FetchHandle(buffer);
  }
  absl::Status Close(SequenceId seq) override { return store_->Close(seq); }
  absl::StatusOr<SequenceStats> GetSequenceStats(SequenceId seq) override {
    return store_->GetSequenceStats(seq);
  }
  absl::StatusOr<StoreStats> GetStoreStats() override {
    return store_->GetStoreStats();
  }
  absl::StatusOr<std::vector<TokenFetchStats>> GetTokenStats(
      SequenceId seq, int32_t layer, int32_t kv_head) override {
    return store_->GetTokenStats(seq, layer, kv_head);
  }
  std::string data_plane() const override { return "inproc"; }

 private:
  // Fetches of at least this many rows (256 KiB and more of fp16 rows of
  // 64 values) gather on the client's fetch thread, so that FetchAsync
  // returns at once and the caller computes meanwhile; smaller ones, which
  // take less than waking a thread, gather on the caller.
  static constexpr size_t kAsyncRows = 1024;

  // The fetch thread: gathers queued fetches in order until the client
  // goes (after the queue is empty: a handle never waits forever).
  void Fetcher() {
    while (true) {
      InprocFetchBuffer* buffer;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](InprocKvClient* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->mu_) {
              return c->stop_ || !c->queue_.empty();
            },
            this));
        if (queue_.empty()) return;
        buffer = queue_.front();
        queue_.pop_front();
      }
      FetchPlan plan;
      plan.indices = buffer->indices;
      plan.head_offsets = buffer->head_offsets;
      buffer->Complete(
          store_->Gather(buffer->seq, buffer->layer, plan, buffer->span()));
    }
  }

  const std::shared_ptr<KvStore> store_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<InprocFetchBuffer*> queue_ ABSL_GUARDED_BY(mu_);
  std::thread fetcher_;  // started with the first queued fetch
};

}  // namespace

std::unique_ptr<KvClient> NewInprocKvClient(std::shared_ptr<KvStore> store) {
  return std::make_unique<InprocKvClient>(std::move(store));
}

}  // namespace infinigen::kv_memory_service
