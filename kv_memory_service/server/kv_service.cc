#include "kv_memory_service/server/kv_service.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kv_memory_service/proto_convert.h"

namespace infinigen::kv_memory_service {
namespace {

// Room left in a fetch response for everything but the rows.
constexpr int64_t kResponseOverhead = 1024;

// Compares in time independent of where the strings differ.
bool SameToken(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ b[i];
  return diff == 0;
}

}  // namespace

KvMemoryService::KvMemoryService(std::shared_ptr<KvStore> store,
                                 const std::string& auth_token,
                                 int32_t max_message_bytes)
    : store_(std::move(store)),
      expected_auth_(auth_token.empty() ? "" : "Bearer " + auth_token),
      max_message_bytes_(max_message_bytes) {}

void KvMemoryService::CancelStreams() {
  absl::MutexLock lock(&mu_);
  streams_cancelled_ = true;
  for (grpc::ServerContext* ctx : streams_) ctx->TryCancel();
}

grpc::Status KvMemoryService::OpenSequence(grpc::ServerContext* ctx,
                                           const kv::OpenSequenceRequest* req,
                                           kv::OpenSequenceResponse* resp) {
  absl::Status status = Authorize(*ctx);
  if (status.ok()) status = DoOpen(*req, resp);
  return ToGrpcStatus(status);
}

grpc::Status KvMemoryService::Append(grpc::ServerContext* ctx,
                                     const kv::AppendRequest* req,
                                     kv::AppendResponse* resp) {
  absl::Status status = Authorize(*ctx);
  if (status.ok()) status = DoAppend(*req, resp);
  return ToGrpcStatus(status);
}

grpc::Status KvMemoryService::Fetch(grpc::ServerContext* ctx,
                                    const kv::FetchRequest* req,
                                    kv::FetchResponse* resp) {
  absl::Status status = Authorize(*ctx);
  if (status.ok()) status = FetchInto(*req, resp);
  return ToGrpcStatus(status);
}

grpc::Status KvMemoryService::FetchStream(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<kv::FetchResponse, kv::FetchRequest>* stream) {
  const absl::Status auth = Authorize(*ctx);
  if (!auth.ok()) return ToGrpcStatus(auth);
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
  if (status.ok()) status = store_->Close(req->sequence_id());
  return ToGrpcStatus(status);
}

grpc::Status KvMemoryService::GetStats(grpc::ServerContext* ctx,
                                       const kv::GetStatsRequest* req,
                                       kv::GetStatsResponse* resp) {
  absl::Status status = Authorize(*ctx);
  if (status.ok()) status = DoGetStats(*req, resp);
  return ToGrpcStatus(status);
}

absl::Status KvMemoryService::Authorize(const grpc::ServerContext& ctx) const {
  if (expected_auth_.empty()) return absl::OkStatus();
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) {
    return absl::UnauthenticatedError("missing authorization token");
  }
  if (!SameToken(absl::string_view(it->second.data(), it->second.size()),
                 expected_auth_)) {
    return absl::UnauthenticatedError("wrong authorization token");
  }
  return absl::OkStatus();
}

absl::Status KvMemoryService::DoOpen(const kv::OpenSequenceRequest& req,
                                     kv::OpenSequenceResponse* resp) {
  if (!req.has_geometry()) {
    return absl::InvalidArgumentError("OpenSequence needs a geometry");
  }
  IG_ASSIGN_OR_RETURN(SequenceGeometry g, FromProto(req.geometry()));
  IG_ASSIGN_OR_RETURN(SequenceId id, store_->Open(g));
  resp->set_sequence_id(id);
  return absl::OkStatus();
}

absl::Status KvMemoryService::DoAppend(const kv::AppendRequest& req,
                                       kv::AppendResponse* resp) {
  AppendBlock block;
  block.first_layer = req.first_layer();
  block.n_layers = req.n_layers();
  block.n_tokens = req.n_tokens();
  IG_ASSIGN_OR_RETURN(block.k, RowsView(req.k(), "k"));
  IG_ASSIGN_OR_RETURN(block.v, RowsView(req.v(), "v"));
  IG_ASSIGN_OR_RETURN(AppendResult result,
                      store_->Append(req.sequence_id(), block));
  ToProto(result, resp);
  return absl::OkStatus();
}

absl::Status KvMemoryService::FetchInto(const kv::FetchRequest& req,
                                        kv::FetchResponse* resp) {
  std::string* rows = resp->mutable_rows();
  absl::Status status = GatherRows(req, rows);
  if (!status.ok()) rows->clear();
  return status;
}

absl::Status KvMemoryService::GatherRows(const kv::FetchRequest& req,
                                         std::string* rows) {
  IG_ASSIGN_OR_RETURN(SequenceGeometry g, store_->Geometry(req.sequence_id()));
  const FetchPlan plan = PlanView(req.plan());
  const size_t elements = FetchElements(plan, g.head_dim);
  if (req.dest_elements() != 0 && elements > req.dest_elements()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "destination holds ", req.dest_elements(), " values; the plan's ",
        plan.indices.size(), " rows of K and V need ", elements));
  }
  const int64_t bytes = static_cast<int64_t>(elements * sizeof(uint16_t));
  if (bytes > max_message_bytes_ - kResponseOverhead) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the fetch's ", bytes, " bytes of rows exceed the message limit of ",
        max_message_bytes_, " bytes"));
  }
  // A string that keeps its size from the previous fetch costs nothing to
  // resize.
  rows->resize(static_cast<size_t>(bytes));
  return store_->Gather(
      req.sequence_id(), req.layer(), plan,
      absl::Span<uint16_t>(reinterpret_cast<uint16_t*>(rows->data()),
                           elements));
}

absl::Status KvMemoryService::DoGetStats(const kv::GetStatsRequest& req,
                                         kv::GetStatsResponse* resp) {
  ToProto(store_->GetStoreStats(), resp->mutable_store());
  if (req.sequence_id() == 0) return absl::OkStatus();
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
