// SpareRows: the shared row memory of a session's closed sequences, kept
// for the session's next sequence of the same size. Private to the store.
//
// A client that reads one-sided (KvStore::ShareRows) maps a sequence's
// memfds and registers the mapping with its device (CUDA, RDMA): at a long
// context that pins gigabytes, seconds a sequence. When the client keeps the
// mapping past the close and the node opens the session's next sequence in
// the same memfds, the client finds them mapped and registered already, and
// their pages are committed: nothing of that is done again. SpareRows owns
// which closed sequences' rows wait to be reused:
//  - only for the session that owned them: the old rows a reused memory
//    still holds are that session's own;
//  - at most per_session of them per session, the oldest leaving first;
//  - only once no call still uses the old sequence (a gather that began
//    before the close finishes on the rows it started with).
// The store counts their bytes against capacity_bytes like a reservation,
// and lets them go (to PinnedRows, while a client still holds them) when
// the session ends or room is needed.
//
// Not thread-safe: the store calls it under its lock.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_STORE_SPARE_ROWS_H_
#define INFINIGEN_KV_MEMORY_SERVICE_STORE_SPARE_ROWS_H_

#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "kv_memory_service/client/kv_types.h"

namespace infinigen::kv_memory_service {

class StoredSequence;

class SpareRows {
 public:
  // A closed sequence whose rows wait for reuse.
  struct Spare {
    SequenceId seq = 0;  // the closed sequence
    SessionId session = 0;
    int64_t bytes = 0;  // its ReservedBytes
    std::shared_ptr<StoredSequence> rows;  // holds its RowMemory
    std::pair<int, int> watches;  // PinnedRows' watches of its K, V memfds
  };

  // per_session 0: nothing is kept (Keep hands every spare back).
  explicit SpareRows(int per_session) : per_session_(per_session) {}

  // Keeps `spare`; returns what no longer fits: the session's oldest beyond
  // per_session (or `spare` itself with per_session 0).
  std::vector<Spare> Keep(Spare spare);
  // A spare of `session` of `bytes` that no call uses any more, taken out
  // (the newest first), and counted as reused; nullopt if there is none.
  std::optional<Spare> Take(SessionId session, int64_t bytes);
  // Every spare of `session`, taken out.
  std::vector<Spare> TakeSession(SessionId session);
  // The oldest spare of any session, taken out; nullopt if there is none.
  std::optional<Spare> TakeOldest();

  int64_t bytes() const { return bytes_; }
  int64_t count() const { return static_cast<int64_t>(spares_.size()); }
  // Spares Take handed out, over the store's life.
  int64_t reused() const { return reused_; }

 private:
  Spare Remove(std::list<Spare>::iterator it);

  const int per_session_;
  std::list<Spare> spares_;  // oldest first
  int64_t bytes_ = 0;
  int64_t reused_ = 0;
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_STORE_SPARE_ROWS_H_
