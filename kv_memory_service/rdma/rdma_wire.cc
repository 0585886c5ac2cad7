#include "kv_memory_service/rdma/rdma_wire.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/address.h"

namespace infinigen::kv_memory_service::rdma {
namespace {

constexpr uint32_t kRequestMagic = 0x52714b49;   // "IKqR"
constexpr uint32_t kResponseMagic = 0x53704b49;  // "IKpS"
constexpr uint32_t k24Bits = (1u << 24) - 1;

struct RequestHeader {
  uint32_t magic;
  uint32_t slot;
  uint64_t sequence;
  uint64_t session;
  int32_t layer;
  uint32_t n_indices;
  uint32_t n_head_offsets;
  uint32_t flags;  // kPlanInline | kHeld
};
constexpr uint32_t kPlanInline = 1;
constexpr uint32_t kHeld = 2;
static_assert(sizeof(RequestHeader) == 40);

struct ResponseHeader {
  uint32_t magic;
  uint32_t slot;
  int32_t code;
  uint32_t message_bytes;
};
static_assert(sizeof(ResponseHeader) == 16);

}  // namespace

bool EndpointInfo::has_gid() const {
  return std::any_of(gid.begin(), gid.end(), [](uint8_t b) { return b != 0; });
}

void ToProto(const EndpointInfo& info, infinigen::kv::RdmaEndpoint* proto) {
  proto->set_qp_num(info.qp_num);
  proto->set_psn(info.psn);
  proto->set_lid(info.lid);
  proto->set_gid(std::string(info.gid.begin(), info.gid.end()));
  proto->set_gid_index(info.gid_index);
  proto->set_mtu(info.mtu);
  proto->set_port(info.port);
}

absl::StatusOr<EndpointInfo> FromProto(const infinigen::kv::RdmaEndpoint& proto) {
  if (proto.qp_num() == 0 || proto.qp_num() > k24Bits) {
    return absl::InvalidArgumentError(
        absl::StrCat("RDMA endpoint: qp_num ", proto.qp_num(),
                     " is not a 24-bit queue pair number"));
  }
  if (proto.psn() > k24Bits) {
    return absl::InvalidArgumentError(
        absl::StrCat("RDMA endpoint: psn ", proto.psn(), " is over 24 bits"));
  }
  if (proto.lid() > 0xffff) {
    return absl::InvalidArgumentError(
        absl::StrCat("RDMA endpoint: lid ", proto.lid(), " is over 16 bits"));
  }
  if (proto.gid().size() != 16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RDMA endpoint: gid has ", proto.gid().size(), " bytes, want 16"));
  }
  if (proto.mtu() < 1 || proto.mtu() > 5) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RDMA endpoint: mtu ", proto.mtu(), " is not an ibv_mtu (1..5)"));
  }
  if (proto.port() < 1 || proto.port() > 255 || proto.gid_index() > 255) {
    return absl::InvalidArgumentError(
        "RDMA endpoint: port or gid_index out of range");
  }
  if (proto.lid() == 0 &&
      std::all_of(proto.gid().begin(), proto.gid().end(),
                  [](char c) { return c == 0; })) {
    return absl::InvalidArgumentError(
        "RDMA endpoint: neither a lid nor a gid to route to");
  }
  EndpointInfo info;
  info.qp_num = proto.qp_num();
  info.psn = proto.psn();
  info.lid = static_cast<uint16_t>(proto.lid());
  std::memcpy(info.gid.data(), proto.gid().data(), 16);
  info.gid_index = proto.gid_index();
  info.mtu = proto.mtu();
  info.port = proto.port();
  return info;
}

std::string GidToString(const std::array<uint8_t, 16>& gid) {
  std::string s;
  for (int i = 0; i < 16; i += 2) {
    absl::StrAppendFormat(&s, "%s%02x%02x", i == 0 ? "" : ":", gid[i],
                          gid[i + 1]);
  }
  return s;
}

size_t InlineRequestBytes(size_t n_indices, size_t n_head_offsets) {
  return sizeof(RequestHeader) + (n_indices + n_head_offsets) * sizeof(int32_t);
}

size_t EncodeFetchRequest(uint32_t slot, SequenceId sequence,
                          SessionId session, int32_t layer,
                          const FetchPlan& plan, absl::Span<char> out,
                          bool held) {
  const size_t n = plan.indices.size();
  const size_t m = plan.head_offsets.size();
  RequestHeader header{};
  header.magic = kRequestMagic;
  header.slot = slot;
  header.sequence = sequence;
  header.session = session;
  header.layer = layer;
  header.n_indices = static_cast<uint32_t>(n);
  header.n_head_offsets = static_cast<uint32_t>(m);
  const size_t inline_bytes = InlineRequestBytes(n, m);
  const bool plan_inline =
      inline_bytes <= std::min(out.size(), kMaxRequestBytes);
  header.flags = (plan_inline ? kPlanInline : 0) | (held ? kHeld : 0);
  std::memcpy(out.data(), &header, sizeof(header));
  if (!plan_inline) return sizeof(header);
  char* p = out.data() + sizeof(header);
  // An empty span's data() may be null, which memcpy must not see.
  if (n > 0) std::memcpy(p, plan.indices.data(), n * sizeof(int32_t));
  if (m > 0) {
    std::memcpy(p + n * sizeof(int32_t), plan.head_offsets.data(),
                m * sizeof(int32_t));
  }
  return inline_bytes;
}

absl::StatusOr<FetchRequest> DecodeFetchRequest(absl::Span<const char> packet) {
  RequestHeader header;
  if (packet.size() < sizeof(header)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RDMA fetch request of ", packet.size(), " bytes is too short"));
  }
  std::memcpy(&header, packet.data(), sizeof(header));
  if (header.magic != kRequestMagic) {
    return absl::InvalidArgumentError("RDMA fetch request: bad magic");
  }
  FetchRequest request;
  request.slot = header.slot;
  request.sequence = header.sequence;
  request.session = header.session;
  request.layer = header.layer;
  request.n_indices = header.n_indices;
  request.n_head_offsets = header.n_head_offsets;
  if ((header.flags & ~(kPlanInline | kHeld)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RDMA fetch request: unknown flags ", header.flags));
  }
  request.plan_inline = (header.flags & kPlanInline) != 0;
  request.held = (header.flags & kHeld) != 0;
  if (request.plan_inline) {
    const size_t want = InlineRequestBytes(header.n_indices, header.n_head_offsets);
    if (packet.size() != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "RDMA fetch request: ", packet.size(), " bytes for a plan of ",
          header.n_indices, " indices and ", header.n_head_offsets,
          " head offsets (want ", want, ")"));
    }
    request.inline_plan = absl::MakeConstSpan(
        reinterpret_cast<const int32_t*>(packet.data() + sizeof(header)),
        header.n_indices + static_cast<size_t>(header.n_head_offsets));
  } else if (packet.size() != sizeof(header)) {
    return absl::InvalidArgumentError(
        "RDMA fetch request: trailing bytes after a header-only request");
  }
  return request;
}

size_t EncodeFetchResponse(uint32_t slot, const absl::Status& status,
                           absl::Span<char> out) {
  ResponseHeader header{};
  header.magic = kResponseMagic;
  header.slot = slot;
  header.code = static_cast<int32_t>(status.code());
  const size_t room = std::min(out.size(), kResponseBytes) - sizeof(header);
  header.message_bytes =
      static_cast<uint32_t>(std::min(status.message().size(), room));
  std::memcpy(out.data(), &header, sizeof(header));
  if (header.message_bytes > 0) {
    std::memcpy(out.data() + sizeof(header), status.message().data(),
                header.message_bytes);
  }
  return sizeof(header) + header.message_bytes;
}

absl::StatusOr<FetchResponse> DecodeFetchResponse(
    absl::Span<const char> packet) {
  ResponseHeader header;
  if (packet.size() < sizeof(header)) {
    return absl::InvalidArgumentError("RDMA fetch response is too short");
  }
  std::memcpy(&header, packet.data(), sizeof(header));
  if (header.magic != kResponseMagic) {
    return absl::InvalidArgumentError("RDMA fetch response: bad magic");
  }
  if (packet.size() != sizeof(header) + header.message_bytes) {
    return absl::InvalidArgumentError(
        "RDMA fetch response: length does not match its message");
  }
  if (header.code < 0 || header.code > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("RDMA fetch response: bad status code ", header.code));
  }
  FetchResponse response;
  response.slot = header.slot;
  if (header.code != 0) {
    response.status = absl::Status(
        static_cast<absl::StatusCode>(header.code),
        absl::string_view(packet.data() + sizeof(header), header.message_bytes));
  }
  return response;
}

absl::StatusOr<RdmaAddress> ParseRdmaAddress(const std::string& address) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad RDMA address '", address,
        "' (want rdma://HOST:PORT[?device=NAME&port=N&gid_index=N]): ", why));
  };
  if (!absl::StartsWith(address, "rdma://")) return bad("no rdma:// prefix");
  absl::string_view rest = absl::string_view(address).substr(7);
  absl::string_view query;
  if (const size_t q = rest.find('?'); q != absl::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  if (!ParseDialHostPort(rest).ok()) return bad("HOST:PORT");
  RdmaAddress parsed;
  parsed.host_port = std::string(rest);
  if (query.empty()) return parsed;
  for (absl::string_view kv : absl::StrSplit(query, '&')) {
    const size_t eq = kv.find('=');
    if (eq == absl::string_view::npos) return bad(absl::StrCat("'", kv, "'"));
    const absl::string_view key = kv.substr(0, eq), value = kv.substr(eq + 1);
    if (key == "device" && !value.empty()) {
      parsed.device = std::string(value);
    } else if (key == "port" && absl::SimpleAtoi(value, &parsed.port) &&
               parsed.port >= 1 && parsed.port <= 255) {
    } else if (key == "gid_index" && absl::SimpleAtoi(value, &parsed.gid_index) &&
               parsed.gid_index >= 0 && parsed.gid_index <= 255) {
    } else {
      return bad(absl::StrCat("option '", kv, "'"));
    }
  }
  return parsed;
}

}  // namespace infinigen::kv_memory_service::rdma
