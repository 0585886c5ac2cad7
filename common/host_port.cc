#include "common/host_port.h"

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace infinigen {

absl::StatusOr<HostPort> ParseHostPort(const std::string& address,
                                       const std::string& what) {
  const size_t colon = address.rfind(':');
  HostPort out;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &out.port) ||
      out.port < 0 || out.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " address '", address, "' is not HOST:PORT"));
  }
  out.host = address.substr(0, colon);
  if (out.host.size() > 2 && out.host.front() == '[' &&
      out.host.back() == ']') {
    out.host = out.host.substr(1, out.host.size() - 2);
  }
  return out;
}

}  // namespace infinigen
