// How a K or V row of one head is stored on the memory node and moved by a
// fetch: the row formats of the KV policies, encoded and decoded on the
// host. Backends decode fetched rows where attention reads them
// (PolicyOps::DecodeKvRows); the CUDA kernels follow these loops formula for
// formula. Plain C++: nvcc includes it through cuda/kernels.h.
#ifndef INFINIGEN_GPU_WORKER_BACKEND_KV_ROWS_H_
#define INFINIGEN_GPU_WORKER_BACKEND_KV_ROWS_H_

#include <cstdint>

namespace infinigen::gpu_worker {

enum class KvRowFormat {
  // head_dim IEEE fp16 values.
  kHalf,
  // FlexGen's group-wise asymmetric 4-bit quantization: groups of
  // g = min(64, head_dim) values; the row is head_dim / g pairs of fp16
  // (scale, min), then head_dim / 2 bytes of nibbles, value 2i in the low
  // nibble of byte i and value 2i + 1 in its high nibble. Value =
  // nibble * scale + min. head_dim must be divisible by 4 and by g.
  kInt4,
};

const char* KvRowFormatName(KvRowFormat format);

// uint16_t values per stored row (inline: the CUDA kernels use it too).
inline int KvRowWidth(KvRowFormat format, int head_dim) {
  if (format == KvRowFormat::kHalf) return head_dim;
  const int group = head_dim < 64 ? head_dim : 64;
  return 2 * (head_dim / group) + head_dim / 4;
}

// rows [n_rows, head_dim] fp32 -> out [n_rows, KvRowWidth()].
void EncodeKvRows(KvRowFormat format, const float* rows, int n_rows,
                  int head_dim, uint16_t* out);
// in [n_rows, KvRowWidth()] -> rows [n_rows, head_dim] fp32.
void DecodeKvRows(KvRowFormat format, const uint16_t* in, int n_rows,
                  int head_dim, float* rows);

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_BACKEND_KV_ROWS_H_
