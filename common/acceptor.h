// Acceptor: accept4 on a listening socket that never spins while the
// process has no descriptors left.
//
// A listening socket with a pending connection stays readable, so a server
// that polls it and whose accept fails with EMFILE or ENFILE would loop at
// full speed until a descriptor frees, and the peer would wait in the
// backlog meanwhile. Acceptor owns one spare descriptor for that moment:
// on EMFILE or ENFILE it closes the spare, accepts the pending connection,
// closes it at once (the peer sees its connection end instead of hanging),
// takes the spare back, and sleeps a short back-off before returning, so a
// caller that polls again right away makes at most one try per back-off.
//
// Thread-compatible: one accepting thread per Acceptor.
#ifndef INFINIGEN_COMMON_ACCEPTOR_H_
#define INFINIGEN_COMMON_ACCEPTOR_H_

#include <cstdint>

#include "absl/time/time.h"

namespace infinigen {

class Acceptor {
 public:
  explicit Acceptor(absl::Duration backoff = absl::Milliseconds(50));
  ~Acceptor();
  Acceptor(const Acceptor&) = delete;
  Acceptor& operator=(const Acceptor&) = delete;

  // accept4(listen_fd, nullptr, nullptr, flags): the connected socket, or
  // -1 with errno as accept4 left it. After EMFILE or ENFILE the pending
  // peer, if any, has been shed and the back-off has passed.
  int Accept(int listen_fd, int flags);

  // Connections accepted and closed at once for want of descriptors.
  int64_t shed() const { return shed_; }

 private:
  void Shed(int listen_fd, int flags);

  const absl::Duration backoff_;
  int spare_ = -1;
  int64_t shed_ = 0;
};

}  // namespace infinigen

#endif  // INFINIGEN_COMMON_ACCEPTOR_H_
