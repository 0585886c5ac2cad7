// TLS for the gRPC servers (kv_memory_server, `infinigen serve`): the
// PEM files their --tls_cert, --tls_key and --tls_client_ca flags name,
// read once, and the grpc::ServerCredentials they make. One place, so that
// both servers accept the same configurations and say the same thing about
// a bad one. Also the OpenSSL contexts of the TLS that does not go through
// gRPC (the HTTPS API, the memory node's fetch socket and its client).
#ifndef INFINIGEN_COMMON_SERVER_TLS_H_
#define INFINIGEN_COMMON_SERVER_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "openssl/ssl.h"
#include "grpcpp/security/server_credentials.h"

namespace infinigen {

// PEM text. All empty: plaintext. cert and key: TLS. With client_ca too:
// mutual TLS, every client must present a certificate that CA signed.
struct ServerTlsPem {
  std::string cert;
  std::string key;
  std::string client_ca;

  bool enabled() const { return !cert.empty(); }
  bool mutual() const { return !client_ca.empty(); }
};

// The PEM file a flag names: "" for an empty path; InvalidArgument naming
// the flag ("--FLAG: ...") for a file that cannot be read or is empty.
absl::StatusOr<std::string> ReadPemFlagFile(const char* flag,
                                            const std::string& path);

// Reads the files (empty paths are skipped). InvalidArgument naming the
// flag (--tls_cert, --tls_key, --tls_client_ca) for a file that cannot be
// read or is empty, or as CheckServerTls.
absl::StatusOr<ServerTlsPem> ReadServerTlsFiles(const std::string& cert_path,
                                                const std::string& key_path,
                                                const std::string& client_ca_path);

// OK if the PEMs are all empty. Otherwise InvalidArgument naming the flag
// unless cert and key are both set, cert holds PEM certificates (the chain,
// leaf first), key a PEM private key that matches the leaf, and client_ca
// (optional) PEM certificates.
absl::Status CheckServerTls(const ServerTlsPem& pem);

// Loads an enabled `pem` into an OpenSSL server context (cpp-httplib's
// SSLServer): the certificate chain and key, TLS 1.2 at least, and with a
// client CA, client certificates required and verified against it.
// InvalidArgument as CheckServerTls.
absl::Status LoadServerTls(const ServerTlsPem& pem, SSL_CTX* ctx);

// A new server context loaded with an enabled `pem` (LoadServerTls), for a
// server that runs its own TLS (the memory node's fetch socket); no session
// cache or tickets, since its clients hold one long connection each.
// InvalidArgument as CheckServerTls.
absl::StatusOr<std::shared_ptr<SSL_CTX>> NewServerTlsContext(
    const ServerTlsPem& pem);

// A new client context: TLS 1.2 at least, the server's certificate verified
// against `ca` (PEM certificates; the name is the caller's to set on each
// connection), and when `cert` is set, that certificate chain (leaf first)
// and its `key` presented to the server. InvalidArgument for PEM that does
// not parse, a key that is not the certificate's, or a certificate without
// its key (or the reverse).
absl::StatusOr<std::shared_ptr<SSL_CTX>> NewClientTlsContext(
    const std::string& ca, const std::string& cert, const std::string& key);

// For TLS clients' files (the worker's --kv_tls_*): InvalidArgument("holds
// no PEM certificate") unless `pem` holds PEM certificates, and
// InvalidArgument unless `key` is a PEM private key matching the first
// certificate of `cert`. Callers prefix the flag.
absl::Status CheckPemCertificates(const std::string& pem);
absl::Status CheckPemKeyPair(const std::string& cert, const std::string& key);

// Insecure credentials when !pem.enabled(), else SSL credentials (requiring
// and verifying a client certificate when pem.mutual()). InvalidArgument as
// CheckServerTls.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> GrpcServerCredentials(
    const ServerTlsPem& pem);

}  // namespace infinigen

#endif  // INFINIGEN_COMMON_SERVER_TLS_H_
