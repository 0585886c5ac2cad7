#include "common/server_tls.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace infinigen {
namespace {

using ::testing::HasSubstr;

std::string Write(const std::string& name, const std::string& text) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(dir ? dir : "/tmp") + "/" + name;
  FILE* f = std::fopen(path.c_str(), "w");
  EXPECT_NE(f, nullptr);
  std::fputs(text.c_str(), f);
  std::fclose(f);
  return path;
}

TEST(ReadServerTlsFiles, NoFilesIsPlaintext) {
  auto pem = ReadServerTlsFiles("", "", "");
  ASSERT_TRUE(pem.ok()) << pem.status();
  EXPECT_FALSE(pem->enabled());
  EXPECT_FALSE(pem->mutual());
}

TEST(ReadServerTlsFiles, ReadsEachFile) {
  auto pem = ReadServerTlsFiles(Write("cert", "CERT"), Write("key", "KEY"),
                                Write("ca", "CA"));
  ASSERT_TRUE(pem.ok()) << pem.status();
  EXPECT_EQ(pem->cert, "CERT");
  EXPECT_EQ(pem->key, "KEY");
  EXPECT_EQ(pem->client_ca, "CA");
  EXPECT_TRUE(pem->enabled());
  EXPECT_TRUE(pem->mutual());
}

TEST(ReadServerTlsFiles, BadFilesNameTheirFlag) {
  const std::string key = Write("key2", "KEY");
  auto missing = ReadServerTlsFiles("/nonexistent/cert.pem", key, "");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("--tls_cert: "));
  auto empty = ReadServerTlsFiles(Write("cert2", "CERT"), key,
                                  Write("empty_ca", ""));
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(empty.status().message()),
              HasSubstr("--tls_client_ca: "));
}

TEST(CheckServerTls, HalfAConfigurationIsInvalid) {
  EXPECT_TRUE(CheckServerTls({}).ok());
  EXPECT_TRUE(CheckServerTls({"C", "K", ""}).ok());
  EXPECT_TRUE(CheckServerTls({"C", "K", "CA"}).ok());
  EXPECT_EQ(CheckServerTls({"C", "", ""}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckServerTls({"", "K", ""}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckServerTls({"", "", "CA"}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GrpcServerCredentials({"", "", "CA"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(GrpcServerCredentials({}).ok());
}

}  // namespace
}  // namespace infinigen
