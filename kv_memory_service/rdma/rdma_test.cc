// The RDMA data plane without a device: handshake and packet encodings,
// queue-pair state-machine parameters, and the "no RDMA device" errors of
// the client and the plane's server. KvServer hosting the plane, and a
// loopback fetch where a device exists, are
// tests/kv_memory_service/rdma_kv_server_test.cc's.
#include <infiniband/verbs.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kv_memory_service/client/kv_client.h"
#include "kv_memory_service/rdma/queue_pair.h"
#include "kv_memory_service/rdma/rdma_device.h"
#include "kv_memory_service/rdma/rdma_server.h"
#include "kv_memory_service/rdma/rdma_wire.h"
#include "kv_memory_service/store/kv_store.h"

namespace infinigen::kv_memory_service::rdma {
namespace {

#define EXPECT_CODE(expr, code_name) \
  EXPECT_EQ((expr).code(), absl::StatusCode::code_name) << (expr)

EndpointInfo RoceEndpoint() {
  EndpointInfo e;
  e.qp_num = 0x1234;
  e.psn = 0xabcdef;
  e.lid = 0;
  e.gid = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 7};
  e.gid_index = 3;
  e.mtu = IBV_MTU_4096;
  e.port = 1;
  return e;
}

EndpointInfo InfinibandEndpoint() {
  EndpointInfo e;
  e.qp_num = 0x77;
  e.psn = 5;
  e.lid = 12;
  e.mtu = IBV_MTU_2048;
  e.port = 2;
  return e;
}

TEST(EndpointTest, RoundTripsThroughTheHandshakeMessage) {
  for (const EndpointInfo& e : {RoceEndpoint(), InfinibandEndpoint()}) {
    infinigen::kv::RdmaEndpoint proto;
    ToProto(e, &proto);
    absl::StatusOr<EndpointInfo> back = FromProto(proto);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->qp_num, e.qp_num);
    EXPECT_EQ(back->psn, e.psn);
    EXPECT_EQ(back->lid, e.lid);
    EXPECT_EQ(back->gid, e.gid);
    EXPECT_EQ(back->gid_index, e.gid_index);
    EXPECT_EQ(back->mtu, e.mtu);
    EXPECT_EQ(back->port, e.port);
    // And through the bytes on the wire.
    infinigen::kv::RdmaEndpoint parsed;
    ASSERT_TRUE(parsed.ParseFromString(proto.SerializeAsString()));
    EXPECT_TRUE(FromProto(parsed).ok());
  }
}

TEST(EndpointTest, RejectsOutOfRangeFields) {
  auto check = [](auto mutate) {
    infinigen::kv::RdmaEndpoint proto;
    ToProto(RoceEndpoint(), &proto);
    mutate(proto);
    return FromProto(proto).status();
  };
  EXPECT_CODE(check([](auto& p) { p.set_qp_num(0); }), kInvalidArgument);
  EXPECT_CODE(check([](auto& p) { p.set_qp_num(1u << 24); }), kInvalidArgument);
  EXPECT_CODE(check([](auto& p) { p.set_psn(1u << 24); }), kInvalidArgument);
  EXPECT_CODE(check([](auto& p) { p.set_lid(70000); }), kInvalidArgument);
  EXPECT_CODE(check([](auto& p) { p.set_gid("short"); }), kInvalidArgument);
  EXPECT_CODE(check([](auto& p) { p.set_mtu(0); }), kInvalidArgument);
  EXPECT_CODE(check([](auto& p) { p.set_mtu(6); }), kInvalidArgument);
  EXPECT_CODE(check([](auto& p) { p.set_port(0); }), kInvalidArgument);
  EXPECT_CODE(check([](auto& p) { p.set_gid(std::string(16, '\0')); }),
              kInvalidArgument);  // lid 0 and no gid: unroutable
  EXPECT_EQ(GidToString(RoceEndpoint().gid),
            "0000:0000:0000:0000:0000:ffff:0a00:0007");
}

TEST(QueuePairTest, InitAllowsRemoteWriteAndRead) {
  const QpTransition t = InitTransition(2);
  EXPECT_EQ(t.attr.qp_state, IBV_QPS_INIT);
  EXPECT_EQ(t.attr.port_num, 2);
  EXPECT_EQ(t.attr.pkey_index, 0);
  EXPECT_EQ(t.attr.qp_access_flags, IBV_ACCESS_LOCAL_WRITE |
                                        IBV_ACCESS_REMOTE_WRITE |
                                        IBV_ACCESS_REMOTE_READ);
  EXPECT_EQ(t.mask,
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

TEST(QueuePairTest, RtrOverRoceUsesTheGrh) {
  const EndpointInfo local = RoceEndpoint();
  EndpointInfo remote = RoceEndpoint();
  remote.qp_num = 0x999;
  remote.psn = 42;
  remote.mtu = IBV_MTU_1024;
  remote.gid[15] = 9;
  RcPathOptions options;
  options.hop_limit = 3;
  const QpTransition t = RtrTransition(local, remote, options);
  EXPECT_EQ(t.attr.qp_state, IBV_QPS_RTR);
  EXPECT_EQ(t.attr.path_mtu, IBV_MTU_1024);  // the smaller of the two
  EXPECT_EQ(t.attr.dest_qp_num, 0x999u);
  EXPECT_EQ(t.attr.rq_psn, 42u);
  EXPECT_EQ(t.attr.max_dest_rd_atomic, options.max_rd_atomic);
  EXPECT_EQ(t.attr.min_rnr_timer, options.min_rnr_timer);
  EXPECT_EQ(t.attr.ah_attr.is_global, 1);
  EXPECT_EQ(std::memcmp(t.attr.ah_attr.grh.dgid.raw, remote.gid.data(), 16), 0);
  EXPECT_EQ(t.attr.ah_attr.grh.sgid_index, 3);  // ours, not the remote's
  EXPECT_EQ(t.attr.ah_attr.grh.hop_limit, 3);
  EXPECT_EQ(t.attr.ah_attr.port_num, 1);
  EXPECT_EQ(t.mask, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                        IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
}

TEST(QueuePairTest, RtrOverInfinibandRoutesByLid) {
  const QpTransition t =
      RtrTransition(InfinibandEndpoint(), InfinibandEndpoint(), {});
  EXPECT_EQ(t.attr.ah_attr.is_global, 0);
  EXPECT_EQ(t.attr.ah_attr.dlid, 12);
  EXPECT_EQ(t.attr.ah_attr.port_num, 2);
  EXPECT_EQ(t.attr.path_mtu, IBV_MTU_2048);
}

TEST(QueuePairTest, RtsSendsFromOurPsn) {
  RcPathOptions options;
  options.retry_cnt = 5;
  const QpTransition t = RtsTransition(RoceEndpoint(), options);
  EXPECT_EQ(t.attr.qp_state, IBV_QPS_RTS);
  EXPECT_EQ(t.attr.sq_psn, 0xabcdefu);
  EXPECT_EQ(t.attr.retry_cnt, 5);
  EXPECT_EQ(t.attr.timeout, options.timeout);
  EXPECT_EQ(t.attr.rnr_retry, options.rnr_retry);
  EXPECT_EQ(t.attr.max_rd_atomic, options.max_rd_atomic);
  EXPECT_EQ(t.mask, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                        IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                        IBV_QP_MAX_QP_RD_ATOMIC);
  for (int i = 0; i < 100; ++i) EXPECT_LE(RandomPsn(), 0xffffffu);
}

TEST(PacketTest, SmallPlansTravelInline) {
  const OwnedFetchPlan plan = OwnedFetchPlan::PerHead({{1, 5, 9}, {}, {2}});
  alignas(8) char packet[kMaxRequestBytes];
  const size_t bytes =
      EncodeFetchRequest(7, 0xdead00000001ULL, 0xbeef00000002ULL, 3, plan.view(),
                         absl::MakeSpan(packet));
  EXPECT_EQ(bytes, InlineRequestBytes(4, 4));
  absl::StatusOr<FetchRequest> r = DecodeFetchRequest(absl::MakeConstSpan(packet, bytes));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->slot, 7u);
  EXPECT_EQ(r->sequence, 0xdead00000001ULL);
  EXPECT_EQ(r->session, 0xbeef00000002ULL);
  EXPECT_EQ(r->layer, 3);
  EXPECT_TRUE(r->plan_inline);
  EXPECT_FALSE(r->held);
  EXPECT_EQ(std::vector<int32_t>(r->inline_plan.begin(), r->inline_plan.end()),
            (std::vector<int32_t>{1, 5, 9, 2, 0, 3, 3, 4}));
}

TEST(PacketTest, ANoteOfHeldRowsSaysSoInlineOrNot) {
  const OwnedFetchPlan small = OwnedFetchPlan::PerHead({{1, 5}, {2}});
  alignas(8) char packet[kMaxRequestBytes];
  size_t bytes = EncodeFetchRequest(2, 9, 4, 1, small.view(),
                                    absl::MakeSpan(packet), /*held=*/true);
  absl::StatusOr<FetchRequest> r =
      DecodeFetchRequest(absl::MakeConstSpan(packet, bytes));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->held);
  EXPECT_TRUE(r->plan_inline);
  EXPECT_EQ(r->n_indices, 3u);

  std::vector<int32_t> positions(4096);
  for (int i = 0; i < 4096; ++i) positions[i] = i;
  const OwnedFetchPlan large = OwnedFetchPlan::SameForAllHeads(2, positions);
  bytes = EncodeFetchRequest(2, 9, 4, 1, large.view(), absl::MakeSpan(packet),
                             /*held=*/true);
  r = DecodeFetchRequest(absl::MakeConstSpan(packet, bytes));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->held);
  EXPECT_FALSE(r->plan_inline);
}

TEST(PacketTest, LargePlansAreReadByTheServer) {
  std::vector<int32_t> positions(4096);
  for (int i = 0; i < 4096; ++i) positions[i] = i;
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(3, positions);
  alignas(8) char packet[kMaxRequestBytes];
  const size_t bytes =
      EncodeFetchRequest(1, 2, 5, 0, plan.view(), absl::MakeSpan(packet));
  absl::StatusOr<FetchRequest> r = DecodeFetchRequest(absl::MakeConstSpan(packet, bytes));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->plan_inline);
  EXPECT_EQ(r->n_indices, 3u * 4096);
  EXPECT_EQ(r->n_head_offsets, 4u);
  EXPECT_TRUE(r->inline_plan.empty());
}

TEST(PacketTest, MalformedRequestsAreRejected) {
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(2, {4, 5});
  alignas(8) char packet[kMaxRequestBytes];
  const size_t bytes =
      EncodeFetchRequest(0, 1, 0, 0, plan.view(), absl::MakeSpan(packet));
  EXPECT_CODE(DecodeFetchRequest(absl::MakeConstSpan(packet, 10)).status(),
              kInvalidArgument);
  EXPECT_CODE(DecodeFetchRequest(absl::MakeConstSpan(packet, bytes - 4)).status(),
              kInvalidArgument);
  EXPECT_CODE(DecodeFetchRequest(absl::MakeConstSpan(packet, bytes + 4)).status(),
              kInvalidArgument);
  packet[0] ^= 1;
  EXPECT_CODE(DecodeFetchRequest(absl::MakeConstSpan(packet, bytes)).status(),
              kInvalidArgument);
  packet[0] ^= 1;
  ASSERT_TRUE(DecodeFetchRequest(absl::MakeConstSpan(packet, bytes)).ok());
  packet[36] |= 4;  // a flag no release sends
  EXPECT_CODE(DecodeFetchRequest(absl::MakeConstSpan(packet, bytes)).status(),
              kInvalidArgument);
}

TEST(PacketTest, ResponsesCarryTheStatus) {
  char packet[kResponseBytes];
  size_t bytes = EncodeFetchResponse(5, absl::OkStatus(), absl::MakeSpan(packet));
  absl::StatusOr<FetchResponse> r = DecodeFetchResponse(absl::MakeConstSpan(packet, bytes));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->slot, 5u);
  EXPECT_TRUE(r->status.ok());
  bytes = EncodeFetchResponse(9, absl::OutOfRangeError("position 7 is beyond"),
                              absl::MakeSpan(packet));
  r = DecodeFetchResponse(absl::MakeConstSpan(packet, bytes));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, absl::OutOfRangeError("position 7 is beyond"));
  // A long message is cut to fit one receive.
  bytes = EncodeFetchResponse(1, absl::InternalError(std::string(5000, 'x')),
                              absl::MakeSpan(packet));
  EXPECT_LE(bytes, kResponseBytes);
  r = DecodeFetchResponse(absl::MakeConstSpan(packet, bytes));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status.code(), absl::StatusCode::kInternal);
  EXPECT_CODE(DecodeFetchResponse(absl::MakeConstSpan(packet, bytes - 1)).status(),
              kInvalidArgument);
  EXPECT_CODE(DecodeFetchResponse(absl::MakeConstSpan(packet, 4)).status(),
              kInvalidArgument);
}

TEST(AddressTest, Parses) {
  absl::StatusOr<RdmaAddress> a = ParseRdmaAddress("rdma://10.0.0.2:7070");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host_port, "10.0.0.2:7070");
  EXPECT_EQ(a->device, "");
  EXPECT_EQ(a->gid_index, -1);
  a = ParseRdmaAddress("rdma://[::1]:1?device=mlx5_1&port=2&gid_index=3");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host_port, "[::1]:1");
  EXPECT_EQ(a->device, "mlx5_1");
  EXPECT_EQ(a->port, 2);
  EXPECT_EQ(a->gid_index, 3);
  for (const char* bad :
       {"rdma://", "rdma://host", "rdma://host:0", "rdma://host:99999",
        "rdma://:7070", "tcp://h:1", "rdma://h:1?device=", "rdma://h:1?gpu=0",
        "rdma://h:1?port=x", "rdma://h:1?gid_index=-2"}) {
    EXPECT_CODE(ParseRdmaAddress(bad).status(), kInvalidArgument) << bad;
  }
}

bool HasDevice(std::string* why) {
  absl::StatusOr<std::unique_ptr<RdmaDevice>> d = RdmaDevice::Open({});
  if (!d.ok()) *why = std::string(d.status().message());
  return d.ok();
}

TEST(NoDeviceTest, EveryEntryPointSaysSo) {
  std::string why;
  if (HasDevice(&why)) GTEST_SKIP() << "this machine has an RDMA device";
  EXPECT_TRUE(absl::StartsWith(why, "no RDMA device: ")) << why;

  // The client: before any network traffic, whatever the server.
  absl::StatusOr<std::unique_ptr<KvClient>> client =
      ConnectKvClient("rdma://127.0.0.1:1");
  EXPECT_CODE(client.status(), kUnavailable);
  EXPECT_TRUE(absl::StartsWith(client.status().message(), "no RDMA device: "))
      << client.status();
  // A bad address is still a bad address.
  EXPECT_CODE(ConnectKvClient("rdma://nohostport").status(), kInvalidArgument);
  EXPECT_CODE(ConnectKvClient("rdma://127.0.0.1:1?device=mlx5_0").status(),
              kUnavailable);

  // The server side.
  auto store = std::make_shared<KvStore>(KvStoreOptions{});
  absl::StatusOr<std::unique_ptr<RdmaServer>> server =
      RdmaServer::Start(store, RdmaServerOptions{});
  EXPECT_CODE(server.status(), kUnavailable);
  EXPECT_TRUE(absl::StartsWith(server.status().message(), "no RDMA device: "));
}

}  // namespace
}  // namespace infinigen::kv_memory_service::rdma
