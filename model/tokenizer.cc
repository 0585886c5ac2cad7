#include "model/tokenizer.h"

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

}  // namespace infinigen::model
