// How a KvStore is sized and behaves (capacity, eviction, limits, leases,
// prefix sharing): apart from kv_store.h so that clients can name an
// in-process store's options without depending on the store.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_CLIENT_KV_STORE_OPTIONS_H_
#define INFINIGEN_KV_MEMORY_SERVICE_CLIENT_KV_STORE_OPTIONS_H_

#include <cstdint>
#include <functional>

#include "absl/time/time.h"
#include "kv_memory_service/client/kv_types.h"

namespace infinigen::kv_memory_service {

struct KvStoreOptions {
  // Most bytes of rows all open sequences may reserve together (the sum of
  // ReservedBytes of their geometries); 0 = unlimited. Open beyond it is
  // ResourceExhausted.
  int64_t capacity_bytes = 0;
  // Most sequences open at once; Open beyond it is ResourceExhausted.
  int32_t max_sequences = 1024;
  // What a full (layer, KV head) drops before taking a new token.
  EvictionPolicy eviction = EvictionPolicy::kLru;
  // Most tokens one Append may carry per layer; more is ResourceExhausted.
  int32_t max_append_tokens = 1 << 20;
  // Most indices one FetchPlan may hold; more is ResourceExhausted.
  int64_t max_fetch_indices = 1 << 24;
  // How long a session lives without a RenewSession before ExpireSessions
  // closes its sequences. Zero: sessions never expire.
  absl::Duration lease_timeout = absl::ZeroDuration();
  // Most sessions at once; OpenSession beyond it is ResourceExhausted.
  int32_t max_sessions = 4096;
  // Most bytes of shared prefix blocks (prefix_cache.h) held at once,
  // counted once however many sequences use them, on top of
  // capacity_bytes; 0 = no sharing (prefix requests neither attach nor
  // publish).
  int64_t prefix_cache_bytes = 0;
  // Threads that share one large gather (the caller included): 0 = one
  // per core (at most 8), 1 = the calling thread alone.
  int32_t gather_threads = 0;
  // Keep each sequence's rows in memfds that its owner on this host may map
  // read-only (KvStore::ShareRows: one-sided reads over the shm data
  // plane). At most this many sequences at once (two descriptors each);
  // those beyond it, or where a memfd cannot be made, keep private memory
  // and are gathered. 0: none.
  int32_t max_shared_sequences = 0;
  // Most closed sequences whose shared rows one session's client may keep
  // pinned (still mapped or held after the close); ShareRows of a new
  // sequence beyond it is ResourceExhausted. Their bytes count against
  // capacity_bytes either way.
  int32_t max_pinned_sequences = 64;
  // Closed sequences per session whose shared rows the store keeps for the
  // session's next sequence of the same size (spare_rows.h): a client that
  // keeps them mapped then maps and registers nothing again. Their bytes
  // count against capacity_bytes until reused, or let go when the session
  // ends or an Open needs the room. 0: rows leave at the close.
  int32_t spare_rows_per_session = 1;
  // The clock leases are measured on; tests pass a fake. Null: absl::Now.
  std::function<absl::Time()> clock;
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_CLIENT_KV_STORE_OPTIONS_H_
