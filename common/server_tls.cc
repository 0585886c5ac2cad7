#include "common/server_tls.h"

#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/status.h"
#include "openssl/err.h"
#include "openssl/pem.h"
#include "openssl/x509.h"

namespace infinigen {

absl::StatusOr<ServerTlsPem> ReadServerTlsFiles(
    const std::string& cert_path, const std::string& key_path,
    const std::string& client_ca_path) {
  ServerTlsPem pem;
  IG_ASSIGN_OR_RETURN(pem.cert, ReadPemFlagFile("tls_cert", cert_path));
  IG_ASSIGN_OR_RETURN(pem.key, ReadPemFlagFile("tls_key", key_path));
  IG_ASSIGN_OR_RETURN(pem.client_ca,
                      ReadPemFlagFile("tls_client_ca", client_ca_path));
  IG_RETURN_IF_ERROR(CheckServerTls(pem));
  return pem;
}

absl::StatusOr<std::string> ReadPemFlagFile(const char* flag,
                                            const std::string& path) {
  if (path.empty()) return std::string();
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": ", text.status().message()));
  }
  if (text->empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": ", path, " is empty"));
  }
  return text;
}

namespace {

using X509Ptr = std::unique_ptr<X509, decltype(&X509_free)>;
using BioPtr = std::unique_ptr<BIO, decltype(&BIO_free)>;

BioPtr MemoryBio(const std::string& text) {
  return BioPtr(BIO_new_mem_buf(text.data(), static_cast<int>(text.size())),
                &BIO_free);
}

// Every certificate of a PEM text, in order; empty if it holds none or one
// does not parse.
std::vector<X509Ptr> ReadCertificates(const std::string& pem) {
  std::vector<X509Ptr> out;
  BioPtr bio = MemoryBio(pem);
  while (X509* cert = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) {
    out.emplace_back(cert, &X509_free);
  }
  // Reading ends with "no start line" at the end of the text; any other
  // error is a broken certificate.
  if (ERR_GET_REASON(ERR_peek_last_error()) != PEM_R_NO_START_LINE) {
    out.clear();
  }
  ERR_clear_error();
  return out;
}

// `name`: the flag or option that holds the PEM text.
absl::Status NotPem(const char* name, const char* what) {
  return absl::InvalidArgumentError(
      absl::StrCat(name, ": holds no PEM ", what));
}

// Loads a certificate chain (leaf first) and its private key into `ctx`;
// errors name the flags or options that hold them.
absl::Status UseCertificateAndKey(const std::string& cert,
                                  const std::string& key, const char* cert_name,
                                  const char* key_name, SSL_CTX* ctx) {
  std::vector<X509Ptr> chain = ReadCertificates(cert);
  if (chain.empty() || SSL_CTX_use_certificate(ctx, chain[0].get()) != 1) {
    ERR_clear_error();
    return NotPem(cert_name, "certificate");
  }
  for (size_t i = 1; i < chain.size(); ++i) {
    // On success the context owns the certificate.
    if (SSL_CTX_add_extra_chain_cert(ctx, chain[i].get()) != 1) {
      ERR_clear_error();
      return NotPem(cert_name, "certificate chain");
    }
    chain[i].release();
  }
  BioPtr bio = MemoryBio(key);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> pkey(
      PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr),
      &EVP_PKEY_free);
  if (pkey == nullptr) {
    ERR_clear_error();
    return NotPem(key_name, "private key");
  }
  if (SSL_CTX_use_PrivateKey(ctx, pkey.get()) != 1 ||
      SSL_CTX_check_private_key(ctx) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat(key_name, " is not the private key of ", cert_name));
  }
  return absl::OkStatus();
}

// Adds the certificates of `pem` to the certificates `ctx` verifies its
// peers against.
absl::Status TrustCertificates(const std::string& pem, const char* name,
                               SSL_CTX* ctx) {
  std::vector<X509Ptr> cas = ReadCertificates(pem);
  if (cas.empty()) return NotPem(name, "certificate");
  X509_STORE* store = SSL_CTX_get_cert_store(ctx);
  for (const X509Ptr& ca : cas) {
    if (X509_STORE_add_cert(store, ca.get()) != 1) {
      ERR_clear_error();
      return NotPem(name, "certificate");
    }
  }
  return absl::OkStatus();
}

using SslCtxPtr = std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)>;

std::shared_ptr<SSL_CTX> Shared(SslCtxPtr ctx) {
  return std::shared_ptr<SSL_CTX>(ctx.release(), &SSL_CTX_free);
}

}  // namespace

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
  if (!pem.enabled()) return absl::OkStatus();
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(
      SSL_CTX_new(TLS_server_method()), &SSL_CTX_free);
  if (ctx == nullptr) return absl::InternalError("SSL_CTX_new failed");
  return LoadServerTls(pem, ctx.get());
}

absl::Status LoadServerTls(const ServerTlsPem& pem, SSL_CTX* ctx) {
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  IG_RETURN_IF_ERROR(
      UseCertificateAndKey(pem.cert, pem.key, "--tls_cert", "--tls_key", ctx));
  if (pem.mutual()) {
    IG_RETURN_IF_ERROR(
        TrustCertificates(pem.client_ca, "--tls_client_ca", ctx));
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT,
                       nullptr);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<SSL_CTX>> NewServerTlsContext(
    const ServerTlsPem& pem) {
  if (!pem.enabled()) {
    return absl::InvalidArgumentError("a TLS server needs --tls_cert");
  }
  SslCtxPtr ctx(SSL_CTX_new(TLS_server_method()), &SSL_CTX_free);
  if (ctx == nullptr) return absl::InternalError("SSL_CTX_new failed");
  IG_RETURN_IF_ERROR(LoadServerTls(pem, ctx.get()));
  SSL_CTX_set_session_cache_mode(ctx.get(), SSL_SESS_CACHE_OFF);
  SSL_CTX_set_options(ctx.get(), SSL_OP_NO_TICKET);
  SSL_CTX_set_num_tickets(ctx.get(), 0);
  return Shared(std::move(ctx));
}

absl::StatusOr<std::shared_ptr<SSL_CTX>> NewClientTlsContext(
    const std::string& ca, const std::string& cert, const std::string& key) {
  if (cert.empty() != key.empty()) {
    return absl::InvalidArgumentError(
        "a TLS client certificate needs its key, and the key its certificate");
  }
  SslCtxPtr ctx(SSL_CTX_new(TLS_client_method()), &SSL_CTX_free);
  if (ctx == nullptr) return absl::InternalError("SSL_CTX_new failed");
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  IG_RETURN_IF_ERROR(TrustCertificates(ca, "tls_ca_pem", ctx.get()));
  if (!cert.empty()) {
    IG_RETURN_IF_ERROR(UseCertificateAndKey(cert, key, "tls_cert_pem",
                                            "tls_key_pem", ctx.get()));
  }
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
  return Shared(std::move(ctx));
}

absl::Status CheckPemCertificates(const std::string& pem) {
  if (ReadCertificates(pem).empty()) {
    return absl::InvalidArgumentError("holds no PEM certificate");
  }
  return absl::OkStatus();
}

absl::Status CheckPemKeyPair(const std::string& cert, const std::string& key) {
  std::vector<X509Ptr> chain = ReadCertificates(cert);
  if (chain.empty()) {
    return absl::InvalidArgumentError("the certificate holds no PEM certificate");
  }
  BioPtr bio = MemoryBio(key);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> pkey(
      PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr),
      &EVP_PKEY_free);
  if (pkey == nullptr) {
    ERR_clear_error();
    return absl::InvalidArgumentError("the key holds no PEM private key");
  }
  if (X509_check_private_key(chain[0].get(), pkey.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        "the key is not the private key of the certificate");
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
