#include "kv_memory_service/server/kv_service.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kv_memory_service/control/proto_convert.h"
#include "kv_memory_service/serving/serve_fetch.h"

namespace infinigen::kv_memory_service {
namespace {

// Room left in a fetch response for everything but the rows.
constexpr int64_t kResponseOverhead = 1024;


}  // namespace

KvMemoryService::KvMemoryService(std::shared_ptr<KvStore> store,
                                 Credentials credentials,
                                 int32_t max_message_bytes, int32_t fetch_port,
                                 bool fetch_tls, RequestMetrics* metrics)
    : store_(std::move(store)),
      credentials_(std::move(credentials)),
      max_message_bytes_(max_message_bytes),
      fetch_port_(fetch_port),
      fetch_tls_(fetch_tls),
      metrics_(metrics) {}

grpc::Status KvMemoryService::Reply(const absl::Status& status) {
  if (metrics_ != nullptr) metrics_->Rejected(Plane::kGrpc, status);
  return ToGrpcStatus(status);
}

void KvMemoryService::CancelStreams() {
  absl::MutexLock lock(&mu_);
  streams_cancelled_ = true;
  for (grpc::ServerContext* ctx : streams_) ctx->TryCancel();
}

grpc::Status KvMemoryService::OpenSession(grpc::ServerContext* ctx,
                                          const kv::OpenSessionRequest*,
                                          kv::OpenSessionResponse* resp) {
  absl::Status status = Authorize(*ctx);
  if (status.ok()) {
    absl::StatusOr<SessionId> session = store_->OpenSession();
    status = session.status();
    if (session.ok()) {
      resp->set_session_id(*session);
      resp->set_lease_timeout_ms(
          absl::ToInt64Milliseconds(store_->options().lease_timeout));
    }
  }
  return Reply(status);
}

grpc::Status KvMemoryService::Heartbeat(grpc::ServerContext* ctx,
                                        const kv::HeartbeatRequest* req,
                                        kv::HeartbeatResponse* resp) {
  absl::Status status = Authorize(*ctx);
  if (status.ok()) status = store_->RenewSession(req->session_id());
  if (status.ok()) {
    resp->set_lease_timeout_ms(
        absl::ToInt64Milliseconds(store_->options().lease_timeout));
  }
  return Reply(status);
}

grpc::Status KvMemoryService::CloseSession(grpc::ServerContext* ctx,
                                           const kv::CloseSessionRequest* req,
                                           kv::CloseSessionResponse*) {
  absl::Status status = Authorize(*ctx);
  if (status.ok()) status = store_->CloseSession(req->session_id());
  return Reply(status);
}

grpc::Status KvMemoryService::OpenSequence(grpc::ServerContext* ctx,
                                           const kv::OpenSequenceRequest* req,
                                           kv::OpenSequenceResponse* resp) {
  absl::StatusOr<const Credential*> credential = Authenticate(*ctx);
  absl::Status status = credential.status();
  if (status.ok()) status = DoOpen(*credential, *req, resp);
  return Reply(status);
}

grpc::Status KvMemoryService::Append(grpc::ServerContext* ctx,
                                     const kv::AppendRequest* req,
                                     kv::AppendResponse* resp) {
  absl::Status status = Authorize(*ctx);
  if (!status.ok()) return Reply(status);
  const absl::Time start = absl::Now();
  status = DoAppend(*ctx, *req, resp);
  if (metrics_ != nullptr && status.ok()) {
    metrics_->Served(Plane::kGrpc, RequestOp::kAppend, absl::Now() - start,
                     static_cast<int64_t>(req->k().size() + req->v().size()));
  }
  return Reply(status);
}

grpc::Status KvMemoryService::Fetch(grpc::ServerContext* ctx,
                                    const kv::FetchRequest* req,
                                    kv::FetchResponse* resp) {
  absl::Status status = Authorize(*ctx);
  if (status.ok()) status = FetchInto(*req, resp);
  return Reply(status);  // FetchInto recorded what it served
}

grpc::Status KvMemoryService::FetchStream(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<kv::FetchResponse, kv::FetchRequest>* stream) {
  const absl::Status auth = Authorize(*ctx);
  if (!auth.ok()) return Reply(auth);
  {
    absl::MutexLock lock(&mu_);
    if (streams_cancelled_) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "the KV memory server is shutting down");
    }
    streams_.insert(ctx);
  }
  // Reused for every fetch of the stream: once their arrays have grown, a
  // fetch allocates nothing.
  kv::FetchRequest req;
  kv::FetchResponse resp;
  while (stream->Read(&req)) {
    resp.set_request_id(req.request_id());
    const absl::Status status = FetchInto(req, &resp);
    if (metrics_ != nullptr) metrics_->Rejected(Plane::kGrpc, status);
    resp.set_status_code(static_cast<int32_t>(status.code()));
    resp.set_status_message(std::string(status.message()));
    if (!stream->Write(resp)) break;
  }
  absl::MutexLock lock(&mu_);
  streams_.erase(ctx);
  return grpc::Status::OK;
}

grpc::Status KvMemoryService::CloseSequence(grpc::ServerContext* ctx,
                                            const kv::CloseSequenceRequest* req,
                                            kv::CloseSequenceResponse*) {
  absl::Status status = Authorize(*ctx);
  if (status.ok()) {
    status = store_->CheckOwner(req->sequence_id(), req->session_id());
  }
  if (status.ok()) status = store_->Close(req->sequence_id());
  return Reply(status);
}

grpc::Status KvMemoryService::GetStats(grpc::ServerContext* ctx,
                                       const kv::GetStatsRequest* req,
                                       kv::GetStatsResponse* resp) {
  absl::Status status = Authorize(*ctx);
  if (status.ok()) status = DoGetStats(*req, resp);
  return Reply(status);
}

grpc::Status KvMemoryService::GetServerInfo(grpc::ServerContext* ctx,
                                            const kv::GetServerInfoRequest*,
                                            kv::GetServerInfoResponse* resp) {
  const absl::Status status = Authorize(*ctx);
  if (status.ok()) {
    if (fetch_tls_) {
      resp->set_fetch_tls_port(fetch_port_);
    } else {
      resp->set_fetch_port(fetch_port_);
    }
    resp->set_max_message_bytes(static_cast<int32_t>(max_message_bytes_));
  }
  return Reply(status);
}

absl::StatusOr<const Credential*> KvMemoryService::Authenticate(
    const grpc::ServerContext& ctx) const {
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return credentials_.Authenticate(nullptr);
  const absl::string_view presented(it->second.data(), it->second.size());
  return credentials_.Authenticate(&presented);
}

absl::Status KvMemoryService::DoOpen(const Credential* credential,
                                     const kv::OpenSequenceRequest& req,
                                     kv::OpenSequenceResponse* resp) {
  if (!req.has_geometry()) {
    return absl::InvalidArgumentError("OpenSequence needs a geometry");
  }
  IG_ASSIGN_OR_RETURN(SequenceGeometry g, FromProto(req.geometry()));
  IG_ASSIGN_OR_RETURN(PrefixRequest prefix, PrefixFromProto(req));
  // The caller's namespace, never the wire's.
  if (credential != nullptr) {
    prefix.prefix_namespace = credential->prefix_namespace;
    prefix.may_publish = !credential->read_only_prefixes;
  }
  IG_ASSIGN_OR_RETURN(const OpenedSequence opened,
                      store_->Open(g, req.session_id(), prefix));
  resp->set_sequence_id(opened.id);
  resp->set_cached_tokens(opened.cached_tokens);
  for (const std::string& meta : opened.prefix_meta) resp->add_prefix_meta(meta);
  return absl::OkStatus();
}

absl::Status KvMemoryService::DoAppend(const grpc::ServerContext& ctx,
                                       const kv::AppendRequest& req,
                                       kv::AppendResponse* resp) {
  AppendBlock block;
  // No deadline: the clock's largest time, which absl represents as is.
  block.deadline = absl::FromChrono(ctx.deadline());
  block.cancelled = [&ctx] { return ctx.IsCancelled(); };
  block.first_layer = req.first_layer();
  block.n_layers = req.n_layers();
  block.n_tokens = req.n_tokens();
  IG_ASSIGN_OR_RETURN(block.k, RowsView(req.k(), "k"));
  IG_ASSIGN_OR_RETURN(block.v, RowsView(req.v(), "v"));
  block.prefix_meta_first_block = req.prefix_meta_first_block();
  const std::vector<std::string> meta(req.prefix_meta().begin(),
                                      req.prefix_meta().end());
  block.prefix_meta = meta;
  IG_RETURN_IF_ERROR(store_->CheckOwner(req.sequence_id(), req.session_id()));
  IG_ASSIGN_OR_RETURN(AppendResult result,
                      store_->Append(req.sequence_id(), block));
  ToProto(result, resp);
  return absl::OkStatus();
}

absl::Status KvMemoryService::FetchInto(const kv::FetchRequest& req,
                                        kv::FetchResponse* resp) {
  std::string* rows = resp->mutable_rows();
  if (req.held()) {
    rows->clear();
    return NoteHeldForResponse(*store_, req.sequence_id(), req.session_id(),
                           req.layer(), PlanView(req.plan()));
  }
  const absl::Time start = absl::Now();
  absl::Status status = GatherForResponse(
      *store_, req.sequence_id(), req.session_id(), req.layer(),
      PlanView(req.plan()),
      req.dest_elements(), max_message_bytes_ - kResponseOverhead, rows);
  if (!status.ok()) {
    rows->clear();
  } else if (metrics_ != nullptr) {
    metrics_->Served(Plane::kGrpc, RequestOp::kFetch, absl::Now() - start,
                     static_cast<int64_t>(rows->size()));
  }
  return status;
}

absl::Status KvMemoryService::DoGetStats(const kv::GetStatsRequest& req,
                                         kv::GetStatsResponse* resp) {
  ToProto(store_->GetStoreStats(), resp->mutable_store());
  if (req.sequence_id() == 0) return absl::OkStatus();
  IG_RETURN_IF_ERROR(store_->CheckOwner(req.sequence_id(), req.session_id()));
  IG_ASSIGN_OR_RETURN(SequenceStats s,
                      store_->GetSequenceStats(req.sequence_id()));
  ToProto(s, resp->mutable_sequence());
  if (req.include_tokens()) {
    IG_ASSIGN_OR_RETURN(
        std::vector<TokenFetchStats> tokens,
        store_->GetTokenStats(req.sequence_id(), req.layer(), req.kv_head()));
    for (const TokenFetchStats& t : tokens) {
      kv::TokenFetchStats* out = resp->add_tokens();
      out->set_position(t.position);
      out->set_fetch_count(t.fetch_count);
      out->set_last_fetch(t.last_fetch);
    }
  }
  return absl::OkStatus();
}

}  // namespace infinigen::kv_memory_service
