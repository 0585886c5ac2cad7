// PinnedRows: row memory that outlives its sequence because a reader still
// holds it. Private to the store.
//
// KvStore::ShareRows hands the owner of a sequence read-only descriptors of
// the memfds holding its rows (one-sided reads). A client that keeps such a
// descriptor, or a mapping made through it, keeps the pages committed after
// the node closes the sequence and its own descriptors: the kernel frees a
// memfd only when its last holder lets go. PinnedRows owns the knowledge of
// which such memory is still held and by whose sequence:
//  - Watch(fd) starts watching a memfd's inode (inotify) before its first
//    descriptor leaves the node;
//  - Outlive(watch, fd, seq, session) at the sequence's close records the
//    bytes the memfd holds (its committed pages) as pinned by `session`;
//  - Reap() reads the kernel's notices: an inode freed (IN_IGNORED) takes
//    its bytes out of the counts.
// The store counts pinned bytes against capacity_bytes like a reservation,
// and caps the closed sequences a session may keep pinned.
//
// Thread-safe.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_STORE_PINNED_ROWS_H_
#define INFINIGEN_KV_MEMORY_SERVICE_STORE_PINNED_ROWS_H_

#include <cstdint>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv_memory_service/client/kv_types.h"

namespace infinigen::kv_memory_service {

class PinnedRows {
 public:
  // Unavailable when the kernel gives no inotify instance: the node then
  // cannot know when shared rows are released, and shares none.
  static absl::StatusOr<std::unique_ptr<PinnedRows>> Create();
  ~PinnedRows();
  PinnedRows(const PinnedRows&) = delete;
  PinnedRows& operator=(const PinnedRows&) = delete;

  // Watches the inode of `fd` (a memfd the node still holds open) from now
  // on and returns the watch; watching one twice is one watch.
  // ResourceExhausted when the kernel refuses another watch
  // (fs.inotify.max_user_watches).
  absl::StatusOr<int> Watch(int fd);
  // At the close of sequence `seq`, whose memfd `fd` (still open here) is
  // watched by `watch`: its committed bytes count as pinned by `session`
  // until the kernel frees the inode. The node closes `fd` afterwards.
  void Outlive(int watch, int fd, SequenceId seq, SessionId session);

  // Applies the kernel's notices of freed inodes. Cheap when there are
  // none (one non-blocking read).
  void Reap();
  // Reap, then while `held()` is true, waits up to `within` in all for
  // more notices: the kernel reports a freed inode a jiffy or so after its
  // last holder lets go, so memory released just now may not have been
  // reported yet. `held` is called without the lock held.
  void ReapUnless(absl::FunctionRef<bool()> held, absl::Duration within);

  // Bytes and closed sequences still held by readers (any of their
  // memfds), in all and of `session`, as of the last Reap.
  int64_t bytes() const;
  int64_t sequences() const;
  int64_t sequences_of(SessionId session) const;

 private:
  explicit PinnedRows(int inotify_fd) : inotify_fd_(inotify_fd) {}
  void ReapLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  struct Pinned {
    bool closed = false;  // Outlive'd: counted below
    SequenceId seq = 0;
    SessionId session = 0;
    int64_t bytes = 0;
  };

  const int inotify_fd_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int, Pinned> watches_ ABSL_GUARDED_BY(mu_);  // by wd
  // Closed sequences' memfds still held, and their sequences by session.
  absl::flat_hash_map<SequenceId, int32_t> memfds_by_sequence_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<SessionId, int64_t> sequences_by_session_
      ABSL_GUARDED_BY(mu_);
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_STORE_PINNED_ROWS_H_
