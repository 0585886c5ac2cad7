#include "kv_memory_service/client/prefix_keys.h"

#include <cstring>

#include <xxhash.h>

namespace infinigen::kv_memory_service {
namespace {

void PutLe32(uint32_t v, unsigned char* out) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<unsigned char>(v >> (8 * i));
}

void PutLe64(uint64_t v, unsigned char* out) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<unsigned char>(v >> (8 * i));
}

PrefixKey FromHash(XXH128_hash_t h) { return PrefixKey{h.low64, h.high64}; }

}  // namespace

PrefixKey HashBytes(absl::string_view bytes) {
  return FromHash(XXH3_128bits(bytes.data(), bytes.size()));
}

std::vector<PrefixKey> PrefixKeys(absl::string_view identity,
                                  int32_t block_tokens,
                                  absl::Span<const int32_t> tokens) {
  std::vector<PrefixKey> keys;
  if (block_tokens <= 0) return keys;
  const size_t blocks = tokens.size() / static_cast<size_t>(block_tokens);
  keys.reserve(blocks);
  std::vector<unsigned char> bytes;
  for (size_t b = 0; b < blocks; ++b) {
    bytes.clear();
    if (b == 0) {
      bytes.assign(identity.begin(), identity.end());
      unsigned char size[4];
      PutLe32(static_cast<uint32_t>(block_tokens), size);
      bytes.insert(bytes.end(), size, size + 4);
    } else {
      unsigned char prev[16];
      PutLe64(keys.back().lo, prev);
      PutLe64(keys.back().hi, prev + 8);
      bytes.insert(bytes.end(), prev, prev + 16);
    }
    for (int32_t t = 0; t < block_tokens; ++t) {
      unsigned char v[4];
      PutLe32(static_cast<uint32_t>(tokens[b * block_tokens + t]), v);
      bytes.insert(bytes.end(), v, v + 4);
    }
    keys.push_back(FromHash(XXH3_128bits(bytes.data(), bytes.size())));
  }
  return keys;
}

}  // namespace infinigen::kv_memory_service
