// Deterministic K/V rows for tests of the store, the clients and the
// server: the row value at (layer, head, position, dim) is a hash of those
// and a per-sequence salt, so a row gathered from the wrong place, the
// wrong sequence or the wrong half (K/V) never matches, and any fetch can be
// checked without keeping what was appended.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_TESTING_KV_TEST_DATA_H_
#define INFINIGEN_KV_MEMORY_SERVICE_TESTING_KV_TEST_DATA_H_

#include <cstdint>
#include <vector>

#include "kv_memory_service/client/kv_types.h"

namespace infinigen::kv_memory_service::testdata {

// kv: 0 for K, 1 for V.
uint16_t RowValue(uint32_t salt, int layer, int head, int position, int dim,
                  int kv);

SequenceGeometry MakeGeometry(int n_layers, int n_kv_heads, int head_dim,
                              int max_tokens);

// Rows of tokens [first_position, +n_tokens) for layers [first_layer,
// +n_layers), in AppendBlock's layout. `block` views `k` and `v`: the
// struct moves but does not copy.
struct TestBlock {
  TestBlock() = default;
  TestBlock(TestBlock&&) = default;
  TestBlock& operator=(TestBlock&&) = default;
  TestBlock(const TestBlock&) = delete;
  TestBlock& operator=(const TestBlock&) = delete;

  std::vector<uint16_t> k, v;
  AppendBlock block;
};
TestBlock MakeTestBlock(uint32_t salt, const SequenceGeometry& geometry,
                        int first_layer, int n_layers, int first_position,
                        int n_tokens);

// What a fetch of `plan` from `layer` must return, in FetchPlan's layout.
std::vector<uint16_t> ExpectedRows(uint32_t salt,
                                   const SequenceGeometry& geometry, int layer,
                                   const FetchPlan& plan);

}  // namespace infinigen::kv_memory_service::testdata

#endif  // INFINIGEN_KV_MEMORY_SERVICE_TESTING_KV_TEST_DATA_H_
