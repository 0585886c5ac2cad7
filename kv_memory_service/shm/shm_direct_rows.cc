// ShmKvClient's one-sided reads (shm_client_internal.h): the node's K and V
// memfds of a sequence, mapped read-only and registered with CUDA until
// Close, and kept mapped past it for the session's next sequence.
#include "kv_memory_service/shm/shm_client_internal.h"

#include <errno.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/cuda_host_register.h"
#include "kv_memory_service/shm/shm_protocol.h"

namespace infinigen::kv_memory_service::shm_client_internal {
namespace {

// A transparent huge page: the least range worth advising to huge pages.
constexpr size_t kHugePage = size_t{2} << 20;

}  // namespace

absl::StatusOr<DirectRows> ShmKvClient::GetDirectRows(SequenceId seq) {
  {
    absl::MutexLock lock(&rows_mu_);
    auto it = rows_.find(seq);
    if (it != rows_.end()) return it->second.rows;
  }
  absl::StatusOr<MappedRows> mapped = MapRows(seq);
  if (!mapped.ok() &&
      mapped.status().code() == absl::StatusCode::kResourceExhausted) {
    // The session's limit of pinned closed sequences, which the mappings
    // kept here count toward where the node keeps no spares: let them go
    // and ask once more.
    std::vector<MappedFile> kept;
    {
      absl::MutexLock lock(&rows_mu_);
      kept.swap(kept_);
    }
    for (const MappedFile& f : kept) Unmap(f);
    if (!kept.empty()) mapped = MapRows(seq);
  }
  if (!mapped.ok()) return mapped.status();
  absl::MutexLock lock(&rows_mu_);
  auto [it, fresh] = rows_.emplace(seq, *mapped);
  if (!fresh) UnmapRows(*mapped);  // mapped twice at once: keep the first
  return it->second.rows;
}

absl::StatusOr<ShmKvClient::MappedRows> ShmKvClient::MapRows(SequenceId seq) {
  MappedRows mapped;
  for (uint32_t part : {0u, 1u}) {
    shm::SocketMessage request;
    request.type = shm::MessageType::kMapRows;
    request.slot = part;
    request.sequence = seq;
    request.session = session();
    shm::SocketMessage reply;
    int fd = -1;
    absl::Status status =
        CallWithin(options_.fetch_timeout, request, -1, &reply, &fd);
    if (status.ok() && fd < 0) {
      status = absl::InternalError("shm data plane: MapRows carried no fd");
    }
    struct stat st {};
    if (status.ok() && fstat(fd, &st) != 0) {
      status = shm::ErrnoStatus(absl::StatusCode::kInternal, "fstat", errno);
    }
    if (status.ok()) {
      const size_t bytes = static_cast<size_t>(st.st_size);
      const size_t layer_bytes = reply.elements * sizeof(uint16_t);
      if (reply.elements == 0 || reply.max_slots == 0 ||
          bytes < layer_bytes || bytes % layer_bytes != 0) {
        status = absl::InternalError(absl::StrCat(
            "shm data plane: MapRows gave ", bytes, " bytes for layers of ",
            layer_bytes));
      }
    }
    absl::StatusOr<MappedFile> file =
        status.ok() ? MapFile(fd, st) : absl::StatusOr<MappedFile>(status);
    if (fd >= 0) close(fd);
    if (!file.ok()) {
      UnmapRows(mapped);
      return file.status();
    }
    (part == 0 ? mapped.k : mapped.v) = *file;
    mapped.rows.layer_values = reply.elements;
    mapped.rows.max_tokens = static_cast<int32_t>(reply.max_slots);
  }
  mapped.rows.k = static_cast<const uint16_t*>(mapped.k.data);
  mapped.rows.v = static_cast<const uint16_t*>(mapped.v.data);
  return mapped;
}

absl::StatusOr<ShmKvClient::MappedFile> ShmKvClient::MapFile(
    int fd, const struct stat& st) {
  const size_t bytes = static_cast<size_t>(st.st_size);
  {
    absl::MutexLock lock(&rows_mu_);
    for (auto it = kept_.begin(); it != kept_.end(); ++it) {
      if (it->dev == st.st_dev && it->ino == st.st_ino &&
          it->bytes == bytes) {
        const MappedFile f = *it;
        kept_.erase(it);
        return f;
      }
    }
  }
  void* p = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    return shm::ErrnoStatus(absl::StatusCode::kResourceExhausted,
                            "mmap of the node's rows", errno);
  }
  MappedFile f;
  f.data = p;
  f.bytes = bytes;
  f.dev = st.st_dev;
  f.ino = st.st_ino;
  // Pinned and mapped for a device in 2 MiB pages where the kernel gives
  // transparent huge pages to shared memory: far fewer pages to pin and
  // map. Nothing changes where it does not.
  if (bytes >= kHugePage) madvise(p, bytes, MADV_HUGEPAGE);
  f.registered = CudaHostRegisterReadOnly(p, bytes);
  return f;
}

void ShmKvClient::Unmap(const MappedFile& f) {
  if (f.data == nullptr) return;
  if (f.registered) CudaHostUnregister(f.data);
  munmap(f.data, f.bytes);
}

void ShmKvClient::UnmapRows(const MappedRows& m) {
  Unmap(m.k);
  Unmap(m.v);
}

absl::Status ShmKvClient::Close(SequenceId seq) {
  std::vector<MappedFile> unmap;
  {
    absl::MutexLock lock(&rows_mu_);
    auto it = rows_.find(seq);
    if (it != rows_.end()) {
      kept_.push_back(it->second.k);
      kept_.push_back(it->second.v);
      rows_.erase(it);
    }
    const size_t keep = 2 * static_cast<size_t>(
                                std::max(0, options_.shm_kept_rows));
    while (kept_.size() > keep) {
      unmap.push_back(kept_.front());
      kept_.erase(kept_.begin());
    }
  }
  for (const MappedFile& f : unmap) Unmap(f);
  return KvClientWrapper::Close(seq);
}

}  // namespace infinigen::kv_memory_service::shm_client_internal
