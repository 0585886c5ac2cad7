// libFuzzer target: a .safetensors file (model/safetensors.h) from untrusted
// bytes, then every tensor read as fp32 (capped, so that a valid file
// announcing a huge tensor does not spend the run converting it); and the
// same bytes as a Hugging Face config.json (ParseHfConfig).
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/memfd_file.h"
#include "model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)infinigen::model::ParseHfConfig(
      std::string(reinterpret_cast<const char*>(data), size), "fuzz");
  infinigen::fuzz::MemfdFile file(data, size);
  if (!file.ok()) return 0;
  auto st = infinigen::model::SafetensorsFile::Open(file.path());
  if (!st.ok()) return 0;
  for (const auto& [name, info] : st->tensors()) {
    (void)info;
    if (size > (1 << 20)) break;  // a file that size holds at most 2^18 floats
    (void)st->ReadFloat32(name);
  }
  return 0;
}
