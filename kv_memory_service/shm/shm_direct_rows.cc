// ShmKvClient's one-sided reads (shm_client_internal.h): the node's K and V
// memfds of a sequence, mapped read-only until Close.
#include "kv_memory_service/shm/shm_client_internal.h"

#include <errno.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "kv_memory_service/shm/shm_protocol.h"

namespace infinigen::kv_memory_service::shm_client_internal {

absl::StatusOr<DirectRows> ShmKvClient::GetDirectRows(SequenceId seq) {
  {
    absl::MutexLock lock(&rows_mu_);
    auto it = rows_.find(seq);
    if (it != rows_.end()) return it->second.rows;
  }
  MappedRows mapped;
  for (uint32_t part : {0u, 1u}) {
    shm::SocketMessage request;
    request.type = shm::MessageType::kMapRows;
    request.slot = part;
    request.sequence = seq;
    request.session = session();
    shm::SocketMessage reply;
    int fd = -1;
    absl::Status status = Call(request, -1, &reply, &fd);
    if (status.ok() && fd < 0) {
      status = absl::InternalError("shm data plane: MapRows carried no fd");
    }
    size_t bytes = 0;
    struct stat st {};
    if (status.ok() && fstat(fd, &st) != 0) {
      status = shm::ErrnoStatus(absl::StatusCode::kInternal, "fstat", errno);
    }
    if (status.ok()) {
      bytes = static_cast<size_t>(st.st_size);
      const size_t layer_bytes = reply.elements * sizeof(uint16_t);
      if (reply.elements == 0 || reply.max_slots == 0 ||
          bytes < layer_bytes || bytes % layer_bytes != 0) {
        status = absl::InternalError(absl::StrCat(
            "shm data plane: MapRows gave ", bytes, " bytes for layers of ",
            layer_bytes));
      }
    }
    void* p = MAP_FAILED;
    if (status.ok()) {
      p = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) {
        status = shm::ErrnoStatus(absl::StatusCode::kResourceExhausted,
                                  "mmap of the node's rows", errno);
      }
    }
    if (fd >= 0) close(fd);
    if (!status.ok()) {
      UnmapRows(mapped);
      return status;
    }
    (part == 0 ? mapped.k : mapped.v) = p;
    (part == 0 ? mapped.k_bytes : mapped.v_bytes) = bytes;
    mapped.rows.layer_values = reply.elements;
    mapped.rows.max_tokens = static_cast<int32_t>(reply.max_slots);
  }
  mapped.rows.k = static_cast<const uint16_t*>(mapped.k);
  mapped.rows.v = static_cast<const uint16_t*>(mapped.v);
  absl::MutexLock lock(&rows_mu_);
  auto [it, fresh] = rows_.emplace(seq, mapped);
  if (!fresh) UnmapRows(mapped);  // mapped twice at once: keep the first
  return it->second.rows;
}

void ShmKvClient::UnmapRows(const MappedRows& m) {
  if (m.k != nullptr) munmap(m.k, m.k_bytes);
  if (m.v != nullptr) munmap(m.v, m.v_bytes);
}

absl::Status ShmKvClient::Close(SequenceId seq) {
  {
    absl::MutexLock lock(&rows_mu_);
    auto it = rows_.find(seq);
    if (it != rows_.end()) {
      UnmapRows(it->second);
      rows_.erase(it);
    }
  }
  return KvClientWrapper::Close(seq);
}

}  // namespace infinigen::kv_memory_service::shm_client_internal
