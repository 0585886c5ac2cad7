// libFuzzer target: a GGUF file (model/gguf.h) from untrusted bytes, then
// the BPE tokenizer built from its metadata (the tokenizer loader) and one
// encode/decode round. Any crash, sanitizer report or hang is a bug; errors
// are the expected answer to most inputs.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/memfd_file.h"
#include "model/gguf.h"
#include "model/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  infinigen::fuzz::MemfdFile file(data, size);
  if (!file.ok()) return 0;
  auto gguf = infinigen::model::GgufFile::Open(file.path());
  if (!gguf.ok()) return 0;
  for (const std::string& key : gguf->keys()) (void)gguf->Find(key);
  auto tokenizer = infinigen::model::LoadGgufTokenizer(*gguf);
  if (!tokenizer.ok()) return 0;
  const std::vector<int> ids = (*tokenizer)->Encode("Hello, world! 123", true);
  int prev = 0;
  for (int id : ids) {
    (void)(*tokenizer)->DecodeToken(prev, id);
    prev = id;
  }
  return 0;
}
