// The client side of the RDMA data plane: rdma://HOST:PORT, optionally
// ?device=NAME&port=N&gid_index=N to pick the local RDMA port.
//
// Connecting opens the local RDMA device first, so that a machine without
// one fails at once with Unavailable("no RDMA device: ..."), before any
// network traffic. Then: one RC queue pair to the server, set up over gRPC
// (KvRdma.Connect at HOST:PORT, queue_pair.h describes the handshake), and
// a control client for tcp://HOST:PORT made by `connect_control` for Open,
// Append, Close and statistics.
//
// Each FetchBuffer is page-aligned host memory registered for remote write
// (and registered with CUDA as pinned memory where a CUDA device answers),
// announced to the server with KvRdma.RegisterBuffer. A fetch is one SEND
// (the request), one RDMA WRITE by the server into the buffer and one SEND
// back (the status); Wait polls the completion queue, spinning briefly and
// then sleeping on its completion channel (rdma_wire.h has the packets).
//
// Failure: a completion error (the server's QP gone: retries exhausted) or a
// gRPC channel that has failed (checked every 100 ms of waiting) ends every
// wait with Unavailable; options.fetch_timeout with DeadlineExceeded. Both
// move the queue pair to ERR first, so the server can no longer write into
// any buffer, and leave the client unusable (later fetches: Unavailable).
//
// Thread-safety: as KvClient.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_RDMA_RDMA_CLIENT_H_
#define INFINIGEN_KV_MEMORY_SERVICE_RDMA_RDMA_CLIENT_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kv_memory_service/client/kv_client.h"

namespace infinigen::kv_memory_service {

// Makes the control client for tcp://HOST:PORT.
using RdmaControlConnector =
    std::function<absl::StatusOr<std::unique_ptr<KvClient>>(
        const std::string& control_address, const KvClientOptions& options)>;

// InvalidArgument for a malformed address; Unavailable with "no RDMA
// device: ..." where this host has none, and when the server does not
// answer or has no RDMA device itself; Unauthenticated for a wrong token.
absl::StatusOr<std::unique_ptr<KvClient>> ConnectRdmaKvClient(
    const std::string& address, const KvClientOptions& options,
    const RdmaControlConnector& connect_control);

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_RDMA_RDMA_CLIENT_H_
