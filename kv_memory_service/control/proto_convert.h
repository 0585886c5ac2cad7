// Conversions between kv_types.h and the messages of proto/kv_memory.proto,
// and between absl::Status and grpc::Status, shared by the gRPC service and
// the gRPC client. Row bytes are little-endian uint16 (this host's order:
// the build is little-endian only). Stateless functions; thread-safe.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_CONTROL_PROTO_CONVERT_H_
#define INFINIGEN_KV_MEMORY_SERVICE_CONTROL_PROTO_CONVERT_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/support/status.h"
#include "kv_memory_service/client/kv_types.h"
#include "proto/kv_memory.pb.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "row bytes on the wire are little-endian uint16");

namespace infinigen::kv_memory_service {

// Same code and message; the two code enums agree numerically.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

void ToProto(const SequenceGeometry& geometry, kv::Geometry* out);
// InvalidArgument for a dtype this build does not know.
absl::StatusOr<SequenceGeometry> FromProto(const kv::Geometry& geometry);

// Fills `out` reusing its arrays' capacity (no allocation once warm).
void ToProto(const FetchPlan& plan, kv::FetchPlan* out);
// A view of the message's arrays; valid while the message is unchanged.
FetchPlan PlanView(const kv::FetchPlan& plan);

void ToProto(const AppendResult& result, kv::AppendResponse* out);
AppendResult FromProto(const kv::AppendResponse& response);

void ToProto(const StoreStats& stats, kv::StoreStats* out);
StoreStats FromProto(const kv::StoreStats& stats);
// The prefix fields of an OpenSequenceRequest (nothing for empty keys);
// InvalidArgument for a key that is not 16 bytes.
void ToProto(const PrefixRequest& prefix, kv::OpenSequenceRequest* out);
absl::StatusOr<PrefixRequest> PrefixFromProto(
    const kv::OpenSequenceRequest& req);
void ToProto(const SequenceStats& stats, kv::SequenceStats* out);
// InvalidArgument for an unknown dtype in the geometry.
absl::StatusOr<SequenceStats> FromProto(const kv::SequenceStats& stats);

// The uint16 values of a bytes field; InvalidArgument (naming `field`) when
// its length is odd.
absl::StatusOr<absl::Span<const uint16_t>> RowsView(const std::string& bytes,
                                                    absl::string_view field);

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_CONTROL_PROTO_CONVERT_H_
