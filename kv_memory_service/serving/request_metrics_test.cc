#include "kv_memory_service/serving/request_metrics.h"

#include <string>

#include "absl/strings/match.h"
#include "common/metrics.h"
#include "gtest/gtest.h"

namespace infinigen::kv_memory_service {
namespace {

std::string Text(const RequestMetrics& m) {
  return MetricsText({m.registry()});
}

TEST(RequestMetricsTest, ServedRequestsLandInTheirPlaneAndOp) {
  RequestMetrics m;
  m.Served(Plane::kShm, RequestOp::kFetch, absl::Microseconds(30), 4096);
  m.Served(Plane::kShm, RequestOp::kFetch, absl::Milliseconds(2), 1024);
  m.Served(Plane::kGrpc, RequestOp::kAppend, absl::Milliseconds(1), 512);
  const std::string text = Text(m);
  EXPECT_TRUE(absl::StrContains(
      text, "infinigen_kv_request_seconds_count{op=\"fetch\",plane=\"shm\"} 2"))
      << text;
  EXPECT_TRUE(absl::StrContains(
      text, "infinigen_kv_served_bytes_total{op=\"fetch\",plane=\"shm\"} 5120"))
      << text;
  EXPECT_TRUE(absl::StrContains(
      text, "infinigen_kv_request_seconds_count{op=\"append\",plane=\"grpc\"} 1"))
      << text;
  EXPECT_TRUE(absl::StrContains(
      text, "infinigen_kv_served_bytes_total{op=\"append\",plane=\"grpc\"} 512"))
      << text;
  // The 30 us fetch is under the 50 us bucket, the 2 ms one is not.
  EXPECT_TRUE(absl::StrContains(
      text,
      "infinigen_kv_request_seconds_bucket{op=\"fetch\",plane=\"shm\",le=\"5e-05\"} 1"))
      << text;
  // Planes that served nothing are present at zero.
  EXPECT_TRUE(absl::StrContains(
      text, "infinigen_kv_request_seconds_count{op=\"fetch\",plane=\"rdma\"} 0"))
      << text;
}

TEST(RequestMetricsTest, RefusalsCountByPlaneAndCode) {
  RequestMetrics m;
  m.Record(Plane::kTcp, RequestOp::kFetch, absl::Microseconds(5), 0,
           absl::NotFoundError("unknown sequence"));
  m.Rejected(Plane::kTcp, absl::NotFoundError("unknown sequence"));
  m.Rejected(Plane::kTcp, absl::UnauthenticatedError("wrong token"));
  m.Rejected(Plane::kGrpc, absl::OkStatus());  // not a refusal
  const std::string text = Text(m);
  EXPECT_TRUE(absl::StrContains(
      text,
      "infinigen_kv_rejected_requests_total{code=\"NOT_FOUND\",plane=\"tcp\"} 2"))
      << text;
  EXPECT_TRUE(absl::StrContains(
      text,
      "infinigen_kv_rejected_requests_total{code=\"UNAUTHENTICATED\",plane=\"tcp\"} 1"))
      << text;
  EXPECT_FALSE(absl::StrContains(text, "code=\"OK\"")) << text;
  // A refused fetch is not a served one.
  EXPECT_TRUE(absl::StrContains(
      text, "infinigen_kv_request_seconds_count{op=\"fetch\",plane=\"tcp\"} 0"))
      << text;
}

}  // namespace
}  // namespace infinigen::kv_memory_service
