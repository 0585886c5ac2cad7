// CheckKvService: a round trip through a memory node as a worker makes it,
// for operators who want to know that a deployed node serves (`infinigen
// kv-check`). It opens a scratch sequence, appends rows of known random
// content, fetches random rows of every KV head by index several times,
// compares every fetched row with what was appended, and closes the
// sequence; it reports how long each call took.
//
// A node that does not answer, refuses the client (token, TLS) or fails a
// call gives that call's error, naming the step; rows that come back other
// than appended give DataLoss naming the first wrong (layer, head,
// position). The sequence is closed whatever happens after it was opened.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_CLIENT_KV_CHECK_H_
#define INFINIGEN_KV_MEMORY_SERVICE_CLIENT_KV_CHECK_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kv_memory_service/client/kv_client.h"

namespace infinigen::kv_memory_service {

struct KvCheckOptions {
  int32_t n_layers = 2;
  int32_t n_kv_heads = 2;
  int32_t head_dim = 64;
  int32_t tokens = 256;         // appended per (layer, head), in one block
  int32_t rows_per_head = 32;   // fetched per head and fetch (at most tokens)
  int32_t fetches = 20;         // per layer
  uint64_t seed = 1;
};

struct KvCheckReport {
  std::string data_plane;       // KvClient::data_plane()
  absl::Duration open, append, close;
  absl::Duration fetch_p50, fetch_max;  // one layer's fetch, FetchAsync + Wait
  int64_t fetched_rows = 0;     // K/V row pairs fetched and compared
  int64_t node_fetched_rows = 0;  // as the node counted them
};

// InvalidArgument for options out of range (before calling the node).
absl::StatusOr<KvCheckReport> CheckKvService(KvClient& client,
                                             const KvCheckOptions& options);

// The report as one line: "data plane tcp: open 0.4 ms, append 256 tokens
// x 2 layers 1.1 ms, 40 fetches of 64 rows p50 0.21 ms (max 0.9 ms), 2560
// rows equal to those appended, close 0.3 ms".
std::string FormatKvCheckReport(const KvCheckReport& report,
                                const KvCheckOptions& options);

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_CLIENT_KV_CHECK_H_
