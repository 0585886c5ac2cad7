// The plain-socket fetch protocol of the TCP data plane: gRPC carries the
// control calls, and fetches go over one TCP connection per client in
// fixed little-endian frames, because a gRPC stream costs about ten times a
// socket round trip on loopback. The server advertises the port in
// GetServerInfo (fetch_port); the client connects to the host it already
// uses for gRPC.
//
//   client -> server   Hello          {magic, version, token_bytes} token
//   server -> client   HelloReply     {magic, status_code, message_bytes} msg
//   client -> server   FetchRequest   header, int32 head_offsets[n_offsets],
//                                     int32 indices[n_indices]
//   server -> client   FetchResponse  header, message, rows (rows_bytes)
//
// A note (a FetchRequest's header and body under kHeldMagic) says the
// client holds the plan's rows: the server counts them as rows of the
// layer's last fetch (KvStore::NoteHeld) and answers with no rows.
//
// An append (kAppendMagic) carries a block of rows to store, so that a
// prefill's rows cross the socket as they are, not as a gRPC message: the
// header's layer is the block's first layer, n_offsets its layer count,
// n_indices its token count and dest_elements its K values; a uint64
// follows the header, the bytes of the block's prefix annotations; the
// body is the K values, then as many V values (uint16 each), then the
// annotations (EncodePrefixMeta, client/kv_types.h). The response's rows
// are the evicted tokens, (layer, kv_head, position) int32 triples.
//
// Responses come in request order and echo request_id. A failed fetch is a
// response with a status code (the connection stays up). The server judges
// each request header before its body: one the sequence cannot need (an
// unknown sequence, head offsets not n_kv_heads + 1, more indices than one
// response's rows allow) is answered at once and its body dropped as it
// arrives; a frame the server cannot read (bad magic, more than the size
// limit) gets one error response with request_id 0 and the connection is
// closed, as does a Hello with a bad form or token. The server closes a
// connection that has not said Hello within its handshake timeout, or that
// stays silent past its idle timeout. The helpers
// retry on EINTR and short transfers; they are thread-compatible.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_TCP_FETCH_WIRE_H_
#define INFINIGEN_KV_MEMORY_SERVICE_TCP_FETCH_WIRE_H_

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the fetch protocol is little-endian");

namespace infinigen::kv_memory_service::fetch_wire {

inline constexpr uint32_t kHelloMagic = 0x4b464749;     // "IGFK"
inline constexpr uint32_t kRequestMagic = 0x51464749;   // "IGFQ"
inline constexpr uint32_t kResponseMagic = 0x52464749;  // "IGFR"
inline constexpr uint32_t kHeldMagic = 0x48464749;      // "IGFH"
inline constexpr uint32_t kAppendMagic = 0x41464749;    // "IGFA"
// 2: requests name the caller's session (the node serves a sequence's rows
// only to the session that owns it). 3: notes of held rows. 4: appends.
inline constexpr uint32_t kVersion = 4;
inline constexpr uint32_t kMaxTokenBytes = 4096;
inline constexpr uint32_t kMaxMessageBytes = 4096;

struct Hello {
  uint32_t magic = kHelloMagic;
  uint32_t version = kVersion;
  uint32_t token_bytes = 0;  // followed by the auth token (may be empty)
  uint32_t reserved = 0;
};

struct HelloReply {
  uint32_t magic = kHelloMagic;
  int32_t status_code = 0;  // absl::StatusCode; not 0: the server closes
  uint32_t message_bytes = 0;
  uint32_t reserved = 0;
};

struct FetchRequestHeader {
  uint32_t magic = kRequestMagic;  // or kHeldMagic, kAppendMagic (above)
  uint32_t n_offsets = 0;  // head_offsets entries (n_kv_heads + 1)
  uint32_t n_indices = 0;
  int32_t layer = 0;
  uint64_t request_id = 0;
  uint64_t sequence_id = 0;
  uint64_t dest_elements = 0;  // the client's buffer, in uint16 values
  uint64_t session_id = 0;     // as in kv_memory.proto's AppendRequest
};

struct FetchResponseHeader {
  uint32_t magic = kResponseMagic;
  int32_t status_code = 0;
  uint64_t request_id = 0;
  uint32_t message_bytes = 0;  // status message, follows the header
  uint32_t reserved = 0;
  uint64_t rows_bytes = 0;  // follows the message
};

static_assert(sizeof(Hello) == 16 && sizeof(HelloReply) == 16 &&
              sizeof(FetchRequestHeader) == 48 &&
              sizeof(FetchResponseHeader) == 32);

// Writes every byte of the iovecs. Unavailable (with errno's text) when the
// connection fails; DeadlineExceeded when a send timeout (SO_SNDTIMEO)
// passes.
absl::Status SendAll(int fd, struct iovec* iov, int iovcnt);
// Reads exactly `bytes`. Unavailable when the peer closes or the connection
// fails.
absl::Status RecvAll(int fd, void* data, size_t bytes);
// Reads and drops `bytes`.
absl::Status Discard(int fd, size_t bytes);

// TCP_NODELAY, and keepalive probes that close a silent connection within
// about 15 s.
void TuneSocket(int fd);

}  // namespace infinigen::kv_memory_service::fetch_wire

#endif  // INFINIGEN_KV_MEMORY_SERVICE_TCP_FETCH_WIRE_H_
