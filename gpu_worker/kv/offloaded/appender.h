// Appends to the memory node off the critical path.
//
// Appender: a decode step's appends (and notes), on a thread of its own.
// Start hands it the step's slots after the step's last attention; each
// slot's work (given at construction) runs there while the step's last MLP
// and the classifier compute; Finish, before the next step fetches, waits
// for them and reports each slot's outcome. LayerAppend: a prefill layer's
// rows, on a thread of their own while the next layer computes.
// AppendRows: one AppendBlock of encoded rows. Start, Finish and Wait are
// called from one thread.
#ifndef INFINIGEN_GPU_WORKER_KV_OFFLOADED_APPENDER_H_
#define INFINIGEN_GPU_WORKER_KV_OFFLOADED_APPENDER_H_

#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kv_memory_service/client/kv_client.h"

namespace infinigen::gpu_worker {
namespace offloaded {

// Appends `n` tokens' rows of layers [first_layer, first_layer + n_layers)
// of `seq`, laid out [layer][token][kv_head][row_width], with the prefix
// blocks' summaries `meta` (from block meta_first_block on) where given.
// The node's error, naming it.
absl::StatusOr<kv_memory_service::AppendResult> AppendRows(
    kv_memory_service::KvClient& client, kv_memory_service::SequenceId seq,
    int n_kv_heads, int row_width, int first_layer, int n_layers,
    const uint16_t* k, const uint16_t* v, int n,
    const std::vector<std::string>* meta = nullptr, int meta_first_block = 0);

class Appender {
 public:
  // `append(slot)`: one slot's work, on the appender's thread; up to
  // `max_slots` slots a step.
  Appender(std::function<absl::Status(int slot)> append, size_t max_slots);
  // Waits for what was started, then stops the thread.
  ~Appender();

  // Starts `slots`' work; the previous step's must be finished.
  void Start(absl::Span<const int> slots);
  // Waits for the started work (none: returns at once) and calls
  // done(slot, status) for each slot, in order; returns the first error.
  absl::Status Finish(
      absl::FunctionRef<void(int slot, const absl::Status& status)> done);

 private:
  void Loop();

  const std::function<absl::Status(int)> append_;
  std::vector<absl::Status> statuses_;  // the appender's until done_
  absl::Mutex mu_;
  std::vector<int> slots_ ABSL_GUARDED_BY(mu_);
  bool pending_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

class LayerAppend {
 public:
  ~LayerAppend() { Wait().IgnoreError(); }
  // Runs `append` on a thread of its own; the last one must be waited for.
  void Start(std::function<absl::Status()> append);
  bool running() const { return thread_.joinable(); }
  // Joins the append in flight (none: OK at once) and returns its status;
  // adds the seconds blocked to *waited where given.
  absl::Status Wait(double* waited = nullptr);

 private:
  std::thread thread_;
  absl::Status status_;
};

}  // namespace offloaded
}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_OFFLOADED_APPENDER_H_
