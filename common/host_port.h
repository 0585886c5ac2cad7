// "HOST:PORT" listen addresses for the servers built on cpp-httplib (the
// HTTP API and the /metrics listeners). Stateless; thread-safe.
#ifndef INFINIGEN_COMMON_HOST_PORT_H_
#define INFINIGEN_COMMON_HOST_PORT_H_

#include <string>

#include "absl/status/statusor.h"

namespace infinigen {

struct HostPort {
  std::string host;  // without the brackets of "[v6]"
  int port = 0;      // 0..65535; 0: any free port
};

// InvalidArgument, naming `what` and the address, unless `address` is
// HOST:PORT with a non-empty HOST and PORT in 0..65535.
absl::StatusOr<HostPort> ParseHostPort(const std::string& address,
                                       const std::string& what);

}  // namespace infinigen

#endif  // INFINIGEN_COMMON_HOST_PORT_H_
