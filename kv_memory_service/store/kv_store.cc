#include "kv_memory_service/store/kv_store.h"

#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "common/log.h"
#include "common/thread_pool.h"
#include "kv_memory_service/store/pinned_rows.h"
#include "kv_memory_service/store/prefix_cache.h"
#include "kv_memory_service/client/prefix_keys.h"
#include "kv_memory_service/store/spare_rows.h"
#include "kv_memory_service/store/stored_sequence.h"

namespace infinigen::kv_memory_service {
namespace {

// A fresh random 64-bit value, never 0: sequence and session ids are
// capabilities (whoever knows one may use it), so they must not be
// guessable from the ids a client was given.
uint64_t RandomId() {
  uint64_t id = 0;
  while (id == 0) {
    if (getrandom(&id, sizeof(id), 0) != static_cast<ssize_t>(sizeof(id))) {
      std::random_device rd;
      id = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    }
  }
  return id;
}

// A spare let go (its session ended, or the room is needed): its rows
// count as pinned while a client still holds them.
void ReleaseSpare(PinnedRows& pinned, SpareRows::Spare spare,
                  std::vector<std::shared_ptr<StoredSequence>>* freed) {
  pinned.Outlive(spare.watches.first, spare.rows->k_fd(), spare.seq,
                 spare.session);
  pinned.Outlive(spare.watches.second, spare.rows->v_fd(), spare.seq,
                 spare.session);
  freed->push_back(std::move(spare.rows));
}

}  // namespace

KvStore::KvStore(const KvStoreOptions& options)
    : options_(options),
      totals_(new StoreTotals),
      prefix_cache_(new PrefixCache(options.prefix_cache_bytes)),
      gather_pool_(
          new ThreadPool(ThreadPool::Resolve(options.gather_threads))) {
  spares_ = std::make_unique<SpareRows>(options_.spare_rows_per_session);
  if (options_.max_shared_sequences > 0) {
    absl::StatusOr<std::unique_ptr<PinnedRows>> pinned = PinnedRows::Create();
    if (pinned.ok()) {
      pinned_ = *std::move(pinned);
    } else {
      IG_LOG(WARNING) << "one-sided reads are off: " << pinned.status();
    }
  }
}

KvStore::~KvStore() = default;

absl::StatusOr<SequenceId> KvStore::Open(const SequenceGeometry& geometry) {
  return Open(geometry, 0);
}

absl::StatusOr<SequenceId> KvStore::Open(const SequenceGeometry& geometry,
                                         SessionId session) {
  IG_RETURN_IF_ERROR(ValidateGeometry(geometry));
  const int64_t bytes = ReservedBytes(geometry);
  SequenceId id;
  std::vector<std::shared_ptr<Sequence>> freed;  // released after mu_
  int64_t pinned = 0;
  if (pinned_ != nullptr) {
    // Rows released just now may not have been reported yet: a sequence
    // that does not fit waits a little for the kernel before it is refused.
    pinned_->ReapUnless(
        [&] {
          const int64_t held = pinned_->bytes();
          if (held == 0 || options_.capacity_bytes == 0) return false;
          absl::ReaderMutexLock lock(&mu_);
          return bytes > options_.capacity_bytes - bytes_reserved_ -
                             spares_->bytes() - held;
        },
        absl::Milliseconds(100));
    pinned = pinned_->bytes();
  }
  // The session's spare of this size, whose memfds the new sequence takes.
  std::optional<SpareRows::Spare> spare;
  {
    absl::MutexLock lock(&mu_);
    Session* owner = nullptr;
    if (session != 0) {
      IG_ASSIGN_OR_RETURN(owner, LiveSessionLocked(session, Now(), &freed));
    }
    if (static_cast<int64_t>(sequences_.size()) >= options_.max_sequences) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the store already holds its limit of ",
                       options_.max_sequences, " sequences"));
    }
    if (owner != nullptr) spare = spares_->Take(session, bytes);
    // Spares are already counted; others' go first when room is needed.
    auto room = [&] {
      return options_.capacity_bytes - bytes_reserved_ - spares_->bytes() -
             pinned;
    };
    while (!spare && options_.capacity_bytes > 0 && bytes > room()) {
      std::optional<SpareRows::Spare> oldest = spares_->TakeOldest();
      if (!oldest) break;
      ReleaseSpare(*pinned_, *std::move(oldest), &freed);
      pinned = pinned_->bytes();  // what its client still holds
    }
    if (!spare && options_.capacity_bytes > 0 && bytes > room()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the sequence needs ", bytes, " bytes; the store has ",
          std::max<int64_t>(0, room()), " of its ", options_.capacity_bytes,
          " left",
          pinned > 0 ? absl::StrCat(" (", pinned,
                                    " bytes of closed sequences are still "
                                    "held by the clients that mapped them)")
                     : ""));
    }
    bytes_reserved_ += bytes;
    do {
      id = RandomId();
    } while (sequences_.contains(id));
    // A placeholder keeps the count and the id taken while the rows are
    // allocated outside the lock.
    sequences_[id] = nullptr;
    if (owner != nullptr) {
      owner->sequences[id] = bytes;
      owner_[id] = session;
    }
  }

  // Shareable rows (memfds) while fewer than max_shared_sequences hold
  // them, or the spare's, which no call uses any more (SpareRows::Take).
  const int64_t max_memfds = int64_t{2} * options_.max_shared_sequences;
  std::pair<RowMemory, RowMemory> rows =
      spare ? spare->rows->TakeRows()
            : std::pair<RowMemory, RowMemory>(
                  RowMemory(static_cast<size_t>(bytes / 2), memfds_,
                            max_memfds),
                  RowMemory(static_cast<size_t>(bytes / 2), memfds_,
                            max_memfds));
  RowMemory& k = rows.first;
  RowMemory& v = rows.second;
  absl::MutexLock lock(&mu_);
  // A spare's memfds go on being watched: its client may hold them still.
  auto outlive_spare = [&] {
    if (!spare) return;
    pinned_->Outlive(spare->watches.first, k.fd(), spare->seq, session);
    pinned_->Outlive(spare->watches.second, v.fd(), spare->seq, session);
  };
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    // The session expired while the rows were allocated; the expiry has
    // released the reservation.
    outlive_spare();
    return absl::NotFoundError(absl::StrCat(
        "session ", session, " expired while sequence ", id, " was opened"));
  }
  if (k == nullptr || v == nullptr) {
    sequences_.erase(it);
    bytes_reserved_ -= bytes;
    ForgetOwnerLocked(id);
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes of rows"));
  }
  // The bookkeeping is bounded by ValidateGeometry, but an allocation may
  // still fail: it must not escape (an RPC would see UNKNOWN) nor leave the
  // placeholder and its reservation behind.
  std::shared_ptr<Sequence> sequence;
  try {
    sequence = std::make_shared<Sequence>(id, geometry, options_.eviction,
                                          std::move(k), std::move(v));
  } catch (const std::bad_alloc&) {
  }
  if (sequence == nullptr) {
    outlive_spare();
    sequences_.erase(it);
    bytes_reserved_ -= bytes;
    ForgetOwnerLocked(id);
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot allocate the bookkeeping of ", geometry.n_layers, " x ",
        geometry.n_kv_heads, " (layer, head) pairs"));
  }
  it->second = std::move(sequence);
  // The client was given these memfds already: shared from the start.
  if (spare) shared_[id] = spare->watches;
  return id;
}

absl::Time KvStore::Now() const {
  return options_.clock ? options_.clock() : absl::Now();
}

bool KvStore::Expired(const Session& session, absl::Time now) const {
  return options_.lease_timeout > absl::ZeroDuration() &&
         now - session.renewed > options_.lease_timeout;
}

void KvStore::ForgetOwnerLocked(SequenceId seq) {
  auto owner = owner_.find(seq);
  if (owner == owner_.end()) return;
  auto session = sessions_.find(owner->second);
  if (session != sessions_.end()) session->second.sequences.erase(seq);
  owner_.erase(owner);
}

absl::StatusOr<SessionId> KvStore::OpenSession() {
  absl::MutexLock lock(&mu_);
  if (static_cast<int64_t>(sessions_.size()) >= options_.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the store already holds its limit of ", options_.max_sessions,
        " sessions"));
  }
  SessionId id = RandomId();
  while (sessions_.contains(id)) id = RandomId();
  sessions_[id].renewed = Now();
  return id;
}

absl::Status KvStore::RenewSession(SessionId session) {
  std::vector<std::shared_ptr<Sequence>> freed;  // released after mu_
  absl::MutexLock lock(&mu_);
  const absl::Time now = Now();
  IG_ASSIGN_OR_RETURN(Session * live, LiveSessionLocked(session, now, &freed));
  live->renewed = now;
  return absl::OkStatus();
}

absl::StatusOr<KvStore::Session*> KvStore::LiveSessionLocked(
    SessionId id, absl::Time now,
    std::vector<std::shared_ptr<Sequence>>* freed) {
  auto it = sessions_.find(id);
  if (it != sessions_.end() && Expired(it->second, now)) {
    ExpireLocked(id, now, freed);
    it = sessions_.end();
  }
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "no session ", id, " (its lease expired, or the server restarted)"));
  }
  return &it->second;
}

std::vector<ExpiredSession> KvStore::ExpireSessions() {
  std::vector<ExpiredSession> expired;
  if (options_.lease_timeout <= absl::ZeroDuration()) return expired;
  std::vector<std::shared_ptr<Sequence>> freed;  // released after mu_
  absl::MutexLock lock(&mu_);
  const absl::Time now = Now();
  std::vector<SessionId> ids;
  for (const auto& [id, session] : sessions_) {
    if (Expired(session, now)) ids.push_back(id);
  }
  for (SessionId id : ids) expired.push_back(ExpireLocked(id, now, &freed));
  return expired;
}

absl::Status KvStore::CloseSession(SessionId session) {
  std::vector<std::shared_ptr<Sequence>> freed;  // released after mu_
  absl::MutexLock lock(&mu_);
  const absl::Time now = Now();
  IG_RETURN_IF_ERROR(LiveSessionLocked(session, now, &freed).status());
  EndSessionLocked(session, now, &freed);
  return absl::OkStatus();
}

ExpiredSession KvStore::ExpireLocked(
    SessionId id, absl::Time now,
    std::vector<std::shared_ptr<Sequence>>* freed) {
  ExpiredSession out = EndSessionLocked(id, now, freed);
  if (out.session != 0) {
    ++expired_sessions_;
    expired_sequences_ += out.sequences;
  }
  return out;
}

void KvStore::OutliveLocked(SequenceId seq, SessionId session,
                            const Sequence& s) {
  auto it = shared_.find(seq);
  if (it == shared_.end()) return;
  pinned_->Outlive(it->second.first, s.k_fd(), seq, session);
  pinned_->Outlive(it->second.second, s.v_fd(), seq, session);
  shared_.erase(it);
}

void KvStore::RetireLocked(SequenceId seq, SessionId session,
                           std::shared_ptr<Sequence> s,
                           std::vector<std::shared_ptr<Sequence>>* freed) {
  auto it = shared_.find(seq);
  if (session == 0 || it == shared_.end()) {
    OutliveLocked(seq, session, *s);
    freed->push_back(std::move(s));
    return;
  }
  SpareRows::Spare spare;
  spare.seq = seq;
  spare.session = session;
  spare.bytes = ReservedBytes(s->geometry());
  spare.rows = std::move(s);
  spare.watches = it->second;
  shared_.erase(it);
  for (SpareRows::Spare& out : spares_->Keep(std::move(spare))) {
    ReleaseSpare(*pinned_, std::move(out), freed);
  }
}

ExpiredSession KvStore::EndSessionLocked(
    SessionId id, absl::Time now,
    std::vector<std::shared_ptr<Sequence>>* freed) {
  ExpiredSession out;
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return out;
  out.session = id;
  out.idle = now - it->second.renewed;
  for (const auto& [seq, bytes] : it->second.sequences) {
    auto s = sequences_.find(seq);
    if (s == sequences_.end()) continue;
    // A placeholder (rows still being allocated) goes too: Open notices.
    if (s->second != nullptr) {
      if (shared_.contains(seq)) ++out.shared;
      OutliveLocked(seq, id, *s->second);
      freed->push_back(std::move(s->second));
    }
    sequences_.erase(s);
    owner_.erase(seq);
    bytes_reserved_ -= bytes;
    out.bytes_freed += bytes;
    ++out.sequences;
  }
  for (SpareRows::Spare& spare : spares_->TakeSession(id)) {
    ReleaseSpare(*pinned_, std::move(spare), freed);
  }
  sessions_.erase(it);
  return out;
}

absl::StatusOr<std::shared_ptr<KvStore::Sequence>> KvStore::Find(
    SequenceId seq) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = sequences_.find(seq);
  if (it == sequences_.end() || it->second == nullptr) {
    return absl::NotFoundError(absl::StrCat("no open sequence ", seq));
  }
  return it->second;
}

absl::StatusOr<AppendResult> KvStore::Append(SequenceId seq,
                                             const AppendBlock& block) {
  IG_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(seq));
  std::vector<std::shared_ptr<const PrefixBlock>> published;
  absl::StatusOr<AppendResult> result =
      s->Append(block, options_.max_append_tokens, *totals_, &published,
                gather_pool_.get());
  for (auto& b : published) prefix_cache_->Insert(std::move(b));
  return result;
}

absl::StatusOr<OpenedSequence> KvStore::Open(const SequenceGeometry& geometry,
                                             SessionId session,
                                             const PrefixRequest& prefix) {
  if (!prefix.keys.empty() &&
      (prefix.block_tokens <= 0 || prefix.block_tokens > kMaxBlockTokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix block_tokens must be in [1, ", kMaxBlockTokens,
                     "], got ", prefix.block_tokens));
  }
  IG_ASSIGN_OR_RETURN(const SequenceId id, Open(geometry, session));
  OpenedSequence opened;
  opened.id = id;
  if (prefix.keys.empty()) return opened;
  // Blocks past the sequence's capacity could not all stay: neither
  // attached nor published.
  const size_t usable = std::min(
      prefix.keys.size(),
      static_cast<size_t>(geometry.max_tokens / prefix.block_tokens));
  // Another namespace's blocks are other keys: key' = XXH3_128(namespace |
  // key), so no sequence attaches a block published under another
  // credential's namespace.
  std::vector<PrefixKey> scoped;
  if (!prefix.prefix_namespace.empty()) {
    scoped.reserve(usable);
    for (size_t i = 0; i < usable; ++i) {
      const PrefixKey& k = prefix.keys[i];
      std::string bytes = prefix.prefix_namespace;
      bytes.push_back('\0');
      bytes.append(reinterpret_cast<const char*>(&k.lo), sizeof(k.lo));
      bytes.append(reinterpret_cast<const char*>(&k.hi), sizeof(k.hi));
      scoped.push_back(HashBytes(bytes));
    }
  }
  absl::Span<const PrefixKey> keys =
      scoped.empty() ? absl::Span<const PrefixKey>(prefix.keys.data(), usable)
                     : absl::Span<const PrefixKey>(scoped);
  std::vector<std::shared_ptr<const PrefixBlock>> blocks =
      prefix_cache_->capacity_bytes() > 0
          ? prefix_cache_->Attach(geometry, prefix.block_tokens, keys)
          : std::vector<std::shared_ptr<const PrefixBlock>>();
  // The cache keeps at most its capacity, and a chain of blocks is of use
  // from its first block on: blocks past what fits beside the attached
  // ones would only push the chain's head out (and be copied for nothing).
  // The sequence publishes only the leading blocks that fit (Attach).
  std::vector<PrefixKey> pending;
  int64_t publish_bytes = 0;
  if (prefix_cache_->capacity_bytes() > 0 && prefix.may_publish) {
    publish_bytes = prefix_cache_->capacity_bytes();
    for (const auto& b : blocks) publish_bytes -= b->bytes();
    pending.assign(keys.begin() + blocks.size(), keys.end());
  }
  for (const auto& b : blocks) opened.prefix_meta.push_back(b->meta);
  auto s = Find(id);
  if (!s.ok()) return s.status();  // its session expired meanwhile
  opened.cached_tokens = (*s)->Attach(std::move(blocks), prefix.block_tokens,
                                      std::move(pending), publish_bytes);
  return opened;
}

absl::StatusOr<std::shared_ptr<KvStore::Sequence>> KvStore::FindForPlan(
    SequenceId seq, const FetchPlan& plan) const {
  if (static_cast<int64_t>(plan.indices.size()) > options_.max_fetch_indices) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "plan of ", plan.indices.size(), " indices exceeds the limit of ",
        options_.max_fetch_indices));
  }
  return Find(seq);
}

absl::Status KvStore::Gather(SequenceId seq, int32_t layer,
                             const FetchPlan& plan, absl::Span<uint16_t> dest) {
  IG_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, FindForPlan(seq, plan));
  return s->Gather(layer, plan, dest, *totals_, gather_pool_.get());
}

absl::StatusOr<DirectRows> KvStore::GetDirectRows(
    SequenceId seq) const {
  IG_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(seq));
  if (s->attached()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", seq, " starts with an attached prefix: its rows are "
        "read through Gather"));
  }
  const SequenceGeometry& g = s->geometry();
  DirectRows rows;
  rows.k = s->k_rows();
  rows.v = s->v_rows();
  rows.layer_values = static_cast<size_t>(g.n_kv_heads) * g.max_tokens *
                      g.head_dim;
  rows.max_tokens = g.max_tokens;
  return rows;
}

absl::StatusOr<KvStore::SharedRows> KvStore::ShareRows(SequenceId seq,
                                                       SessionId session) {
  IG_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, FindOwned(seq, session));
  if (s->attached()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", seq, " starts with an attached prefix: its rows are "
        "read through Gather"));
  }
  if (s->k_fd() < 0 || s->v_fd() < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the rows of sequence ", seq, " are in the node's private memory "
        "(not shared with readers on its host): fetches gather them"));
  }
  if (pinned_ == nullptr) {
    return absl::FailedPreconditionError(
        "the node cannot watch shared memory (no inotify): fetches gather "
        "the rows");
  }
  bool first_share;
  {
    absl::ReaderMutexLock lock(&mu_);
    first_share = !shared_.contains(seq);
  }
  if (first_share) {
    // As in Open: rows released just now may not be reported yet.
    pinned_->ReapUnless(
        [&] {
          const int64_t held = pinned_->sequences_of(session);
          return held > 0 && held >= options_.max_pinned_sequences;
        },
        absl::Milliseconds(100));
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = sequences_.find(seq);
    if (it == sequences_.end() || it->second != s) {  // closed meanwhile
      return absl::NotFoundError(absl::StrCat("no open sequence ", seq));
    }
    if (!shared_.contains(seq)) {
      const int64_t held = pinned_->sequences_of(session);
      if (held >= options_.max_pinned_sequences) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "session ", session, " still holds the rows of ", held,
            " closed sequences, the node's limit "
            "(--shm_max_pinned_sequences=", options_.max_pinned_sequences,
            "): unmap them and close their descriptors"));
      }
      IG_ASSIGN_OR_RETURN(const int k_watch, pinned_->Watch(s->k_fd()));
      IG_ASSIGN_OR_RETURN(const int v_watch, pinned_->Watch(s->v_fd()));
      shared_[seq] = {k_watch, v_watch};
    }
  }
  // Read-only descriptors of the same memfds, which are sealed (kRowSeals):
  // reopened writable or not, nothing through them changes the node's rows.
  SharedRows rows;
  rows.k_fd = open(absl::StrCat("/proc/self/fd/", s->k_fd()).c_str(),
                   O_RDONLY | O_CLOEXEC);
  rows.v_fd = open(absl::StrCat("/proc/self/fd/", s->v_fd()).c_str(),
                   O_RDONLY | O_CLOEXEC);
  if (rows.k_fd < 0 || rows.v_fd < 0) {
    const int err = errno;
    if (rows.k_fd >= 0) close(rows.k_fd);
    if (rows.v_fd >= 0) close(rows.v_fd);
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot open the rows of sequence ", seq, " read-only: ",
        std::strerror(err)));
  }
  const SequenceGeometry& g = s->geometry();
  rows.layer_values = static_cast<size_t>(g.n_kv_heads) * g.max_tokens *
                      g.head_dim;
  rows.max_tokens = g.max_tokens;
  return rows;
}

absl::Status KvStore::NoteFetched(SequenceId seq, int32_t layer,
                                  const FetchPlan& plan) {
  IG_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, FindForPlan(seq, plan));
  return s->NoteFetched(layer, plan, *totals_);
}

absl::Status KvStore::NoteHeld(SequenceId seq, int32_t layer,
                               const FetchPlan& plan) {
  IG_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, FindForPlan(seq, plan));
  return s->NoteHeld(layer, plan, *totals_);
}

absl::Status KvStore::NoteLeadingFetched(
    SequenceId seq, int32_t layer, absl::Span<const int32_t> head_offsets) {
  IG_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(seq));
  return s->NoteLeadingFetched(layer, head_offsets, *totals_);
}

absl::StatusOr<std::shared_ptr<KvStore::Sequence>> KvStore::FindOwned(
    SequenceId seq, SessionId session) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = sequences_.find(seq);
  auto owner = owner_.find(seq);
  if (it == sequences_.end() || it->second == nullptr ||
      (owner != owner_.end() && owner->second != session)) {
    return absl::NotFoundError(absl::StrCat("no open sequence ", seq));
  }
  return it->second;
}

absl::Status KvStore::CheckOwner(SequenceId seq, SessionId session) const {
  return FindOwned(seq, session).status();
}

absl::Status KvStore::Close(SequenceId seq) {
  std::vector<std::shared_ptr<Sequence>> freed;  // after the lock is released
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(seq);
  if (it == sequences_.end() || it->second == nullptr) {
    return absl::NotFoundError(absl::StrCat("no open sequence ", seq));
  }
  std::shared_ptr<Sequence> s = std::move(it->second);
  sequences_.erase(it);
  bytes_reserved_ -= ReservedBytes(s->geometry());
  auto owner = owner_.find(seq);
  RetireLocked(seq, owner == owner_.end() ? 0 : owner->second, std::move(s),
               &freed);
  ForgetOwnerLocked(seq);
  return absl::OkStatus();
}

absl::StatusOr<SequenceGeometry> KvStore::Geometry(SequenceId seq) const {
  IG_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(seq));
  return s->geometry();
}

absl::StatusOr<SequenceGeometry> KvStore::Geometry(SequenceId seq,
                                                   SessionId session) const {
  IG_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, FindOwned(seq, session));
  return s->geometry();
}

absl::StatusOr<SequenceStats> KvStore::GetSequenceStats(SequenceId seq) const {
  IG_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(seq));
  return s->Stats();
}

StoreStats KvStore::GetStoreStats() const {
  StoreStats s;
  {
    absl::ReaderMutexLock lock(&mu_);
    s.open_sequences = static_cast<int32_t>(sequences_.size());
    s.bytes_reserved = bytes_reserved_;
    s.open_sessions = static_cast<int32_t>(sessions_.size());
    s.expired_sessions = expired_sessions_;
    s.expired_sequences = expired_sequences_;
    s.spare_sequences = spares_->count();
    s.spare_bytes = spares_->bytes();
    s.reused_row_sequences = spares_->reused();
  }
  if (pinned_ != nullptr) {
    pinned_->Reap();
    s.pinned_bytes = pinned_->bytes();
    s.pinned_sequences = pinned_->sequences();
  }
  s.lease_timeout_ms = absl::ToInt64Milliseconds(options_.lease_timeout);
  s.max_sequences = options_.max_sequences;
  s.capacity_bytes = options_.capacity_bytes;
  s.eviction = options_.eviction;
  s.appended_rows = totals_->appended_rows.load(std::memory_order_relaxed);
  s.evicted_rows = totals_->evicted_rows.load(std::memory_order_relaxed);
  s.fetches = totals_->fetches.load(std::memory_order_relaxed);
  s.fetched_rows = totals_->fetched_rows.load(std::memory_order_relaxed);
  const PrefixCacheStats p = prefix_cache_->Stats();
  s.prefix_blocks = p.blocks;
  s.prefix_bytes = p.bytes;
  s.prefix_capacity_bytes = p.capacity_bytes;
  s.prefix_hit_tokens = p.hit_tokens;
  s.prefix_lookup_tokens = p.lookup_tokens;
  s.prefix_evicted_blocks = p.evicted_blocks;
  return s;
}

absl::StatusOr<std::vector<TokenFetchStats>> KvStore::GetTokenStats(
    SequenceId seq, int32_t layer, int32_t kv_head) const {
  IG_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(seq));
  return s->TokenStats(layer, kv_head);
}

}  // namespace infinigen::kv_memory_service
