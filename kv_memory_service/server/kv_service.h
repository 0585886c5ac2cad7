// KvMemoryService: the KvMemory gRPC service over a KvStore, and the only
// place where absl::Status becomes grpc::Status. It converts protobufs,
// checks the "authorization: Bearer TOKEN" metadata (UNAUTHENTICATED) and
// calls the store; it keeps no state of its own but the set of open fetch
// streams, so that shutdown can end them (a fetch stream lives as long as
// its client and would otherwise hold shutdown to its deadline).
//
// Private to the server package; KvServer owns one. Thread-safe: gRPC calls
// the methods from many threads.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_SERVER_KV_SERVICE_H_
#define INFINIGEN_KV_MEMORY_SERVICE_SERVER_KV_SERVICE_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "kv_memory_service/store/kv_store.h"
#include "kv_memory_service/serving/credentials.h"
#include "kv_memory_service/serving/request_metrics.h"
#include "proto/kv_memory.grpc.pb.h"

namespace infinigen::kv_memory_service {

class KvMemoryService final : public kv::KvMemory::Service {
 public:
  // `credentials` empty: no check; a sequence opens in its credential's
  // prefix namespace (credentials.h). Fetches whose rows exceed
  // max_message_bytes (less room for the rest of the response) are
  // RESOURCE_EXHAUSTED.
  // fetch_port: what GetServerInfo advertises (0: no fetch socket), as
  // fetch_tls_port when `fetch_tls`. `metrics` (not owned, outlives the
  // service; null: none) records every fetch and append served and every
  // call refused.
  KvMemoryService(std::shared_ptr<KvStore> store, Credentials credentials,
                  int32_t max_message_bytes, int32_t fetch_port, bool fetch_tls,
                  RequestMetrics* metrics = nullptr);

  // Ends every open fetch stream now and refuses new ones (UNAVAILABLE).
  // Unary calls are unaffected; grpc::Server::Shutdown drains those.
  void CancelStreams();

  grpc::Status OpenSession(grpc::ServerContext* ctx,
                           const kv::OpenSessionRequest* req,
                           kv::OpenSessionResponse* resp) override;
  grpc::Status Heartbeat(grpc::ServerContext* ctx,
                         const kv::HeartbeatRequest* req,
                         kv::HeartbeatResponse* resp) override;
  grpc::Status CloseSession(grpc::ServerContext* ctx,
                            const kv::CloseSessionRequest* req,
                            kv::CloseSessionResponse* resp) override;
  grpc::Status OpenSequence(grpc::ServerContext* ctx,
                            const kv::OpenSequenceRequest* req,
                            kv::OpenSequenceResponse* resp) override;
  grpc::Status Append(grpc::ServerContext* ctx, const kv::AppendRequest* req,
                      kv::AppendResponse* resp) override;
  grpc::Status Fetch(grpc::ServerContext* ctx, const kv::FetchRequest* req,
                     kv::FetchResponse* resp) override;
  grpc::Status FetchStream(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<kv::FetchResponse, kv::FetchRequest>* stream)
      override;
  grpc::Status CloseSequence(grpc::ServerContext* ctx,
                             const kv::CloseSequenceRequest* req,
                             kv::CloseSequenceResponse* resp) override;
  grpc::Status GetStats(grpc::ServerContext* ctx,
                        const kv::GetStatsRequest* req,
                        kv::GetStatsResponse* resp) override;
  grpc::Status GetServerInfo(grpc::ServerContext* ctx,
                             const kv::GetServerInfoRequest* req,
                             kv::GetServerInfoResponse* resp) override;

 private:
  // The caller's credential (null: no check configured), or
  // Unauthenticated.
  absl::StatusOr<const Credential*> Authenticate(
      const grpc::ServerContext& ctx) const;
  absl::Status Authorize(const grpc::ServerContext& ctx) const {
    return Authenticate(ctx).status();
  }
  // The call's reply; a refusal is counted.
  grpc::Status Reply(const absl::Status& status);
  absl::Status DoOpen(const Credential* credential,
                      const kv::OpenSequenceRequest& req,
                      kv::OpenSequenceResponse* resp);
  // `ctx`'s deadline and cancellation travel with the block (AppendBlock).
  absl::Status DoAppend(const grpc::ServerContext& ctx,
                        const kv::AppendRequest& req, kv::AppendResponse* resp);
  // Gathers straight into the response's rows, resized in place; on error
  // the rows are empty.
  absl::Status FetchInto(const kv::FetchRequest& req, kv::FetchResponse* resp);
  absl::Status DoGetStats(const kv::GetStatsRequest& req,
                          kv::GetStatsResponse* resp);

  const std::shared_ptr<KvStore> store_;
  const Credentials credentials_;
  const int64_t max_message_bytes_;
  const int32_t fetch_port_;
  const bool fetch_tls_;
  RequestMetrics* const metrics_;

  absl::Mutex mu_;
  bool streams_cancelled_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<grpc::ServerContext*> streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_SERVER_KV_SERVICE_H_
