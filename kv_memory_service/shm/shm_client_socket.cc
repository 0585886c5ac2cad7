// The shm client's setup (shm_client_internal.h): sealed memfds and their
// shared mappings, the data-plane socket and the server's Hello, and one
// setup request's exchange.
#include "kv_memory_service/shm/shm_client_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kv_memory_service/shm/shm_protocol.h"

namespace infinigen::kv_memory_service::shm_client_internal {

// A sealed memfd of `bytes`: neither side can shrink it under the other's
// mapping.
absl::StatusOr<int> NewSealedMemfd(const char* name, size_t bytes) {
  const int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    return shm::ErrnoStatus(absl::StatusCode::kResourceExhausted,
                            "memfd_create", errno);
  }
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const int err = errno;
    close(fd);
    return shm::ErrnoStatus(absl::StatusCode::kResourceExhausted,
                            absl::StrCat("sizing a memfd of ", bytes, " bytes"),
                            err);
  }
  return fd;
}

absl::StatusOr<void*> MapShared(int fd, size_t offset, size_t bytes,
                                bool populate) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                 MAP_SHARED | (populate ? MAP_POPULATE : 0), fd,
                 static_cast<off_t>(offset));
  if (p == MAP_FAILED) {
    return shm::ErrnoStatus(absl::StatusCode::kResourceExhausted,
                            absl::StrCat("mmap of ", bytes, " shared bytes"),
                            errno);
  }
  return p;
}

// Connects to the data-plane socket at `path` and reads the server's Hello;
// returns the socket, and the announced control address in `control`.
absl::StatusOr<int> OpenDataPlaneSocket(const std::string& path,
                                        absl::Duration timeout,
                                        std::string* control) {
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return shm::ErrnoStatus(absl::StatusCode::kInternal, "socket", errno);
  auto fail = [fd](absl::Status status) {
    close(fd);
    return status;
  };
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return fail(shm::ErrnoStatus(
        absl::StatusCode::kUnavailable,
        absl::StrCat("no KV memory server's shm data plane at ", path,
                     ": connect"),
        errno));
  }
  absl::Status status = shm::SetReceiveTimeout(fd, timeout);
  if (!status.ok()) return fail(status);
  absl::StatusOr<shm::SocketMessage> hello = shm::ReceiveMessage(fd, nullptr);
  if (!hello.ok()) return fail(hello.status());
  if (hello->type == shm::MessageType::kReply) {
    status = shm::StatusOfReply(*hello);  // refused, e.g. too many clients
    return fail(status.ok() ? absl::InternalError("shm: empty refusal") : status);
  }
  if (hello->type != shm::MessageType::kHello) {
    return fail(absl::InternalError("shm data plane: the server sent no Hello"));
  }
  *control = hello->text;
  return fd;
}

// One setup request on `socket` and its reply; rings the doorbell so that a
// sleeping server thread reads it.
// `reply` and `reply_fd` (may be null) get the reply's fields and the
// descriptor it carried (-1: none; the caller closes it).
absl::Status Exchange(int socket, shm::RegionHeader* header,
                      const shm::SocketMessage& message, int fd,
                      shm::SocketMessage* reply, int* reply_fd) {
  IG_RETURN_IF_ERROR(shm::SendMessage(socket, message, fd));
  header->control_seq.fetch_add(1);
  header->doorbell.fetch_add(1);
  if (header->server_waiting.load() != 0) shm::FutexWakeAll(&header->doorbell);
  IG_ASSIGN_OR_RETURN(shm::SocketMessage got,
                      shm::ReceiveMessage(socket, reply_fd));
  if (reply != nullptr) *reply = got;
  return shm::StatusOfReply(got);
}

}  // namespace infinigen::kv_memory_service::shm_client_internal
