#include "kv_memory_service/control/grpc_client.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/address.h"
#include "common/log.h"
#include "common/server_tls.h"
#include "common/status.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "kv_memory_service/control/proto_convert.h"
#include "kv_memory_service/tcp/fetch_connection.h"
#include "proto/kv_memory.grpc.pb.h"

namespace infinigen::kv_memory_service {
namespace {

class GrpcKvClient final : public KvClient, public FetchWaiter {
 public:
  // `fetch_host`: the host to reach the server's fetch socket at (the one
  // the channel uses); empty = always the gRPC FetchStream. `fetch_tls`:
  // the client context for a TLS fetch socket (null: the client speaks
  // plaintext, and takes only a plaintext one).
  GrpcKvClient(std::shared_ptr<grpc::Channel> channel,
               const KvClientOptions& options, std::string fetch_host,
               std::shared_ptr<SSL_CTX> fetch_tls, std::string address)
      : address_(std::move(address)),
        channel_(std::move(channel)),
        stub_(kv::KvMemory::NewStub(channel_)),
        options_(options),
        auth_(options.auth_token.empty() ? "" : "Bearer " + options.auth_token),
        fetch_host_(options.tcp_fetch_socket ? std::move(fetch_host) : ""),
        fetch_tls_(std::move(fetch_tls)) {
    // The first beat opens the session, so Health() means something from
    // the start; a failure here is retried by the thread.
    Beat();
    heartbeat_ = std::thread([this] { HeartbeatLoop(); });
  }

  ~GrpcKvClient() override {
    {
      absl::MutexLock lock(&session_mu_);
      stopping_ = true;
      if (beat_ctx_ != nullptr) beat_ctx_->TryCancel();
    }
    heartbeat_.join();
    {
      absl::MutexLock lock(&mu_);
      connection_.reset();  // cuts the connection and joins its reader
    }
    // Going away cleanly: end the session now rather than at its lease
    // (closing what sequences it still owns). Best effort, briefly.
    SessionId session;
    {
      absl::MutexLock lock(&session_mu_);
      session = session_;
    }
    if (session != 0) {
      kv::CloseSessionRequest req;
      req.set_session_id(session);
      kv::CloseSessionResponse resp;
      grpc::ClientContext ctx;
      Prepare(&ctx);
      ctx.set_deadline(absl::ToChronoTime(
          absl::Now() + std::min(options_.rpc_timeout, absl::Seconds(1))));
      (void)stub_->CloseSession(&ctx, req, &resp);
    }
  }

  absl::StatusOr<OpenedSequence> OpenSequence(
      const SequenceGeometry& geometry, const PrefixRequest& prefix) override {
    kv::OpenSequenceRequest req;
    ToProto(geometry, req.mutable_geometry());
    ToProto(prefix, &req);
    IG_RETURN_IF_ERROR(Unresponsive());
    IG_ASSIGN_OR_RETURN(SessionId session, CurrentSession());
    absl::Status status;
    // A generation waits on this call: the data path's timeout.
    absl::Duration timeout = options_.fetch_timeout;
    for (int attempt = 0; attempt < 2; ++attempt) {
      req.set_session_id(session);
      kv::OpenSequenceResponse resp;
      grpc::ClientContext ctx;
      Prepare(&ctx, timeout);
      status = FromGrpcStatus(stub_->OpenSequence(&ctx, req, &resp));
      if (absl::IsUnavailable(status) && Health().ok()) {
        // The channel is down, e.g. the server just restarted and gRPC is
        // between reconnect attempts: a new generation starts here, so
        // wait (up to connect_timeout) for it to come back rather than
        // fail the generation at once. Not for a node the heartbeats
        // already find down: its callers decide how long to wait.
        const absl::Status down = status;
        const absl::Duration wait =
            std::min(options_.rpc_timeout, options_.connect_timeout);
        grpc::ClientContext retry;
        Prepare(&retry, wait);
        retry.set_wait_for_ready(true);
        status = FromGrpcStatus(stub_->OpenSequence(&retry, req, &resp));
        if (absl::IsDeadlineExceeded(status)) {
          status = absl::UnavailableError(absl::StrCat(
              down.message(), "; it did not come back within ",
              absl::FormatDuration(wait)));
        }
      }
      if (status.ok()) {
        OpenedSequence opened{resp.sequence_id(), resp.cached_tokens(), {}};
        opened.prefix_meta.assign(resp.prefix_meta().begin(),
                                  resp.prefix_meta().end());
        return opened;
      }
      // The only NotFound of OpenSequence: the session expired (or the
      // server restarted). Its sequences are gone; new ones go into a new
      // session.
      if (!absl::IsNotFound(status)) break;
      IG_ASSIGN_OR_RETURN(session, NewSession(session, options_.rpc_timeout));
    }
    return NoteOutcome(status, timeout);
  }

  // Over the fetch socket where there is one; otherwise a unary call.
  absl::StatusOr<AppendResult> Append(SequenceId seq,
                                      const AppendBlock& block) override {
    std::string meta = EncodePrefixMeta(block);
    if (!block.k.empty() && block.v.size() == block.k.size() &&
        4 * block.k.size() + meta.size() + 1024 <=
            static_cast<size_t>(options_.max_message_bytes)) {
      IG_RETURN_IF_ERROR(Unresponsive());
      auto connection = Connection();
      if (!connection.ok()) {
        return NoteOutcome(connection.status(), options_.fetch_timeout);
      }
      if ((*connection)->carries_appends()) {
        return appender_.Append(
            *std::move(connection), seq, session(),
            next_request_id_.fetch_add(1) + 1,
            std::min(block.deadline, absl::Now() + options_.fetch_timeout),
            block, std::move(meta));
      }
    }
    kv::AppendRequest req;
    req.set_sequence_id(seq);
    req.set_session_id(session());
    req.set_first_layer(block.first_layer);
    req.set_n_layers(block.n_layers);
    req.set_n_tokens(block.n_tokens);
    req.set_k(reinterpret_cast<const char*>(block.k.data()),
              block.k.size() * sizeof(uint16_t));
    req.set_prefix_meta_first_block(block.prefix_meta_first_block);
    for (const std::string& meta : block.prefix_meta) req.add_prefix_meta(meta);
    req.set_v(reinterpret_cast<const char*>(block.v.data()),
              block.v.size() * sizeof(uint16_t));
    IG_RETURN_IF_ERROR(Unresponsive());
    kv::AppendResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx, options_.fetch_timeout);  // the data path: see options
    IG_RETURN_IF_ERROR(
        NoteOutcome(FromGrpcStatus(stub_->Append(&ctx, req, &resp)),
                    options_.fetch_timeout));
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
    IG_ASSIGN_OR_RETURN(uint16_t* memory, AllocateFetchMemory(elements));
    return std::make_unique<GrpcFetchBuffer>(this, this, memory, elements);
  }

  FetchHandle FetchAsync(SequenceId seq, int32_t layer, const FetchPlan& plan,
                         FetchBuffer* dest) override {
    return Request(seq, layer, plan, dest, /*held=*/false);
  }

  // Over the fetch connection, as a fetch whose response carries no rows.
  FetchHandle NoteHeldAsync(SequenceId seq, int32_t layer,
                            const FetchPlan& plan, FetchBuffer* via) override {
    return Request(seq, layer, plan, via, /*held=*/true);
  }

  absl::Status Close(SequenceId seq) override {
    IG_RETURN_IF_ERROR(Unresponsive());
    kv::CloseSequenceRequest req;
    req.set_sequence_id(seq);
    req.set_session_id(session());
    kv::CloseSequenceResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    return NoteOutcome(FromGrpcStatus(stub_->CloseSequence(&ctx, req, &resp)),
                       options_.rpc_timeout);
  }

  absl::StatusOr<SequenceStats> GetSequenceStats(SequenceId seq) override {
    kv::GetStatsRequest req;
    req.set_sequence_id(seq);
    req.set_session_id(session());
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

  absl::StatusOr<std::vector<TokenFetchStats>> GetTokenStats(
      SequenceId seq, int32_t layer, int32_t kv_head) override {
    kv::GetStatsRequest req;
    req.set_sequence_id(seq);
    req.set_session_id(session());
    req.set_include_tokens(true);
    req.set_layer(layer);
    req.set_kv_head(kv_head);
    kv::GetStatsResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    IG_RETURN_IF_ERROR(FromGrpcStatus(stub_->GetStats(&ctx, req, &resp)));
    std::vector<TokenFetchStats> tokens;
    tokens.reserve(resp.tokens_size());
    for (const kv::TokenFetchStats& t : resp.tokens()) {
      TokenFetchStats out;
      out.position = t.position();
      out.fetch_count = t.fetch_count();
      out.last_fetch = t.last_fetch();
      tokens.push_back(out);
    }
    return tokens;
  }

  std::string data_plane() const override { return "tcp"; }
  std::string address() const override { return address_; }
  void NoteUnanswered(absl::Duration timeout) override {
    NoteTimeout("a fetch", timeout);
  }
  absl::Status Unanswered() const override { return Unresponsive(); }

  absl::Status Health() const override {
    absl::MutexLock lock(&session_mu_);
    return health_;
  }

  // The session named in calls on a sequence, fetches included (0 before
  // the first).
  SessionId session() const override {
    absl::MutexLock lock(&session_mu_);
    return session_;
  }

  // FetchBuffer::WaitForFetch of this client's buffers.
  absl::Status WaitFor(GrpcFetchBuffer* buffer) override {
    if (!buffer->Await(buffer->deadline)) {
      FetchConnection* connection = buffer->connection.get();
      if (connection != nullptr && connection->Abandon(buffer->request_id)) {
        buffer->Complete(absl::DeadlineExceededError(absl::StrCat(
            "no answer from the KV memory server within ",
            absl::FormatDuration(options_.fetch_timeout))));
      }
      // Either just completed above, or the reader is completing it; a cut
      // connection ends its reader promptly.
      buffer->Await(absl::InfiniteFuture());
    }
    buffer->connection.reset();
    return NoteOutcome(buffer->Take(), options_.fetch_timeout);
  }

 private:
  // A fetch of `plan` into `dest`, or with `held` a note of its rows held
  // through `dest` (FetchRequest.held: nothing is written into the buffer).
  FetchHandle Request(SequenceId seq, int32_t layer, const FetchPlan& plan,
                      FetchBuffer* dest, bool held) {
    const size_t request_bytes =
        (plan.indices.size() + plan.head_offsets.size()) * sizeof(int32_t);
    if (request_bytes + 1024 > static_cast<size_t>(options_.max_message_bytes)) {
      return FetchHandle(absl::ResourceExhaustedError(absl::StrCat(
          "a plan of ", plan.indices.size(),
          " indices exceeds the message limit of ", options_.max_message_bytes,
          " bytes")));
    }
    auto claimed = FetchBuffer::Claim<GrpcFetchBuffer>(this, dest);
    if (!claimed.ok()) return FetchHandle(claimed.status());
    GrpcFetchBuffer* buffer = *claimed;
    if (absl::Status down = Unresponsive(); !down.ok()) {
      buffer->Complete(std::move(down));
      return FetchHandle(buffer);
    }

    buffer->deadline = absl::Now() + options_.fetch_timeout;
    kv::FetchRequest& req = buffer->request;
    req.set_sequence_id(seq);
    req.set_session_id(session());
    req.set_layer(layer);
    ToProto(plan, req.mutable_plan());
    req.set_dest_elements(buffer->size());
    req.set_held(held);
    buffer->request_id = next_request_id_.fetch_add(1) + 1;
    req.set_request_id(buffer->request_id);

    absl::StatusOr<std::shared_ptr<FetchConnection>> connection = Connection();
    if (!connection.ok()) {
      buffer->connection.reset();
      buffer->Complete(connection.status());
      return FetchHandle(buffer);
    }
    buffer->connection = *std::move(connection);
    buffer->connection->Send(buffer);
    return FetchHandle(buffer);
  }

  void Prepare(grpc::ClientContext* ctx) const {
    Prepare(ctx, options_.rpc_timeout);
  }
  void Prepare(grpc::ClientContext* ctx, absl::Duration timeout) const {
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    if (!auth_.empty()) ctx->AddMetadata("authorization", auth_);
  }

  // A node whose call timed out is unresponsive until it answers a
  // heartbeat (asked for at once): until then calls fail here, in no time,
  // instead of each waiting out its own timeout on a node known to be hung
  // (a recovery's close, reopen and appends; a serving worker's queue).
  absl::Status Unresponsive() const {
    absl::MutexLock lock(&session_mu_);
    return unresponsive_;
  }

  // Returns `status`, first noting a timeout: the node becomes unresponsive.
  absl::Status NoteOutcome(absl::Status status, absl::Duration timeout) {
    if (!absl::IsDeadlineExceeded(status)) return status;
    NoteTimeout("a call", timeout);
    // gRPC says only "Deadline Exceeded".
    return absl::DeadlineExceededError(absl::StrCat(
        "no answer to a call within ", absl::FormatDuration(timeout)));
  }
  // `what` (a call, a fetch) timed out after `timeout`.
  void NoteTimeout(absl::string_view what, absl::Duration timeout) {
    absl::MutexLock lock(&session_mu_);
    if (unresponsive_.ok()) {
      unresponsive_ = absl::UnavailableError(absl::StrCat(
          "not answering (", what, " timed out after ",
          absl::FormatDuration(timeout),
          "); calls fail until it answers a heartbeat"));
      beat_now_ = true;
    }
  }

  // The session sequences are opened in, opened if there is none.
  absl::StatusOr<SessionId> CurrentSession() {
    {
      absl::MutexLock lock(&session_mu_);
      if (session_ != 0) return session_;
    }
    return NewSession(0, options_.rpc_timeout);
  }

  // Opens a session to replace `stale` (0: none), unless another thread
  // has already replaced it, and returns the current one.
  absl::StatusOr<SessionId> NewSession(SessionId stale,
                                       absl::Duration timeout) {
    absl::MutexLock open_lock(&open_session_mu_);
    {
      absl::MutexLock lock(&session_mu_);
      if (session_ != 0 && session_ != stale) return session_;
    }
    kv::OpenSessionRequest req;
    kv::OpenSessionResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    IG_RETURN_IF_ERROR(FromGrpcStatus(stub_->OpenSession(&ctx, req, &resp)));
    absl::MutexLock lock(&session_mu_);
    if (stale != 0) {
      IG_LOG(WARNING) << "KV memory session " << stale
                      << " is gone on the server (its lease expired, or the "
                         "server restarted): its sequences are lost; new "
                         "sequences go into session "
                      << resp.session_id();
    }
    session_ = resp.session_id();
    beat_interval_ = options_.heartbeat_interval;
    if (resp.lease_timeout_ms() > 0) {
      beat_interval_ = std::min(beat_interval_,
                                absl::Milliseconds(resp.lease_timeout_ms()) / 3);
    }
    return session_;
  }

  // One heartbeat: renews the session's lease (opening a session if there
  // is none, a new one if the server no longer knows ours) and records the
  // outcome for Health().
  void Beat() {
    absl::Duration timeout;
    SessionId session;
    {
      absl::MutexLock lock(&session_mu_);
      session = session_;
      // Long enough for a loaded host, short enough that a hung server
      // shows in Health() within about a second.
      timeout = std::min(options_.rpc_timeout,
                         std::max(beat_interval_, absl::Seconds(1)));
    }
    absl::Status status;
    if (session == 0) {
      status = NewSession(0, timeout).status();
    } else {
      kv::HeartbeatRequest req;
      req.set_session_id(session);
      kv::HeartbeatResponse resp;
      grpc::ClientContext ctx;
      Prepare(&ctx);
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
      {
        absl::MutexLock lock(&session_mu_);
        if (stopping_) return;
        beat_ctx_ = &ctx;
      }
      status = FromGrpcStatus(stub_->Heartbeat(&ctx, req, &resp));
      {
        absl::MutexLock lock(&session_mu_);
        beat_ctx_ = nullptr;
      }
      if (absl::IsNotFound(status)) status = NewSession(session, timeout).status();
    }
    absl::MutexLock lock(&session_mu_);
    // A node that answers a heartbeat takes calls again.
    if (status.ok()) unresponsive_ = absl::OkStatus();
    beat_now_ = false;
    health_ = status.ok()
                  ? absl::OkStatus()
                  : absl::Status(status.code(),
                                 absl::StrCat("KV memory server heartbeat: ",
                                              status.message()));
  }

  void HeartbeatLoop() {
    while (true) {
      {
        absl::MutexLock lock(&session_mu_);
        auto wake = [this]() ABSL_SHARED_LOCKS_REQUIRED(session_mu_) {
          return stopping_ || beat_now_;
        };
        session_mu_.AwaitWithTimeout(absl::Condition(&wake), beat_interval_);
        if (stopping_) return;
      }
      Beat();
    }
  }

  // The live fetch connection, opened (after waiting for the channel, at
  // most connect_timeout; the node's fetch port asked within the fetch
  // timeout, since a fetch or an append waits) if there is none or the
  // last one broke.
  absl::StatusOr<std::shared_ptr<FetchConnection>> Connection() {
    absl::MutexLock lock(&mu_);
    if (connection_ != nullptr && !connection_->broken()) return connection_;
    // A waiter may still hold the broken one; it goes with the last
    // reference.
    connection_.reset();
    IG_RETURN_IF_ERROR(AwaitChannel());
    int fetch_port = 0;
    if (!fetch_host_.empty()) {
      kv::GetServerInfoRequest req;
      kv::GetServerInfoResponse resp;
      grpc::ClientContext ctx;
      Prepare(&ctx, options_.fetch_timeout);  // a fetch or append waits
      IG_RETURN_IF_ERROR(FromGrpcStatus(stub_->GetServerInfo(&ctx, req, &resp)));
      if (resp.fetch_tls_port() > 0) {
        if (fetch_tls_ == nullptr) {
          return absl::FailedPreconditionError(absl::StrCat(
              "the KV memory server's fetch socket (port ",
              resp.fetch_tls_port(),
              ") speaks TLS: connect with the server's CA (tls_ca_pem, "
              "--kv_tls_ca)"));
        }
        fetch_port = resp.fetch_tls_port();
      } else if (fetch_tls_ == nullptr) {
        // A TLS client never sends rows' indices to a plaintext socket: it
        // takes the (TLS) stream instead.
        fetch_port = resp.fetch_port();
      }
    }
    if (fetch_port > 0) {
      IG_ASSIGN_OR_RETURN(
          connection_,
          ConnectFetchSocket(
              fetch_host_, fetch_port, auth_, fetch_tls_.get(),
              options_.tls_server_name.empty() ? fetch_host_
                                               : options_.tls_server_name,
              options_.connect_timeout));
    } else {
      connection_ = NewStreamConnection(stub_.get(), auth_);
    }
    return connection_;
  }

  // OK once the channel is connected. Fails at once while the last attempt
  // to connect failed (the server is down: callers get an error now, not
  // after a timeout; gRPC keeps reconnecting in the background), and after
  // connect_timeout while a connection attempt hangs.
  absl::Status AwaitChannel() {
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

  const std::string address_;  // as given: tcp://HOST:PORT or unix:PATH
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<kv::KvMemory::StubInterface> stub_;
  const KvClientOptions options_;
  const std::string auth_;  // "Bearer TOKEN", or empty
  const std::string fetch_host_;
  const std::shared_ptr<SSL_CTX> fetch_tls_;
  std::atomic<uint64_t> next_request_id_{0};

  absl::Mutex mu_;
  std::shared_ptr<FetchConnection> connection_ ABSL_GUARDED_BY(mu_);
  SocketAppender appender_{this, this};

  absl::Mutex open_session_mu_;  // one OpenSession in flight at a time
  mutable absl::Mutex session_mu_;
  SessionId session_ ABSL_GUARDED_BY(session_mu_) = 0;  // 0: none yet
  absl::Duration beat_interval_ ABSL_GUARDED_BY(session_mu_) =
      options_.heartbeat_interval;
  absl::Status health_ ABSL_GUARDED_BY(session_mu_);
  // Not OK from a call's timeout until the next heartbeat that succeeds.
  absl::Status unresponsive_ ABSL_GUARDED_BY(session_mu_);
  bool beat_now_ ABSL_GUARDED_BY(session_mu_) = false;  // wake the heartbeat
  bool stopping_ ABSL_GUARDED_BY(session_mu_) = false;
  // The heartbeat in flight, cancelled by the destructor.
  grpc::ClientContext* beat_ctx_ ABSL_GUARDED_BY(session_mu_) = nullptr;
  std::thread heartbeat_;  // last: starts after everything above exists
};


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
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // gRPC's name for the time one connection attempt may take: not too short
  // for a loaded host or a server that is still starting.
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS,
              static_cast<int>(absl::ToInt64Milliseconds(options.connect_timeout)));
  return args;
}

}  // namespace

std::unique_ptr<KvClient> NewGrpcKvClient(
    std::shared_ptr<grpc::Channel> channel, const KvClientOptions& options) {
  return std::make_unique<GrpcKvClient>(std::move(channel), options, "",
                                        nullptr, "grpc:");
}

absl::StatusOr<std::unique_ptr<KvClient>> ConnectGrpcKvClient(
    const std::string& address, const KvClientOptions& options) {
  std::string target, fetch_host;
  if (absl::StartsWith(address, "tcp://")) {
    target = address.substr(6);
    absl::StatusOr<HostPort> host_port = ParseDialHostPort(target);
    if (!host_port.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("address '", address, "' is not tcp://HOST:PORT"));
    }
    fetch_host = host_port->host;
  } else if (absl::StartsWith(address, "unix:") && ParseUnixPath(address).ok()) {
    target = address;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "address '", address, "' is not tcp://HOST:PORT or unix:PATH"));
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      grpc::InsecureChannelCredentials();
  grpc::ChannelArguments args = ChannelArgs(options);
  std::shared_ptr<SSL_CTX> fetch_tls;
  if (!options.tls_ca_pem.empty()) {
    if (options.tls_cert_pem.empty() != options.tls_key_pem.empty()) {
      return absl::InvalidArgumentError(
          "a TLS client certificate needs its key, and the key its "
          "certificate");
    }
    if (!fetch_host.empty()) {
      IG_ASSIGN_OR_RETURN(fetch_tls, NewClientTlsContext(options.tls_ca_pem,
                                                         options.tls_cert_pem,
                                                         options.tls_key_pem));
    }
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_ca_pem;
    ssl.pem_cert_chain = options.tls_cert_pem;
    ssl.pem_private_key = options.tls_key_pem;
    credentials = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty()) {
      args.SetSslTargetNameOverride(options.tls_server_name);
    }
  } else if (!options.tls_cert_pem.empty()) {
    return absl::InvalidArgumentError(
        "a TLS client certificate needs tls_ca_pem (the server's CA)");
  }
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(target, credentials, args);
  // Connected, or failed: a refused connection or a rejected handshake
  // fails now, with its reason; only an attempt that hangs waits out
  // connect_timeout.
  const auto deadline =
      absl::ToChronoTime(absl::Now() + options.connect_timeout);
  grpc_connectivity_state state = channel->GetState(/*try_to_connect=*/true);
  while (state != GRPC_CHANNEL_READY &&
         state != GRPC_CHANNEL_TRANSIENT_FAILURE &&
         state != GRPC_CHANNEL_SHUTDOWN &&
         channel->WaitForStateChange(state, deadline)) {
    state = channel->GetState(/*try_to_connect=*/true);
  }
  if (state != GRPC_CHANNEL_READY) {
    const bool timed_out = state != GRPC_CHANNEL_TRANSIENT_FAILURE &&
                           state != GRPC_CHANNEL_SHUTDOWN;
    // The channel keeps why its last attempt failed (refused, a TLS
    // handshake one side rejected); a fail-fast call reports it.
    grpc::ClientContext probe;
    probe.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    kv::GetServerInfoResponse info;
    const grpc::Status why = kv::KvMemory::NewStub(channel)->GetServerInfo(
        &probe, kv::GetServerInfoRequest(), &info);
    // A closed socket during the handshake is how a TLS server answers a
    // plaintext client, and a TLS handshake error how a plaintext server
    // (or one that does not trust this client) answers a TLS one: say so.
    const std::string reason = why.ok() ? "" : why.error_message();
    std::string hint;
    if (!timed_out && options.tls_ca_pem.empty() &&
        absl::StrContains(reason, "Socket closed")) {
      hint = " (a TLS server closes plaintext connections: if it uses TLS, "
             "connect with its CA, --kv_tls_ca)";
    } else if (!timed_out && !options.tls_ca_pem.empty() &&
               (absl::StrContains(reason, "Handshake") ||
                absl::StrContains(reason, "SSL") ||
                absl::StrContains(reason, "Socket closed"))) {
      hint = " (the TLS handshake failed: the server may not speak TLS, or "
             "may not trust this client's certificate)";
    }
    return absl::UnavailableError(absl::StrCat(
        "cannot connect to the KV memory server at ", address,
        timed_out ? absl::StrCat(" within ",
                                 absl::FormatDuration(options.connect_timeout))
                  : "",
        options.tls_ca_pem.empty() ? "" : " over TLS",
        reason.empty() ? "" : absl::StrCat(": ", reason), hint));
  }
  return std::make_unique<GrpcKvClient>(std::move(channel), options,
                                        std::move(fetch_host),
                                        std::move(fetch_tls), address);
}

}  // namespace infinigen::kv_memory_service
