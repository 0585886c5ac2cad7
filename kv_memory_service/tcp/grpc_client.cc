#include "kv_memory_service/tcp/grpc_client.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "kv_memory_service/proto_convert.h"
#include "proto/kv_memory.grpc.pb.h"

namespace infinigen::kv_memory_service {
namespace {

constexpr size_t kAlignment = 4096;

class GrpcKvClient;
class FetchStream;

// Plain host memory plus the request it reuses for every fetch.
class GrpcFetchBuffer final : public FetchBuffer {
 public:
  GrpcFetchBuffer(GrpcKvClient* client, uint16_t* memory, size_t size)
      : FetchBuffer(client, memory, size), client_(client), memory_(memory) {}
  ~GrpcFetchBuffer() override { std::free(memory_); }

  absl::Status Begin() { return BeginFetch(); }
  void Complete(absl::Status status) { CompleteFetch(std::move(status)); }
  bool Await(absl::Time deadline) { return AwaitCompletion(deadline); }
  absl::Status Take() { return TakeResult(); }

  // Set by FetchAsync before the request leaves; read by the waiter.
  kv::FetchRequest request;
  uint64_t request_id = 0;
  absl::Time deadline;
  std::shared_ptr<FetchStream> stream;

 private:
  absl::Status WaitForFetch() override;

  GrpcKvClient* const client_;
  uint16_t* const memory_;
};

// One FetchStream RPC, its reader thread and the fetches waiting on it.
class FetchStream {
 public:
  FetchStream(kv::KvMemory::StubInterface* stub, const std::string& auth)
      : auth_(auth) {
    if (!auth_.empty()) ctx_.AddMetadata("authorization", auth_);
    rw_ = stub->FetchStream(&ctx_);
    reader_ = std::thread([this] { ReadLoop(); });
  }
  ~FetchStream() {
    ctx_.TryCancel();
    reader_.join();
  }

  bool broken() const {
    absl::MutexLock lock(&mu_);
    return broken_;
  }

  // Registers `buffer` under its request id and sends its request. If the
  // stream is already broken, completes the buffer with the stream's error.
  void Send(GrpcFetchBuffer* buffer) {
    {
      absl::MutexLock lock(&mu_);
      if (broken_) {
        buffer->Complete(error_);
        return;
      }
      pending_[buffer->request_id] = buffer;
    }
    // A failed write means the call is over: ReadLoop's Read fails too and
    // completes every pending fetch, this one included. After Finish the
    // stream takes no writes; the reader then fails this fetch with the
    // others.
    absl::MutexLock lock(&write_mu_);
    if (!finished_) rw_->Write(buffer->request);
  }

  // Called by a waiter whose deadline passed. True if the fetch was still
  // pending (now removed: nothing will write into the buffer); false if the
  // reader already took it and is about to complete it.
  bool Abandon(uint64_t request_id) {
    absl::MutexLock lock(&mu_);
    if (pending_.erase(request_id) == 0) return false;
    timed_out_ = true;
    return true;
  }

  // Ends the stream: every pending fetch fails.
  void Cancel() { ctx_.TryCancel(); }

 private:
  void ReadLoop() {
    kv::FetchResponse resp;
    while (rw_->Read(&resp)) {
      GrpcFetchBuffer* buffer = nullptr;
      {
        absl::MutexLock lock(&mu_);
        auto it = pending_.find(resp.request_id());
        if (it == pending_.end()) continue;  // abandoned after a timeout
        buffer = it->second;
        pending_.erase(it);
      }
      absl::Status status(static_cast<absl::StatusCode>(resp.status_code()),
                          resp.status_message());
      if (status.ok()) {
        const std::string& rows = resp.rows();
        if (rows.size() > buffer->size() * sizeof(uint16_t)) {
          status = absl::InternalError(absl::StrCat(
              "the server sent ", rows.size(), " bytes of rows for a ",
              buffer->size() * sizeof(uint16_t), "-byte fetch buffer"));
        } else {
          std::memcpy(buffer->data(), rows.data(), rows.size());
        }
      }
      buffer->Complete(std::move(status));
    }
    grpc::Status end;
    {
      absl::MutexLock lock(&write_mu_);
      end = rw_->Finish();
      finished_ = true;
    }
    absl::flat_hash_map<uint64_t, GrpcFetchBuffer*> failed;
    absl::Status error;
    {
      absl::MutexLock lock(&mu_);
      if (timed_out_) {
        error = absl::DeadlineExceededError(
            "the KV memory server did not answer a fetch in time; its fetch "
            "stream was cancelled");
      } else if (end.ok() || end.error_code() == grpc::StatusCode::CANCELLED) {
        error = absl::UnavailableError(absl::StrCat(
            "the KV memory server closed the fetch stream",
            end.ok() ? "" : ": ", end.error_message()));
      } else {
        error = FromGrpcStatus(end);
      }
      broken_ = true;
      error_ = error;
      failed.swap(pending_);
    }
    for (auto& [id, buffer] : failed) buffer->Complete(error);
  }

  const std::string auth_;
  grpc::ClientContext ctx_;
  std::unique_ptr<
      grpc::ClientReaderWriterInterface<kv::FetchRequest, kv::FetchResponse>>
      rw_;
  absl::Mutex write_mu_;  // one Write at a time, as gRPC requires
  bool finished_ ABSL_GUARDED_BY(write_mu_) = false;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, GrpcFetchBuffer*> pending_ ABSL_GUARDED_BY(mu_);
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool timed_out_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);

  std::thread reader_;  // last: starts after everything above exists
};

class GrpcKvClient final : public KvClient {
 public:
  GrpcKvClient(std::shared_ptr<grpc::Channel> channel,
               const KvClientOptions& options)
      : channel_(std::move(channel)),
        stub_(kv::KvMemory::NewStub(channel_)),
        options_(options),
        auth_(options.auth_token.empty() ? ""
                                         : "Bearer " + options.auth_token) {}

  ~GrpcKvClient() override {
    absl::MutexLock lock(&mu_);
    stream_.reset();  // cancels the stream and joins its reader
  }

  absl::StatusOr<SequenceId> Open(const SequenceGeometry& geometry) override {
    kv::OpenSequenceRequest req;
    ToProto(geometry, req.mutable_geometry());
    kv::OpenSequenceResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    IG_RETURN_IF_ERROR(FromGrpcStatus(stub_->OpenSequence(&ctx, req, &resp)));
    return resp.sequence_id();
  }

  absl::StatusOr<AppendResult> Append(SequenceId seq,
                                      const AppendBlock& block) override {
    kv::AppendRequest req;
    req.set_sequence_id(seq);
    req.set_first_layer(block.first_layer);
    req.set_n_layers(block.n_layers);
    req.set_n_tokens(block.n_tokens);
    req.set_k(reinterpret_cast<const char*>(block.k.data()),
              block.k.size() * sizeof(uint16_t));
    req.set_v(reinterpret_cast<const char*>(block.v.data()),
              block.v.size() * sizeof(uint16_t));
    kv::AppendResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    IG_RETURN_IF_ERROR(FromGrpcStatus(stub_->Append(&ctx, req, &resp)));
    return FromProto(resp);
  }

  absl::StatusOr<std::unique_ptr<FetchBuffer>> NewFetchBuffer(
      size_t elements) override {
    if (elements == 0) {
      return absl::InvalidArgumentError("a fetch buffer needs at least 1 value");
    }
    if (elements * sizeof(uint16_t) >
        static_cast<size_t>(options_.max_message_bytes)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "a fetch buffer of ", elements * sizeof(uint16_t),
          " bytes exceeds the message limit of ", options_.max_message_bytes));
    }
    const size_t bytes = (elements * sizeof(uint16_t) + kAlignment - 1) /
                         kAlignment * kAlignment;
    auto* memory = static_cast<uint16_t*>(std::aligned_alloc(kAlignment, bytes));
    if (memory == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate a fetch buffer of ", bytes, " bytes"));
    }
    return std::make_unique<GrpcFetchBuffer>(this, memory, elements);
  }

  FetchHandle FetchAsync(SequenceId seq, int32_t layer, const FetchPlan& plan,
                         FetchBuffer* dest) override {
    if (dest == nullptr || dest->owner() != this) {
      return FetchHandle(absl::InvalidArgumentError(
          "the fetch buffer was not made by this client"));
    }
    auto* buffer = static_cast<GrpcFetchBuffer*>(dest);
    absl::Status begun = buffer->Begin();
    if (!begun.ok()) return FetchHandle(std::move(begun));

    buffer->deadline = absl::Now() + options_.fetch_timeout;
    kv::FetchRequest& req = buffer->request;
    req.set_sequence_id(seq);
    req.set_layer(layer);
    ToProto(plan, req.mutable_plan());
    req.set_dest_elements(buffer->size());
    buffer->request_id = next_request_id_.fetch_add(1) + 1;
    req.set_request_id(buffer->request_id);

    absl::StatusOr<std::shared_ptr<FetchStream>> stream = Stream();
    if (!stream.ok()) {
      buffer->stream.reset();
      buffer->Complete(stream.status());
      return FetchHandle(buffer);
    }
    buffer->stream = *std::move(stream);
    buffer->stream->Send(buffer);
    return FetchHandle(buffer);
  }

  absl::Status Close(SequenceId seq) override {
    kv::CloseSequenceRequest req;
    req.set_sequence_id(seq);
    kv::CloseSequenceResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    return FromGrpcStatus(stub_->CloseSequence(&ctx, req, &resp));
  }

  absl::StatusOr<SequenceStats> GetSequenceStats(SequenceId seq) override {
    kv::GetStatsRequest req;
    req.set_sequence_id(seq);
    kv::GetStatsResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    IG_RETURN_IF_ERROR(FromGrpcStatus(stub_->GetStats(&ctx, req, &resp)));
    return FromProto(resp.sequence());
  }

  absl::StatusOr<StoreStats> GetStoreStats() override {
    kv::GetStatsRequest req;
    kv::GetStatsResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    IG_RETURN_IF_ERROR(FromGrpcStatus(stub_->GetStats(&ctx, req, &resp)));
    return FromProto(resp.store());
  }

  std::string data_plane() const override { return "tcp"; }

  // FetchBuffer::WaitForFetch of this client's buffers.
  absl::Status WaitFor(GrpcFetchBuffer* buffer) {
    if (!buffer->Await(buffer->deadline)) {
      FetchStream* stream = buffer->stream.get();
      if (stream != nullptr && stream->Abandon(buffer->request_id)) {
        buffer->Complete(absl::DeadlineExceededError(absl::StrCat(
            "no answer from the KV memory server within ",
            absl::FormatDuration(options_.fetch_timeout))));
        // The server is hung or far behind: start afresh on the next fetch.
        stream->Cancel();
      }
      buffer->Await(absl::InfiniteFuture());
    }
    buffer->stream.reset();
    return buffer->Take();
  }

 private:
  void Prepare(grpc::ClientContext* ctx) const {
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
    if (!auth_.empty()) ctx->AddMetadata("authorization", auth_);
  }

  // The live fetch stream, opened (after waiting for a connection, at most
  // connect_timeout) if there is none or the last one broke.
  absl::StatusOr<std::shared_ptr<FetchStream>> Stream() {
    absl::MutexLock lock(&mu_);
    if (stream_ != nullptr && !stream_->broken()) return stream_;
    // The broken stream's reader has finished or is about to; a waiter may
    // still hold it, so it goes away with the last reference.
    stream_.reset();
    IG_RETURN_IF_ERROR(AwaitConnection());
    stream_ = std::make_shared<FetchStream>(stub_.get(), auth_);
    return stream_;
  }

  // OK once the channel is connected. Fails at once while the last attempt
  // to connect failed (the server is down: callers get an error now, not
  // after a timeout; gRPC keeps reconnecting in the background), and after
  // connect_timeout while a connection attempt hangs.
  absl::Status AwaitConnection() {
    const auto deadline =
        absl::ToChronoTime(absl::Now() + options_.connect_timeout);
    while (true) {
      const grpc_connectivity_state state = channel_->GetState(true);
      if (state == GRPC_CHANNEL_READY) return absl::OkStatus();
      if (state == GRPC_CHANNEL_TRANSIENT_FAILURE ||
          state == GRPC_CHANNEL_SHUTDOWN) {
        return absl::UnavailableError(
            "the KV memory server is unreachable (connection failed)");
      }
      if (!channel_->WaitForStateChange(state, deadline)) {
        return absl::UnavailableError(
            absl::StrCat("cannot reach the KV memory server within ",
                         absl::FormatDuration(options_.connect_timeout)));
      }
    }
  }

  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<kv::KvMemory::StubInterface> stub_;
  const KvClientOptions options_;
  const std::string auth_;  // "Bearer TOKEN", or empty
  std::atomic<uint64_t> next_request_id_{0};

  absl::Mutex mu_;
  std::shared_ptr<FetchStream> stream_ ABSL_GUARDED_BY(mu_);
};

absl::Status GrpcFetchBuffer::WaitForFetch() { return client_->WaitFor(this); }

grpc::ChannelArguments ChannelArgs(const KvClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  // Each client its own connection, so that clients do not queue behind
  // each other's fetches.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // Notice a silent (hung, unplugged) server within ~15 s even when no fetch
  // is waiting, and reconnect quickly to a restarted one.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return args;
}

}  // namespace

std::unique_ptr<KvClient> NewGrpcKvClient(
    std::shared_ptr<grpc::Channel> channel, const KvClientOptions& options) {
  return std::make_unique<GrpcKvClient>(std::move(channel), options);
}

absl::StatusOr<std::unique_ptr<KvClient>> ConnectGrpcKvClient(
    const std::string& address, const KvClientOptions& options) {
  std::string target;
  if (absl::StartsWith(address, "tcp://")) {
    target = address.substr(6);
    if (target.empty() || target.rfind(':') == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("address '", address, "' is not tcp://HOST:PORT"));
    }
  } else if (absl::StartsWith(address, "unix:") && address.size() > 5) {
    target = address;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "address '", address, "' is not tcp://HOST:PORT or unix:PATH"));
  }
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(
      target, grpc::InsecureChannelCredentials(), ChannelArgs(options));
  if (!channel->WaitForConnected(
          absl::ToChronoTime(absl::Now() + options.connect_timeout))) {
    return absl::UnavailableError(
        absl::StrCat("cannot connect to the KV memory server at ", address,
                     " within ", absl::FormatDuration(options.connect_timeout)));
  }
  return NewGrpcKvClient(std::move(channel), options);
}

}  // namespace infinigen::kv_memory_service
