// The in-process data plane: a KvClient that calls a KvStore in this
// process directly. It is the embedded default (`inproc:`), and the
// in-memory transport tests use in place of a server.
//
// Fetches gather straight into the FetchBuffer (plain page-aligned host
// memory). A fetch of 1,024 rows or more is queued to the client's fetch
// thread (started with the first such fetch), so FetchAsync returns at
// once and the gather overlaps the caller's work; a smaller one gathers on
// the calling thread and its handle is complete on return. Thread-safe, as
// KvStore is. The client shares ownership of the store; destroying it
// finishes the queued fetches first.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_INPROC_INPROC_CLIENT_H_
#define INFINIGEN_KV_MEMORY_SERVICE_INPROC_INPROC_CLIENT_H_

#include <memory>

#include "kv_memory_service/client/kv_client.h"
#include "kv_memory_service/store/kv_store.h"

namespace infinigen::kv_memory_service {

std::unique_ptr<KvClient> NewInprocKvClient(std::shared_ptr<KvStore> store);

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_INPROC_INPROC_CLIENT_H_
