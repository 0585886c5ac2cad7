#include "kv_memory_service/testing/kv_test_data.h"

namespace infinigen::kv_memory_service::testdata {

uint16_t RowValue(uint32_t salt, int layer, int head, int position, int dim,
                  int kv) {
  uint64_t x = (uint64_t{salt} << 40) ^ (uint64_t(layer) << 32) ^
               (uint64_t(head) << 24) ^ (uint64_t(position) << 8) ^
               (uint64_t(dim) << 1) ^ uint64_t(kv);
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return static_cast<uint16_t>(x);
}

SequenceGeometry MakeGeometry(int n_layers, int n_kv_heads, int head_dim,
                              int max_tokens) {
  SequenceGeometry g;
  g.n_layers = n_layers;
  g.n_kv_heads = n_kv_heads;
  g.head_dim = head_dim;
  g.max_tokens = max_tokens;
  return g;
}

TestBlock MakeTestBlock(uint32_t salt, const SequenceGeometry& g,
                        int first_layer, int n_layers, int first_position,
                        int n_tokens) {
  TestBlock b;
  const size_t n = static_cast<size_t>(n_layers) * n_tokens * g.n_kv_heads *
                   g.head_dim;
  b.k.reserve(n);
  b.v.reserve(n);
  for (int l = first_layer; l < first_layer + n_layers; ++l) {
    for (int t = 0; t < n_tokens; ++t) {
      for (int h = 0; h < g.n_kv_heads; ++h) {
        for (int d = 0; d < g.head_dim; ++d) {
          b.k.push_back(RowValue(salt, l, h, first_position + t, d, 0));
          b.v.push_back(RowValue(salt, l, h, first_position + t, d, 1));
        }
      }
    }
  }
  b.block.first_layer = first_layer;
  b.block.n_layers = n_layers;
  b.block.n_tokens = n_tokens;
  b.block.k = b.k;
  b.block.v = b.v;
  return b;
}

std::vector<uint16_t> ExpectedRows(uint32_t salt, const SequenceGeometry& g,
                                   int layer, const FetchPlan& plan) {
  const size_t n = plan.indices.size();
  std::vector<uint16_t> out(2 * n * g.head_dim);
  for (int h = 0; h + 1 < static_cast<int>(plan.head_offsets.size()); ++h) {
    for (int j = plan.head_offsets[h]; j < plan.head_offsets[h + 1]; ++j) {
      for (int d = 0; d < g.head_dim; ++d) {
        out[j * g.head_dim + d] = RowValue(salt, layer, h, plan.indices[j], d, 0);
        out[(n + j) * g.head_dim + d] =
            RowValue(salt, layer, h, plan.indices[j], d, 1);
      }
    }
  }
  return out;
}

}  // namespace infinigen::kv_memory_service::testdata
