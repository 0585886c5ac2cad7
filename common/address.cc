#include "common/address.h"

#include <netdb.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace infinigen {
namespace {

// HOST:PORT with PORT in min_port..65535; false otherwise.
bool SplitHostPort(absl::string_view address, int min_port, HostPort& out) {
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &out.port) ||
      out.port < min_port || out.port > 65535) {
    return false;
  }
  absl::string_view host = address.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  out.host = std::string(host);
  return true;
}

}  // namespace

absl::StatusOr<HostPort> ParseHostPort(const std::string& address,
                                       const std::string& what) {
  HostPort out;
  if (!SplitHostPort(address, 0, out)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " address '", address, "' is not HOST:PORT"));
  }
  return out;
}

absl::StatusOr<HostPort> ParseDialHostPort(absl::string_view host_port) {
  HostPort out;
  if (!SplitHostPort(host_port, 1, out)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", host_port, "' is not HOST:PORT with a port in 1..65535"));
  }
  return out;
}

absl::StatusOr<std::string> ParseUnixPath(absl::string_view address) {
  if (!absl::StartsWith(address, "unix:")) {
    return absl::InvalidArgumentError(
        absl::StrCat("want unix:PATH, got '", address, "'"));
  }
  std::string path(address.substr(5));
  if (path.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("empty socket path in '", address, "'"));
  }
  if (path.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unix socket path '", path, "' is longer than ",
                     sizeof(sockaddr_un{}.sun_path) - 1, " bytes"));
  }
  return path;
}

absl::StatusOr<ListenAddress> ParseListenAddress(const std::string& listen) {
  ListenAddress out;
  if (absl::StartsWith(listen, "unix:")) {
    if (listen.size() == 5) {
      return absl::InvalidArgumentError("listen address 'unix:' has no path");
    }
    absl::StatusOr<std::string> path = ParseUnixPath(listen);
    if (!path.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("listen address: ", path.status().message()));
    }
    out.unix_path = *std::move(path);
    return out;
  }
  if (!SplitHostPort(listen, 0, out.host_port)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "listen address '", listen, "' is not HOST:PORT or unix:PATH"));
  }
  return out;
}

std::string WhyNotListening(const std::string& listen) {
  absl::StatusOr<ListenAddress> address = ParseListenAddress(listen);
  if (!address.ok()) return std::string(address.status().message());
  if (address->is_unix() || address->host_port.port == 0) return "";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(address->host_port.port);
  const std::string& host = address->host_port.host;
  if (const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(),
                                 port.c_str(), &hints, &found);
      rc != 0) {
    return absl::StrCat("cannot resolve '", host, "': ", gai_strerror(rc));
  }
  std::string why;
  for (addrinfo* a = found; a != nullptr && why.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0) why = std::strerror(errno);
    close(fd);
  }
  freeaddrinfo(found);
  return why;
}

}  // namespace infinigen
