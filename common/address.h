// The addresses infinigen's servers listen on and its clients dial, parsed
// in one place:
//   listen:  HOST:PORT (port 0: any free port) or unix:PATH;
//   dialled: tcp://HOST:PORT, rdma://HOST:PORT, dns+tcp://NAME:PORT,
//            unix:PATH, shm:unix:PATH (the schemes are the callers'; the
//            HOST:PORT and unix:PATH parts are parsed here).
// HOST may be an IPv6 address in brackets ("[::1]:80"); the brackets are
// dropped from HostPort::host. Stateless; thread-safe.
#ifndef INFINIGEN_COMMON_ADDRESS_H_
#define INFINIGEN_COMMON_ADDRESS_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace infinigen {

struct HostPort {
  std::string host;  // without the brackets of "[v6]"; never empty
  int port = 0;      // 0..65535; 0 only in a listen address
};

// HOST:PORT with a non-empty HOST and PORT in 0..65535; InvalidArgument
// naming `what` and the address otherwise.
absl::StatusOr<HostPort> ParseHostPort(const std::string& address,
                                       const std::string& what);

// The HOST:PORT of a dialled address (after its scheme): PORT in 1..65535.
// InvalidArgument saying what is wrong, for the caller to put in context.
absl::StatusOr<HostPort> ParseDialHostPort(absl::string_view host_port);

// unix:PATH with a non-empty PATH short enough for a socket address;
// returns PATH.
absl::StatusOr<std::string> ParseUnixPath(absl::string_view address);

// A server's listen address: unix:PATH or HOST:PORT.
struct ListenAddress {
  std::string unix_path;  // set for unix:PATH
  HostPort host_port;     // set otherwise
  bool is_unix() const { return !unix_path.empty(); }
};
absl::StatusOr<ListenAddress> ParseListenAddress(const std::string& listen);

// Why a server could not listen on HOST:PORT, as the kernel says when a
// socket tries ("address already in use", "cannot assign requested
// address"); empty when a trial bind succeeds or the address is a unix one
// or port 0. For messages after a server library failed without a reason.
std::string WhyNotListening(const std::string& listen);

}  // namespace infinigen

#endif  // INFINIGEN_COMMON_ADDRESS_H_
