// Plain value types shared by the KV store, its gRPC service and every
// client transport: sequence geometry, the rows of an append, the fetch plan
// with the layout of its destination, eviction policies and statistics.
//
// Terms. A sequence holds, for every (layer, KV head), the K row and the V
// row (head_dim 16-bit values each) of every token appended to it. A token is
// named by its *position*: 0 for the first token appended to that layer, 1
// for the next, and so on. Positions never change, even when the pool evicts
// tokens; an evicted position simply has no row any more.
//
// Rows are head_dim uint16_t values: 16-bit floats (fp16 or bf16 per
// SequenceGeometry::dtype) for most policies, or any packed format the
// worker chooses (int4 rows, gpu_worker/backend/kv_rows.h, are scales, minimums and
// nibbles packed into KvRowWidth values, which the worker passes as
// head_dim). The memory node never interprets them, it only moves bits.
//
// Nothing here owns memory except the result structs; spans point at the
// caller's buffers. Everything is a plain value: not synchronized.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_CLIENT_KV_TYPES_H_
#define INFINIGEN_KV_MEMORY_SERVICE_CLIENT_KV_TYPES_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace infinigen::kv_memory_service {

// Names an open sequence. Assigned by the store at Open: 64 random bits
// (never 0), so an id cannot be guessed from other ids (sequences opened
// one after the other get unrelated ids), and an id from a store that has
// since restarted is NotFound rather than someone else's sequence. Whoever
// knows an id may use the sequence: clients should not share them.
using SequenceId = uint64_t;

// Names a client session: the owner of the sequences a client opens, kept
// alive by the client's heartbeats (a lease). Assigned by the store, random
// like SequenceId; 0 = no session (the sequence lives until closed).
using SessionId = uint64_t;

// The meaning of the 16-bit row values. Stored and returned bit for bit.
enum class KvDType { kFloat16 = 0, kBFloat16 = 1 };

// What the pool drops when a (layer, KV head) is full (InfiniGen's memory
// pool, Lee et al., OSDI 2024). Let p be the position being appended:
//  - kFifo: the present token with the smallest position.
//  - kLru: among the present tokens with position < p / 2 (integer
//    division), the one whose last fetch is oldest (never fetched is oldest
//    of all); ties go to the smallest position.
//  - kCounter: among the present tokens with position < p / 2, the one
//    fetched the fewest times; ties go to the smallest position.
// LRU and counter fall back to FIFO when no present token has position
// < p / 2 (possible only when the capacity is more than half the length).
enum class EvictionPolicy { kFifo = 0, kLru = 1, kCounter = 2 };

// "fifo", "lru", "counter" (lower case); InvalidArgument otherwise.
absl::StatusOr<EvictionPolicy> ParseEvictionPolicy(absl::string_view name);
absl::string_view EvictionPolicyName(EvictionPolicy policy);

// The shape of one sequence's cache, fixed at Open.
struct SequenceGeometry {
  int32_t n_layers = 0;    // > 0
  int32_t n_kv_heads = 0;  // > 0
  // > 0: uint16_t values per stored row; the model's head dimension for
  // 16-bit rows, the packed width for int4 (KvRowWidth, kv_rows.h).
  int32_t head_dim = 0;
  // Most tokens kept per (layer, KV head): the pool's capacity for this
  // sequence. When a (layer, head) holds this many, appending one more first
  // evicts one by the store's EvictionPolicy. Open reserves (accounts) room
  // for this many tokens; memory is committed as rows arrive.
  int32_t max_tokens = 0;  // > 0
  KvDType dtype = KvDType::kFloat16;
};

// InvalidArgument naming the field when a field is out of range, when
// n_layers x n_kv_heads exceeds 2^16 or the reservation 2^50 bytes.
absl::Status ValidateGeometry(const SequenceGeometry& geometry);

// Bytes of K and V rows the pool reserves for a sequence of this geometry:
// 2 * n_layers * n_kv_heads * max_tokens * head_dim * 2.
int64_t ReservedBytes(const SequenceGeometry& geometry);

// Names one prefix block: the rows of block_tokens consecutive tokens of
// every (layer, KV head), as one model in one row format computed them
// after the same earlier tokens. A 128-bit hash chain (PrefixKeys in
// prefix_keys.h): equal keys mean equal model identity, block size and
// tokens from position 0 through the block's end.
struct PrefixKey {
  uint64_t lo = 0;
  uint64_t hi = 0;

  bool operator==(const PrefixKey& o) const { return lo == o.lo && hi == o.hi; }
  bool operator!=(const PrefixKey& o) const { return !(*this == o); }
  template <typename H>
  friend H AbslHashValue(H h, const PrefixKey& k) {
    return H::combine(std::move(h), k.lo, k.hi);
  }
};

// What a sequence may reuse and share. keys[i] names the tokens
// [i * block_tokens, (i + 1) * block_tokens) of the sequence (with all
// before them). Open attaches the longest run of leading blocks the store
// holds; the rest are published as shared blocks once every layer's rows
// of a block are appended. Empty keys: nothing reused or shared.
struct PrefixRequest {
  int32_t block_tokens = 0;  // > 0 when keys is not empty
  std::vector<PrefixKey> keys;
  // Set by the node from the caller's credential, never sent: blocks are
  // attached and published only within one namespace ("" the default),
  // and a read-only credential's sequences publish none.
  std::string prefix_namespace;
  bool may_publish = true;
};

// An opened sequence: its id and how many leading tokens (a multiple of
// block_tokens) were attached from shared blocks. Every layer's length
// starts at cached_tokens, their rows present; the caller appends from
// there.
struct OpenedSequence {
  SequenceId id = 0;
  int32_t cached_tokens = 0;
  // The annotation each attached block was published with (AppendBlock),
  // one per block, in order.
  std::vector<std::string> prefix_meta;
};

// The K and V rows of n_tokens new tokens, for the consecutive layers
// [first_layer, first_layer + n_layers). Layer l's tokens take its next
// positions: length(l), length(l) + 1, ... Layers may be appended separately
// (prefill layer by layer) or together (one decode step for all layers).
struct AppendBlock {
  int32_t first_layer = 0;
  int32_t n_layers = 0;
  int32_t n_tokens = 0;
  // [n_layers][n_tokens][n_kv_heads][head_dim]: for each layer, the K
  // projection of the tokens in token order, heads side by side, exactly
  // what a K projection of n_tokens produces.
  absl::Span<const uint16_t> k;
  absl::Span<const uint16_t> v;  // same layout as k
  // Optional annotations of the sequence's prefix blocks (PrefixRequest):
  // prefix_meta[i] belongs to block prefix_meta_first_block + i and is
  // kept with that block when it is shared, returned to whoever attaches
  // it (OpenedSequence::prefix_meta). The node never reads them; a worker
  // keeps there what it derives from a block's tokens besides K and V
  // (InfiniGen: the block's summed query magnitudes). At most
  // kMaxPrefixMetaBytes each.
  int32_t prefix_meta_first_block = 0;
  absl::Span<const std::string> prefix_meta;
  // The caller's deadline and cancellation (a server passes its request's):
  // an append still waiting for its sequence when either has come is
  // refused with nothing written. Default: none.
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;
};
inline constexpr size_t kMaxPrefixMetaBytes = 1 << 20;

// A block's prefix annotations as the data planes that carry an append's
// rows themselves (the shm slot, the fetch socket) send them after the
// rows: uint32 count, int32 prefix_meta_first_block, count uint32 sizes,
// then the annotations' bytes, little-endian. Empty when the block has
// none.
std::string EncodePrefixMeta(const AppendBlock& block);
// The annotations and their first block from EncodePrefixMeta's bytes,
// which may be anything: InvalidArgument for a count, size or total that
// does not add up, or an annotation over kMaxPrefixMetaBytes.
absl::Status DecodePrefixMeta(absl::string_view bytes,
                              std::vector<std::string>* meta,
                              int32_t* first_block);

// One token the pool dropped to make room. Fetching it afterwards fails with
// FailedPrecondition; the caller should stop selecting it.
struct EvictedToken {
  int32_t layer = 0;
  int32_t kv_head = 0;
  int32_t position = 0;

  bool operator==(const EvictedToken& o) const {
    return layer == o.layer && kv_head == o.kv_head && position == o.position;
  }
};

// The evicted tokens from `n` (layer, kv_head, position) int32 triples, as
// the shm slot and the fetch socket answer an append.
std::vector<EvictedToken> EvictedFromTriples(const int32_t* triples,
                                             size_t n);

struct AppendResult {
  // In the order the evictions happened: by layer, then token, then head.
  // Empty while no (layer, head) is at capacity.
  std::vector<EvictedToken> evicted;
};

// Which tokens to fetch from one layer: for each KV head, a list of token
// positions. Heads may select different tokens and different counts. Views
// the caller's arrays: nothing is copied and nothing allocated.
//
//   head h selects indices[head_offsets[h]] ... indices[head_offsets[h+1]-1]
//
// head_offsets has n_kv_heads + 1 entries, head_offsets[0] == 0, is
// non-decreasing, and its last entry is indices.size(). Within a head,
// positions may come in any order and may repeat; each is gathered (and
// counted as fetched) once per occurrence.
//
// Destination layout, one contiguous array of uint16_t, all K then all V:
//
//   [K rows of head 0 in plan order][K rows of head 1] ... [head H-1]
//   [V rows of head 0 in plan order][V rows of head 1] ... [head H-1]
//
// each row head_dim values, so the K row of the j-th index of head h
// (j counted from head_offsets[h]) starts at element
// (head_offsets[h] + j) * head_dim, and its V row at
// (indices.size() + head_offsets[h] + j) * head_dim.
// FetchElements() gives the total: 2 * indices.size() * head_dim.
struct FetchPlan {
  absl::Span<const int32_t> indices;
  absl::Span<const int32_t> head_offsets;

  int32_t n_heads() const {
    return head_offsets.empty() ? 0
                                : static_cast<int32_t>(head_offsets.size()) - 1;
  }
};

// uint16_t elements a fetch of `plan` writes: 2 * indices.size() * head_dim.
inline size_t FetchElements(const FetchPlan& plan, int32_t head_dim) {
  return 2 * plan.indices.size() * static_cast<size_t>(head_dim);
}

// Checks the plan's shape against n_kv_heads (not the positions, which need
// the store): InvalidArgument if head_offsets does not have n_kv_heads + 1
// entries, does not start at 0, decreases, or does not end at
// indices.size().
absl::Status ValidatePlanShape(const FetchPlan& plan, int32_t n_kv_heads);
// ValidatePlanShape's checks of the head offsets alone (their count, the
// first 0, none decreasing): a plan of each head's leading positions
// (KvStore::NoteLeadingFetched) has no indices to end at.
absl::Status ValidateHeadOffsets(absl::Span<const int32_t> head_offsets,
                                 int32_t n_kv_heads);
// ValidatePlanShape's first check alone, for a data plane that judges a
// request by its header (n_offsets head offsets) before its body arrives.
absl::Status ValidatePlanHeadCount(size_t n_offsets, int32_t n_kv_heads);

// A sequence's rows where a reader on the memory node's host can read them
// itself (one-sided reads): [layer][kv_head][slot][head_dim] uint16_t
// values, layer_values a layer and max_tokens slots a head. Until a head
// evicts, position p of a (layer, head) is at slot p. The memory stays at
// this address until the sequence is closed.
struct DirectRows {
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;
  size_t layer_values = 0;
  int32_t max_tokens = 0;
};

// A plan that owns its arrays; handy for tests and for callers that build
// a plan once and reuse it.
struct OwnedFetchPlan {
  std::vector<int32_t> indices;
  std::vector<int32_t> head_offsets;

  FetchPlan view() const { return FetchPlan{indices, head_offsets}; }
  // Every one of n_kv_heads heads selects the same `positions`.
  static OwnedFetchPlan SameForAllHeads(int32_t n_kv_heads,
                                        absl::Span<const int32_t> positions);
  // Head h selects per_head[h].
  static OwnedFetchPlan PerHead(
      const std::vector<std::vector<int32_t>>& per_head);
};

// Fetch statistics of one present token in one (layer, KV head).
struct TokenFetchStats {
  int32_t position = 0;
  int64_t fetch_count = 0;
  // The sequence's fetch clock at this token's last fetch: each Gather of
  // the sequence advances the clock by one. 0 = never fetched.
  uint64_t last_fetch = 0;
};

struct SequenceStats {
  SequenceId id = 0;
  SequenceGeometry geometry;
  std::vector<int32_t> layer_lengths;  // [n_layers] positions appended
  int64_t present_rows = 0;   // (layer, head, token) K/V row pairs stored
  int64_t evicted_rows = 0;   // row pairs dropped by eviction so far
  int64_t bytes_reserved = 0;  // ReservedBytes(geometry)
  int64_t fetches = 0;         // Gather calls that succeeded
  int64_t fetched_rows = 0;    // K/V row pairs those gathers copied
};

struct StoreStats {
  int32_t open_sequences = 0;
  int32_t max_sequences = 0;
  int64_t bytes_reserved = 0;   // sum of open sequences' ReservedBytes
  int64_t capacity_bytes = 0;   // 0 = unlimited
  EvictionPolicy eviction = EvictionPolicy::kFifo;
  int64_t appended_rows = 0;    // over the store's life, closed sequences too
  int64_t evicted_rows = 0;
  int64_t fetches = 0;
  int64_t fetched_rows = 0;
  int32_t open_sessions = 0;
  int64_t expired_sessions = 0;   // leases that ran out, over the store's life
  int64_t expired_sequences = 0;  // sequences closed with them
  int64_t lease_timeout_ms = 0;   // 0 = sessions never expire
  // The shared prefix blocks (prefix_cache.h).
  int64_t prefix_blocks = 0;          // held now
  int64_t prefix_bytes = 0;           // their K and V rows, each counted once
  int64_t prefix_capacity_bytes = 0;  // 0 = no prefix sharing
  int64_t prefix_hit_tokens = 0;      // tokens attached at Open, life total
  int64_t prefix_lookup_tokens = 0;   // tokens Open was asked to attach
  int64_t prefix_evicted_blocks = 0;  // dropped to make room, life total
  // Rows of closed sequences that a reader on the node's host still holds
  // (one-sided reads: KvStore::ShareRows), counted against capacity_bytes
  // until released.
  int64_t pinned_bytes = 0;
  int64_t pinned_sequences = 0;
  // Closed sequences' shared rows kept for their sessions' next sequences
  // (KvStoreOptions::spare_rows_per_session), counted against
  // capacity_bytes, and the sequences opened in such rows (life total).
  int64_t spare_sequences = 0;
  int64_t spare_bytes = 0;
  int64_t reused_row_sequences = 0;
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_CLIENT_KV_TYPES_H_
