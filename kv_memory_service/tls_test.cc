// gRPC over TLS between the memory node and its client (issue 18): a
// client that trusts the server's CA and presents a certificate from the
// CA the server requires gets bit-exact rows; every other combination is
// refused before any call reaches the store. The certificates are in
// testing/tls (test-only, valid until 2123).
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "common/file.h"
#include "gtest/gtest.h"
#include "kv_memory_service/kv_client.h"
#include "kv_memory_service/server/kv_server.h"
#include "kv_memory_service/testing/kv_test_data.h"

namespace infinigen::kv_memory_service {
namespace {

std::string Pem(const std::string& name) {
  absl::StatusOr<std::string> text =
      ReadFileToString("kv_memory_service/testing/tls/" + name);
  EXPECT_TRUE(text.ok()) << text.status();
  return text.value_or("");
}

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KvServerOptions options;
    options.listen = "127.0.0.1:0";
    options.tls_cert_pem = Pem("server.pem");
    options.tls_key_pem = Pem("server.key");
    options.tls_client_ca_pem = Pem("ca.pem");
    auto server = KvServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  KvClientOptions Trusting() {
    KvClientOptions options;
    options.tls_ca_pem = Pem("ca.pem");
    options.tls_cert_pem = Pem("client.pem");
    options.tls_key_pem = Pem("client.key");
    options.connect_timeout = absl::Seconds(3);
    return options;
  }

  std::unique_ptr<KvServer> server_;
};

TEST_F(TlsTest, AClientWithTheRightCertificatesGetsItsRows) {
  // Under TLS the plain fetch socket is off: fetches take the gRPC stream.
  EXPECT_EQ(server_->fetch_port(), 0);
  auto client = ConnectKvClient(server_->client_address(), Trusting());
  ASSERT_TRUE(client.ok()) << client.status();
  const SequenceGeometry g = testdata::MakeGeometry(2, 2, 16, 64);
  auto id = (*client)->Open(g);
  ASSERT_TRUE(id.ok()) << id.status();
  testdata::TestBlock b = testdata::MakeTestBlock(9, g, 0, 2, 0, 20);
  ASSERT_TRUE((*client)->Append(*id, b.block).ok());
  const OwnedFetchPlan plan = OwnedFetchPlan::PerHead({{19, 0, 7}, {3}});
  auto buffer = (*client)->NewFetchBuffer(FetchElements(plan.view(), 16));
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  ASSERT_TRUE((*client)->Fetch(*id, 1, plan.view(), buffer->get()).ok());
  const std::vector<uint16_t> want = testdata::ExpectedRows(9, g, 1, plan.view());
  EXPECT_EQ(std::vector<uint16_t>((*buffer)->data(),
                                  (*buffer)->data() + want.size()),
            want);
}

TEST_F(TlsTest, EveryOtherClientIsRefused) {
  const std::string address = server_->client_address();
  KvClientOptions plaintext;
  plaintext.connect_timeout = absl::Seconds(3);
  EXPECT_FALSE(ConnectKvClient(address, plaintext).ok()) << "plaintext";

  KvClientOptions no_certificate = Trusting();
  no_certificate.tls_cert_pem.clear();
  no_certificate.tls_key_pem.clear();
  EXPECT_FALSE(ConnectKvClient(address, no_certificate).ok())
      << "no client certificate";

  KvClientOptions stranger = Trusting();
  stranger.tls_cert_pem = Pem("other.pem");
  stranger.tls_key_pem = Pem("other.key");
  EXPECT_FALSE(ConnectKvClient(address, stranger).ok())
      << "a certificate from another CA";

  KvClientOptions wrong_ca = Trusting();
  wrong_ca.tls_ca_pem = Pem("other.pem");
  EXPECT_FALSE(ConnectKvClient(address, wrong_ca).ok())
      << "a server the client does not trust";

  // And the server still serves the right client.
  auto client = ConnectKvClient(address, Trusting());
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_TRUE((*client)->Open(testdata::MakeGeometry(1, 1, 8, 8)).ok());
}

TEST(TlsOptionsTest, HalfAConfigurationIsInvalid) {
  KvServerOptions options;
  options.listen = "127.0.0.1:0";
  options.tls_cert_pem = Pem("server.pem");
  EXPECT_EQ(KvServer::Start(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.tls_cert_pem.clear();
  options.tls_client_ca_pem = Pem("ca.pem");
  EXPECT_EQ(KvServer::Start(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  KvClientOptions client;
  client.tls_cert_pem = Pem("client.pem");
  client.tls_key_pem = Pem("client.key");
  EXPECT_EQ(ConnectKvClient("tcp://127.0.0.1:1", client).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace infinigen::kv_memory_service
