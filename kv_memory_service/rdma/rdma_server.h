// RdmaServer: the server side of the RDMA data plane. Its KvRdma gRPC
// service (proto/kv_rdma.proto) sets up one RC queue pair per client; a
// thread per connection then serves that client's fetches: receive the
// request (reading a large plan from the client with one RDMA READ), gather
// from the KvStore into a registered staging buffer, and post one RDMA
// WRITE of the rows into the client's registered FetchBuffer chained with a
// SEND of the status. The staging buffer is reused only after the SEND
// completes, which, on an RC queue pair, also means the WRITE has landed.
//
// A connection ends on Disconnect, on any completion error (the client
// died: its QP stops answering) or at shutdown.
//
// Thread-safety: the service runs on gRPC's threads; Start and the
// destructor from one thread. The store is shared with the gRPC KvMemory
// service.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_RDMA_RDMA_SERVER_H_
#define INFINIGEN_KV_MEMORY_SERVICE_RDMA_RDMA_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/impl/service_type.h"
#include "kv_memory_service/serving/credentials.h"
#include "kv_memory_service/store/kv_store.h"
#include "kv_memory_service/serving/request_metrics.h"

namespace infinigen::kv_memory_service {

struct RdmaServerOptions {
  // ibverbs device name; empty = the first device with an active port.
  std::string device;
  int port = 0;        // 0 = the device's first active port
  int gid_index = -1;  // -1 = chosen from the GID table (rdma_device.h)
  // Clients must send "authorization: Bearer TOKEN" of one of these;
  // empty = no check.
  Credentials credentials;
  int max_connections = 64;
  // How long a connection thread polls for the next request before it
  // sleeps on its completion channel.
  absl::Duration spin = absl::Microseconds(200);
  // Records each fetch served or refused (not owned, outlives the server;
  // null: none).
  RequestMetrics* metrics = nullptr;
};

class RdmaServer {
 public:
  // Opens the device. Unavailable("no RDMA device: ...") where there is none.
  static absl::StatusOr<std::unique_ptr<RdmaServer>> Start(
      std::shared_ptr<KvStore> store, const RdmaServerOptions& options);
  // Ends every connection (clients' waits fail) and joins their threads.
  ~RdmaServer();
  RdmaServer(const RdmaServer&) = delete;
  RdmaServer& operator=(const RdmaServer&) = delete;

  // The KvRdma service, to register with the gRPC server before it starts.
  grpc::Service* service();
  // The device and port, for logs.
  std::string Describe() const;

 private:
  class Impl;
  explicit RdmaServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_RDMA_RDMA_SERVER_H_
