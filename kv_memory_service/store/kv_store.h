// KvStore: the memory node's pool of KV caches, plain C++ (no gRPC).
//
// Holds many sequences. Each sequence's K and V rows live in one host
// mapping made at Open, sized for SequenceGeometry::max_tokens tokens per
// (layer, KV head); appends copy rows in, gathers copy the rows a FetchPlan
// names into one contiguous caller-provided destination (layout in
// kv_types.h). When a (layer, head) is at capacity, each new token first
// evicts one token of that (layer, head) by the store's EvictionPolicy, and
// Append reports which. Per present token, the store counts fetches and
// remembers the last one (the LRU and counter policies read these).
//
// Memory. Open accounts ReservedBytes against capacity_bytes but commits
// nothing: row pages are committed as rows are written, and per-(layer,
// head) bookkeeping has one entry per present token, so a sequence's
// memory is bounded by the rows it holds (at most its reservation plus the
// bookkeeping of max_tokens tokens per head), however many positions were
// ever appended. Close returns all of it, except rows a reader on this host
// still holds through ShareRows' descriptors or mappings: those pages stay
// committed until the reader lets go, and until then they count against
// capacity_bytes as pinned bytes (pinned_rows.h). A session's closed
// shared sequence may instead stay as its spare (spare_rows.h,
// KvStoreOptions::spare_rows_per_session): the session's next Open of the
// same size takes those memfds, so that a client that kept them mapped and
// registered does neither again; spares count against capacity_bytes, and
// go when their session ends or an Open needs the room. Each eviction costs
// O(log max_tokens), whatever the policy.
//
// Prefix sharing. A sequence opened with a PrefixRequest attaches the
// longest run of its leading blocks already in the store's PrefixCache
// (prefix_cache.h): those tokens are present in every (layer, head) from
// the start, their rows read from the shared blocks (held by reference,
// never copied into the sequence). Each later block of the request is
// copied into the cache once every layer's rows of it are appended, so
// the next sequence with the same prefix (from any client) attaches it.
// Shared blocks take memory once, against prefix_cache_bytes.
//
// Ids and ownership. Sequence and session ids are random 64-bit values:
// none can be derived from another. A sequence opened in a session answers
// calls only from that session (CheckOwner): the gRPC service applies it to
// Append, Close, statistics and Fetch, and every data plane (the TCP fetch
// socket, shared memory, RDMA) to each fetch, whose request names the
// caller's session beside the sequence id. Another session gets NotFound,
// as for an id never handed out, so a leaked id alone reads nothing.
//
// Error contract, the same for every transport in front of the store:
//  - NotFound: unknown (or closed) sequence id.
//  - InvalidArgument: a geometry field out of range; a layer or layer range
//    outside the geometry; a plan whose head count is not n_kv_heads or
//    whose offsets are malformed; a negative position; K/V sizes that do not
//    match the block's shape; a destination smaller than the plan needs.
//  - OutOfRange: a position at or beyond the layer's current length (it
//    may become valid after more appends).
//  - FailedPrecondition: a position that was evicted (it never comes back).
//  - ResourceExhausted: Open beyond max_sequences or capacity_bytes
//    (pinned bytes included); ShareRows for a session that keeps
//    max_pinned_sequences closed sequences pinned; an append or fetch
//    beyond the per-call limits in KvStoreOptions.
//  - Cancelled / DeadlineExceeded: an append whose caller gave up, or whose
//    deadline came, while it waited for its sequence (AppendBlock).
// A call that fails changes nothing: no row, length or counter.
//
// Leases. A sequence may belong to a session (OpenSession), which its
// client keeps alive with RenewSession. ExpireSessions, called periodically
// by the server, closes every sequence of each session that went
// lease_timeout without a renewal, exactly as Close would. An expired
// session is gone: renewing it, or opening a sequence in it, is NotFound,
// and so is every later call on its sequences. Sequences opened without a
// session (the in-process client) live until closed.
//
// Thread-safety: every method may be called concurrently. Calls on
// different sequences run in parallel; calls on one sequence are serialized
// by that sequence's lock. Close while another thread gathers from the same
// sequence is safe: the gather finishes on the rows it started with.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_STORE_KV_STORE_H_
#define INFINIGEN_KV_MEMORY_SERVICE_STORE_KV_STORE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kv_memory_service/client/kv_store_options.h"
#include "kv_memory_service/client/kv_types.h"

namespace infinigen {
class ThreadPool;
}  // namespace infinigen

namespace infinigen::kv_memory_service {

class PinnedRows;
class PrefixCache;
class SpareRows;

// A session whose lease ExpireSessions found run out.
struct ExpiredSession {
  SessionId session = 0;
  int32_t sequences = 0;    // closed with it
  int64_t bytes_freed = 0;  // their ReservedBytes
  // Of those, the sequences whose rows the client was given (ShareRows):
  // their pages stay pinned while the client holds them.
  int32_t shared = 0;
  absl::Duration idle;      // since the session's last renewal
};

class StoredSequence;
struct StoreTotals;

class KvStore {
 public:
  explicit KvStore(const KvStoreOptions& options);
  ~KvStore();
  KvStore(const KvStore&) = delete;
  KvStore& operator=(const KvStore&) = delete;

  // Reserves ReservedBytes(geometry) and returns the new sequence's id.
  // InvalidArgument for a bad geometry; ResourceExhausted when
  // max_sequences are open or the reservation would pass capacity_bytes.
  absl::StatusOr<SequenceId> Open(const SequenceGeometry& geometry);
  // The same, the sequence owned by `session` (0: none). NotFound if the
  // session is unknown or its lease has run out.
  absl::StatusOr<SequenceId> Open(const SequenceGeometry& geometry,
                                  SessionId session);

  // Open that also reuses and shares prefix blocks: attaches the longest
  // run of prefix.keys' leading blocks held in the prefix cache (the new
  // sequence's first cached_tokens positions of every layer, present and
  // fetchable as if appended), and publishes each later block once every
  // layer's rows of it are appended. Keys past max_tokens / block_tokens
  // are ignored. InvalidArgument for block_tokens outside [1,
  // kMaxBlockTokens] with keys; otherwise as Open.
  absl::StatusOr<OpenedSequence> Open(const SequenceGeometry& geometry,
                                      SessionId session,
                                      const PrefixRequest& prefix);
  static constexpr int32_t kMaxBlockTokens = 1 << 16;

  // Starts a session with a full lease. ResourceExhausted beyond
  // max_sessions.
  absl::StatusOr<SessionId> OpenSession();
  // Renews the session's lease. NotFound if it is unknown or its lease has
  // already run out (its sequences are then closed here, if ExpireSessions
  // has not done it yet).
  absl::Status RenewSession(SessionId session);
  // Ends the session now and closes the sequences it still owns (its client
  // is going away); not counted as an expiry. NotFound if it is unknown or
  // has expired.
  absl::Status CloseSession(SessionId session);
  // Closes the sequences of every session whose lease has run out, ends
  // those sessions, and returns them. Nothing when lease_timeout is zero.
  std::vector<ExpiredSession> ExpireSessions();

  // Appends block.n_tokens tokens to each layer of the block (layout in
  // AppendBlock), evicting first where a (layer, head) is full, and returns
  // the evicted tokens. All-or-nothing: validated completely before any row
  // is written. NotFound, InvalidArgument (layer range, n_tokens <= 0, k/v
  // sizes), ResourceExhausted (n_tokens > max_append_tokens), OutOfRange (a
  // position would pass INT32_MAX), Cancelled / DeadlineExceeded (the
  // block's caller gave up, or its deadline came, before it ran).
  absl::StatusOr<AppendResult> Append(SequenceId seq, const AppendBlock& block);

  // Copies the K and V rows `plan` selects from `layer` into dest, in the
  // layout FetchPlan documents, and counts each selected token as fetched
  // once per occurrence. dest must hold at least FetchElements(plan,
  // head_dim) values; anything past that is left untouched. Errors per the
  // contract above; on error dest may be partly written but nothing stored
  // changes.
  //
  // Cost: a position's row is found by arithmetic (a ring or map lookup
  // only for LRU/counter heads that have evicted); runs of consecutive
  // positions are copied as one block; a gather of over 1 MiB is split
  // across KvStoreOptions::gather_threads. Gathers of one sequence run
  // concurrently with each other (not with its appends). The fetch
  // statistics are recorded in a log (the plan, 4 bytes a row) applied
  // off the fetch path; allocation happens only as that log grows.
  absl::Status Gather(SequenceId seq, int32_t layer, const FetchPlan& plan,
                      absl::Span<uint16_t> dest);

  // One-sided reads, for a reader on this host (the in-process client): the
  // sequence's rows (DirectRows, kv_types.h). FailedPrecondition for a
  // sequence with an attached prefix (those rows live in shared blocks);
  // NotFound if unknown.
  absl::StatusOr<DirectRows> GetDirectRows(SequenceId seq) const;

  // One-sided reads for a reader on this host in another process (the shm
  // data plane): read-only descriptors of the memfds holding `seq`'s K and
  // V rows, for `session` (CheckOwner), in GetDirectRows' layout. The
  // caller owns the descriptors. The memfds are sealed (kRowSeals): whoever
  // holds a descriptor, even reopened writable, can only read. From the
  // first share on, the rows' memory is watched, and after the sequence's
  // close it counts as pinned while any holder keeps it. FailedPrecondition
  // where the rows are in private memory (KvStoreOptions::
  // max_shared_sequences), the sequence has an attached prefix, or the node
  // cannot watch shared memory; ResourceExhausted when `session` already
  // keeps max_pinned_sequences closed sequences pinned; NotFound as
  // CheckOwner.
  struct SharedRows {
    int k_fd = -1;
    int v_fd = -1;
    size_t layer_values = 0;
    int32_t max_tokens = 0;
  };
  absl::StatusOr<SharedRows> ShareRows(SequenceId seq, SessionId session);

  // Records a fetch of `plan` from `layer` that its reader did itself
  // (GetDirectRows), as Gather records its own: the fetch statistics and
  // eviction candidates learn of it. Checks the plan as Gather does, and
  // FailedPrecondition for a position not at its own slot (its head evicts,
  // or it belongs to an attached prefix): what the reader read there was
  // not that position's row.
  absl::Status NoteFetched(SequenceId seq, int32_t layer,
                           const FetchPlan& plan);
  // Records that the reader used `plan`'s rows of `layer` from copies of
  // its own (a row cache), read beside the layer's last fetch: the fetch
  // statistics and eviction candidates count them as that fetch's rows
  // (the clock of the layer's last fetch, no tick of its own), so that a
  // reader which fetches only what it does not hold leaves the node's
  // statistics and evictions as fetching every row would. Positions the
  // node evicted since are left out (their rows are no longer counted);
  // wherever the position lies (an evicting head, an attached prefix).
  // The plan checked as Gather checks it (InvalidArgument, OutOfRange,
  // ResourceExhausted over max_fetch_indices).
  absl::Status NoteHeld(SequenceId seq, int32_t layer, const FetchPlan& plan);
  // NoteFetched of the plan in which each KV head h read its first
  // head_offsets[h + 1] - head_offsets[h] positions, in order (a whole
  // layer read in place), without its indices: recorded in O(n_kv_heads)
  // while no head evicts. The same checks as NoteFetched's on that plan.
  absl::Status NoteLeadingFetched(SequenceId seq, int32_t layer,
                                  absl::Span<const int32_t> head_offsets);

  // OK if `seq` is open and `session` may use it: the session that opened
  // it, or any caller for a sequence opened without a session. NotFound
  // otherwise, the same answer as for an id never handed out, so that a
  // caller learns nothing of other sessions' sequences. The gRPC service
  // checks it before each control call on a sequence.
  absl::Status CheckOwner(SequenceId seq, SessionId session) const;

  // Frees the sequence's rows. NotFound if unknown.
  absl::Status Close(SequenceId seq);

  // NotFound if unknown.
  absl::StatusOr<SequenceGeometry> Geometry(SequenceId seq) const;
  // The same for a sequence `session` may use (CheckOwner), in one lookup:
  // what a fetch checks before it reads a plan against the geometry.
  absl::StatusOr<SequenceGeometry> Geometry(SequenceId seq,
                                            SessionId session) const;
  absl::StatusOr<SequenceStats> GetSequenceStats(SequenceId seq) const;
  StoreStats GetStoreStats() const;
  // The present tokens of (layer, kv_head), by increasing position, with
  // their fetch statistics. NotFound / InvalidArgument as above.
  absl::StatusOr<std::vector<TokenFetchStats>> GetTokenStats(
      SequenceId seq, int32_t layer, int32_t kv_head) const;

  const KvStoreOptions& options() const { return options_; }

 private:
  // One sequence's rows and bookkeeping (stored_sequence.h).
  using Sequence = StoredSequence;

  // A client session: its last renewal and the sequences it owns, with
  // their reserved bytes.
  struct Session {
    absl::Time renewed;
    absl::flat_hash_map<SequenceId, int64_t> sequences;
  };

  absl::StatusOr<std::shared_ptr<Sequence>> Find(SequenceId seq) const;
  // Find, after refusing a plan over max_fetch_indices (ResourceExhausted):
  // what Gather and the notes check first.
  absl::StatusOr<std::shared_ptr<Sequence>> FindForPlan(
      SequenceId seq, const FetchPlan& plan) const;
  // Find, NotFound also when `session` may not use the sequence.
  absl::StatusOr<std::shared_ptr<Sequence>> FindOwned(SequenceId seq,
                                                      SessionId session) const;
  absl::Time Now() const;
  bool Expired(const Session& session, absl::Time now) const;
  // Ends the session: its sequences leave the store (their rows move to
  // `freed`, to be released after mu_) and the totals count them.
  ExpiredSession ExpireLocked(SessionId id, absl::Time now,
                              std::vector<std::shared_ptr<Sequence>>* freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The rows of `s` (sequence `seq` of `session`), just taken out of the
  // store: if they were shared, they count as pinned until released.
  void OutliveLocked(SequenceId seq, SessionId session, const Sequence& s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The same at a Close: shared rows of a session stay as its spare
  // (spares_), pushing out its oldest; what leaves goes to `freed`.
  void RetireLocked(SequenceId seq, SessionId session,
                    std::shared_ptr<Sequence> s,
                    std::vector<std::shared_ptr<Sequence>>* freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ExpireLocked without the expiry counts; what it closed.
  ExpiredSession EndSessionLocked(SessionId id, absl::Time now,
                                  std::vector<std::shared_ptr<Sequence>>* freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The live session `id` at `now`; one whose lease ran out is expired
  // first. NotFound when there is none.
  absl::StatusOr<Session*> LiveSessionLocked(
      SessionId id, absl::Time now,
      std::vector<std::shared_ptr<Sequence>>* freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops `seq` from its session, if it has one.
  void ForgetOwnerLocked(SequenceId seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const KvStoreOptions options_;
  // Live memfds of shareable rows (KvStoreOptions::max_shared_sequences).
  const std::shared_ptr<std::atomic<int64_t>> memfds_ =
      std::make_shared<std::atomic<int64_t>>(0);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<SequenceId, std::shared_ptr<Sequence>> sequences_
      ABSL_GUARDED_BY(mu_);
  int64_t bytes_reserved_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<SessionId, Session> sessions_ ABSL_GUARDED_BY(mu_);
  // The session of each sequence that has one.
  absl::flat_hash_map<SequenceId, SessionId> owner_ ABSL_GUARDED_BY(mu_);
  // Open sequences whose rows ShareRows has handed out, with pinned_'s
  // watches of their K and V memfds.
  absl::flat_hash_map<SequenceId, std::pair<int, int>> shared_
      ABSL_GUARDED_BY(mu_);
  // Null where the kernel gives no inotify: then nothing is shared.
  std::unique_ptr<PinnedRows> pinned_;
  // Closed shared sequences kept for their sessions' next Open.
  std::unique_ptr<SpareRows> spares_ ABSL_GUARDED_BY(mu_);
  int64_t expired_sessions_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t expired_sequences_ ABSL_GUARDED_BY(mu_) = 0;

  // Lifetime totals, kept as atomics so the hot paths do not take mu_.
  std::unique_ptr<StoreTotals> totals_;
  std::unique_ptr<PrefixCache> prefix_cache_;
  std::unique_ptr<ThreadPool> gather_pool_;  // splits large gathers
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_STORE_KV_STORE_H_
