#include "common/server_tls.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace infinigen {
namespace {

using ::testing::HasSubstr;

// The test certificates of kv_memory_service/testing/tls.
std::string Cert(const std::string& name) {
  return "kv_memory_service/testing/tls/" + name;
}

std::string Pem(const std::string& name) {
  absl::StatusOr<std::string> text = ReadFileToString(Cert(name));
  EXPECT_TRUE(text.ok()) << text.status();
  return text.value_or("");
}

std::string Write(const std::string& name, const std::string& text) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(dir ? dir : "/tmp") + "/" + name;
  FILE* f = std::fopen(path.c_str(), "w");
  EXPECT_NE(f, nullptr);
  std::fputs(text.c_str(), f);
  std::fclose(f);
  return path;
}

std::string Message(const absl::Status& status) {
  return std::string(status.message());
}

TEST(ReadServerTlsFiles, NoFilesIsPlaintext) {
  auto pem = ReadServerTlsFiles("", "", "");
  ASSERT_TRUE(pem.ok()) << pem.status();
  EXPECT_FALSE(pem->enabled());
  EXPECT_FALSE(pem->mutual());
}

TEST(ReadServerTlsFiles, ReadsEachFile) {
  auto pem = ReadServerTlsFiles(Cert("server.pem"), Cert("server.key"),
                                Cert("ca.pem"));
  ASSERT_TRUE(pem.ok()) << pem.status();
  EXPECT_EQ(pem->cert, Pem("server.pem"));
  EXPECT_EQ(pem->key, Pem("server.key"));
  EXPECT_EQ(pem->client_ca, Pem("ca.pem"));
  EXPECT_TRUE(pem->enabled());
  EXPECT_TRUE(pem->mutual());
}

TEST(ReadServerTlsFiles, BadFilesNameTheirFlag) {
  const std::string cert = Cert("server.pem"), key = Cert("server.key");
  auto missing = ReadServerTlsFiles("/nonexistent/cert.pem", key, "");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(missing.status()), HasSubstr("--tls_cert: "));
  auto empty = ReadServerTlsFiles(cert, key, Write("empty_ca", ""));
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(empty.status()), HasSubstr("--tls_client_ca: "));
  const std::string garbage = Write("garbage", "not a certificate\n");
  EXPECT_THAT(Message(ReadServerTlsFiles(garbage, key, "").status()),
              HasSubstr("--tls_cert: holds no PEM certificate"));
  EXPECT_THAT(Message(ReadServerTlsFiles(cert, garbage, "").status()),
              HasSubstr("--tls_key: holds no PEM private key"));
  EXPECT_THAT(Message(ReadServerTlsFiles(cert, key, garbage).status()),
              HasSubstr("--tls_client_ca: holds no PEM certificate"));
  EXPECT_THAT(
      Message(ReadServerTlsFiles(cert, Cert("client.key"), "").status()),
      HasSubstr("--tls_key is not the private key of --tls_cert"));
}

TEST(CheckPem, ClientFiles) {
  EXPECT_TRUE(CheckPemCertificates(Pem("ca.pem")).ok());
  EXPECT_EQ(CheckPemCertificates("garbage").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckPemCertificates(Pem("client.key")).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckPemKeyPair(Pem("client.pem"), Pem("client.key")).ok());
  EXPECT_THAT(Message(CheckPemKeyPair(Pem("client.pem"), Pem("other.key"))),
              HasSubstr("not the private key"));
  EXPECT_THAT(Message(CheckPemKeyPair(Pem("client.pem"), "garbage")),
              HasSubstr("no PEM private key"));
  EXPECT_THAT(Message(CheckPemKeyPair("garbage", Pem("client.key"))),
              HasSubstr("no PEM certificate"));
}

TEST(CheckServerTls, HalfAConfigurationIsInvalid) {
  const std::string cert = Pem("server.pem"), key = Pem("server.key");
  const std::string ca = Pem("ca.pem");
  EXPECT_TRUE(CheckServerTls({}).ok());
  EXPECT_TRUE(CheckServerTls({cert, key, ""}).ok());
  EXPECT_TRUE(CheckServerTls({cert, key, ca}).ok());
  EXPECT_EQ(CheckServerTls({cert, "", ""}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckServerTls({"", key, ""}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckServerTls({"", "", ca}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GrpcServerCredentials({"", "", ca}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GrpcServerCredentials({"garbage", key, ""}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(GrpcServerCredentials({}).ok());
  EXPECT_TRUE(GrpcServerCredentials({cert, key, ca}).ok());
}

// The OpenSSL contexts of the memory node's fetch socket and its client.
TEST(TlsContexts, LoadWhatTheFlagsAccept) {
  const std::string cert = Pem("server.pem"), key = Pem("server.key");
  const std::string ca = Pem("ca.pem");
  EXPECT_TRUE(NewServerTlsContext({cert, key, ""}).ok());
  EXPECT_TRUE(NewServerTlsContext({cert, key, ca}).ok());
  EXPECT_EQ(NewServerTlsContext({}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(NewServerTlsContext({cert, Pem("client.key"), ""})
                          .status()),
              HasSubstr("--tls_key is not the private key of --tls_cert"));

  EXPECT_TRUE(NewClientTlsContext(ca, "", "").ok());
  EXPECT_TRUE(
      NewClientTlsContext(ca, Pem("client.pem"), Pem("client.key")).ok());
  EXPECT_THAT(Message(NewClientTlsContext("garbage", "", "").status()),
              HasSubstr("tls_ca_pem: holds no PEM certificate"));
  EXPECT_EQ(NewClientTlsContext(ca, Pem("client.pem"), "").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      Message(NewClientTlsContext(ca, Pem("client.pem"), Pem("other.key"))
                  .status()),
      HasSubstr("tls_key_pem is not the private key of tls_cert_pem"));
}

}  // namespace
}  // namespace infinigen
