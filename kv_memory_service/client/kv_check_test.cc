#include "kv_memory_service/client/kv_check.h"

#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv_memory_service/server/kv_server.h"
#include "kv_memory_service/testing/fault_injection_client.h"

namespace infinigen::kv_memory_service {
namespace {

using ::testing::HasSubstr;

// Flips one bit of the K row of the first fetched index of every fetch.
class CorruptingClient final : public KvClientWrapper {
 public:
  using KvClientWrapper::KvClientWrapper;
  FetchHandle FetchAsync(SequenceId seq, int32_t layer, const FetchPlan& plan,
                         FetchBuffer* dest) override {
    absl::Status s = target()->Fetch(seq, layer, plan, dest);
    if (s.ok()) dest->data()[3] ^= 1;
    return FetchHandle(s);
  }
};

std::unique_ptr<KvClient> Inproc() {
  auto client = ConnectKvClient("inproc:");
  EXPECT_TRUE(client.ok()) << client.status();
  return *std::move(client);
}

TEST(CheckKvService, RowsComeBackAsAppendedInProcess) {
  auto client = Inproc();
  KvCheckOptions options;
  auto report = CheckKvService(*client, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->data_plane, "inproc");
  const int64_t rows = int64_t{options.fetches} * options.n_layers *
                       options.rows_per_head * options.n_kv_heads;
  EXPECT_EQ(report->fetched_rows, rows);
  EXPECT_EQ(report->node_fetched_rows, rows);
  EXPECT_LE(report->fetch_p50, report->fetch_max);
  // The scratch sequence is gone.
  auto stats = client->GetStoreStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->open_sequences, 0);
  const std::string line = FormatKvCheckReport(*report, options);
  EXPECT_THAT(line, HasSubstr("data plane inproc: open "));
  EXPECT_THAT(line, HasSubstr("2560 rows equal to those appended"));
}

TEST(CheckKvService, OverLoopbackTcpToAServer) {
  KvServerOptions server_options;
  server_options.listen = "127.0.0.1:0";
  server_options.credentials = Credentials::Single("check-token");
  auto server = KvServer::Start(server_options);
  ASSERT_TRUE(server.ok()) << server.status();
  KvClientOptions options;
  options.auth_token = "check-token";
  auto client = ConnectKvClient((*server)->client_address(), options);
  ASSERT_TRUE(client.ok()) << client.status();
  auto report = CheckKvService(**client, {});
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->data_plane, "tcp");
  EXPECT_EQ((*server)->store().GetStoreStats().open_sequences, 0);

  // The wrong token: the open is refused, and the message says so.
  options.auth_token = "wrong";
  auto refused = ConnectKvClient((*server)->client_address(), options);
  ASSERT_TRUE(refused.ok()) << refused.status();
  auto failed = CheckKvService(**refused, {});
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnauthenticated)
      << failed.status();
  EXPECT_TRUE(absl::StartsWith(failed.status().message(), "open: "))
      << failed.status();
}

TEST(CheckKvService, RowsThatDifferAreDataLossNamingTheRow) {
  CorruptingClient client(Inproc());
  auto report = CheckKvService(client, {});
  EXPECT_EQ(report.status().code(), absl::StatusCode::kDataLoss)
      << report.status();
  EXPECT_THAT(report.status().message(),
              HasSubstr("the K row of layer 0, KV head 0, position"));
  EXPECT_EQ(client.GetStoreStats()->open_sequences, 0);
}

TEST(CheckKvService, AFailedFetchNamesItsStepAndClosesTheSequence) {
  FaultInjectionKvClient client(Inproc());
  client.FailFetches(absl::UnavailableError("node gone"), /*skip=*/1);
  auto report = CheckKvService(client, {});
  EXPECT_EQ(report.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(report.status().message(), "fetch of layer 1: node gone");
  EXPECT_EQ(client.GetStoreStats()->open_sequences, 0);
}

TEST(CheckKvService, OptionsOutOfRangeCallNothing) {
  FaultInjectionKvClient client(Inproc());
  KvCheckOptions options;
  options.rows_per_head = options.tokens + 1;
  auto report = CheckKvService(client, options);
  EXPECT_EQ(report.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(report.status().message(), HasSubstr("rows per head"));
  options = {};
  options.fetches = 0;
  EXPECT_EQ(CheckKvService(client, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client.appends(), 0);
  EXPECT_EQ(client.GetStoreStats()->open_sequences, 0);
}

}  // namespace
}  // namespace infinigen::kv_memory_service
