#include "gpu_worker/backend/kv_rows.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "common/half.h"

namespace infinigen::gpu_worker {
namespace {

int Int4Group(int head_dim) { return std::min(64, head_dim); }

void EncodeInt4(const float* rows, int n_rows, int d, uint16_t* out) {
  const int group = Int4Group(d), n_groups = d / group;
  const int width = KvRowWidth(KvRowFormat::kInt4, d);
  for (int r = 0; r < n_rows; ++r) {
    const float* x = rows + static_cast<size_t>(r) * d;
    uint16_t* o = out + static_cast<size_t>(r) * width;
    uint8_t* packed = reinterpret_cast<uint8_t*>(o + 2 * n_groups);
    for (int gi = 0; gi < n_groups; ++gi) {
      const float* xg = x + gi * group;
      float mn = xg[0], mx = xg[0];
      for (int i = 1; i < group; ++i) {
        mn = std::min(mn, xg[i]);
        mx = std::max(mx, xg[i]);
      }
      const uint16_t mn_h = FloatToHalf(mn);
      const float mn_q = HalfToFloat(mn_h);
      const uint16_t scale_h = FloatToHalf((mx - mn_q) / 15.0f);
      const float scale = HalfToFloat(scale_h);
      const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
      o[2 * gi] = scale_h;
      o[2 * gi + 1] = mn_h;
      for (int i = 0; i < group; ++i) {
        const int q = std::clamp(
            static_cast<int>(std::lround((xg[i] - mn_q) * inv)), 0, 15);
        const int idx = gi * group + i;
        if (idx % 2 == 0) {
          packed[idx / 2] = static_cast<uint8_t>(q);
        } else {
          packed[idx / 2] |= static_cast<uint8_t>(q << 4);
        }
      }
    }
  }
}

void DecodeInt4(const uint16_t* in, int n_rows, int d, float* rows) {
  const int group = Int4Group(d), n_groups = d / group;
  const int width = KvRowWidth(KvRowFormat::kInt4, d);
  for (int r = 0; r < n_rows; ++r) {
    const uint16_t* o = in + static_cast<size_t>(r) * width;
    const uint8_t* packed = reinterpret_cast<const uint8_t*>(o + 2 * n_groups);
    float* x = rows + static_cast<size_t>(r) * d;
    for (int gi = 0; gi < n_groups; ++gi) {
      const float scale = HalfToFloat(o[2 * gi]);
      const float mn = HalfToFloat(o[2 * gi + 1]);
      for (int i = 0; i < group; ++i) {
        const int idx = gi * group + i;
        const int q = (packed[idx / 2] >> (4 * (idx % 2))) & 0xF;
        x[idx] = q * scale + mn;
      }
    }
  }
}

}  // namespace

const char* KvRowFormatName(KvRowFormat format) {
  return format == KvRowFormat::kHalf ? "fp16" : "int4";
}

void EncodeKvRows(KvRowFormat format, const float* rows, int n_rows,
                  int head_dim, uint16_t* out) {
  if (format == KvRowFormat::kHalf) {
    FloatToHalf(rows, static_cast<size_t>(n_rows) * head_dim, out);
  } else {
    EncodeInt4(rows, n_rows, head_dim, out);
  }
}

void DecodeKvRows(KvRowFormat format, const uint16_t* in, int n_rows,
                  int head_dim, float* rows) {
  if (format == KvRowFormat::kHalf) {
    HalfToFloat(in, static_cast<size_t>(n_rows) * head_dim, rows);
  } else {
    DecodeInt4(in, n_rows, head_dim, rows);
  }
}

}  // namespace infinigen::gpu_worker
