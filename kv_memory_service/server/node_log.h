// The line kv_memory_server logs every --log_interval while it serves:
// what it holds (sequences, sessions, bytes reserved against its capacity)
// and what it moved in the interval (fetch and append bandwidth, rows).
#ifndef INFINIGEN_KV_MEMORY_SERVICE_SERVER_NODE_LOG_H_
#define INFINIGEN_KV_MEMORY_SERVICE_SERVER_NODE_LOG_H_

#include <string>

#include "kv_memory_service/client/kv_types.h"

namespace infinigen::kv_memory_service {

// What the node served in an interval: bytes of K/V rows every plane sent
// for fetches and received for appends.
struct ServedBytes {
  double fetched = 0;
  double appended = 0;
};

// `now` and the interval's work (`now` less `before`, `served` bytes) over
// `seconds`.
std::string NodeSummaryLine(const StoreStats& now, const StoreStats& before,
                            const ServedBytes& served, double seconds);

// Whether the interval saw any work (a line is worth writing).
bool NodeWasBusy(const StoreStats& now, const StoreStats& before,
                 const ServedBytes& served);

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_SERVER_NODE_LOG_H_
