#include "common/api_key.h"

namespace infinigen {

absl::Status CheckApiKey(const absl::string_view* authorization,
                         absl::string_view key) {
  if (key.empty()) return absl::OkStatus();
  if (authorization == nullptr || authorization->empty()) {
    return absl::UnauthenticatedError(
        "missing API key (Authorization: Bearer KEY)");
  }
  constexpr absl::string_view kBearer = "Bearer ";
  const bool bearer = authorization->substr(0, kBearer.size()) == kBearer;
  const absl::string_view presented =
      bearer ? authorization->substr(kBearer.size()) : *authorization;
  // Every byte of the key is compared, whatever the lengths.
  unsigned char diff = bearer && presented.size() == key.size() ? 0 : 1;
  for (size_t i = 0; i < key.size(); ++i) {
    diff |= static_cast<unsigned char>(i < presented.size() ? presented[i] : 0) ^
            static_cast<unsigned char>(key[i]);
  }
  if (diff != 0) return absl::UnauthenticatedError("invalid API key");
  return absl::OkStatus();
}

}  // namespace infinigen
