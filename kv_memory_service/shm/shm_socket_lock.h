// The lock that makes a data-plane socket path one server's: PATH.lock,
// held with flock while the server serves PATH. Private to
// kv_memory_service/shm/.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_SHM_SHM_SOCKET_LOCK_H_
#define INFINIGEN_KV_MEMORY_SERVICE_SHM_SHM_SOCKET_LOCK_H_

#include <string>

#include "absl/status/statusor.h"

namespace infinigen::kv_memory_service::shm {

// Takes PATH.lock (flock, exclusive): the socket at PATH belongs to whoever
// holds it. FailedPrecondition when a live server holds it. A lock file left
// by a dead server is simply taken over (flock dies with its holder).
absl::StatusOr<int> LockSocketPath(const std::string& path);
// Removes PATH.lock while still holding it, then lets it go.
void UnlockSocketPath(const std::string& path, int lock_fd);

}  // namespace infinigen::kv_memory_service::shm

#endif  // INFINIGEN_KV_MEMORY_SERVICE_SHM_SHM_SOCKET_LOCK_H_
