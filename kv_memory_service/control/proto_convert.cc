#include "kv_memory_service/control/proto_convert.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace infinigen::kv_memory_service {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  std::string message = status.error_message();
  // gRPC's words for a transport the peer ended, in the user's.
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    for (absl::string_view closed :
         {"Socket closed", "Connection reset by peer", "Broken pipe",
          "Stream removed", "GOAWAY received"}) {
      if (absl::StrContains(message, closed)) {
        message = absl::StrCat("the connection closed (the node stopped or "
                               "restarted; gRPC: ",
                               message, ")");
        break;
      }
    }
    if (absl::StrContains(message, "Connection refused")) {
      message = absl::StrCat("connection refused (is the node running?; "
                             "gRPC: ",
                             message, ")");
    }
  }
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      message);
}

void ToProto(const SequenceGeometry& g, kv::Geometry* out) {
  out->set_n_layers(g.n_layers);
  out->set_n_kv_heads(g.n_kv_heads);
  out->set_head_dim(g.head_dim);
  out->set_max_tokens(g.max_tokens);
  out->set_dtype(g.dtype == KvDType::kBFloat16 ? kv::DTYPE_BFLOAT16
                                               : kv::DTYPE_FLOAT16);
}

absl::StatusOr<SequenceGeometry> FromProto(const kv::Geometry& g) {
  SequenceGeometry out;
  out.n_layers = g.n_layers();
  out.n_kv_heads = g.n_kv_heads();
  out.head_dim = g.head_dim();
  out.max_tokens = g.max_tokens();
  switch (g.dtype()) {
    case kv::DTYPE_FLOAT16:
      out.dtype = KvDType::kFloat16;
      break;
    case kv::DTYPE_BFLOAT16:
      out.dtype = KvDType::kBFloat16;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown dtype ", static_cast<int>(g.dtype())));
  }
  return out;
}

void ToProto(const FetchPlan& plan, kv::FetchPlan* out) {
  out->mutable_indices()->Clear();
  out->mutable_indices()->Add(plan.indices.begin(), plan.indices.end());
  out->mutable_head_offsets()->Clear();
  out->mutable_head_offsets()->Add(plan.head_offsets.begin(),
                                   plan.head_offsets.end());
}

FetchPlan PlanView(const kv::FetchPlan& plan) {
  return FetchPlan{
      absl::Span<const int32_t>(plan.indices().data(), plan.indices_size()),
      absl::Span<const int32_t>(plan.head_offsets().data(),
                                plan.head_offsets_size())};
}

void ToProto(const AppendResult& result, kv::AppendResponse* out) {
  out->mutable_evicted()->Reserve(static_cast<int>(result.evicted.size()));
  for (const EvictedToken& e : result.evicted) {
    kv::EvictedToken* t = out->add_evicted();
    t->set_layer(e.layer);
    t->set_kv_head(e.kv_head);
    t->set_position(e.position);
  }
}

AppendResult FromProto(const kv::AppendResponse& response) {
  AppendResult result;
  result.evicted.reserve(response.evicted_size());
  for (const kv::EvictedToken& t : response.evicted()) {
    result.evicted.push_back(EvictedToken{t.layer(), t.kv_head(), t.position()});
  }
  return result;
}

void ToProto(const StoreStats& s, kv::StoreStats* out) {
  out->set_open_sequences(s.open_sequences);
  out->set_max_sequences(s.max_sequences);
  out->set_bytes_reserved(s.bytes_reserved);
  out->set_capacity_bytes(s.capacity_bytes);
  out->set_eviction(static_cast<kv::Eviction>(s.eviction));
  out->set_appended_rows(s.appended_rows);
  out->set_evicted_rows(s.evicted_rows);
  out->set_fetches(s.fetches);
  out->set_fetched_rows(s.fetched_rows);
  out->set_open_sessions(s.open_sessions);
  out->set_expired_sessions(s.expired_sessions);
  out->set_expired_sequences(s.expired_sequences);
  out->set_lease_timeout_ms(s.lease_timeout_ms);
  out->set_prefix_blocks(s.prefix_blocks);
  out->set_prefix_bytes(s.prefix_bytes);
  out->set_prefix_capacity_bytes(s.prefix_capacity_bytes);
  out->set_prefix_hit_tokens(s.prefix_hit_tokens);
  out->set_prefix_lookup_tokens(s.prefix_lookup_tokens);
  out->set_prefix_evicted_blocks(s.prefix_evicted_blocks);
  out->set_pinned_bytes(s.pinned_bytes);
  out->set_pinned_sequences(s.pinned_sequences);
  out->set_spare_sequences(s.spare_sequences);
  out->set_spare_bytes(s.spare_bytes);
  out->set_reused_row_sequences(s.reused_row_sequences);
}

void ToProto(const PrefixRequest& p, kv::OpenSequenceRequest* out) {
  if (p.keys.empty()) return;
  out->set_prefix_block_tokens(p.block_tokens);
  for (const PrefixKey& k : p.keys) {
    char bytes[16];
    for (int i = 0; i < 8; ++i) {
      bytes[i] = static_cast<char>(k.lo >> (8 * i));
      bytes[8 + i] = static_cast<char>(k.hi >> (8 * i));
    }
    out->add_prefix_keys(std::string(bytes, 16));
  }
}

absl::StatusOr<PrefixRequest> PrefixFromProto(
    const kv::OpenSequenceRequest& req) {
  PrefixRequest p;
  p.block_tokens = req.prefix_block_tokens();
  p.keys.reserve(req.prefix_keys_size());
  for (const std::string& bytes : req.prefix_keys()) {
    if (bytes.size() != 16) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a prefix key has 16 bytes, got ", bytes.size()));
    }
    PrefixKey k;
    for (int i = 0; i < 8; ++i) {
      k.lo |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i]))
              << (8 * i);
      k.hi |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[8 + i]))
              << (8 * i);
    }
    p.keys.push_back(k);
  }
  return p;
}

StoreStats FromProto(const kv::StoreStats& s) {
  StoreStats out;
  out.open_sequences = s.open_sequences();
  out.max_sequences = s.max_sequences();
  out.bytes_reserved = s.bytes_reserved();
  out.capacity_bytes = s.capacity_bytes();
  out.eviction = static_cast<EvictionPolicy>(s.eviction());
  out.appended_rows = s.appended_rows();
  out.evicted_rows = s.evicted_rows();
  out.fetches = s.fetches();
  out.fetched_rows = s.fetched_rows();
  out.open_sessions = s.open_sessions();
  out.expired_sessions = s.expired_sessions();
  out.expired_sequences = s.expired_sequences();
  out.lease_timeout_ms = s.lease_timeout_ms();
  out.prefix_blocks = s.prefix_blocks();
  out.prefix_bytes = s.prefix_bytes();
  out.prefix_capacity_bytes = s.prefix_capacity_bytes();
  out.prefix_hit_tokens = s.prefix_hit_tokens();
  out.prefix_lookup_tokens = s.prefix_lookup_tokens();
  out.prefix_evicted_blocks = s.prefix_evicted_blocks();
  out.pinned_bytes = s.pinned_bytes();
  out.pinned_sequences = s.pinned_sequences();
  out.spare_sequences = s.spare_sequences();
  out.spare_bytes = s.spare_bytes();
  out.reused_row_sequences = s.reused_row_sequences();
  return out;
}

void ToProto(const SequenceStats& s, kv::SequenceStats* out) {
  out->set_sequence_id(s.id);
  ToProto(s.geometry, out->mutable_geometry());
  out->mutable_layer_lengths()->Add(s.layer_lengths.begin(),
                                    s.layer_lengths.end());
  out->set_present_rows(s.present_rows);
  out->set_evicted_rows(s.evicted_rows);
  out->set_bytes_reserved(s.bytes_reserved);
  out->set_fetches(s.fetches);
  out->set_fetched_rows(s.fetched_rows);
}

absl::StatusOr<SequenceStats> FromProto(const kv::SequenceStats& s) {
  SequenceStats out;
  out.id = s.sequence_id();
  absl::StatusOr<SequenceGeometry> g = FromProto(s.geometry());
  if (!g.ok()) return g.status();
  out.geometry = *g;
  out.layer_lengths.assign(s.layer_lengths().begin(), s.layer_lengths().end());
  out.present_rows = s.present_rows();
  out.evicted_rows = s.evicted_rows();
  out.bytes_reserved = s.bytes_reserved();
  out.fetches = s.fetches();
  out.fetched_rows = s.fetched_rows();
  return out;
}

absl::StatusOr<absl::Span<const uint16_t>> RowsView(const std::string& bytes,
                                                    absl::string_view field) {
  if (bytes.size() % sizeof(uint16_t) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " has ", bytes.size(), " bytes, not a whole number of uint16"));
  }
  return absl::Span<const uint16_t>(
      reinterpret_cast<const uint16_t*>(bytes.data()),
      bytes.size() / sizeof(uint16_t));
}

}  // namespace infinigen::kv_memory_service
