// The TCP data plane: a KvClient for a kv_memory_server at tcp://HOST:PORT
// or unix:PATH. Control calls (Open, Append, Close, statistics) are unary
// RPCs with a deadline of options.rpc_timeout. Fetches share one long-lived
// connection per client: for tcp://, the server's fetch socket
// (fetch_wire.h; port from GetServerInfo, same host), where the request
// leaves with one sendmsg and a reader thread receives the rows straight
// into the FetchBuffer; for unix: (or options.tcp_fetch_socket = false, or
// a server without one) the gRPC FetchStream, rows copied out of the
// response. FetchAsync sends and returns; Wait gives up at
// options.fetch_timeout, after which nothing writes into the buffer.
//
// TLS (options.tls_ca_pem): the channel, and the fetch socket, which a node
// under TLS advertises as fetch_tls_port (fetch_tls.h): the client checks
// its certificate against the CA and the address's host (or
// tls_server_name) and presents tls_cert_pem. A TLS client never uses a
// plaintext fetch socket (it takes the stream instead); a plaintext client
// that finds a TLS one fails its fetches with FailedPrecondition.
//
// A server that dies fails every fetch in flight with Unavailable as soon
// as the connection drops; a hung one with DeadlineExceeded at the timeout
// (the connection is then cut; keepalive probes also close a silent one).
// While the server is unreachable, fetches fail at once with Unavailable;
// the next fetch after it is back opens a new connection, so a restarted
// server is picked up (its sequences are gone: NotFound). Thread-safe.
//
// Leases: the client opens a session (OpenSession) when it is made and a
// heartbeat thread renews it (kv_client.h, "Leases"); every sequence it
// opens belongs to that session. A heartbeat that finds the session gone
// (expired, or a restarted server) opens a new one and logs a warning.
// Health() is the last heartbeat's outcome. Destroying the client ends its
// session at once (CloseSession), closing the sequences it still owns.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_CONTROL_GRPC_CLIENT_H_
#define INFINIGEN_KV_MEMORY_SERVICE_CONTROL_GRPC_CLIENT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/channel.h"
#include "kv_memory_service/client/kv_client.h"

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

#endif  // INFINIGEN_KV_MEMORY_SERVICE_CONTROL_GRPC_CLIENT_H_
