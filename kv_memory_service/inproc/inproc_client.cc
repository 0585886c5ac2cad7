#include "kv_memory_service/inproc/inproc_client.h"

#include <cstdlib>
#include <utility>

#include "common/status.h"

namespace infinigen::kv_memory_service {
namespace {

class InprocFetchBuffer final : public FetchBuffer {
 public:
  InprocFetchBuffer(const void* owner, uint16_t* data, size_t size)
      : FetchBuffer(owner, data, size), memory_(data) {}
  ~InprocFetchBuffer() override { std::free(memory_); }

  void Complete(absl::Status status) { CompleteFetch(std::move(status)); }

 private:
  uint16_t* const memory_;
};

class InprocKvClient final : public KvClient {
 public:
  explicit InprocKvClient(std::shared_ptr<KvStore> store)
      : store_(std::move(store)) {}

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
  FetchHandle FetchAsync(SequenceId seq, int32_t layer, const FetchPlan& plan,
                         FetchBuffer* dest) override {
    auto buffer = FetchBuffer::Claim<InprocFetchBuffer>(this, dest);
    if (!buffer.ok()) return FetchHandle(buffer.status());
    (*buffer)->Complete(store_->Gather(seq, layer, plan, (*buffer)->span()));
    return FetchHandle(*buffer);
  }
  absl::Status Close(SequenceId seq) override { return store_->Close(seq); }
  absl::StatusOr<SequenceStats> GetSequenceStats(SequenceId seq) override {
    return store_->GetSequenceStats(seq);
  }
  absl::StatusOr<StoreStats> GetStoreStats() override {
    return store_->GetStoreStats();
  }
  std::string data_plane() const override { return "inproc"; }

 private:
  const std::shared_ptr<KvStore> store_;
};

}  // namespace

std::unique_ptr<KvClient> NewInprocKvClient(std::shared_ptr<KvStore> store) {
  return std::make_unique<InprocKvClient>(std::move(store));
}

}  // namespace infinigen::kv_memory_service
