#include "common/server_tls.h"

#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/status.h"

namespace infinigen {

absl::StatusOr<ServerTlsPem> ReadServerTlsFiles(
    const std::string& cert_path, const std::string& key_path,
    const std::string& client_ca_path) {
  ServerTlsPem pem;
  const struct {
    const char* flag;
    const std::string& path;
    std::string* text;
  } files[] = {{"tls_cert", cert_path, &pem.cert},
               {"tls_key", key_path, &pem.key},
               {"tls_client_ca", client_ca_path, &pem.client_ca}};
  for (const auto& file : files) {
    if (file.path.empty()) continue;
    absl::StatusOr<std::string> text = ReadFileToString(file.path);
    if (!text.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", file.flag, ": ", text.status().message()));
    }
    if (text->empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", file.flag, ": ", file.path, " is empty"));
    }
    *file.text = *std::move(text);
  }
  IG_RETURN_IF_ERROR(CheckServerTls(pem));
  return pem;
}

absl::Status CheckServerTls(const ServerTlsPem& pem) {
  if (pem.cert.empty() != pem.key.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert and --tls_key go together (the server's certificate "
        "chain and its private key)");
  }
  if (!pem.enabled() && pem.mutual()) {
    return absl::InvalidArgumentError(
        "--tls_client_ca needs --tls_cert and --tls_key");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> GrpcServerCredentials(
    const ServerTlsPem& pem) {
  IG_RETURN_IF_ERROR(CheckServerTls(pem));
  if (!pem.enabled()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl(
      pem.mutual() ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                   : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  ssl.pem_root_certs = pem.client_ca;
  ssl.pem_key_cert_pairs.push_back({pem.key, pem.cert});
  return grpc::SslServerCredentials(ssl);
}

}  // namespace infinigen
