#include "kv_memory_service/serving/credentials.h"

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace infinigen::kv_memory_service {
namespace {

// Equal, in time that depends on neither string's contents.
bool SameToken(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < b.size(); ++i) {
    diff |= (i < a.size() ? a[i] : 0) ^ b[i];
  }
  return diff == 0;
}

}  // namespace

Credentials Credentials::Single(const std::string& token) {
  Credentials c;
  if (!token.empty()) c.credentials_.push_back({token, "", false});
  return c;
}

absl::StatusOr<Credentials> Credentials::Parse(absl::string_view text,
                                               absl::string_view source) {
  Credentials out;
  absl::flat_hash_set<std::string> seen;
  int number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || absl::StartsWith(line, "#")) continue;
    std::vector<std::string> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    Credential c;
    c.token = fields[0];
    if (fields.size() >= 2) c.prefix_namespace = fields[1];
    if (fields.size() == 3 && fields[2] == "read-only") {
      c.read_only_prefixes = true;
    } else if (fields.size() >= 3) {
      return absl::InvalidArgumentError(absl::StrCat(
          source, " line ", number,
          ": want TOKEN [NAMESPACE [read-only]], got ", fields.size(),
          " fields ending in '", fields.back(), "'"));
    }
    if (!seen.insert(c.token).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, " line ", number, ": a token listed twice"));
    }
    out.credentials_.push_back(std::move(c));
  }
  if (out.credentials_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, " holds no token"));
  }
  return out;
}

absl::StatusOr<const Credential*> Credentials::Authenticate(
    const absl::string_view* presented) const {
  if (credentials_.empty()) return nullptr;
  if (presented == nullptr || presented->empty()) {
    return absl::UnauthenticatedError("missing authorization token");
  }
  absl::string_view token = *presented;
  const bool bearer = absl::ConsumePrefix(&token, "Bearer ");
  const Credential* found = nullptr;
  for (const Credential& c : credentials_) {  // every one, no early exit
    if (SameToken(token, c.token) && found == nullptr) found = &c;
  }
  if (found == nullptr || !bearer) {
    return absl::UnauthenticatedError("wrong authorization token");
  }
  return found;
}

}  // namespace infinigen::kv_memory_service
