// libFuzzer target: a llama2.c tokenizer.bin (model/llama2c.h) from
// untrusted bytes, then one encode/decode round. The first byte picks the
// vocabulary size the model would claim.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/memfd_file.h"
#include "model/llama2c.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int vocab_size = 1 + data[0] * 4;  // 1 .. 1021, covers tok512
  infinigen::fuzz::MemfdFile file(data + 1, size - 1);
  if (!file.ok()) return 0;
  auto tokenizer =
      infinigen::model::Llama2cTokenizer::Load(file.path(), vocab_size);
  if (!tokenizer.ok()) return 0;
  const std::vector<int> ids = (*tokenizer)->Encode("Once upon a time", true);
  int prev = 1;
  for (int id : ids) {
    (void)(*tokenizer)->DecodeToken(prev, id);
    prev = id;
  }
  return 0;
}
