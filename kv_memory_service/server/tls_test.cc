// TLS between the memory node and its client: a client that
// trusts the server's CA and presents a certificate from the CA the server
// requires gets bit-exact rows, over gRPC and over the fetch socket, which
// speaks TLS too; every other combination is refused before any call
// reaches the store, and the fetch socket drops plaintext peers, peers
// without the right certificate and unfinished handshakes while it serves
// the right client. The certificates are in testing/tls (test-only, valid
// until 2123).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/file.h"
#include "common/metrics.h"
#include "common/server_tls.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv_memory_service/client/kv_client.h"
#include "kv_memory_service/server/kv_server.h"
#include "kv_memory_service/tcp/fetch_tls.h"
#include "kv_memory_service/tcp/fetch_wire.h"
#include "kv_memory_service/testing/kv_test_data.h"
#include "proto/kv_memory.grpc.pb.h"

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
    // Short, for the peer that never finishes its handshake; long enough
    // for a loaded machine's real handshakes.
    options.fetch_handshake_timeout = absl::Seconds(2);
    auto server = KvServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  // Fetches the fetch socket (the "tcp" plane) and the gRPC stream have
  // served.
  int64_t FetchesServed(const char* plane) {
    const std::string text = MetricsText({server_->request_metrics()});
    const std::string key =
        absl::StrCat("infinigen_kv_request_seconds_count{op=\"fetch\",plane=\"",
                     plane, "\"} ");
    const size_t at = text.find(key);
    EXPECT_NE(at, std::string::npos) << text;
    if (at == std::string::npos) return -1;
    return std::stoll(text.substr(at + key.size()));
  }

  int DialFetchSocket() {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(server_->fetch_port());
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    return fd;
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

// A client with the right certificates, one sequence, and a check that a
// fetch returns its rows bit for bit.
class RightClient {
 public:
  explicit RightClient(std::unique_ptr<KvClient> client)
      : client_(std::move(client)) {
    auto id = client_->Open(g_);
    EXPECT_TRUE(id.ok()) << id.status();
    id_ = id.value_or(0);
    testdata::TestBlock b = testdata::MakeTestBlock(9, g_, 0, 2, 0, 20);
    EXPECT_TRUE(client_->Append(id_, b.block).ok());
    auto buffer = client_->NewFetchBuffer(FetchElements(plan_.view(), 16));
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    if (buffer.ok()) buffer_ = *std::move(buffer);
  }

  void ExpectRows() {
    ASSERT_NE(buffer_, nullptr);
    const absl::Status fetched =
        client_->Fetch(id_, 1, plan_.view(), buffer_.get());
    ASSERT_TRUE(fetched.ok()) << fetched;
    const std::vector<uint16_t> want =
        testdata::ExpectedRows(9, g_, 1, plan_.view());
    EXPECT_EQ(
        std::vector<uint16_t>(buffer_->data(), buffer_->data() + want.size()),
        want);
  }

 private:
  const SequenceGeometry g_ = testdata::MakeGeometry(2, 2, 16, 64);
  const OwnedFetchPlan plan_ = OwnedFetchPlan::PerHead({{19, 0, 7}, {3}});
  std::unique_ptr<KvClient> client_;
  SequenceId id_ = 0;
  std::unique_ptr<FetchBuffer> buffer_;
};

TEST_F(TlsTest, AClientWithTheRightCertificatesGetsItsRows) {
  // Under TLS the fetch socket speaks TLS: tcp:// fetches go over it, not
  // over the gRPC stream.
  ASSERT_GT(server_->fetch_port(), 0);
  auto client = ConnectKvClient(server_->client_address(), Trusting());
  ASSERT_TRUE(client.ok()) << client.status();
  RightClient right(*std::move(client));
  for (int i = 0; i < 3; ++i) right.ExpectRows();
  EXPECT_EQ(FetchesServed("tcp"), 3);
  EXPECT_EQ(FetchesServed("grpc"), 0);
  EXPECT_EQ(server_->fetch_socket_stats().connections, 1);
}

// The node names its TLS fetch socket fetch_tls_port and leaves fetch_port
// 0: a client that knows only fetch_port takes the gRPC stream instead of
// sending plaintext frames to it.
TEST_F(TlsTest, TheFetchSocketIsAdvertisedAsTls) {
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = Pem("ca.pem");
  ssl.pem_cert_chain = Pem("client.pem");
  ssl.pem_private_key = Pem("client.key");
  auto stub = kv::KvMemory::NewStub(grpc::CreateChannel(
      server_->client_address().substr(6), grpc::SslCredentials(ssl)));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  kv::GetServerInfoResponse info;
  ASSERT_TRUE(
      stub->GetServerInfo(&ctx, kv::GetServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.fetch_port(), 0);
  EXPECT_EQ(info.fetch_tls_port(), server_->fetch_port());

  // A plaintext Hello to it is told, in plaintext, what the socket speaks.
  const int fd = DialFetchSocket();
  fetch_wire::Hello hello;
  iovec iov = {&hello, sizeof(hello)};
  ASSERT_TRUE(fetch_wire::SendAll(fd, &iov, 1).ok());
  fetch_wire::HelloReply reply;
  ASSERT_TRUE(fetch_wire::RecvAll(fd, &reply, sizeof(reply)).ok());
  std::string message(reply.message_bytes, '\0');
  ASSERT_TRUE(fetch_wire::RecvAll(fd, message.data(), message.size()).ok());
  close(fd);
  EXPECT_EQ(reply.status_code,
            static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(absl::StrContains(message, "speaks TLS")) << message;
}

// Peers of the fetch socket itself, each followed by a fetch of the right
// client (its connection held throughout) and of a new one.
TEST_F(TlsTest, TheFetchSocketDropsEveryOtherPeer) {
  auto client = ConnectKvClient(server_->client_address(), Trusting());
  ASSERT_TRUE(client.ok()) << client.status();
  RightClient held(*std::move(client));
  held.ExpectRows();
  int64_t served = FetchesServed("tcp");
  int64_t refused = server_->fetch_socket_stats().refused;
  auto after = [&](const std::string& peer) {
    SCOPED_TRACE(peer);
    held.ExpectRows();
    auto fresh = ConnectKvClient(server_->client_address(), Trusting());
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    RightClient(*std::move(fresh)).ExpectRows();
    served += 2;
    EXPECT_EQ(FetchesServed("tcp"), served);
    EXPECT_EQ(FetchesServed("grpc"), 0);
  };
  // Waits for the server's loop to count the refusal.
  auto refusal = [&](const std::string& peer) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (server_->fetch_socket_stats().refused == refused &&
           absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_EQ(server_->fetch_socket_stats().refused, ++refused) << peer;
  };

  {  // Plaintext.
    const int fd = DialFetchSocket();
    fetch_wire::Hello hello;
    iovec iov = {&hello, sizeof(hello)};
    ASSERT_TRUE(fetch_wire::SendAll(fd, &iov, 1).ok());
    fetch_wire::HelloReply reply;
    ASSERT_TRUE(fetch_wire::RecvAll(fd, &reply, sizeof(reply)).ok());
    EXPECT_EQ(reply.status_code,
              static_cast<int>(absl::StatusCode::kFailedPrecondition));
    close(fd);
    refusal("plaintext");
  }
  after("plaintext");

  // TLS without a client certificate, and with another CA's.
  for (const std::string cert : {"", "other"}) {
    auto ctx = NewClientTlsContext(Pem("ca.pem"),
                                   cert.empty() ? "" : Pem(cert + ".pem"),
                                   cert.empty() ? "" : Pem(cert + ".key"));
    ASSERT_TRUE(ctx.ok()) << ctx.status();
    const int fd = DialFetchSocket();
    auto stream = fetch_tls::TlsClientStream::Connect(
        fd, ctx->get(), "127.0.0.1", absl::Seconds(10));
    absl::Status status = stream.status();
    if (stream.ok()) {
      // TLS 1.3: the refusal arrives after the client's handshake, as an
      // alert in place of the Hello's reply.
      fetch_wire::Hello hello;
      iovec iov = {&hello, sizeof(hello)};
      status = (*stream)->Send(&iov, 1, absl::Seconds(10));
      fetch_wire::HelloReply reply;
      if (status.ok()) {
        status = (*stream)->Recv(&reply, sizeof(reply),
                                 absl::Now() + absl::Seconds(10));
      }
      stream->reset();
    }
    close(fd);
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    refusal(cert.empty() ? "no certificate" : "another CA's certificate");
    after(cert.empty() ? "no certificate" : "another CA's certificate");
  }

  {  // Connects and never starts the TLS handshake.
    const absl::Time start = absl::Now();
    const int fd = DialFetchSocket();
    char c;
    EXPECT_EQ(recv(fd, &c, 1, 0), 0);  // blocks until the server closes
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(1900));
    close(fd);
    EXPECT_EQ(server_->fetch_socket_stats().timed_out, 1);
  }
  after("silent");
  // Every refused peer leaves the handshake pool (each once its loop has
  // closed it).
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (server_->fetch_socket_stats().handshakes > 0 &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(server_->fetch_socket_stats().handshakes, 0);
}

TEST_F(TlsTest, EveryOtherClientIsRefused) {
  const std::string address = server_->client_address();
  KvClientOptions plaintext;
  plaintext.connect_timeout = absl::Seconds(3);
  const absl::Status refused = ConnectKvClient(address, plaintext).status();
  EXPECT_FALSE(refused.ok()) << "plaintext";
  // The reason says what to do.
  EXPECT_THAT(std::string(refused.message()),
              ::testing::HasSubstr("TLS server closes plaintext connections"))
      << refused;

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

  // And the server still serves the right client, over the fetch socket.
  auto client = ConnectKvClient(address, Trusting());
  ASSERT_TRUE(client.ok()) << client.status();
  RightClient(*std::move(client)).ExpectRows();
  EXPECT_EQ(FetchesServed("tcp"), 1);
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
