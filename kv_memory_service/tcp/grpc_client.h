// The gRPC data plane: a KvClient for a kv_memory_server at tcp://HOST:PORT
// or unix:PATH. Control calls (Open, Append, Close, statistics) are unary
// RPCs with a deadline of options.rpc_timeout. Fetches share one long-lived
// FetchStream per client: FetchAsync writes the request and returns; a
// reader thread matches each response to its FetchBuffer by request id and
// copies the rows in (the one copy this data plane makes); Wait gives up at
// options.fetch_timeout, after which nothing writes into the buffer.
//
// A server that dies fails every fetch in flight with Unavailable as soon
// as the connection drops; a hung one with DeadlineExceeded at the timeout
// (keepalive pings close a silent connection too). The next fetch opens a
// new stream, so a restarted server is picked up (its sequences are gone:
// NotFound). Thread-safe.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_TCP_GRPC_CLIENT_H_
#define INFINIGEN_KV_MEMORY_SERVICE_TCP_GRPC_CLIENT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/channel.h"
#include "kv_memory_service/kv_client.h"

namespace infinigen::kv_memory_service {

// `address` is tcp://HOST:PORT or unix:PATH. InvalidArgument for anything
// else; Unavailable when the server does not accept a connection within
// options.connect_timeout.
absl::StatusOr<std::unique_ptr<KvClient>> ConnectGrpcKvClient(
    const std::string& address, const KvClientOptions& options);

// Over a channel the caller made (e.g. KvServer::InProcessChannel()).
std::unique_ptr<KvClient> NewGrpcKvClient(
    std::shared_ptr<grpc::Channel> channel, const KvClientOptions& options);

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_TCP_GRPC_CLIENT_H_
