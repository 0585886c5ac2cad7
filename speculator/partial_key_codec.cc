#include "speculator/speculator.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "speculator/internal.h"
#include "speculator/partial_keys.h"

namespace infinigen::speculator {

using internal::ReadPartialKeyRow;

void QuantizePartialKeys(const float* keys, int n_rows, int n_cols,
                         uint8_t* rows) {
  const int bytes = PartialKeyRowBytes(n_cols);
  for (int r = 0; r < n_rows; ++r) {
    const float* v = keys + static_cast<size_t>(r) * n_cols;
    uint8_t* row = rows + static_cast<size_t>(r) * bytes;
    float lo = v[0], hi = v[0];
    for (int c = 1; c < n_cols; ++c) {
      lo = std::min(lo, v[c]);
      hi = std::max(hi, v[c]);
    }
    const float scale = (hi - lo) / 15.0f;
    std::memcpy(row, &lo, sizeof(float));
    std::memcpy(row + sizeof(float), &scale, sizeof(float));
    uint8_t* codes = row + 2 * sizeof(float);
    std::memset(codes, 0, bytes - 2 * sizeof(float));
    if (!(scale > 0.0f)) continue;
    for (int c = 0; c < n_cols; ++c) {
      const int code = std::clamp(
          static_cast<int>(std::nearbyint((v[c] - lo) / scale)), 0, 15);
      codes[c / 2] |= static_cast<uint8_t>(code << (4 * (c & 1)));
    }
  }
}

void DequantizePartialKeys(const uint8_t* rows, int n_rows, int n_cols,
                           float* keys) {
  const int bytes = PartialKeyRowBytes(n_cols);
  for (int r = 0; r < n_rows; ++r) {
    float lo, scale;
    float* v = keys + static_cast<size_t>(r) * n_cols;
    ReadPartialKeyRow(rows + static_cast<size_t>(r) * bytes, n_cols, &lo,
                      &scale, v);
    for (int c = 0; c < n_cols; ++c) v[c] = lo + scale * v[c];
  }
}

}  // namespace infinigen::speculator
