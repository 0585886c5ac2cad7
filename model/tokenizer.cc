#include "model/tokenizer.h"

#include <utility>

#include "absl/strings/str_format.h"

namespace infinigen::model {

std::string Tokenizer::Decode(const std::vector<int>& tokens) const {
  std::string out;
  int prev = -1;
  for (int t : tokens) {
    out += DecodeToken(prev, t);
    prev = t;
  }
  return out;
}

absl::Status CheckVocabulary(const char* kind, int n, size_t types,
                             long scores, int bos, int eos, int unk) {
  if (n == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s vocabulary is empty", kind));
  }
  if (scores > 0 && scores != n) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s vocabulary has %d tokens but %d scores", kind, n, scores));
  }
  if (types != 0 && types != static_cast<size_t>(n)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s vocabulary has %d tokens but %d token types", kind, n, types));
  }
  for (auto [name, id] : {std::pair<const char*, int>{"bos", bos},
                          {"eos", eos},
                          {"unk", unk}}) {
    if (id < -1 || id >= n) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s token id %d is outside the vocabulary of %d tokens", name, id,
          n));
    }
  }
  return absl::OkStatus();
}

}  // namespace infinigen::model
