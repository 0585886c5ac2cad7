// The credentials a memory node accepts (--auth_token_file), and the
// prefix namespace each stands for.
//
// The file holds one credential per line, "TOKEN [NAMESPACE [read-only]]"
// (blank lines and lines starting with # skipped): a bare TOKEN is in the
// default namespace. Prefix blocks published under a credential are
// attached only by sequences opened under a credential of the same
// namespace; a read-only credential attaches its namespace's blocks and
// never publishes. Every plane accepts every credential; the namespace
// matters where sequences open (the gRPC service). Content addressing
// cannot prove that rows are what a model computes: a namespace bounds who
// can plant rows for whom.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_SERVING_CREDENTIALS_H_
#define INFINIGEN_KV_MEMORY_SERVICE_SERVING_CREDENTIALS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace infinigen::kv_memory_service {

struct Credential {
  std::string token;
  std::string prefix_namespace;  // "" the default
  bool read_only_prefixes = false;
};

class Credentials {
 public:
  Credentials() = default;  // accepts everyone, in the default namespace
  // One token in the default namespace (empty: accepts everyone).
  static Credentials Single(const std::string& token);
  // The file's text (above); InvalidArgument naming `source` and the line
  // for a malformed one, a repeated token, or no token at all.
  static absl::StatusOr<Credentials> Parse(absl::string_view text,
                                           absl::string_view source);

  // Whether anyone is accepted without a token.
  bool empty() const { return credentials_.empty(); }
  size_t size() const { return credentials_.size(); }

  // The credential of `presented` ("Bearer TOKEN"; null: none sent),
  // compared with every token in time independent of where they differ: OK
  // with null when empty(); Unauthenticated otherwise when none matches.
  absl::StatusOr<const Credential*> Authenticate(
      const absl::string_view* presented) const;

 private:
  std::vector<Credential> credentials_;
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_SERVING_CREDENTIALS_H_
