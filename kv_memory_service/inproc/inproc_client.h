// The in-process data plane: a KvClient that calls a KvStore in this
// process directly. It is the embedded default (`inproc:`), and the
// in-memory transport tests use in place of a server.
//
// FetchAsync gathers on the calling thread, straight into the FetchBuffer
// (plain page-aligned host memory), so the handle it returns is already
// complete. Thread-safe, as KvStore is. The client shares ownership of the
// store.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_INPROC_INPROC_CLIENT_H_
#define INFINIGEN_KV_MEMORY_SERVICE_INPROC_INPROC_CLIENT_H_

#include <memory>

#include "kv_memory_service/kv_client.h"
#include "kv_memory_service/kv_store.h"

namespace infinigen::kv_memory_service {

std::unique_ptr<KvClient> NewInprocKvClient(std::shared_ptr<KvStore> store);

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_INPROC_INPROC_CLIENT_H_
