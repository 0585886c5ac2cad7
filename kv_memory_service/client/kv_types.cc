#include "kv_memory_service/client/kv_types.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace infinigen::kv_memory_service {
namespace {

// Largest reservation one sequence may ask for; keeps every size
// computation far from overflow.
constexpr int64_t kMaxSequenceBytes = int64_t{1} << 50;
// Most (layer, KV head) pairs one sequence may have: the store keeps
// bookkeeping per pair from Open on, so this bounds what an Open costs
// whatever its rows (models have at most a few thousand).
constexpr int64_t kMaxLayerHeads = int64_t{1} << 16;

}  // namespace

absl::StatusOr<EvictionPolicy> ParseEvictionPolicy(absl::string_view name) {
  if (name == "fifo") return EvictionPolicy::kFifo;
  if (name == "lru") return EvictionPolicy::kLru;
  if (name == "counter") return EvictionPolicy::kCounter;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown eviction policy '", name, "' (want fifo, lru or counter)"));
}

absl::string_view EvictionPolicyName(EvictionPolicy policy) {
  switch (policy) {
    case EvictionPolicy::kFifo:
      return "fifo";
    case EvictionPolicy::kLru:
      return "lru";
    case EvictionPolicy::kCounter:
      return "counter";
  }
  return "unknown";
}

absl::Status ValidateGeometry(const SequenceGeometry& g) {
  if (g.n_layers <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("n_layers must be positive, got ", g.n_layers));
  }
  if (g.n_kv_heads <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("n_kv_heads must be positive, got ", g.n_kv_heads));
  }
  if (g.head_dim <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim must be positive, got ", g.head_dim));
  }
  if (g.max_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens must be positive, got ", g.max_tokens));
  }
  if (g.dtype != KvDType::kFloat16 && g.dtype != KvDType::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dtype must be float16 or bfloat16, got ", static_cast<int>(g.dtype)));
  }
  if (int64_t{g.n_layers} * g.n_kv_heads > kMaxLayerHeads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry too large: ", g.n_layers, " layers x ", g.n_kv_heads,
        " KV heads exceeds ", kMaxLayerHeads, " (layer, head) pairs"));
  }
  // Each factor is below 2^31, so the product of two fits; check before
  // each further multiplication.
  int64_t bytes = int64_t{4} * g.n_layers;
  for (int64_t f : {int64_t{g.n_kv_heads}, int64_t{g.max_tokens},
                    int64_t{g.head_dim}}) {
    if (bytes > kMaxSequenceBytes / f) {
      return absl::InvalidArgumentError(absl::StrCat(
          "geometry too large: ", g.n_layers, " layers x ", g.n_kv_heads,
          " KV heads x ", g.max_tokens, " tokens x ", g.head_dim,
          " dims exceeds 2^50 bytes"));
    }
    bytes *= f;
  }
  return absl::OkStatus();
}

int64_t ReservedBytes(const SequenceGeometry& g) {
  return int64_t{4} * g.n_layers * g.n_kv_heads * g.max_tokens * g.head_dim;
}

absl::Status ValidatePlanHeadCount(size_t n_offsets, int32_t n_kv_heads) {
  if (n_offsets != static_cast<size_t>(n_kv_heads) + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan has ", n_offsets, " head offsets; the sequence has ", n_kv_heads,
        " KV heads, so it needs ", n_kv_heads + 1));
  }
  return absl::OkStatus();
}

absl::Status ValidateHeadOffsets(absl::Span<const int32_t> head_offsets,
                                 int32_t n_kv_heads) {
  if (absl::Status count =
          ValidatePlanHeadCount(head_offsets.size(), n_kv_heads);
      !count.ok()) {
    return count;
  }
  if (head_offsets[0] != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan head_offsets[0] must be 0, got ", head_offsets[0]));
  }
  for (int32_t h = 0; h < n_kv_heads; ++h) {
    if (head_offsets[h + 1] < head_offsets[h]) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan head_offsets decrease at head ", h, ": ",
                       head_offsets[h], " then ", head_offsets[h + 1]));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidatePlanShape(const FetchPlan& plan, int32_t n_kv_heads) {
  if (absl::Status offsets = ValidateHeadOffsets(plan.head_offsets, n_kv_heads);
      !offsets.ok()) {
    return offsets;
  }
  if (static_cast<size_t>(plan.head_offsets[n_kv_heads]) !=
      plan.indices.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan head_offsets end at ", plan.head_offsets[n_kv_heads], " but it has ",
        plan.indices.size(), " indices"));
  }
  return absl::OkStatus();
}

OwnedFetchPlan OwnedFetchPlan::SameForAllHeads(
    int32_t n_kv_heads, absl::Span<const int32_t> positions) {
  OwnedFetchPlan plan;
  plan.head_offsets.push_back(0);
  for (int32_t h = 0; h < n_kv_heads; ++h) {
    plan.indices.insert(plan.indices.end(), positions.begin(), positions.end());
    plan.head_offsets.push_back(static_cast<int32_t>(plan.indices.size()));
  }
  return plan;
}

OwnedFetchPlan OwnedFetchPlan::PerHead(
    const std::vector<std::vector<int32_t>>& per_head) {
  OwnedFetchPlan plan;
  plan.head_offsets.push_back(0);
  for (const auto& positions : per_head) {
    plan.indices.insert(plan.indices.end(), positions.begin(), positions.end());
    plan.head_offsets.push_back(static_cast<int32_t>(plan.indices.size()));
  }
  return plan;
}

std::vector<EvictedToken> EvictedFromTriples(const int32_t* triples,
                                             size_t n) {
  std::vector<EvictedToken> evicted(n);
  for (size_t i = 0; i < n; ++i) {
    evicted[i].layer = triples[3 * i];
    evicted[i].kv_head = triples[3 * i + 1];
    evicted[i].position = triples[3 * i + 2];
  }
  return evicted;
}

std::string EncodePrefixMeta(const AppendBlock& block) {
  if (block.prefix_meta.empty()) return "";
  const uint32_t count = static_cast<uint32_t>(block.prefix_meta.size());
  std::string out(sizeof(uint32_t) * (2 + count), '\0');
  std::memcpy(out.data(), &count, sizeof(count));
  std::memcpy(out.data() + 4, &block.prefix_meta_first_block, 4);
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t size = static_cast<uint32_t>(block.prefix_meta[i].size());
    std::memcpy(out.data() + 8 + 4 * i, &size, sizeof(size));
  }
  for (const std::string& m : block.prefix_meta) out += m;
  return out;
}

absl::Status DecodePrefixMeta(absl::string_view bytes,
                              std::vector<std::string>* meta,
                              int32_t* first_block) {
  meta->clear();
  *first_block = 0;
  if (bytes.empty()) return absl::OkStatus();
  uint32_t count = 0;
  if (bytes.size() < 8) {
    return absl::InvalidArgumentError("prefix annotations: a short header");
  }
  std::memcpy(&count, bytes.data(), 4);
  std::memcpy(first_block, bytes.data() + 4, 4);
  if (count > (bytes.size() - 8) / 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix annotations: ", count, " sizes in ", bytes.size(), " bytes"));
  }
  size_t at = 8 + size_t{4} * count;
  std::vector<uint32_t> sizes(count);
  if (count > 0) std::memcpy(sizes.data(), bytes.data() + 8, 4 * count);
  meta->reserve(count);
  for (const uint32_t size : sizes) {
    if (size > kMaxPrefixMetaBytes || size > bytes.size() - at) {
      meta->clear();
      return absl::InvalidArgumentError(absl::StrCat(
          "prefix annotations: one of ", size, " bytes where ",
          bytes.size() - at, " remain (at most ", kMaxPrefixMetaBytes, ")"));
    }
    meta->emplace_back(bytes.substr(at, size));
    at += size;
  }
  if (at != bytes.size()) {
    meta->clear();
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix annotations: ", bytes.size() - at, " bytes left over"));
  }
  return absl::OkStatus();
}

}  // namespace infinigen::kv_memory_service
