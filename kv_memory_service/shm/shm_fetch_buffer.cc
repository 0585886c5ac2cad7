// ShmFetchBuffer (shm_client_internal.h): a fetch through its slot, the
// wait for the server (a spin, then the futex), and giving up on a server
// that does not answer.
#include "kv_memory_service/shm/shm_client_internal.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/cuda_host_register.h"
#include "kv_memory_service/shm/shm_protocol.h"

namespace infinigen::kv_memory_service::shm_client_internal {
namespace {

// How often a sleeping waiter checks that the server is still there.
constexpr absl::Duration kServerCheckInterval = absl::Milliseconds(10);

// How long Wait polls before it sleeps on the futex: long enough to catch
// small and medium gathers (about 0.25 us per index at head_dim 64) without
// a wake-up, short enough that a waiter for a large one sleeps instead of
// competing with the server's thread for a CPU. Polling yields the CPU after
// the first few steps (shm::SpinStep); a sleeper is woken by the server.
int64_t SpinNanos(size_t n_indices) {
  return std::min<int64_t>(20'000 + 250 * static_cast<int64_t>(n_indices),
                           60'000);
}

}  // namespace

ShmFetchBuffer::~ShmFetchBuffer() {
  if (pinned_) CudaHostUnregister(memory_.data);
  // An abandoned slot stays taken: the server may still be writing it.
  if (!abandoned_) client_->ReleaseSlot(slot_);
  munmap(memory_.data, memory_.data_bytes);
  munmap(memory_.plan, memory_.plan_bytes);
}

FetchHandle ShmFetchBuffer::Start(SequenceId seq, int32_t layer,
                                  const FetchPlan& plan, absl::Time deadline,
                                  uint32_t flags) {
  absl::Status connected = client_->EnsureConnected();
  if (!connected.ok()) {
    CompleteFetch(std::move(connected));
    return FetchHandle(this);
  }
  const size_t n = plan.indices.size();
  const size_t m = plan.head_offsets.size();
  if (n + m > memory_.plan_capacity) {
    CompleteFetch(absl::InvalidArgumentError(absl::StrCat(
        "a plan of ", n, " indices and ", m, " head offsets does not fit a ",
        "shm fetch buffer of ", memory_.elements, " values")));
    return FetchHandle(this);
  }
  // An empty span's data() may be null, which memcpy must not see.
  if (n > 0) std::memcpy(memory_.plan, plan.indices.data(), n * sizeof(int32_t));
  if (m > 0) {
    std::memcpy(memory_.plan + n, plan.head_offsets.data(), m * sizeof(int32_t));
  }
  control_->layer = layer;
  control_->sequence = seq;
  control_->session = client_->session();
  control_->n_indices = static_cast<uint32_t>(n);
  control_->n_head_offsets = static_cast<uint32_t>(m);
  control_->flags = flags;
  return Publish(deadline, SpinNanos(n));
}

FetchHandle ShmFetchBuffer::Publish(absl::Time deadline, int64_t spin_ns) {
  generation_ = client_->generation();
  control_->state.store(shm::kRequested, std::memory_order_release);
  client_->Ring();
  published_ = true;
  deadline_ = deadline;
  spin_ns_ = spin_ns;
  return FetchHandle(this);
}

FetchHandle ShmFetchBuffer::StartAppend(SequenceId seq,
                                        const AppendBlock& block,
                                        size_t meta_bytes,
                                        absl::Time deadline) {
  absl::Status connected = client_->EnsureConnected();
  if (!connected.ok()) {
    CompleteFetch(std::move(connected));
    return FetchHandle(this);
  }
  control_->layer = block.first_layer;
  control_->sequence = seq;
  control_->session = client_->session();
  control_->n_indices = static_cast<uint32_t>(block.n_tokens);
  control_->n_head_offsets = static_cast<uint32_t>(block.n_layers);
  control_->append_values = block.k.size();
  control_->append_meta_bytes = meta_bytes;
  control_->flags = shm::kAppend;
  // About a gather's cost per value: spin through small appends (a decode
  // step's), sleep through a prefill's.
  return Publish(deadline, SpinNanos(block.k.size() / 64));
}

absl::StatusOr<std::vector<EvictedToken>> ShmFetchBuffer::Evicted() const {
  const size_t n = control_->result_count;
  if (3 * n > memory_.plan_capacity) {
    return absl::InternalError(absl::StrCat(
        "shm data plane: the server reported ", n,
        " evicted tokens, more than the slot holds"));
  }
  return EvictedFromTriples(memory_.plan, n);
}

absl::Status ShmFetchBuffer::AwaitServer() {
  const int64_t spin_until = absl::GetCurrentTimeNanos() + spin_ns_;
  uint32_t state;
  uint32_t steps = 0;
  while ((state = control_->state.load(std::memory_order_acquire)) !=
         shm::kDone) {
    if (absl::GetCurrentTimeNanos() >= spin_until) break;
    shm::SpinStep(steps);
  }
  while (state != shm::kDone) {
    if (client_->generation() != generation_) {
      return client_->GoneStatus();  // reconnected since: this one is lost
    }
    const absl::Time now = absl::Now();
    if (now >= deadline_) {
      // The node is taken as unresponsive: the fetches after this one, and
      // those in flight on other buffers, fail at once.
      client_->NoteUnanswered(client_->fetch_timeout());
      return GiveUp(absl::DeadlineExceededError(absl::StrCat(
          "no answer to a shm fetch within ",
          absl::FormatDuration(client_->fetch_timeout()))));
    }
    if (absl::Status down = client_->Unanswered(); !down.ok()) {
      return GiveUp(down);  // another fetch of this client timed out
    }
    // Announce the sleep before the last look, so that the server, which
    // stores kDone and then reads client_waiting, cannot miss us.
    control_->client_waiting.store(1);
    state = control_->state.load();
    if (state == shm::kDone) break;
    shm::FutexWait(&control_->state, state,
                   std::min(kServerCheckInterval, deadline_ - now));
    state = control_->state.load(std::memory_order_acquire);
    if (state != shm::kDone && client_->ServerGone()) {
      control_->client_waiting.store(0);
      return client_->GoneStatus();
    }
  }
  control_->client_waiting.store(0, std::memory_order_relaxed);
  return TakeServerStatus();
}

absl::Status ShmFetchBuffer::TakeServerStatus() {
  const auto code = static_cast<absl::StatusCode>(control_->status_code);
  absl::Status status;
  if (code != absl::StatusCode::kOk) {
    const size_t len =
        std::min<size_t>(control_->message_bytes, shm::kStatusMessageBytes);
    status = absl::Status(code, absl::string_view(control_->message, len));
  }
  control_->state.store(shm::kIdle, std::memory_order_relaxed);
  return status;
}

absl::Status ShmFetchBuffer::GiveUp(absl::Status why) {
  uint32_t expected = shm::kRequested;
  if (control_->state.compare_exchange_strong(expected, shm::kCancelled)) {
    // The server never started it and now never will.
    return why;
  }
  if (expected == shm::kDone) return TakeServerStatus();
  if (expected != shm::kServing) return why;
  // The server is writing into the slot right now and may go on after we
  // return: swap the buffer's pages for private ones at the same address,
  // so that the caller's memory stays valid and the server's late writes
  // land where nobody looks.
  if (pinned_) {
    CudaHostUnregister(memory_.data);
    pinned_ = false;
  }
  mmap(memory_.data, memory_.data_bytes, PROT_READ | PROT_WRITE,
       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  abandoned_ = true;
  client_->Abandon();
  return why;
}

}  // namespace infinigen::kv_memory_service::shm_client_internal
