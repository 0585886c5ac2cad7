// The Backend defaults every backend starts from, on the CPU backend: the
// stored KV row formats, decoding them, and copies from host memory.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gpu_worker/backend/backend.h"
#include "gpu_worker/backend/cpu/cpu_backend.h"
#include "gpu_worker/backend/kv_rows.h"
#include "gpu_worker/backend/shared_vector.h"
#include "gtest/gtest.h"
#include "speculator/partial_keys.h"

namespace infinigen::gpu_worker {
namespace {

TEST(KvRows, Widths) {
  EXPECT_EQ(KvRowWidth(KvRowFormat::kHalf, 64), 64);
  // Groups of min(64, d): 2 fp16 per group, then d / 4 uint16 of nibbles.
  EXPECT_EQ(KvRowWidth(KvRowFormat::kInt4, 64), 2 + 16);
  EXPECT_EQ(KvRowWidth(KvRowFormat::kInt4, 128), 4 + 32);
  EXPECT_EQ(KvRowWidth(KvRowFormat::kInt4, 32), 2 + 8);
  EXPECT_STREQ(KvRowFormatName(KvRowFormat::kInt4), "int4");
}

TEST(KvRows, HalfRoundTripIsExactForHalfValues) {
  const std::vector<float> rows = {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f,
                                   0x1p-24f, 0.333251953125f, -1024.0f};
  std::vector<uint16_t> stored(rows.size());
  EncodeKvRows(KvRowFormat::kHalf, rows.data(), 2, 4, stored.data());
  std::vector<float> back(rows.size());
  DecodeKvRows(KvRowFormat::kHalf, stored.data(), 2, 4, back.data());
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(back[i], rows[i]) << i;
    EXPECT_EQ(std::signbit(back[i]), std::signbit(rows[i])) << i;
  }
}

// Each value comes back within half a quantization step of its group
// (plus the fp16 rounding of the group's minimum and scale).
TEST(KvRows, Int4ErrorIsWithinHalfAStep) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int d = 128, n = 9;
  std::vector<float> rows(n * d);
  for (float& x : rows) x = normal(rng);
  std::vector<uint16_t> stored(n * KvRowWidth(KvRowFormat::kInt4, d));
  EncodeKvRows(KvRowFormat::kInt4, rows.data(), n, d, stored.data());
  std::vector<float> back(rows.size());
  DecodeKvRows(KvRowFormat::kInt4, stored.data(), n, d, back.data());
  for (int r = 0; r < n; ++r) {
    for (int g = 0; g < d / 64; ++g) {
      const float* x = &rows[r * d + g * 64];
      float mn = x[0], mx = x[0];
      for (int i = 0; i < 64; ++i) {
        mn = std::min(mn, x[i]);
        mx = std::max(mx, x[i]);
      }
      const float step = (mx - mn) / 15.0f;
      for (int i = 0; i < 64; ++i) {
        EXPECT_NEAR(back[r * d + g * 64 + i], x[i], step * 0.5f + 1e-2f)
            << "row " << r << " value " << g * 64 + i;
      }
    }
  }
}

TEST(CpuBackend, DecodesStoredRowsLikeTheHost) {
  auto cpu = NewCpuBackend();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (KvRowFormat format : {KvRowFormat::kHalf, KvRowFormat::kInt4}) {
    const int d = 64, n = 5;
    std::vector<float> rows(n * d);
    for (float& x : rows) x = normal(rng);
    std::vector<uint16_t> stored(n * KvRowWidth(format, d));
    EncodeKvRows(format, rows.data(), n, d, stored.data());
    std::vector<float> want(rows.size()), got(rows.size(), -1.0f);
    DecodeKvRows(format, stored.data(), n, d, want.data());
    cpu->DecodeKvRows(stored.data(), n, d, format, got.data());
    EXPECT_EQ(got, want) << KvRowFormatName(format);
  }
}

// Attention over fp16 rows where they lie equals decoding them and running
// Attention, query head by query head, up to the order of the sums; with
// the probabilities H2O accumulates. Other formats are declined.
TEST(CpuBackend, AttendsStoredRowsInPlaceLikeDecodedAttention) {
  auto cpu = NewCpuBackend();
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (int d : {64, 128, 24}) {
    for (int count : {0, 1, 37, 300}) {
      const int group = 3, n = count + 1;
      std::vector<float> q(group * d), k(n * d), v(n * d);
      for (float& x : q) x = normal(rng);
      for (float& x : k) x = normal(rng);
      for (float& x : v) x = normal(rng);
      std::vector<uint16_t> k_half(count * d + 1), v_half(count * d + 1);
      EncodeKvRows(KvRowFormat::kHalf, k.data(), count, d, k_half.data());
      EncodeKvRows(KvRowFormat::kHalf, v.data(), count, d, v_half.data());
      // The reference: stored rows decoded, the new row exact, then one
      // Attention per query head.
      std::vector<float> kd(k), vd(v);
      DecodeKvRows(KvRowFormat::kHalf, k_half.data(), count, d, kd.data());
      DecodeKvRows(KvRowFormat::kHalf, v_half.data(), count, d, vd.data());
      const float scale = 1.0f / std::sqrt(static_cast<float>(d));
      std::vector<float> want(group * d), want_probs(group * (n + 2), 0.5f);
      for (int h = 0; h < group; ++h) {
        AttentionParams p;
        p.q = q.data() + h * d;
        p.k = kd.data();
        p.v = vd.data();
        p.out = want.data() + h * d;
        p.n = 1;
        p.n_heads = 1;
        p.n_kv_heads = 1;
        p.head_dim = d;
        p.kv_stride = n;
        p.kv_len0 = n;
        p.scale = scale;
        p.prob_sums = want_probs.data() + h * (n + 2);
        cpu->Attention(p);
      }
      std::vector<float> got(group * d, -7.0f),
          got_probs(group * (n + 2), 0.5f);
      StoredRowsAttention p;
      p.q = q.data();
      p.k = k_half.data();
      p.v = v_half.data();
      p.k_new = k.data() + count * d;
      p.v_new = v.data() + count * d;
      p.out = got.data();
      p.group = group;
      p.count = count;
      p.head_dim = d;
      p.row_width = d;
      p.scale = scale;
      p.prob_sums = got_probs.data();
      p.prob_stride = n + 2;
      ASSERT_TRUE(cpu->AttendStoredRows(p));
      for (int i = 0; i < group * d; ++i) {
        ASSERT_NEAR(got[i], want[i], 1e-5f) << "d " << d << " count " << count;
      }
      for (int i = 0; i < group * (n + 2); ++i) {
        // Past each head's n probabilities nothing is touched.
        ASSERT_NEAR(got_probs[i], want_probs[i], 1e-6f) << i;
      }
      // The same rows read by index from a table where they lie apart
      // (one-sided reads): the same sums in the same order.
      std::vector<uint16_t> k_table(3 * count * d + d), v_table(k_table.size());
      std::vector<int32_t> indices(count);
      for (int t = 0; t < count; ++t) {
        indices[t] = 3 * (count - 1 - t) + 1;
        std::copy_n(k_half.begin() + t * d, d,
                    k_table.begin() + indices[t] * d);
        std::copy_n(v_half.begin() + t * d, d,
                    v_table.begin() + indices[t] * d);
      }
      std::vector<float> by_index(group * d, -7.0f),
          by_index_probs(group * (n + 2), 0.5f);
      StoredRowsAttention pi = p;
      pi.k = k_table.data();
      pi.v = v_table.data();
      pi.indices = indices.data();
      pi.out = by_index.data();
      pi.prob_sums = by_index_probs.data();
      ASSERT_TRUE(cpu->AttendStoredRows(pi));
      EXPECT_EQ(by_index, got);
      EXPECT_EQ(by_index_probs, got_probs);
      p.format = KvRowFormat::kInt4;
      EXPECT_FALSE(cpu->AttendStoredRows(p));
    }
  }
}

// Sliding-window attention (Gemma 3's local layers) against a direct
// softmax over each query's last `window` rows, with a prefill chunk whose
// windows start at different rows, and the H2O sums only over the window.
// The staged rows' reference (what the CUDA kernel is tested against) is
// the engine's head-by-head path: each head's rows decoded with the new
// row after them, then Attention, within float rounding. An empty head
// attends to the new row alone; int4 rows decode as stored.
TEST(AttendStagedRowsOnHost, MatchesDecodedAttentionHeadByHead) {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal;
  auto cpu = NewCpuBackend();
  for (KvRowFormat format : {KvRowFormat::kHalf, KvRowFormat::kInt4}) {
    const int n_heads = 6, n_kv_heads = 3, hd = 64;
    const int width = KvRowWidth(format, hd);
    const std::vector<int32_t> offsets = {0, 37, 37, 137};  // head 1 empty
    const int rows = offsets.back();
    std::vector<float> exact(static_cast<size_t>(rows) * hd);
    for (float& x : exact) x = normal(rng);
    std::vector<uint16_t> k_rows(static_cast<size_t>(rows) * width),
        v_rows(k_rows.size());
    EncodeKvRows(format, exact.data(), rows, hd, k_rows.data());
    for (float& x : exact) x = normal(rng);
    EncodeKvRows(format, exact.data(), rows, hd, v_rows.data());
    std::vector<float> q(n_heads * hd), k_new(n_kv_heads * hd),
        v_new(n_kv_heads * hd);
    for (auto* v : {&q, &k_new, &v_new}) {
      for (float& x : *v) x = normal(rng);
    }
    StagedRowsAttention p;
    std::vector<float> got(n_heads * hd, -1.0f);
    p.q = q.data();
    p.k_rows = k_rows.data();
    p.v_rows = v_rows.data();
    p.head_offsets = offsets.data();
    p.rows = rows;
    p.k_new = k_new.data();
    p.v_new = v_new.data();
    p.out = got.data();
    p.n_heads = n_heads;
    p.n_kv_heads = n_kv_heads;
    p.head_dim = hd;
    p.max_head_rows = 100;
    p.format = format;
    p.scale = 0.125f;
    AttendStagedRowsOnHost(p);
    for (int h = 0; h < n_heads; ++h) {
      const int g = h / 2;
      const int count = offsets[g + 1] - offsets[g];
      std::vector<float> k((count + 1) * hd), v((count + 1) * hd);
      DecodeKvRows(format, k_rows.data() + offsets[g] * width, count, hd,
                   k.data());
      DecodeKvRows(format, v_rows.data() + offsets[g] * width, count, hd,
                   v.data());
      std::copy_n(&k_new[g * hd], hd, &k[count * hd]);
      std::copy_n(&v_new[g * hd], hd, &v[count * hd]);
      std::vector<float> want(hd);
      AttentionParams a;
      a.q = &q[h * hd];
      a.k = k.data();
      a.v = v.data();
      a.out = want.data();
      a.n = 1;
      a.n_heads = 1;
      a.n_kv_heads = 1;
      a.head_dim = hd;
      a.kv_stride = count + 1;
      a.kv_len0 = count + 1;
      a.scale = 0.125f;
      cpu->Attention(a);
      for (int d = 0; d < hd; ++d) {
        ASSERT_NEAR(got[h * hd + d], want[d], 1e-5f * (1 + std::fabs(want[d])))
            << KvRowFormatName(format) << " head " << h << " dim " << d;
      }
      if (count == 0) {
        // The new row alone: its value row, exactly.
        for (int d = 0; d < hd; ++d) EXPECT_EQ(got[h * hd + d], v_new[g * hd + d]);
      }
    }
  }
}

// A row cache's rows: some planned rows in slots (moved there by
// ScatterRows, as a device's misses are), the rest in the staging, read by
// slot, give the staged rows' attention bit for bit.
TEST(AttendStagedRowsOnHost, ReadsARowCachesSlotsAsTheStagedRows) {
  std::mt19937 rng(4);
  std::normal_distribution<float> normal;
  const int n_heads = 4, n_kv_heads = 2, hd = 16;
  const std::vector<int32_t> offsets = {0, 9, 20};
  const int rows = offsets.back();
  std::vector<float> exact(static_cast<size_t>(rows) * hd);
  std::vector<uint16_t> k_rows(exact.size()), v_rows(exact.size());
  for (float& x : exact) x = normal(rng);
  EncodeKvRows(KvRowFormat::kHalf, exact.data(), rows, hd, k_rows.data());
  for (float& x : exact) x = normal(rng);
  EncodeKvRows(KvRowFormat::kHalf, exact.data(), rows, hd, v_rows.data());
  std::vector<float> q(n_heads * hd), k_new(n_kv_heads * hd),
      v_new(n_kv_heads * hd);
  for (auto* v : {&q, &k_new, &v_new}) {
    for (float& x : *v) x = normal(rng);
  }
  StagedRowsAttention p;
  std::vector<float> want(n_heads * hd), got(n_heads * hd, -1.0f);
  p.q = q.data();
  p.k_rows = k_rows.data();
  p.v_rows = v_rows.data();
  p.head_offsets = offsets.data();
  p.rows = rows;
  p.k_new = k_new.data();
  p.v_new = v_new.data();
  p.out = want.data();
  p.n_heads = n_heads;
  p.n_kv_heads = n_kv_heads;
  p.head_dim = hd;
  p.max_head_rows = 11;
  p.format = KvRowFormat::kHalf;
  p.scale = 0.25f;
  AttendStagedRowsOnHost(p);
  // Every third planned row is a miss in a staging of its own; the others
  // sit in slots 40 - r of a slot array; the misses bound for slots go
  // there through ScatterRows, one (the last) is read from the staging.
  const int slot_rows = 48;
  std::vector<uint16_t> slot_k(slot_rows * hd, 0), slot_v(slot_k.size(), 0);
  std::vector<uint16_t> miss_k, miss_v;
  std::vector<int32_t> slots(rows), miss_slots;
  for (int r = 0; r < rows; ++r) {
    const bool miss = r % 3 == 0;
    if (miss) {
      miss_k.insert(miss_k.end(), &k_rows[r * hd], &k_rows[r * hd] + hd);
      miss_v.insert(miss_v.end(), &v_rows[r * hd], &v_rows[r * hd] + hd);
      const bool skipped = r == rows - 2;
      miss_slots.push_back(skipped ? -1 : 40 - r);
      slots[r] = skipped ? -static_cast<int32_t>(miss_slots.size())
                         : 40 - r;
    } else {
      std::copy_n(&k_rows[r * hd], hd, &slot_k[(40 - r) * hd]);
      std::copy_n(&v_rows[r * hd], hd, &slot_v[(40 - r) * hd]);
      slots[r] = 40 - r;
    }
  }
  auto cpu = NewCpuBackend();
  ScatterRowsParams s;
  s.k_rows = miss_k.data();
  s.v_rows = miss_v.data();
  s.slots = miss_slots.data();
  s.n_rows = static_cast<long>(miss_slots.size());
  s.row_width = hd;
  s.slot_k = slot_k.data();
  s.slot_v = slot_v.data();
  s.slot_rows = slot_rows;
  cpu->ScatterRows(s);
  p.k_rows = miss_k.data();
  p.v_rows = miss_v.data();
  p.slots = slots.data();
  p.slot_k = slot_k.data();
  p.slot_v = slot_v.data();
  p.slot_rows = slot_rows;
  p.staged_rows = static_cast<long>(miss_slots.size());
  p.out = got.data();
  AttendStagedRowsOnHost(p);
  EXPECT_EQ(got, want);
  // A slot no miss names is left alone.
  EXPECT_EQ(slot_k[(40 - (rows - 2)) * hd], 0);
}

// LinearBatched is one Linear per batch entry at its strides; partial key
// rows quantized at a stride are the packed rows, placed a stride apart
// (the bytes between them untouched).
TEST(PolicyOps, BatchedProductsAndStridedPartialKeys) {
  std::mt19937 rng(4);
  std::normal_distribution<float> normal;
  auto cpu = NewCpuBackend();
  const int batch = 3, n = 2, in = 16, out = 5;
  const long x_stride = n * in + 3, w_stride = out * in + 7, y_stride = n * out + 2;
  std::vector<float> x(batch * x_stride), w(batch * w_stride);
  for (float& v : x) v = normal(rng);
  for (float& v : w) v = normal(rng);
  std::vector<float> got(batch * y_stride, -7.0f), want(got);
  cpu->LinearBatched(x.data(), x_stride, n, in, w.data(), w_stride, out,
                     got.data(), y_stride, batch);
  for (int b = 0; b < batch; ++b) {
    cpu->Linear(x.data() + b * x_stride, n, in, w.data() + b * w_stride,
                nullptr, out, want.data() + b * y_stride);
  }
  EXPECT_EQ(got, want);  // the padding between entries untouched as well

  const int n_rows = 4, n_cols = 19;
  const size_t row_bytes = speculator::PartialKeyRowBytes(n_cols);
  std::vector<float> keys(n_rows * n_cols);
  for (float& v : keys) v = normal(rng);
  std::vector<uint8_t> packed(n_rows * row_bytes);
  cpu->QuantizePartialKeys(keys.data(), n_rows, n_cols, packed.data(),
                           row_bytes);
  const size_t stride = row_bytes + 11;
  std::vector<uint8_t> strided(n_rows * stride, 0xAB);
  cpu->QuantizePartialKeys(keys.data(), n_rows, n_cols, strided.data(),
                           stride);
  for (int r = 0; r < n_rows; ++r) {
    EXPECT_TRUE(std::equal(packed.begin() + r * row_bytes,
                           packed.begin() + (r + 1) * row_bytes,
                           strided.begin() + r * stride))
        << r;
    for (size_t i = row_bytes; i < stride; ++i) {
      EXPECT_EQ(strided[r * stride + i], 0xAB) << r << " " << i;
    }
  }
}

// Attention against a double-precision reference, with GQA and the
// probabilities H2O accumulates: prefill rows (several queries, a sliding
// window), and a decode step's single query (each KV head's rows read once
// for its group of query heads), with and without a window.
TEST(CpuBackend, AttentionMatchesAReferenceWithWindowsAndGroups) {
  auto cpu = NewCpuBackend();
  constexpr int kHeads = 6, kKvHeads = 2, kDim = 8, kStride = 32;
  constexpr int kLen0 = 20;
  std::mt19937 rng(11);
  std::normal_distribution<float> dist;
  struct Case {
    int n, window;
  };
  for (const Case c : {Case{6, 7}, Case{1, 7}, Case{1, 0}, Case{6, 0}}) {
    SCOPED_TRACE(testing::Message() << c.n << " queries, window " << c.window);
    std::vector<float> q(c.n * kHeads * kDim), k(kKvHeads * kStride * kDim),
        v(kKvHeads * kStride * kDim);
    for (float& x : q) x = dist(rng);
    for (float& x : k) x = dist(rng);
    for (float& x : v) x = dist(rng);
    const int kv_max = kLen0 + c.n - 1;
    std::vector<float> out(q.size()), sums(kHeads * kv_max, 0.0f);
    AttentionParams p;
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.out = out.data();
    p.n = c.n;
    p.n_heads = kHeads;
    p.n_kv_heads = kKvHeads;
    p.head_dim = kDim;
    p.kv_stride = kStride;
    p.kv_len0 = kLen0;
    p.scale = 0.5f;
    p.window = c.window;
    p.prob_sums = sums.data();
    cpu->Attention(p);
    std::vector<float> want_sums(sums.size(), 0.0f);
    for (int i = 0; i < c.n; ++i) {
      const int len = kLen0 + i;
      const int lo = c.window > 0 ? std::max(0, len - c.window) : 0;
      for (int h = 0; h < kHeads; ++h) {
        const int g = h / (kHeads / kKvHeads);
        std::vector<double> w(len - lo);
        double mx = -1e30, z = 0;
        for (int t = lo; t < len; ++t) {
          double s = 0;
          for (int d = 0; d < kDim; ++d) {
            s += q[(i * kHeads + h) * kDim + d] *
                 k[(g * kStride + t) * kDim + d];
          }
          w[t - lo] = s * p.scale;
          mx = std::max(mx, w[t - lo]);
        }
        for (double& x : w) z += (x = std::exp(x - mx));
        for (int d = 0; d < kDim; ++d) {
          double o = 0;
          for (int t = lo; t < len; ++t) {
            o += w[t - lo] / z * v[(g * kStride + t) * kDim + d];
          }
          EXPECT_NEAR(out[(i * kHeads + h) * kDim + d], o, 1e-5) << i << h;
        }
        for (int t = lo; t < len; ++t) {
          want_sums[h * kv_max + t] += w[t - lo] / z;
        }
      }
    }
    for (size_t j = 0; j < sums.size(); ++j) {
      EXPECT_NEAR(sums[j], want_sums[j], 1e-5) << j;
    }
  }
}

TEST(CpuBackend, GeluTanhGateAndScale) {
  auto cpu = NewCpuBackend();
  std::vector<float> gate = {-3.0f, -0.5f, 0.0f, 0.5f, 3.0f};
  const std::vector<float> up = {2.0f, -1.0f, 4.0f, 1.0f, 0.5f};
  std::vector<float> want(gate.size());
  for (size_t i = 0; i < gate.size(); ++i) {
    const double g = gate[i];
    want[i] = 0.5 * g *
              (1 + std::tanh(std::sqrt(2 / M_PI) * (g + 0.044715 * g * g * g))) *
              up[i];
  }
  cpu->GeluTanhGate(gate.data(), up.data(), static_cast<long>(gate.size()));
  for (size_t i = 0; i < gate.size(); ++i) EXPECT_NEAR(gate[i], want[i], 1e-6);
  cpu->Scale(gate.data(), static_cast<long>(gate.size()), 2.0f);
  for (size_t i = 0; i < gate.size(); ++i) {
    EXPECT_NEAR(gate[i], 2 * want[i], 2e-6);
  }
}

// On the CPU a copy is done when CopyFromHost returns, in issue order, so
// marks carry no information (0) and pinning has nothing to do.
TEST(CpuBackend, CopiesFromHostAtOnce) {
  auto cpu = NewCpuBackend();
  std::vector<float> src = {1, 2, 3, 4};
  SharedVector<float> dst(4, 0.0f, SharedAllocator<float>(cpu.get()));
  EXPECT_TRUE(cpu->PinHost(src.data(), 16).ok());
  const Backend::Mark mark = cpu->MarkIssued();
  EXPECT_EQ(mark, 0u);
  cpu->CopyFromHost(dst.data(), src.data(), 3 * sizeof(float), mark);
  src[0] = 9;  // after WaitCopies the source is free again
  EXPECT_TRUE(cpu->WaitCopies().ok());
  EXPECT_EQ(std::vector<float>(dst.begin(), dst.end()),
            (std::vector<float>{1, 2, 3, 0}));
  cpu->UnpinHost(src.data());
  EXPECT_TRUE(cpu->Synchronize().ok());
}

// A wrapper forwards every call: its results are the wrapped backend's,
// and an override changes only what it overrides.
// A chunk's K rows [token][head][dim] into a cache's [head][position][dim]:
// each row lands at its stride, and nothing between rows is touched.
TEST(CpuBackend, CopiesStridedRows) {
  auto cpu = NewCpuBackend();
  const int tokens = 5, heads = 3, dim = 4;
  std::vector<float> chunk(tokens * heads * dim);
  for (size_t i = 0; i < chunk.size(); ++i) chunk[i] = static_cast<float>(i);
  const int max_seq = 8;
  std::vector<float> cache(heads * max_seq * dim, -1.0f);
  for (int g = 0; g < heads; ++g) {
    cpu->CopyRows(cache.data() + (g * max_seq + 2) * dim, dim,
                  chunk.data() + g * dim, heads * dim, tokens, dim);
  }
  for (int g = 0; g < heads; ++g) {
    for (int p = 0; p < max_seq; ++p) {
      for (int d = 0; d < dim; ++d) {
        const float got = cache[(g * max_seq + p) * dim + d];
        const int t = p - 2;
        const float want =
            t >= 0 && t < tokens ? chunk[(t * heads + g) * dim + d] : -1.0f;
        ASSERT_EQ(got, want) << g << " " << p << " " << d;
      }
    }
  }
}

TEST(BackendWrapper, ForwardsEveryCallButTheOverridden) {
  class CountingLinear final : public BackendWrapper {
   public:
    CountingLinear() : BackendWrapper(NewCpuBackend()) {}
    void Linear(const float* x, int n, int in, const float* w, const float* b,
                int out, float* y) override {
      ++linears;
      BackendWrapper::Linear(x, n, in, w, b, out, y);
    }
    int linears = 0;
  };
  CountingLinear wrapped;
  auto cpu = NewCpuBackend();
  EXPECT_EQ(wrapped.name(), cpu->name());
  EXPECT_EQ(wrapped.OperatesOnHostMemory(), cpu->OperatesOnHostMemory());
  const std::vector<float> x = {1, 2, 3, 4, 5, 6};  // [2, 3]
  const std::vector<float> w = {1, 0, -1, 2, 2, 2};  // [2, 3]
  const std::vector<float> bias = {0.5f, -0.5f};
  std::vector<float> want(4), got(4);
  cpu->Linear(x.data(), 2, 3, w.data(), bias.data(), 2, want.data());
  wrapped.Linear(x.data(), 2, 3, w.data(), bias.data(), 2, got.data());
  EXPECT_EQ(got, want);
  EXPECT_EQ(wrapped.linears, 1);
  std::vector<float> y = {1, -2, 3};
  wrapped.Relu(y.data(), 3);
  EXPECT_EQ(y, (std::vector<float>{1, 0, 3}));
  void* p = wrapped.AllocateDevice(64);
  ASSERT_NE(p, nullptr);
  wrapped.FreeDevice(p);
  EXPECT_TRUE(wrapped.Synchronize().ok());
}

}  // namespace
}  // namespace infinigen::gpu_worker
