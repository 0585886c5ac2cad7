// The bearer API key of `infinigen serve`: the one check HTTP
// (Authorization header) and gRPC (authorization metadata) share.
// Stateless; thread-safe.
#ifndef INFINIGEN_COMMON_API_KEY_H_
#define INFINIGEN_COMMON_API_KEY_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace infinigen {

// OK when `key` is empty (no key required) or `authorization` is
// "Bearer <key>"; the key is compared in time that does not depend on
// where it differs. Unauthenticated otherwise ("missing API key" when
// `authorization` is null or empty, "invalid API key" else).
absl::Status CheckApiKey(const absl::string_view* authorization,
                         absl::string_view key);

}  // namespace infinigen

#endif  // INFINIGEN_COMMON_API_KEY_H_
