// ConnectKvClient: the one place that maps an address to a data plane.
// A new data plane adds its directory and target, one line below, and its
// target to :kv_client's deps.
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kv_memory_service/inproc/inproc_client.h"
#include "kv_memory_service/client/kv_client.h"
#include "kv_memory_service/rdma/rdma_client.h"
#include "kv_memory_service/sharded/sharded_kv_client.h"
#include "kv_memory_service/shm/shm_client.h"
#include "kv_memory_service/control/grpc_client.h"

namespace infinigen::kv_memory_service {
namespace {

absl::StatusOr<std::unique_ptr<KvClient>> ConnectOneNode(
    const std::string& address, const KvClientOptions& options) {
  if (address == "inproc:") {
    std::shared_ptr<KvStore> store = options.inproc_store;
    if (store == nullptr) {
      store = std::make_shared<KvStore>(options.inproc_store_options);
    }
    return NewInprocKvClient(std::move(store));
  }
  if (absl::StartsWith(address, "tcp://") || absl::StartsWith(address, "unix:")) {
    return ConnectGrpcKvClient(address, options);
  }
  if (absl::StartsWith(address, "shm:")) {
    // Control calls go to the gRPC address the server announces.
    return ConnectShmKvClient(address, options, ConnectGrpcKvClient);
  }
  if (absl::StartsWith(address, "rdma://")) {
    // Unavailable("no RDMA device: ...") on hosts without one.
    return ConnectRdmaKvClient(address, options, ConnectGrpcKvClient);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown KV memory address '", address,
      "' (want inproc:, tcp://HOST:PORT, unix:PATH, shm:..., rdma://HOST:PORT,"
      " a comma-separated list of those, or dns+tcp://NAME:PORT)"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvClient>> ConnectKvClient(
    const std::string& address, const KvClientOptions& options) {
  // Several nodes: one sequence's KV heads spread over all of them.
  if (IsMemoryTierAddress(address)) {
    return ConnectMemoryTier(address, options, ConnectOneNode);
  }
  return ConnectOneNode(address, options);
}

}  // namespace infinigen::kv_memory_service
