// PrefixKeys: the content address of a token prefix's KV rows, block by
// block, as a worker computes it before opening a sequence (kv_types.h,
// PrefixRequest).
//
// The chain, with XXH3's 128-bit hash (Debian's libxxhash):
//
//   key[0] = XXH3_128(identity | block_tokens | tokens[0, B))
//   key[i] = XXH3_128(key[i - 1] | tokens[i*B, (i+1)*B))
//
// where identity names the model and everything the stored rows depend on
// (weights, row format, skew), B = block_tokens and tokens are
// little-endian int32. Two sequences share key[i] only when they share
// the identity, the block size and every token up to the end of block i:
// another model, another row format or one different token earlier gives
// another key, so a lookup misses rather than returns foreign rows.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_CLIENT_PREFIX_KEYS_H_
#define INFINIGEN_KV_MEMORY_SERVICE_CLIENT_PREFIX_KEYS_H_

#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kv_memory_service/client/kv_types.h"

namespace infinigen::kv_memory_service {

// The keys of the floor(tokens.size() / block_tokens) whole blocks of
// `tokens` (none when block_tokens <= 0).
std::vector<PrefixKey> PrefixKeys(absl::string_view identity,
                                  int32_t block_tokens,
                                  absl::Span<const int32_t> tokens);

// XXH3_128 of `bytes`, for identities made of several parts (a model
// file's contents, a skew file's).
PrefixKey HashBytes(absl::string_view bytes);

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_CLIENT_PREFIX_KEYS_H_
