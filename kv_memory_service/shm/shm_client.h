// The client side of the shared-memory data plane: `shm:unix:PATH`, where
// PATH is the unix socket a ShmServer (kv_memory_server --shm_listen)
// listens on. Same host only.
//
// Connecting: the server's Hello names its control address (the gRPC
// endpoint); control calls (Open, Close, statistics) go to a client for
// that address, made by `connect_control`. Fetches and appends never touch
// gRPC (an append's rows are written into a slot the client keeps for
// appends, and appended by the server from there; only a block with prefix
// annotations goes through the control client):
// every FetchBuffer is a slot in memory shared with the server (a sealed
// memfd passed over the socket), registered with CUDA as pinned memory when
// a CUDA device is present. FetchAsync writes the plan into the slot and
// rings a doorbell; the server gathers into the slot; Wait spins briefly and
// then sleeps on a futex (protocol in shm_protocol.h).
//
// Failure: Wait gives up with Unavailable within about 10 ms of the server's
// death (its socket closes) and with DeadlineExceeded after
// options.fetch_timeout. After the server went away, the next call tries to
// reconnect to a server at the same path (a restarted one) and re-sends the
// live buffers, so the same client and buffers work again, as the gRPC
// client does. A fetch that times out while the server is still gathering
// (a hung server), or a setup call the server does not answer, leaves the
// client unusable (Unavailable from then on): such a fetch's buffer pages
// are swapped for private memory so that a late server cannot write into
// them.
//
// Thread-safety: as KvClient.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_SHM_SHM_CLIENT_H_
#define INFINIGEN_KV_MEMORY_SERVICE_SHM_SHM_CLIENT_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kv_memory_service/client/kv_client.h"

namespace infinigen::kv_memory_service {

// Makes the control client for the address the server announces.
using ControlConnector = std::function<absl::StatusOr<std::unique_ptr<KvClient>>(
    const std::string& control_address, const KvClientOptions& options)>;

// InvalidArgument for an address not of the form shm:unix:PATH; Unavailable
// when nothing listens there; Unauthenticated for a wrong auth token;
// errors of connect_control.
absl::StatusOr<std::unique_ptr<KvClient>> ConnectShmKvClient(
    const std::string& address, const KvClientOptions& options,
    const ControlConnector& connect_control);

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_SHM_SHM_CLIENT_H_
