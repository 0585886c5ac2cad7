// The shared-memory data plane's wire format: what the client and the server
// process both see. Private to kv_memory_service/shm/.
//
// Two kinds of shared memory, both memfds the client creates and passes to
// the server over the data-plane unix socket (SCM_RIGHTS):
//
//  * The control region, one per connection:
//      [RegionHeader, 4 KiB][SlotControl x max_slots, 512 B each]
//    The header holds the server's doorbell; each SlotControl is the
//    request/response mailbox of one FetchBuffer.
//
//  * One slot memfd per FetchBuffer, mapped by both sides at setup:
//      [data: the FetchBuffer's values, page-rounded][plan area: int32s]
//    The server gathers straight into `data`; the client writes the plan
//    (indices then head_offsets) into the plan area.
//
// A fetch, with no system call on the fast path:
//   client: plan -> plan area; fields -> SlotControl; state = kRequested;
//           ++doorbell (futex-wake the server only if it sleeps)
//   server: scans the slots, CAS kRequested -> kServing, copies the plan out
//           of shared memory (the client cannot change it under the store's
//           validation), KvStore::Gather into data, writes the status,
//           state = kDone (futex-wake the client only if it sleeps)
//   client: spins briefly on state, then futex-waits in short slices,
//           checking between slices that the server's socket is still open
//           (a dead server closes it) and the fetch deadline.
// Both sides spin a little before sleeping, so a back-to-back fetch costs
// two cache-line round trips plus the gather.
//
// The socket carries setup only (SocketMessage, one per SEQPACKET): the
// server's Hello, then the client's Attach (control region fd, auth token),
// MapSlot (slot fd), UnmapSlot and MapRows, each answered by a Reply. After
// sending, the client bumps control_seq and rings the doorbell so that a
// sleeping server reads it.
//
// An append, the same way: the client writes the block's K values, then
// its V values, into the slot's data and sends the block's shape with
// kAppend; the server appends them from there (KvStore::Append, after
// checking the shape against the sequence's geometry and the slot), and
// answers with the tokens it evicted, as (layer, kv_head, position) int32
// triples at the start of the plan area, result_count of them. The rows
// cross once, not through a gRPC message.
//
// One-sided reads: MapRows gives the owner of a sequence a read-only
// descriptor of each memfd holding its rows (K, then V); the client maps
// them, reads the rows a plan selects itself, then sends the plan through
// a slot with kNoteOnly so that the node's statistics and eviction learn
// of the fetch. A client that holds rows of its own (a row cache) notes
// them with kNoteOnly | kHeld.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_SHM_SHM_PROTOCOL_H_
#define INFINIGEN_KV_MEMORY_SERVICE_SHM_SHM_PROTOCOL_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace infinigen::kv_memory_service::shm {

constexpr uint64_t kRegionMagic = 0x3176'4b6d'6853'4749ULL;  // "IGShmKv1"
// 2: each fetch names the caller's session (SlotControl::session).
// 3: one-sided reads (MapRows, SlotControl::flags' kNoteOnly).
// 4: notes of rows the client holds (kHeld).
// 5: appends through a slot (kAppend, SlotControl::append_values and
//    result_count).
// 6: an append's prefix annotations after its rows (append_meta_bytes).
constexpr uint32_t kProtocolVersion = 6;
constexpr size_t kPageBytes = 4096;
constexpr size_t kHeaderBytes = 4096;
// Most FetchBuffers one connection may hold at once.
constexpr uint32_t kMaxSlots = 256;
// The plan area holds elements / 2 indices (the most any plan that fits the
// buffer can have: head_dim >= 1) plus this many head offsets.
constexpr size_t kMaxPlanHeadOffsets = 4097;
constexpr size_t kStatusMessageBytes = 436;

// SlotControl::state. Transitions: client kIdle|kCancelled -> kRequested;
// server kRequested -> kServing -> kDone; client kDone -> kIdle, or, giving
// up at its deadline, kRequested -> kCancelled (the server never claimed it).
enum SlotState : uint32_t {
  kIdle = 0,
  kRequested = 1,
  kServing = 2,
  kDone = 3,
  kCancelled = 4,
};

static_assert(std::atomic<uint32_t>::is_always_lock_free,
              "futex words must be lock-free atomics");

struct RegionHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t max_slots;
  // Bumped by the client after each request; the server futex-waits on it.
  alignas(64) std::atomic<uint32_t> doorbell;
  // 1 while the server is (about to be) asleep on the doorbell.
  std::atomic<uint32_t> server_waiting;
  // Bumped by the client after each socket message.
  std::atomic<uint32_t> control_seq;
};
static_assert(sizeof(RegionHeader) <= kHeaderBytes);
static_assert(std::is_standard_layout_v<RegionHeader>);

struct SlotControl {
  // Written by the client (except state, which both write).
  alignas(64) std::atomic<uint32_t> state;   // SlotState; futex word
  std::atomic<uint32_t> client_waiting;      // 1 while the client sleeps
  int32_t layer;            // kAppend: the block's first layer
  uint32_t n_indices;       // plan area [0, n_indices): indices
                            // (kAppend: the block's tokens)
  uint32_t n_head_offsets;  // then n_head_offsets head offsets
                            // (kAppend: the block's layers)
  uint32_t flags;           // kNoteOnly, kLeading, kHeld, kAppend
  uint64_t sequence;
  uint64_t session;  // the caller's; the node serves only the owner's rows
  uint64_t append_values;  // kAppend: the K values (and the V values)
  // kAppend: bytes of prefix annotations after the V values in the data
  // (EncodePrefixMeta's; 0: none).
  uint64_t append_meta_bytes;
  // Written by the server before state = kDone.
  alignas(64) int32_t status_code;  // absl::StatusCode
  uint32_t message_bytes;
  uint32_t result_count;  // kAppend: evicted tokens in the plan area
  char message[kStatusMessageBytes];
};
static_assert(sizeof(SlotControl) == 512);
static_assert(std::is_standard_layout_v<SlotControl>);

// SlotControl::flags: the client read the plan's rows itself through
// MapRows' mappings; the server records the fetch (KvStore::NoteFetched)
// and writes nothing into the slot's data.
constexpr uint32_t kNoteOnly = 1;
// With kNoteOnly: the plan is head offsets alone, each head having read
// its first positions in order (KvStore::NoteLeadingFetched).
constexpr uint32_t kLeading = 2;
// With kNoteOnly: the client holds the plan's rows (a row cache); the
// server counts them as rows of the layer's last fetch (KvStore::NoteHeld).
constexpr uint32_t kHeld = 4;
// The slot's data holds a block to append (AppendBlock's layout: K, then
// V, then append_meta_bytes of its prefix annotations); the server answers
// with the evicted tokens.
constexpr uint32_t kAppend = 8;

inline size_t ControlRegionBytes(uint32_t max_slots) {
  return kHeaderBytes + static_cast<size_t>(max_slots) * sizeof(SlotControl);
}
inline SlotControl* SlotAt(void* region, uint32_t slot) {
  return reinterpret_cast<SlotControl*>(static_cast<char*>(region) +
                                        kHeaderBytes) +
         slot;
}
inline size_t RoundUpToPage(size_t bytes) {
  return (bytes + kPageBytes - 1) / kPageBytes * kPageBytes;
}
// Bytes of a slot's data part and plan part for a buffer of `elements`.
inline size_t SlotDataBytes(size_t elements) {
  return RoundUpToPage(elements * sizeof(uint16_t));
}
inline size_t SlotPlanCapacity(size_t elements) {  // in int32s
  return elements / 2 + kMaxPlanHeadOffsets;
}
inline size_t SlotPlanBytes(size_t elements) {
  return RoundUpToPage(SlotPlanCapacity(elements) * sizeof(int32_t));
}

// Setup messages on the SEQPACKET socket.
enum class MessageType : uint32_t {
  kHello = 1,      // server -> client; text: the control address
  kAttach = 2,     // client -> server; fd: control region; text: auth token
  kMapSlot = 3,    // client -> server; fd: slot memfd; slot, elements
  kUnmapSlot = 4,  // client -> server; slot
  kReply = 5,      // server -> client; code, text: the error message
  // client -> server; sequence, session, slot: 0 for K, 1 for V. The reply
  // carries a read-only fd of that memfd of the sequence's rows
  // (KvStore::ShareRows), elements: values per layer, max_slots: the
  // sequence's max_tokens.
  kMapRows = 6,
};

constexpr size_t kMaxMessageText = 4096;

struct SocketMessage {
  uint32_t magic = static_cast<uint32_t>(kRegionMagic);
  uint32_t version = kProtocolVersion;
  MessageType type = MessageType::kReply;
  uint32_t slot = 0;
  int32_t code = 0;  // absl::StatusCode, in replies
  uint32_t max_slots = 0;
  uint64_t elements = 0;
  uint64_t sequence = 0;
  uint64_t session = 0;
  std::string text;
};

// Sends `message` as one packet, with `fd` attached when >= 0. Unavailable
// when the peer is gone.
absl::Status SendMessage(int socket, const SocketMessage& message, int fd = -1);
// Receives one packet; `fd` (may be null) gets an attached descriptor or -1.
// Unavailable on EOF or error, DeadlineExceeded when the socket's receive
// timeout passes, InvalidArgument for a malformed packet.
absl::StatusOr<SocketMessage> ReceiveMessage(int socket, int* fd);

// A reply carrying `status`, and its inverse.
SocketMessage ReplyFor(const absl::Status& status);
absl::Status StatusOfReply(const SocketMessage& reply);

// True when the peer of a connected socket has closed its end (or the socket
// failed). Does not consume data.
bool PeerClosed(int socket);

// Sets SO_RCVTIMEO (0 = none).
absl::Status SetReceiveTimeout(int socket, absl::Duration timeout);

void YieldCpu();  // sched_yield

// Process-shared futex on a word in MAP_SHARED memory. FutexWait returns when
// woken, when *word != expected, or after `timeout`.
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected,
               absl::Duration timeout);
void FutexWakeAll(std::atomic<uint32_t>* word);

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// One step of a polling loop: a pause for the first few dozen steps, then
// sched_yield, so that a poller never keeps a runnable peer (the other
// side's thread on an oversubscribed host) off its CPU for long.
inline void SpinStep(uint32_t& steps) {
  if (++steps < 64) {
    CpuRelax();
  } else {
    YieldCpu();
  }
}

// A status from errno after a failed call: "<call>: <strerror>".
absl::Status ErrnoStatus(absl::StatusCode code, absl::string_view call,
                         int err);

}  // namespace infinigen::kv_memory_service::shm

#endif  // INFINIGEN_KV_MEMORY_SERVICE_SHM_SHM_PROTOCOL_H_
