// The RDMA data plane hosted by KvServer: without a device, the server
// says why it cannot start; with one (a real adapter or soft-RoCE:
// README.md), a client over loopback fetches rows bit-exact. The plane's
// own tests are kv_memory_service/rdma/rdma_test.cc.
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kv_memory_service/client/kv_client.h"
#include "kv_memory_service/rdma/rdma_device.h"
#include "kv_memory_service/server/kv_server.h"
#include "kv_memory_service/testing/kv_test_data.h"

namespace infinigen::kv_memory_service::rdma {
namespace {

#define EXPECT_CODE(expr, code_name) \
  EXPECT_EQ((expr).code(), absl::StatusCode::code_name) << (expr)

bool HasDevice(std::string* why) {
  absl::StatusOr<std::unique_ptr<RdmaDevice>> d = RdmaDevice::Open({});
  if (!d.ok()) *why = std::string(d.status().message());
  return d.ok();
}

TEST(NoDeviceTest, KvServerSaysSo) {
  std::string why;
  if (HasDevice(&why)) GTEST_SKIP() << "this machine has an RDMA device";
  KvServerOptions options;
  options.listen = "127.0.0.1:0";
  options.rdma_device = "any";
  absl::StatusOr<std::unique_ptr<KvServer>> kv_server = KvServer::Start(options);
  EXPECT_CODE(kv_server.status(), kUnavailable);
  EXPECT_TRUE(absl::StrContains(kv_server.status().message(), "no RDMA device"))
      << kv_server.status();
}

// A KvServer with the RDMA data plane and a client over loopback: rows
// bit-exact, errors with the store's codes. Needs a device (a real adapter
// or soft-RoCE: README.md).
TEST(RdmaLoopbackTest, FetchesAreBitExact) {
  std::string why;
  if (!HasDevice(&why)) GTEST_SKIP() << why;
  KvServerOptions options;
  options.listen = "127.0.0.1:0";
  options.rdma_device = "any";
  absl::StatusOr<std::unique_ptr<KvServer>> server = KvServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address =
      "rdma://127.0.0.1:" + std::to_string((*server)->port());
  absl::StatusOr<std::unique_ptr<KvClient>> client = ConnectKvClient(address);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->data_plane(), "rdma");
  const SequenceGeometry g = testdata::MakeGeometry(2, 3, 64, 4096);
  absl::StatusOr<SequenceId> id = (*client)->Open(g);
  ASSERT_TRUE(id.ok());
  testdata::TestBlock b = testdata::MakeTestBlock(3, g, 0, 2, 0, 4096);
  ASSERT_TRUE((*client)->Append(*id, b.block).ok());
  auto buffer = (*client)->NewFetchBuffer(2 * 3 * 64 * 4096);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  std::mt19937 rng(1);
  for (int n : {1, 16, 256, 4096}) {  // inline plans, and one read by RDMA
    std::vector<std::vector<int32_t>> per_head(3);
    for (auto& p : per_head) {
      for (int i = 0; i < n; ++i) p.push_back(rng() % 4096);
    }
    const OwnedFetchPlan plan = OwnedFetchPlan::PerHead(per_head);
    ASSERT_TRUE((*client)->Fetch(*id, 1, plan.view(), buffer->get()).ok());
    const std::vector<uint16_t> want = testdata::ExpectedRows(3, g, 1, plan.view());
    ASSERT_EQ(std::vector<uint16_t>((*buffer)->data(), (*buffer)->data() + want.size()),
              want)
        << n;
  }
  const OwnedFetchPlan beyond = OwnedFetchPlan::SameForAllHeads(3, {5000});
  EXPECT_CODE((*client)->Fetch(*id, 0, beyond.view(), buffer->get()), kOutOfRange);
  EXPECT_CODE((*client)->Fetch(*id + 1, 0, beyond.view(), buffer->get()), kNotFound);
}

}  // namespace
}  // namespace infinigen::kv_memory_service::rdma
