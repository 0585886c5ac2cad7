#include "speculator/speculator.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <new>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "speculator/partial_keys.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

// Counts heap allocations so the tests can check the "no allocation once
// grown" contract of the per-step functions directly. Out of line, so that
// GCC does not pair an inlined free() with operator new and warn.
namespace {
std::atomic<int64_t> g_allocations{0};
}  // namespace

[[gnu::noinline]] void* operator new(size_t size) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, size_t) noexcept {
  std::free(p);
}

namespace infinigen::speculator {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

std::vector<float> RandomMatrix(int rows, int cols, std::mt19937& rng,
                                float stddev = 1.0f) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> m(static_cast<size_t>(rows) * cols);
  for (float& x : m) x = dist(rng);
  return m;
}

// [rows, cols] row-major with orthonormal columns (rows >= cols), by
// modified Gram-Schmidt in double on a random matrix: independent of LAPACK.
std::vector<double> OrthonormalColumns(int rows, int cols, std::mt19937& rng) {
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<double> m(static_cast<size_t>(rows) * cols);
  for (double& x : m) x = dist(rng);
  for (int c = 0; c < cols; ++c) {
    for (int p = 0; p < c; ++p) {
      double dot = 0;
      for (int r = 0; r < rows; ++r) dot += m[r * cols + c] * m[r * cols + p];
      for (int r = 0; r < rows; ++r) m[r * cols + c] -= dot * m[r * cols + p];
    }
    double norm = 0;
    for (int r = 0; r < rows; ++r) norm += m[r * cols + c] * m[r * cols + c];
    norm = std::sqrt(norm);
    for (int r = 0; r < rows; ++r) m[r * cols + c] /= norm;
  }
  return m;
}

// [rows, d] = U diag(s) V^T with U [rows, d] and V [d, d] orthonormal columns.
std::vector<float> WithSpectrum(const std::vector<double>& u,
                                const std::vector<double>& s,
                                const std::vector<double>& v, int rows, int d) {
  std::vector<float> m(static_cast<size_t>(rows) * d);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < d; ++c) {
      double acc = 0;
      for (int i = 0; i < d; ++i) acc += u[r * d + i] * s[i] * v[c * d + i];
      m[r * d + c] = static_cast<float>(acc);
    }
  }
  return m;
}

// ---------------------------------------------------------------------------
// ComputeSkew / ApplySkew

TEST(ComputeSkew, IsOrthogonal) {
  std::mt19937 rng(1);
  const int d = 16;
  std::vector<float> q = RandomMatrix(200, d, rng);
  std::vector<float> k = RandomMatrix(150, d, rng);
  absl::StatusOr<std::vector<float>> a =
      ComputeSkew(q.data(), 200, k.data(), 150, d);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->size(), d * d);
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) {
      double aat = 0, ata = 0;
      for (int m = 0; m < d; ++m) {
        aat += (*a)[i * d + m] * (*a)[j * d + m];
        ata += (*a)[m * d + i] * (*a)[m * d + j];
      }
      EXPECT_NEAR(aat, i == j ? 1.0 : 0.0, 1e-4) << i << "," << j;
      EXPECT_NEAR(ata, i == j ? 1.0 : 0.0, 1e-4) << i << "," << j;
    }
  }
}

TEST(ComputeSkew, PreservesDotProducts) {
  std::mt19937 rng(2);
  const int d = 32;
  std::vector<float> calib_q = RandomMatrix(96, d, rng, 3.0f);
  std::vector<float> calib_k = RandomMatrix(64, d, rng, 0.5f);
  absl::StatusOr<std::vector<float>> a =
      ComputeSkew(calib_q.data(), 96, calib_k.data(), 64, d);
  ASSERT_TRUE(a.ok()) << a.status();
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> q = RandomMatrix(1, d, rng);
    std::vector<float> k = RandomMatrix(1, d, rng);
    std::vector<float> qa(d), ka(d);
    ApplySkew(q.data(), 1, a->data(), d, qa.data());
    ApplySkew(k.data(), 1, a->data(), d, ka.data());
    double exact = 0, skewed = 0, scale = 0;
    for (int c = 0; c < d; ++c) {
      exact += q[c] * k[c];
      skewed += qa[c] * ka[c];
      scale += std::fabs(q[c] * k[c]);
    }
    EXPECT_NEAR(skewed, exact, 1e-5 * scale + 1e-6);
  }
}

// q and k are built with known singular vectors and values; the values are
// attached to V's columns out of order, so A's column order is a real check.
TEST(ComputeSkew, ColumnsAreQuerySingularVectorsByDescendingProduct) {
  std::mt19937 rng(3);
  const int d = 8, q_rows = 40, k_rows = 30;
  std::vector<double> v = OrthonormalColumns(d, d, rng);
  std::vector<double> s_q = {3.0, 9.0, 1.0, 6.0, 0.5, 12.0, 2.0, 4.5};
  std::vector<float> q =
      WithSpectrum(OrthonormalColumns(q_rows, d, rng), s_q, v, q_rows, d);
  std::vector<double> s_k = {8, 7, 6, 5, 4, 3, 2, 1};
  std::vector<float> k = WithSpectrum(OrthonormalColumns(k_rows, d, rng), s_k,
                                      OrthonormalColumns(d, d, rng), k_rows, d);

  absl::StatusOr<std::vector<float>> a =
      ComputeSkew(q.data(), q_rows, k.data(), k_rows, d);
  ASSERT_TRUE(a.ok()) << a.status();

  // Both spectra as LAPACK sees them are descending, so the product order
  // is q's descending order: V columns 5 (12), 1 (9), 3 (6), 7 (4.5), ...
  std::vector<int> expected(d);
  std::iota(expected.begin(), expected.end(), 0);
  std::sort(expected.begin(), expected.end(),
            [&](int i, int j) { return s_q[i] > s_q[j]; });
  ASSERT_THAT(expected, ElementsAre(5, 1, 3, 7, 0, 6, 2, 4));
  for (int c = 0; c < d; ++c) {
    double dot = 0;
    for (int r = 0; r < d; ++r) dot += (*a)[r * d + c] * v[r * d + expected[c]];
    EXPECT_NEAR(std::fabs(dot), 1.0, 1e-4) << "column " << c;
  }
}

TEST(ComputeSkew, ConcentratesEnergyOfLowRankQueries) {
  std::mt19937 rng(4);
  const int d = 32, rows = 256, rank = 3;
  // Low rank plus a little noise, as real queries are.
  std::vector<float> basis = RandomMatrix(rank, d, rng);
  std::vector<float> coeffs = RandomMatrix(rows, rank, rng, 4.0f);
  std::vector<float> q = RandomMatrix(rows, d, rng, 0.05f);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < rank; ++i) {
      for (int c = 0; c < d; ++c)
        q[r * d + c] += coeffs[r * rank + i] * basis[i * d + c];
    }
  }
  std::vector<float> k = RandomMatrix(rows, d, rng);
  absl::StatusOr<std::vector<float>> a =
      ComputeSkew(q.data(), rows, k.data(), rows, d);
  ASSERT_TRUE(a.ok()) << a.status();

  std::vector<float> skewed(q.size());
  ApplySkew(q.data(), rows, a->data(), d, skewed.data());
  auto energy_of_first = [&](const std::vector<float>& m, int n) {
    double head = 0, total = 0;
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < d; ++c) {
        const double e = double{m[r * d + c]} * m[r * d + c];
        total += e;
        if (c < n) head += e;
      }
    }
    return head / total;
  };
  EXPECT_GT(energy_of_first(skewed, rank), 0.99);
  // Unskewed, the first columns hold only about their share.
  EXPECT_LT(energy_of_first(q, rank), 0.5);
  // Skewing is a rotation: total energy is unchanged.
  double before = 0, after = 0;
  for (size_t i = 0; i < q.size(); ++i) {
    before += double{q[i]} * q[i];
    after += double{skewed[i]} * skewed[i];
  }
  EXPECT_NEAR(after, before, 1e-4 * before);
}

TEST(ComputeSkew, RejectsTooFewRows) {
  std::mt19937 rng(5);
  const int d = 16;
  std::vector<float> m = RandomMatrix(d, d, rng);
  EXPECT_EQ(ComputeSkew(m.data(), d - 1, m.data(), d, d).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeSkew(m.data(), d, m.data(), d - 1, d).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeSkew(m.data(), d, m.data(), d, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Exactly d rows is enough.
  EXPECT_TRUE(ComputeSkew(m.data(), d, m.data(), d, d).ok());
}

TEST(ApplySkew, MatchesNaiveProduct) {
  std::mt19937 rng(6);
  const int n = 7, d = 12;
  std::vector<float> x = RandomMatrix(n, d, rng);
  std::vector<float> a = RandomMatrix(d, d, rng);
  std::vector<float> y(n * d, -1.0f);
  ApplySkew(x.data(), n, a.data(), d, y.data());
  for (int r = 0; r < n; ++r) {
    for (int c = 0; c < d; ++c) {
      double acc = 0;
      for (int i = 0; i < d; ++i) acc += x[r * d + i] * a[i * d + c];
      EXPECT_NEAR(y[r * d + c], acc, 1e-4) << r << "," << c;
    }
  }
}

TEST(AddSkewedColumnSums, AddsEachTokensSkewedMagnitudesToItsKvHead) {
  // GQA: 4 query heads over 2 KV heads, 300 tokens (a 256-token block and
  // a tail), added to sums that already hold a value.
  std::mt19937 rng(8);
  const int n = 300, heads = 4, per_kv = 2, d = 16, groups = heads / per_kv;
  std::vector<float> x = RandomMatrix(n * heads, d, rng);
  std::vector<float> a = RandomMatrix(groups * d, d, rng);  // [g][d][d]
  std::vector<float> a_t(a.size());
  for (int g = 0; g < groups; ++g) {
    for (int r = 0; r < d; ++r) {
      for (int c = 0; c < d; ++c) {
        a_t[(g * d + c) * d + r] = a[(g * d + r) * d + c];
      }
    }
  }
  std::vector<float> sums(groups * d, 0.5f);
  AddSkewedColumnSums(x.data(), n, heads, per_kv, d, a_t.data(), sums.data());
  // The same sums through ApplySkew with A itself, block by block: bit for
  // bit.
  std::vector<float> expect(groups * d, 0.5f);
  std::vector<float> y(256 * heads * d);
  for (int i0 = 0; i0 < n; i0 += 256) {
    const int bn = std::min(256, n - i0);
    for (int h = 0; h < heads; ++h) {
      ApplySkew(x.data() + (i0 * heads + h) * d, bn, heads * d,
                a.data() + (h / per_kv) * d * d, d, y.data() + h * d,
                heads * d);
    }
    for (int i = 0; i < bn; ++i) {
      for (int h = 0; h < heads; ++h) {
        for (int c = 0; c < d; ++c) {
          expect[(h / per_kv) * d + c] += std::fabs(y[(i * heads + h) * d + c]);
        }
      }
    }
  }
  EXPECT_EQ(sums, expect);
  // And the naive product's magnitudes, within float rounding.
  for (int g = 0; g < groups; ++g) {
    for (int c = 0; c < d; ++c) {
      double acc = 0.5;
      for (int t = 0; t < n; ++t) {
        for (int h = g * per_kv; h < (g + 1) * per_kv; ++h) {
          double v = 0;
          for (int j = 0; j < d; ++j) {
            v += x[(t * heads + h) * d + j] * a[(g * d + j) * d + c];
          }
          acc += std::fabs(v);
        }
      }
      EXPECT_NEAR(sums[g * d + c], acc, 1e-3 * acc) << g << "," << c;
    }
  }
  // No tokens: nothing added.
  const std::vector<float> before = sums;
  AddSkewedColumnSums(x.data(), 0, heads, per_kv, d, a_t.data(), sums.data());
  EXPECT_EQ(sums, before);
}

TEST(ApplySkew, StridedRowsMatchRowByRow) {
  // One head's rows of a [tokens, heads, d] array, written into the same
  // head's rows of another: the other heads' values stay untouched.
  std::mt19937 rng(7);
  const int n = 9, heads = 3, d = 8, h = 1;
  std::vector<float> x = RandomMatrix(n * heads, d, rng);
  std::vector<float> a = RandomMatrix(d, d, rng);
  std::vector<float> y(x.size(), -1.0f);
  ApplySkew(x.data() + h * d, n, heads * d, a.data(), d, y.data() + h * d,
            heads * d);
  std::vector<float> row(d);
  for (int t = 0; t < n; ++t) {
    for (int head = 0; head < heads; ++head) {
      const size_t at = (static_cast<size_t>(t) * heads + head) * d;
      if (head != h) {
        for (int c = 0; c < d; ++c) EXPECT_EQ(y[at + c], -1.0f);
        continue;
      }
      ApplySkew(x.data() + at, 1, a.data(), d, row.data());
      for (int c = 0; c < d; ++c) {
        EXPECT_NEAR(y[at + c], row[c], 1e-5) << t << "," << c;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// SkewMatrices

TEST(SkewMatrices, Identity) {
  SkewMatrices m = SkewMatrices::Identity(2, 3, 4);
  EXPECT_EQ(m.n_layers, 2);
  EXPECT_EQ(m.n_kv_heads, 3);
  EXPECT_EQ(m.head_dim, 4);
  ASSERT_EQ(m.a.size(), 2 * 3 * 4 * 4);
  for (int l = 0; l < 2; ++l) {
    for (int g = 0; g < 3; ++g) {
      const float* a = m.at(l, g);
      for (int i = 0; i < 4; ++i) {
        for (int j = 0; j < 4; ++j)
          EXPECT_EQ(a[i * 4 + j], i == j ? 1.0f : 0.0f);
      }
    }
  }
  EXPECT_TRUE(m.CheckShape(2, 3, 4).ok());
}

TEST(SkewMatrices, AtAddressesLayerAndHead) {
  SkewMatrices m = SkewMatrices::Identity(3, 2, 4);
  EXPECT_EQ(m.at(0, 0), m.a.data());
  EXPECT_EQ(m.at(1, 1), m.a.data() + (1 * 2 + 1) * 16);
  EXPECT_EQ(m.at(2, 0), m.a.data() + (2 * 2 + 0) * 16);
}

TEST(SkewMatrices, SaveLoadRoundTripIsBitExact) {
  std::mt19937 rng(7);
  SkewMatrices m;
  m.n_layers = 3;
  m.n_kv_heads = 2;
  m.head_dim = 5;
  m.a = RandomMatrix(3 * 2, 5 * 5, rng);
  m.a[0] = -0.0f;
  m.a[1] = std::numeric_limits<float>::denorm_min();
  const std::string path = TempPath("skew_roundtrip.bin");
  ASSERT_TRUE(m.Save(path).ok());
  absl::StatusOr<SkewMatrices> loaded = SkewMatrices::Load(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->n_layers, 3);
  EXPECT_EQ(loaded->n_kv_heads, 2);
  EXPECT_EQ(loaded->head_dim, 5);
  ASSERT_EQ(loaded->a.size(), m.a.size());
  EXPECT_EQ(std::memcmp(loaded->a.data(), m.a.data(), m.a.size() * 4), 0);

  // The format is the documented one: magic, three int32, the floats.
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)),
                    std::istreambuf_iterator<char>());
  ASSERT_EQ(bytes.size(), 8 + 12 + m.a.size() * 4);
  EXPECT_EQ(bytes.substr(0, 8), "IGSKEW01");
  int32_t dims[3];
  std::memcpy(dims, bytes.data() + 8, 12);
  EXPECT_THAT(dims, ElementsAre(3, 2, 5));

  // Saving again overwrites.
  SkewMatrices id = SkewMatrices::Identity(1, 1, 2);
  ASSERT_TRUE(id.Save(path).ok());
  loaded = SkewMatrices::Load(path);
  ASSERT_TRUE(loaded.ok());
  EXPECT_THAT(loaded->a, ElementsAre(1, 0, 0, 1));
}

TEST(SkewMatrices, SaveRejectsInconsistentSizeAndReportsIoErrors) {
  SkewMatrices m = SkewMatrices::Identity(1, 2, 4);
  m.a.pop_back();
  EXPECT_EQ(m.Save(TempPath("skew_bad.bin")).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SkewMatrices::Identity(1, 1, 2)
                .Save(TempPath("no/such/dir/skew.bin"))
                .code(),
            absl::StatusCode::kInternal);
}

TEST(SkewMatrices, CheckShapeMismatch) {
  SkewMatrices m = SkewMatrices::Identity(2, 3, 4);
  EXPECT_TRUE(m.CheckShape(2, 3, 4).ok());
  for (absl::Status s :
       {m.CheckShape(1, 3, 4), m.CheckShape(2, 1, 4), m.CheckShape(2, 3, 8)}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  }
  m.a.resize(5);
  EXPECT_EQ(m.CheckShape(2, 3, 4).code(), absl::StatusCode::kInvalidArgument);
}

TEST(SkewMatrices, LoadMissingFileIsNotFound) {
  absl::StatusOr<SkewMatrices> m =
      SkewMatrices::Load(TempPath("does_not_exist.bin"));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
}

// A profile for Identity-shaped skews: n_layers x n_kv_heads, a 3-point
// grid, errors counting up.
HeadProfile SmallProfile(int n_layers, int n_kv_heads) {
  HeadProfile p;
  p.n_layers = n_layers;
  p.n_kv_heads = n_kv_heads;
  p.fractions = {0.1f, 0.5f, 1.0f};
  p.partial_ratio = 0.25f;
  for (int i = 0; i < n_layers * n_kv_heads * 3; ++i) {
    p.error.push_back(static_cast<float>(i));
    p.speculated_error.push_back(static_cast<float>(2 * i));
  }
  return p;
}

TEST(SkewMatrices, TheHeadProfileRoundTripsAndOldFilesHaveNone) {
  const std::string path = TempPath("skew_profile.bin");
  SkewMatrices m = SkewMatrices::Identity(2, 3, 4);
  m.profile = SmallProfile(2, 3);
  ASSERT_TRUE(m.Save(path).ok());
  absl::StatusOr<SkewMatrices> loaded = SkewMatrices::Load(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->a, m.a);
  EXPECT_EQ(loaded->profile.n_layers, 2);
  EXPECT_EQ(loaded->profile.n_kv_heads, 3);
  EXPECT_EQ(loaded->profile.fractions, m.profile.fractions);
  EXPECT_EQ(loaded->profile.error, m.profile.error);
  EXPECT_EQ(loaded->profile.speculated_error, m.profile.speculated_error);
  EXPECT_EQ(loaded->profile.partial_ratio, 0.25f);
  EXPECT_EQ(loaded->profile.at(1, 2)[0], 15.0f);

  // Without a profile the file is the old format, and loads with none.
  ASSERT_TRUE(SkewMatrices::Identity(2, 3, 4).Save(path).ok());
  loaded = SkewMatrices::Load(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(loaded->profile.empty());
  std::remove(path.c_str());

  // A profile of another shape is not saved.
  m.profile = SmallProfile(1, 3);
  EXPECT_EQ(m.Save(path).code(), absl::StatusCode::kInvalidArgument);
}

class SkewLoadCorruption : public ::testing::Test {
 protected:
  // Writes a valid file for Identity(2, 1, 3), then returns its bytes.
  std::string ValidBytes() {
    const std::string path = TempPath("skew_valid.bin");
    EXPECT_TRUE(SkewMatrices::Identity(2, 1, 3).Save(path).ok());
    std::ifstream in(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)),
                       std::istreambuf_iterator<char>());
  }
  void ExpectInvalid(const std::string& name, const std::string& bytes) {
    const std::string path = TempPath(name);
    std::ofstream(path, std::ios::binary) << bytes;
    absl::StatusOr<SkewMatrices> m = SkewMatrices::Load(path);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(std::string(m.status().message()), HasSubstr(path));
  }
};

TEST_F(SkewLoadCorruption, BadMagic) {
  std::string bytes = ValidBytes();
  bytes[6] = '9';
  ExpectInvalid("skew_magic.bin", bytes);
}

TEST_F(SkewLoadCorruption, EmptyAndShortHeader) {
  ExpectInvalid("skew_empty.bin", "");
  ExpectInvalid("skew_short.bin", ValidBytes().substr(0, 12));
}

TEST_F(SkewLoadCorruption, Truncated) {
  std::string bytes = ValidBytes();
  ExpectInvalid("skew_truncated.bin", bytes.substr(0, bytes.size() - 3));
}

TEST_F(SkewLoadCorruption, TrailingBytes) {
  ExpectInvalid("skew_trailing.bin", ValidBytes() + "x");
}

TEST_F(SkewLoadCorruption, NegativeOrHugeDimensions) {
  std::string bytes = ValidBytes();
  int32_t neg = -2;
  std::memcpy(&bytes[8], &neg, 4);
  ExpectInvalid("skew_negative.bin", bytes);
  // Dimensions whose product would overflow 64 bits must not pass.
  bytes = ValidBytes();
  int32_t huge[3] = {1 << 30, 1 << 30, 1 << 30};
  std::memcpy(&bytes[8], huge, 12);
  ExpectInvalid("skew_huge.bin", bytes);
}

TEST_F(SkewLoadCorruption, BadProfileSections) {
  const std::string path = TempPath("skew_profile_valid.bin");
  SkewMatrices m = SkewMatrices::Identity(2, 1, 3);
  m.profile = SmallProfile(2, 1);
  ASSERT_TRUE(m.Save(path).ok());
  std::ifstream in(path, std::ios::binary);
  const std::string valid((std::istreambuf_iterator<char>(in)),
                          std::istreambuf_iterator<char>());
  std::remove(path.c_str());
  const size_t section = 8 + 12 + 2 * 9 * 4;
  ASSERT_EQ(valid.substr(section, 8), "IGPROF01");
  ExpectInvalid("skew_profile_truncated.bin",
                valid.substr(0, valid.size() - 4));
  ExpectInvalid("skew_profile_trailing.bin", valid + "x");
  ExpectInvalid("skew_profile_header.bin", valid.substr(0, section + 10));
  std::string bytes = valid;
  int32_t layers = 3;  // not the skew's 2
  std::memcpy(&bytes[section + 8], &layers, 4);
  ExpectInvalid("skew_profile_layers.bin", bytes);
  bytes = valid;
  const float descending = 0.7f;  // fractions 0.7, 0.7, 1: not ascending
  std::memcpy(&bytes[section + 24], &descending, 4);
  std::memcpy(&bytes[section + 28], &descending, 4);
  ExpectInvalid("skew_profile_order.bin", bytes);
}

// ---------------------------------------------------------------------------
// Head profiles and budgets

TEST(ProfileLayer, ErrorFallsToZeroAndSpreadHeadsLoseMore) {
  // Two KV heads, one query head each, d = 2, 40 tokens. Head 0's query
  // points at token 3's key only (the others are orthogonal to it); head
  // 1's query is orthogonal to every key, so it attends uniformly over
  // values that differ: reading part of them moves its output.
  const int n = 40, d = 2, dim = 2;
  std::vector<float> q(n * 2 * d, 0.0f), k(n * 2 * d, 0.0f),
      v(n * 2 * d, 0.0f);
  for (int t = 0; t < n; ++t) {
    q[(t * 2 + 0) * d + 0] = 40.0f;
    k[(t * 2 + 0) * d + 1] = 1.0f;
    if (t == 3) k[(t * 2 + 0) * d + 0] = 1.0f;
    v[(t * 2 + 0) * d + 0] = static_cast<float>(t % 5);
    k[(t * 2 + 1) * d + 0] = 1.0f;
    q[(t * 2 + 1) * d + 1] = 1.0f;
    v[(t * 2 + 1) * d + 0] = static_cast<float>(t % 7);
    v[(t * 2 + 1) * d + 1] = static_cast<float>(t % 3);
  }
  // W_o = identity for both heads: [dim][2 * d].
  std::vector<float> wo(dim * 2 * d, 0.0f);
  wo[0 * 4 + 0] = wo[1 * 4 + 1] = 1.0f;
  wo[0 * 4 + 2] = wo[1 * 4 + 3] = 1.0f;
  const std::vector<float> fractions = {0.05f, 0.25f, 0.5f, 1.0f};
  std::vector<float> error(2 * fractions.size(), -1.0f);
  ProfileLayer(q.data(), k.data(), v.data(), nullptr, nullptr, nullptr, n, 2,
               2, d, wo.data(), dim, fractions, 20, 4, error.data(),
               nullptr);
  // Head 0 reads the key that matters at every fraction: no error.
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(error[i], 0.0f, 1e-6f) << i;
  // Head 1 loses less as it reads more, and nothing at 1.
  EXPECT_GT(error[4], 0.1f);
  EXPECT_NEAR(error[7], 0.0f, 1e-9f);
  EXPECT_GE(error[4], error[5]);
  EXPECT_GE(error[5], error[6]);
  EXPECT_GT(error[4], error[0] + 0.1f);
}

HeadProfile Curves(std::vector<std::vector<float>> curves, int n_kv_heads,
                   std::vector<float> fractions) {
  HeadProfile p;
  p.n_kv_heads = n_kv_heads;
  p.n_layers = static_cast<int>(curves.size()) / n_kv_heads;
  p.fractions = std::move(fractions);
  for (const auto& c : curves) p.error.insert(p.error.end(), c.begin(), c.end());
  return p;
}

TEST(AllocateBudgets, KeepsTheMeanAndGivesTheBudgetWhereErrorFalls) {
  // Layer 0 reads everything; in layer 1 head 0 loses nothing at any
  // fraction, head 1 loses a lot until it reads half its tokens.
  const HeadProfile p = Curves({{5, 5, 0}, {5, 5, 0},
                                {0, 0, 0}, {8, 4, 0}},
                               2, {0.1f, 0.5f, 1.0f});
  std::vector<float> b = AllocateBudgets(p, p.error, 0.2f, 1, 0.0f);
  ASSERT_EQ(b.size(), 4u);
  EXPECT_EQ(b[0], 1.0f);
  EXPECT_EQ(b[1], 1.0f);
  // Head 0 keeps nothing above the floor (0 here); head 1 takes the rest.
  EXPECT_NEAR(b[2], 0.0f, 1e-6f);
  EXPECT_NEAR(b[3], 0.4f, 1e-6f);
  // A floor of 0.5 of the mean keeps 0.1 for head 0.
  b = AllocateBudgets(p, p.error, 0.2f, 1, 0.1f);
  EXPECT_NEAR(b[2], 0.1f, 1e-6f);
  EXPECT_NEAR(b[3], 0.3f, 1e-6f);
  // Equal curves share equally; a mean of 1 reads everything.
  const HeadProfile same = Curves({{4, 2, 0}, {4, 2, 0}}, 2,
                                  {0.1f, 0.5f, 1.0f});
  b = AllocateBudgets(same, same.error, 0.3f, 0, 0.0f);
  EXPECT_NEAR(b[0] + b[1], 0.6f, 1e-6f);
  b = AllocateBudgets(same, same.error, 1.0f, 0, 0.0f);
  EXPECT_NEAR(b[0], 1.0f, 1e-6f);
  EXPECT_NEAR(b[1], 1.0f, 1e-6f);
}

TEST(AllocateBudgets, ANonConvexCurveIsJudgedByItsHull) {
  // Head 0 gains nothing until 0.5, then all of its 10: by its hull it is
  // worth 20 per unit of fraction from the start, more than head 1's 4, so
  // it takes the budget although its first step alone gains nothing.
  const HeadProfile p = Curves({{10, 10, 0, 0}, {3, 2, 1, 0}}, 2,
                               {0.1f, 0.3f, 0.5f, 1.0f});
  const std::vector<float> b = AllocateBudgets(p, p.error, 0.3f, 0, 0.0f);
  EXPECT_NEAR(b[0], 0.5f, 1e-6f);
  EXPECT_NEAR(b[1], 0.1f, 1e-6f);
}

TEST(SelectTopKPerHead, EachHeadTakesItsOwnK) {
  const int n = 6;
  const std::vector<float> scores = {1, 6, 2, 5, 3, 4,   // head 0
                                     9, 1, 1, 1, 1, 8};  // head 1
  std::vector<int32_t> indices, offsets;
  const int k[2] = {3, 1};
  EXPECT_EQ(SelectTopKPerHead(scores.data(), 2, n, nullptr, k, indices,
                              offsets),
            4);
  EXPECT_THAT(offsets, ElementsAre(0, 3, 4));
  EXPECT_THAT(indices, ElementsAre(1, 3, 5, 0));
  // Evicted tokens are skipped; k is clamped to what is present.
  std::vector<uint8_t> present(2 * n, 1);
  present[1] = 0;
  for (int t = 1; t < n; ++t) present[n + t] = 0;
  const int big[2] = {2, 4};
  EXPECT_EQ(SelectTopKPerHead(scores.data(), 2, n, present.data(), big,
                              indices, offsets),
            3);
  EXPECT_THAT(offsets, ElementsAre(0, 2, 3));
  EXPECT_THAT(indices, ElementsAre(3, 5, 0));
}

// Each head's k highest present scores (NaN below every number, ties to
// the lower position), ascending positions.
std::vector<int32_t> NaiveTopK(const float* s, const uint8_t* present, int n,
                               int k) {
  std::vector<int32_t> order;
  for (int t = 0; t < n; ++t) {
    if (present == nullptr || present[t]) order.push_back(t);
  }
  auto key = [s](int32_t t) {
    return std::isnan(s[t]) ? -std::numeric_limits<double>::infinity()
                            : static_cast<double>(s[t]);
  };
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    if (std::isnan(s[a]) != std::isnan(s[b])) return !std::isnan(s[a]);
    return key(a) > key(b);
  });
  order.resize(std::min<size_t>(order.size(), k));
  std::sort(order.begin(), order.end());
  return order;
}

TEST(SelectTopKPerHead, MatchesNaiveOnLongCaches) {
  // Caches long enough for the binned floor: spread, tied, clustered and
  // constant scores, with NaN, infinities and evicted tokens, k from one
  // token to a third of them.
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(-10.0f, 3.0f);
  std::uniform_int_distribution<int> coin(0, 19);
  for (int trial = 0; trial < 24; ++trial) {
    const int n_heads = 2, n = trial % 2 == 0 ? 4096 : 9001 + trial;
    std::vector<float> scores(static_cast<size_t>(n_heads) * n);
    for (float& v : scores) v = normal(rng);
    switch (trial % 6) {
      case 1:  // ties everywhere
        for (float& v : scores) v = std::round(v);
        break;
      case 2:  // one far outlier: most scores share a bin
        scores[17] = 1e6f;
        break;
      case 3:  // non-finite scores
        for (int i = 0; i < 40; ++i) {
          scores[coin(rng) * 97 % scores.size()] =
              i % 3 == 0   ? std::numeric_limits<float>::quiet_NaN()
              : i % 3 == 1 ? -std::numeric_limits<float>::infinity()
                           : std::numeric_limits<float>::infinity();
        }
        break;
      case 4:  // constant
        std::fill(scores.begin(), scores.end(), -3.0f);
        break;
      default:
        break;
    }
    std::vector<uint8_t> present(scores.size(), 1);
    const bool masked = trial % 4 >= 2;
    if (masked) {
      for (uint8_t& p : present) p = coin(rng) != 0;
    }
    const int ks[] = {1, 7, n / 10, n / 3};
    const int k[2] = {ks[trial % 4], ks[(trial + 2) % 4]};
    std::vector<int32_t> indices, offsets;
    SelectTopKPerHead(scores.data(), n_heads, n,
                      masked ? present.data() : nullptr, k, indices, offsets);
    ASSERT_EQ(offsets.size(), n_heads + 1);
    for (int g = 0; g < n_heads; ++g) {
      const std::vector<int32_t> got(indices.begin() + offsets[g],
                                     indices.begin() + offsets[g + 1]);
      EXPECT_EQ(got, NaiveTopK(scores.data() + static_cast<size_t>(g) * n,
                               masked ? present.data() + static_cast<size_t>(g) * n
                                      : nullptr,
                               n, k[g]))
          << "trial " << trial << " head " << g;
    }
  }
}

// A runner that takes the tasks in reverse order, each on its own thread.
TaskRunner ReverseThreads() {
  return [](int n, absl::FunctionRef<void(int)> fn) {
    std::vector<std::thread> pool;
    for (int i = n - 1; i >= 0; --i) pool.emplace_back([&fn, i] { fn(i); });
    for (std::thread& t : pool) t.join();
  };
}

TEST(TaskRunner, HostTasksRunEveryTaskOnceAboveTheThreshold) {
  EXPECT_EQ(HostTasks((size_t{1} << 16) - 1), nullptr);
  const TaskRunner* run = HostTasks(size_t{1} << 16);
  ASSERT_NE(run, nullptr);
  EXPECT_EQ(run, HostTasks(size_t{1} << 20));  // one pool for the process
  std::vector<std::atomic<int>> calls(37);
  (*run)(static_cast<int>(calls.size()), [&](int i) { ++calls[i]; });
  for (size_t i = 0; i < calls.size(); ++i) EXPECT_EQ(calls[i], 1) << i;
}

TEST(TaskRunner, HeadsOnSeveralThreadsGiveTheSerialResults) {
  const TaskRunner threads = ReverseThreads();
  std::mt19937 rng(22);
  std::uniform_int_distribution<int> coin(0, 9);
  const int n_heads = 8, n_kv = 4, n = 5000;
  std::vector<float> head_scores = RandomMatrix(n_heads, n, rng, 3.0f);
  std::vector<uint8_t> present(static_cast<size_t>(n_kv) * n);
  for (uint8_t& p : present) p = coin(rng) != 0;
  std::vector<float> serial(static_cast<size_t>(n_kv) * n),
      parallel(serial.size());
  CombineHeadScores(head_scores.data(), n_heads, n_kv, n, present.data(),
                    serial.data());
  CombineHeadScores(head_scores.data(), n_heads, n_kv, n, present.data(),
                    parallel.data(), &threads);
  EXPECT_EQ(serial, parallel);

  std::vector<int32_t> a, a_off, b, b_off;
  SelectionOptions options;
  options.alpha = 2.0f;
  options.max_fraction = 0.1f;
  EXPECT_EQ(SelectTokens(serial.data(), n_kv, n, present.data(), options, a,
                         a_off),
            SelectTokens(serial.data(), n_kv, n, present.data(), options, b,
                         b_off, &threads));
  EXPECT_EQ(a, b);
  EXPECT_EQ(a_off, b_off);

  const int k[n_kv] = {1, 50, 0, 700};
  EXPECT_EQ(SelectTopKPerHead(serial.data(), n_kv, n, present.data(), k, a,
                              a_off),
            SelectTopKPerHead(serial.data(), n_kv, n, present.data(), k, b,
                              b_off, &threads));
  EXPECT_EQ(a, b);
  EXPECT_EQ(a_off, b_off);
  EXPECT_EQ(a_off.back(), 751);
}

// ---------------------------------------------------------------------------
// Partial columns

TEST(PartialColumnCount, TruncatesAtLeastOneAtMostD) {
  EXPECT_EQ(PartialColumnCount(64, 0.3), 19);
  EXPECT_EQ(PartialColumnCount(64, 0.2), 12);
  EXPECT_EQ(PartialColumnCount(64, 0.1), 6);
  EXPECT_EQ(PartialColumnCount(64, 0.0), 1);
  EXPECT_EQ(PartialColumnCount(64, 1.0), 64);
  EXPECT_EQ(PartialColumnCount(64, 2.0), 64);
  EXPECT_EQ(PartialColumnCount(128, 0.3), 38);
  EXPECT_EQ(PartialColumnCount(4, 0.1), 1);
}

TEST(SelectPartialColumns, SumsAbsoluteValuesOverTheGroupsHeads) {
  // GQA: 6 query heads, 2 KV heads, so heads 0-2 are group 0 and 3-5 group 1.
  const int n_tokens = 10, n_heads = 6, n_kv_heads = 2, d = 8, n_cols = 3;
  std::mt19937 rng(8);
  std::vector<float> q = RandomMatrix(n_tokens * n_heads, d, rng, 0.1f);
  auto at = [&](int t, int h, int c) -> float& {
    return q[(t * n_heads + h) * d + c];
  };
  for (int t = 0; t < n_tokens; ++t) {
    // Group 0: each winning column is large in one head only, so only the
    // sum over the group's heads finds all three.
    at(t, 0, 6) = 2.0f;
    at(t, 1, 1) = -2.0f;
    at(t, 2, 4) = 1.5f;
    // Column 3: alternating sign, a signed sum would cancel; |q| does not.
    at(t, 2, 3) = t % 2 == 0 ? 1.2f : -1.2f;
    // Group 1.
    at(t, 3, 7) = 3.0f;
    at(t, 4, 0) = 2.5f;
    at(t, 5, 2) = t % 2 == 0 ? 2.0f : -2.0f;
  }
  std::vector<int32_t> cols(n_kv_heads * n_cols, -1);
  SelectPartialColumns(q.data(), n_tokens, n_heads, n_kv_heads, d, n_cols,
                       cols.data());
  EXPECT_THAT(cols, ElementsAre(1, 4, 6, 0, 2, 7));

  // One more column: group 0's alternating column 3 comes next.
  std::vector<int32_t> cols4(n_kv_heads * 4, -1);
  SelectPartialColumns(q.data(), n_tokens, n_heads, n_kv_heads, d, 4,
                       cols4.data());
  EXPECT_THAT(std::vector<int32_t>(cols4.begin(), cols4.begin() + 4),
              ElementsAre(1, 3, 4, 6));
}

// Keeping every column chooses nothing: whatever the sums, each head's
// columns are 0 .. d - 1 in order (InfiniGen then skips the prompt's sums).
TEST(SelectPartialColumns, KeepingEveryColumnIsEveryColumnInOrder) {
  const int n_tokens = 7, n_heads = 4, n_kv_heads = 2, d = 16;
  std::mt19937 rng(10);
  std::vector<int32_t> in_order(n_kv_heads * d);
  for (int g = 0; g < n_kv_heads; ++g) {
    std::iota(in_order.begin() + g * d, in_order.begin() + (g + 1) * d, 0);
  }
  for (int trial = 0; trial < 3; ++trial) {
    std::vector<float> q = RandomMatrix(n_tokens * n_heads, d, rng);
    std::vector<int32_t> cols(n_kv_heads * d, -1);
    SelectPartialColumns(q.data(), n_tokens, n_heads, n_kv_heads, d, d,
                         cols.data());
    EXPECT_EQ(cols, in_order);
  }
}

TEST(SelectPartialColumns, MatchesNaiveRankingOnRandomData) {
  const int n_tokens = 33, n_heads = 9, n_kv_heads = 3, d = 16, n_cols = 5;
  std::mt19937 rng(9);
  std::vector<float> q = RandomMatrix(n_tokens * n_heads, d, rng);
  std::vector<int32_t> cols(n_kv_heads * n_cols);
  SelectPartialColumns(q.data(), n_tokens, n_heads, n_kv_heads, d, n_cols,
                       cols.data());
  for (int g = 0; g < n_kv_heads; ++g) {
    std::vector<double> sum(d, 0.0);
    for (int t = 0; t < n_tokens; ++t) {
      for (int h = g * 3; h < g * 3 + 3; ++h) {
        for (int c = 0; c < d; ++c)
          sum[c] += std::fabs(q[(t * n_heads + h) * d + c]);
      }
    }
    std::vector<int32_t> order(d);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(),
              [&](int i, int j) { return sum[i] > sum[j]; });
    order.resize(n_cols);
    std::sort(order.begin(), order.end());
    EXPECT_THAT(std::vector<int32_t>(cols.begin() + g * n_cols,
                                     cols.begin() + (g + 1) * n_cols),
                ElementsAreArray(order))
        << "group " << g;
  }
}

TEST(SelectPartialColumns, AllColumnsWhenNColsIsD) {
  const int d = 6;
  std::mt19937 rng(10);
  std::vector<float> q = RandomMatrix(4 * 2, d, rng);
  std::vector<int32_t> cols(d);
  SelectPartialColumns(q.data(), 4, 2, 1, d, d, cols.data());
  EXPECT_THAT(cols, ElementsAre(0, 1, 2, 3, 4, 5));
}

// ---------------------------------------------------------------------------
// Partial key rows and SpeculateScores

std::vector<uint8_t> Quantized(const std::vector<float>& keys, int n_cols) {
  const int n_rows = static_cast<int>(keys.size()) / n_cols;
  std::vector<uint8_t> rows(static_cast<size_t>(n_rows) *
                            PartialKeyRowBytes(n_cols));
  QuantizePartialKeys(keys.data(), n_rows, n_cols, rows.data());
  return rows;
}

std::vector<float> ReadBack(const std::vector<uint8_t>& rows, int n_cols) {
  const int n_rows =
      static_cast<int>(rows.size()) / PartialKeyRowBytes(n_cols);
  std::vector<float> keys(static_cast<size_t>(n_rows) * n_cols);
  DequantizePartialKeys(rows.data(), n_rows, n_cols, keys.data());
  return keys;
}

TEST(PartialKeys, RowLayoutIsRangeThenPackedNibbles) {
  // One row of 5 columns: min -1, max 2, scale 0.2.
  const std::vector<float> v = {-1.0f, 2.0f, 0.0f, 0.8f, -0.6f};
  ASSERT_EQ(PartialKeyRowBytes(5), 12);  // 8 + 3 code bytes, padded to 4
  ASSERT_EQ(PartialKeyRowBytes(64), 40);
  ASSERT_EQ(PartialKeyRowBytes(19), 20);
  std::vector<uint8_t> row = Quantized(v, 5);
  ASSERT_EQ(row.size(), 12u);
  float lo, scale;
  std::memcpy(&lo, row.data(), 4);
  std::memcpy(&scale, row.data() + 4, 4);
  EXPECT_EQ(lo, -1.0f);
  EXPECT_FLOAT_EQ(scale, 3.0f / 15.0f);
  // Codes 0, 15, 5, 9, 2.
  EXPECT_EQ(row[8], 0x0 | (15 << 4));
  EXPECT_EQ(row[9], 5 | (9 << 4));
  EXPECT_EQ(row[10], 2);
  EXPECT_EQ(row[11], 0);
}

TEST(PartialKeys, ReadBackIsWithinHalfAStepAndConstantRowsAreExact) {
  std::mt19937 rng(21);
  for (int n_cols : {1, 2, 7, 19, 64}) {
    std::vector<float> keys = RandomMatrix(9, n_cols, rng);
    std::vector<float> back = ReadBack(Quantized(keys, n_cols), n_cols);
    for (int r = 0; r < 9; ++r) {
      const float* k = keys.data() + r * n_cols;
      const float lo = *std::min_element(k, k + n_cols);
      const float hi = *std::max_element(k, k + n_cols);
      for (int c = 0; c < n_cols; ++c) {
        EXPECT_NEAR(back[r * n_cols + c], k[c],
                    (hi - lo) / 30.0f * 1.0001f + 1e-6f)
            << n_cols << " " << r << " " << c;
      }
    }
  }
  const std::vector<float> flat(6, 0.75f);
  EXPECT_EQ(ReadBack(Quantized(flat, 6), 6), flat);
}

std::vector<float> NaiveScores(const std::vector<float>& q, int n_heads,
                               int n_kv_heads, int d,
                               const std::vector<float>& partial_k,
                               int k_stride, int n_tokens,
                               const std::vector<int32_t>& cols, int n_cols) {
  const int group = n_heads / n_kv_heads;
  std::vector<float> out(n_heads * n_tokens);
  for (int h = 0; h < n_heads; ++h) {
    const int g = h / group;
    for (int t = 0; t < n_tokens; ++t) {
      double acc = 0;
      for (int c = 0; c < n_cols; ++c) {
        acc += double{q[h * d + cols[g * n_cols + c]]} *
               partial_k[(g * k_stride + t) * n_cols + c];
      }
      out[h * n_tokens + t] =
          static_cast<float>(acc / std::sqrt(static_cast<double>(d)));
    }
  }
  return out;
}

// Scores of two computations of the same sums (different rounding).
void ExpectSameScores(const std::vector<float>& got,
                      const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-5f * (1.0f + std::fabs(want[i])))
        << what << " i=" << i;
  }
}

TEST(SpeculateScores, MatchesNaiveWithGqaStrideAndColumnSubsets) {
  const int n_heads = 6, n_kv_heads = 2, d = 16, n_cols = 5;
  const int k_stride = 13, n_tokens = 9;
  std::mt19937 rng(11);
  std::vector<float> q = RandomMatrix(n_heads, d, rng);
  std::vector<uint8_t> partial_k =
      Quantized(RandomMatrix(n_kv_heads * k_stride, n_cols, rng), n_cols);
  const std::vector<float> read_back = ReadBack(partial_k, n_cols);
  // Rows past n_tokens are unused capacity: poison them (NaN ranges).
  const int row_bytes = PartialKeyRowBytes(n_cols);
  for (int g = 0; g < n_kv_heads; ++g) {
    for (int t = n_tokens; t < k_stride; ++t) {
      std::fill_n(partial_k.begin() + (g * k_stride + t) * row_bytes,
                  row_bytes, 0xFF);
    }
  }
  // Different columns per KV head, not contiguous.
  std::vector<int32_t> cols = {0, 3, 4, 9, 15, 1, 2, 7, 8, 12};
  std::vector<float> scores(n_heads * n_tokens, 123.0f);
  SpeculateScores(q.data(), n_heads, n_kv_heads, d, partial_k.data(), k_stride,
                  n_tokens, cols.data(), n_cols, scores.data());
  ExpectSameScores(scores,
                   NaiveScores(q, n_heads, n_kv_heads, d, read_back, k_stride,
                               n_tokens, cols, n_cols),
                   "gqa");
}

TEST(SpeculateScores, MatchesNaiveAcrossShapes) {
  std::mt19937 rng(12);
  struct Case {
    int n_heads, n_kv_heads, d, n_cols, k_stride, n_tokens;
  };
  std::vector<Case> cases = {{4, 4, 8, 3, 5, 5},
                             {9, 3, 64, 19, 600, 517},
                             {2, 1, 4, 1, 3, 1},
                             {32, 8, 128, 38, 40, 33}};
  // Every column-tail length and token-tail length the blocked kernel has.
  for (int n_cols : {1, 7, 8, 9, 16, 19, 24, 64}) {
    for (int n_tokens : {1, 7, 8, 9, 16, 23}) {
      cases.push_back({6, 2, 64, n_cols, n_tokens + n_tokens % 3, n_tokens});
    }
  }
  for (const Case& c : cases) {
    std::vector<float> q = RandomMatrix(c.n_heads, c.d, rng);
    // Exactly n_kv_heads * k_stride rows, so a read past the last row would
    // leave the buffer (visible under a sanitizer).
    const std::vector<float> keys =
        RandomMatrix(c.n_kv_heads * c.k_stride, c.n_cols, rng);
    std::vector<uint8_t> partial_k = Quantized(keys, c.n_cols);
    std::vector<int32_t> cols;
    for (int g = 0; g < c.n_kv_heads; ++g) {
      std::vector<int32_t> all(c.d);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      all.resize(c.n_cols);
      std::sort(all.begin(), all.end());
      cols.insert(cols.end(), all.begin(), all.end());
    }
    std::vector<float> scores(c.n_heads * c.n_tokens);
    SpeculateScores(q.data(), c.n_heads, c.n_kv_heads, c.d, partial_k.data(),
                    c.k_stride, c.n_tokens, cols.data(), c.n_cols,
                    scores.data());
    ExpectSameScores(
        scores,
        NaiveScores(q, c.n_heads, c.n_kv_heads, c.d,
                    ReadBack(partial_k, c.n_cols), c.k_stride, c.n_tokens,
                    cols, c.n_cols),
        absl::StrFormat("n_heads=%d n_kv_heads=%d n_cols=%d n_tokens=%d",
                        c.n_heads, c.n_kv_heads, c.n_cols, c.n_tokens));
    // fp32 rows (the exact diagnostics).
    SpeculateScores(q.data(), c.n_heads, c.n_kv_heads, c.d,
                    reinterpret_cast<const uint8_t*>(keys.data()), c.k_stride,
                    c.n_tokens, cols.data(), c.n_cols, scores.data(),
                    PartialKeyFormat::kFloat);
    ExpectSameScores(
        scores,
        NaiveScores(q, c.n_heads, c.n_kv_heads, c.d, keys, c.k_stride,
                    c.n_tokens, cols, c.n_cols),
        absl::StrFormat("fp32 n_heads=%d n_kv_heads=%d n_cols=%d n_tokens=%d",
                        c.n_heads, c.n_kv_heads, c.n_cols, c.n_tokens));
  }
}

// The scores are split into tasks by KV head and range of tokens: a runner
// that takes them in reverse order, each on its own thread, gives the very
// scores of one pass on the caller, in both row formats (ranges of 1024
// tokens; a token tail shorter than a block).
TEST(SpeculateScores, TokenRangesOnSeveralThreadsGiveTheSerialScores) {
  const TaskRunner threads = ReverseThreads();
  std::mt19937 rng(23);
  const int n_heads = 9, n_kv_heads = 3, d = 64, n_cols = 19;
  const int n_tokens = 2500, k_stride = 2600;
  std::vector<float> q = RandomMatrix(n_heads, d, rng);
  const std::vector<float> keys =
      RandomMatrix(n_kv_heads * k_stride, n_cols, rng);
  const std::vector<uint8_t> partial_k = Quantized(keys, n_cols);
  std::vector<int32_t> cols;
  for (int g = 0; g < n_kv_heads; ++g) {
    for (int c = 0; c < n_cols; ++c) cols.push_back((3 * c + g) % d);
  }
  for (PartialKeyFormat format :
       {PartialKeyFormat::kInt4, PartialKeyFormat::kFloat}) {
    const uint8_t* rows = format == PartialKeyFormat::kInt4
                              ? partial_k.data()
                              : reinterpret_cast<const uint8_t*>(keys.data());
    std::vector<float> serial(n_heads * n_tokens), parallel(serial.size());
    SpeculateScores(q.data(), n_heads, n_kv_heads, d, rows, k_stride,
                    n_tokens, cols.data(), n_cols, serial.data(), format);
    SpeculateScores(q.data(), n_heads, n_kv_heads, d, rows, k_stride,
                    n_tokens, cols.data(), n_cols, parallel.data(), format,
                    &threads);
    EXPECT_EQ(serial, parallel);
    ExpectSameScores(
        serial,
        NaiveScores(q, n_heads, n_kv_heads, d,
                    format == PartialKeyFormat::kInt4
                        ? ReadBack(partial_k, n_cols)
                        : keys,
                    k_stride, n_tokens, cols, n_cols),
        "ranges");
  }
}

// With every column each head's scores are its scaled exact logits, up to
// the keys' 4-bit steps: within half a step of each column times |q| /
// sqrt(d); fp32 rows give them exactly.
TEST(SpeculateScores, AllColumnsGiveEachHeadsScaledLogits) {
  const int n_heads = 6, n_kv_heads = 2, d = 8, n_tokens = 7;
  std::mt19937 rng(13);
  std::vector<float> q = RandomMatrix(n_heads, d, rng);
  std::vector<float> k = RandomMatrix(n_kv_heads * n_tokens, d, rng);
  std::vector<int32_t> cols;
  for (int g = 0; g < n_kv_heads; ++g) {
    for (int c = 0; c < d; ++c) cols.push_back(c);
  }
  std::vector<float> scores(n_heads * n_tokens), exact(n_heads * n_tokens);
  SpeculateScores(q.data(), n_heads, n_kv_heads, d, Quantized(k, d).data(),
                  n_tokens, n_tokens, cols.data(), d, scores.data());
  SpeculateScores(q.data(), n_heads, n_kv_heads, d,
                  reinterpret_cast<const uint8_t*>(k.data()), n_tokens,
                  n_tokens, cols.data(), d, exact.data(),
                  PartialKeyFormat::kFloat);
  for (int h = 0; h < n_heads; ++h) {
    const int g = h / 3;
    for (int t = 0; t < n_tokens; ++t) {
      const float* kt = k.data() + (g * n_tokens + t) * d;
      const float step = (*std::max_element(kt, kt + d) -
                          *std::min_element(kt, kt + d)) / 15.0f;
      float dot = 0, abs_q = 0;
      for (int c = 0; c < d; ++c) {
        dot += q[h * d + c] * kt[c];
        abs_q += std::fabs(q[h * d + c]);
      }
      const float want = dot / std::sqrt(8.0f);
      EXPECT_NEAR(exact[h * n_tokens + t], want, 1e-5f);
      EXPECT_NEAR(scores[h * n_tokens + t], want,
                  step / 2 * abs_q / std::sqrt(8.0f) * 1.001f + 1e-5f);
    }
  }
}

TEST(SpeculateScores, NoTokensWritesNothingAndSteadyStateDoesNotAllocate) {
  const int n_heads = 4, n_kv_heads = 2, d = 8, n_cols = 2;
  std::vector<float> q(n_heads * d, 1.0f);
  std::vector<uint8_t> partial_k =
      Quantized(std::vector<float>(n_kv_heads * 4 * n_cols, 1.0f), n_cols);
  std::vector<int32_t> cols = {0, 1, 2, 3};
  std::vector<float> scores(n_heads * 4, 7.0f);
  SpeculateScores(q.data(), n_heads, n_kv_heads, d, partial_k.data(), 4, 0,
                  cols.data(), n_cols, scores.data());
  EXPECT_THAT(scores, ::testing::Each(7.0f));

  SpeculateScores(q.data(), n_heads, n_kv_heads, d, partial_k.data(), 4, 4,
                  cols.data(), n_cols, scores.data());
  const int64_t before = g_allocations.load();
  SpeculateScores(q.data(), n_heads, n_kv_heads, d, partial_k.data(), 4, 4,
                  cols.data(), n_cols, scores.data());
  EXPECT_EQ(g_allocations.load(), before);
  EXPECT_FLOAT_EQ(scores[0], 2.0f / std::sqrt(8.0f));
}

// ---------------------------------------------------------------------------
// SelectTokens

// Independent reference: full sort instead of nth_element.
int NaiveSelect(const std::vector<float>& scores, int n_kv_heads, int n_tokens,
                const std::vector<uint8_t>* present,
                const SelectionOptions& options,
                std::vector<int32_t>& indices) {
  indices.clear();
  double total = 0;
  int min_present = n_tokens;
  for (int g = 0; g < n_kv_heads; ++g) {
    float mx = -std::numeric_limits<float>::infinity();
    int n = 0;
    for (int t = 0; t < n_tokens; ++t) {
      if (present != nullptr && !(*present)[g * n_tokens + t]) continue;
      mx = std::max(mx, scores[g * n_tokens + t]);
      ++n;
    }
    if (n == 0) return 0;
    for (int t = 0; t < n_tokens; ++t) {
      if (present != nullptr && !(*present)[g * n_tokens + t]) continue;
      if (scores[g * n_tokens + t] >= mx - options.alpha) total += 1;
    }
    min_present = std::min(min_present, n);
  }
  const int cap = std::max(
      1, static_cast<int>(static_cast<float>(n_tokens) * options.max_fraction));
  int k = static_cast<int>(std::lround(total / n_kv_heads));
  k = std::min(std::max(k, 1), cap);
  k = std::min(k, min_present);
  for (int g = 0; g < n_kv_heads; ++g) {
    std::vector<int32_t> pos;
    for (int t = 0; t < n_tokens; ++t) {
      if (present == nullptr || (*present)[g * n_tokens + t]) pos.push_back(t);
    }
    std::stable_sort(pos.begin(), pos.end(), [&](int a, int b) {
      return scores[g * n_tokens + a] > scores[g * n_tokens + b];
    });
    pos.resize(k);
    std::sort(pos.begin(), pos.end());
    indices.insert(indices.end(), pos.begin(), pos.end());
  }
  return k;
}

std::vector<int32_t> Slice(const std::vector<int32_t>& v, int begin, int end) {
  return std::vector<int32_t>(v.begin() + begin, v.begin() + end);
}

TEST(SelectTokens, AveragesThresholdCountsAndTakesPerHeadTopK) {
  const int n_tokens = 20;
  std::vector<float> scores(2 * n_tokens);
  // Background well below alpha = 1 of the max, distinct so top-k is unique.
  for (int t = 0; t < n_tokens; ++t) {
    scores[t] = 5.0f - 0.01f * t;
    scores[n_tokens + t] = 3.0f - 0.01f * ((t * 7) % n_tokens);
  }
  // Head 0: three tokens within alpha (9.0 is exactly max - alpha: counts).
  scores[5] = 10.0f;
  scores[12] = 9.5f;
  scores[1] = 9.0f;
  scores[17] = 8.9f;  // Just outside, but the 4th best.
  // Head 1: five tokens within alpha.
  for (int t : {2, 3, 11, 18, 19}) scores[n_tokens + t] = 20.0f - 0.01f * t;

  SelectionOptions options;
  options.alpha = 1.0f;
  options.max_fraction = 1.0f;
  std::vector<int32_t> indices, offsets;
  const int k = SelectTokens(scores.data(), 2, n_tokens, nullptr, options,
                             indices, offsets);
  EXPECT_EQ(k, 4);  // round((3 + 5) / 2)
  EXPECT_THAT(offsets, ElementsAre(0, 4, 8));
  EXPECT_THAT(Slice(indices, 0, 4), ElementsAre(1, 5, 12, 17));
  // Head 1's top 4 of its 5 candidates: 19 has the lowest score of them.
  EXPECT_THAT(Slice(indices, 4, 8), ElementsAre(2, 3, 11, 18));
}

TEST(SelectTokens, RoundsTheMeanCount) {
  // Counts 1 and 2: mean 1.5 rounds to 2. Counts 1, 1, 2: mean 1.33 -> 1.
  const int n = 6;
  std::vector<float> scores = {9, 0, 0, 0, 0, 0,  //
                               9, 9, 0, 0, 0, 0,  //
                               0, 0, 0, 0, 0, 9};
  SelectionOptions options;
  options.alpha = 1.0f;
  options.max_fraction = 1.0f;
  std::vector<int32_t> indices, offsets;
  EXPECT_EQ(
      SelectTokens(scores.data(), 2, n, nullptr, options, indices, offsets), 2);
  EXPECT_THAT(indices, ElementsAre(0, 1, 0, 1));
  std::vector<float> three = {9, 0, 0, 0, 0, 0,  //
                              0, 0, 0, 0, 9, 0,  //
                              9, 9, 0, 0, 0, 0};
  EXPECT_EQ(
      SelectTokens(three.data(), 3, n, nullptr, options, indices, offsets), 1);
  EXPECT_THAT(indices, ElementsAre(0, 4, 0));
  EXPECT_THAT(offsets, ElementsAre(0, 1, 2, 3));
}

TEST(SelectTokens, CapIsIntOfNTokensTimesMaxFraction) {
  const int n_tokens = 23;
  std::vector<float> scores(n_tokens);
  for (int t = 0; t < n_tokens; ++t) scores[t] = static_cast<float>(t % 5);
  SelectionOptions options;
  options.alpha = 100.0f;       // Every token is a candidate.
  options.max_fraction = 0.2f;  // int(4.6) = 4
  std::vector<int32_t> indices, offsets;
  EXPECT_EQ(SelectTokens(scores.data(), 1, n_tokens, nullptr, options, indices,
                         offsets),
            4);
  // The four 4.0 scores at t = 4, 9, 14, 19.
  EXPECT_THAT(indices, ElementsAre(4, 9, 14, 19));

  options.max_fraction = 0.7f;  // 23 * 0.7 = 16.1
  EXPECT_EQ(SelectTokens(scores.data(), 1, n_tokens, nullptr, options, indices,
                         offsets),
            16);
  // 10 tokens * 0.7 is 7, not 6.
  options.max_fraction = 0.7f;
  EXPECT_EQ(
      SelectTokens(scores.data(), 1, 10, nullptr, options, indices, offsets),
      7);
}

TEST(SelectTokens, KIsAtLeastOne) {
  std::vector<float> scores = {1, 2, 3};
  SelectionOptions options;
  options.alpha = 100.0f;
  options.max_fraction = 0.2f;  // int(0.6) = 0, raised to 1.
  std::vector<int32_t> indices, offsets;
  EXPECT_EQ(
      SelectTokens(scores.data(), 1, 3, nullptr, options, indices, offsets), 1);
  EXPECT_THAT(indices, ElementsAre(2));
  options.max_fraction = 0.0f;
  options.alpha = 0.0f;
  EXPECT_EQ(
      SelectTokens(scores.data(), 1, 3, nullptr, options, indices, offsets), 1);
  EXPECT_THAT(offsets, ElementsAre(0, 1));
}

TEST(SelectTokens, EvictedTokensAreNeverSelectedNorCounted) {
  const int n = 8;
  // Head 0: the evicted token 3 has the highest score; had it counted, the
  // max would be 100 and no present token would be within alpha.
  std::vector<float> scores = {5, 4.5f, 1, 100, 4.2f, 0, 3.9f, 4.9f,  //
                               7, 1,    7, 7,   1,    1, 1,    7};
  std::vector<uint8_t> present = {1, 1, 1, 0, 1, 1, 1, 1,  //
                                  1, 1, 0, 0, 1, 1, 1, 1};
  SelectionOptions options;
  options.alpha = 1.0f;
  options.max_fraction = 1.0f;
  std::vector<int32_t> indices, offsets;
  // Head 0 counts {0, 1, 4, 7} = 4 (6 at 3.9 is outside); head 1 counts the
  // present 7s {0, 7} = 2, not the evicted 10 and 11. k = 3.
  const int k = SelectTokens(scores.data(), 2, n, present.data(), options,
                             indices, offsets);
  EXPECT_EQ(k, 3);
  EXPECT_THAT(Slice(indices, 0, 3), ElementsAre(0, 1, 7));
  // Head 1 fills its third slot with a present score-1 token (the lowest
  // position: 1), never with the evicted 7s at 2 and 3.
  EXPECT_THAT(Slice(indices, 3, 6), ElementsAre(0, 1, 7));
}

TEST(SelectTokens, FewPresentTokensClampK) {
  const int n = 10;
  std::vector<float> scores(2 * n, 1.0f);  // All within alpha.
  std::vector<uint8_t> present(2 * n, 1);
  for (int t = 0; t < n; ++t) present[t] = (t == 4 || t == 8) ? 1 : 0;
  SelectionOptions options;
  options.alpha = 5.0f;
  options.max_fraction = 1.0f;
  std::vector<int32_t> indices, offsets;
  // Mean count (2 + 10) / 2 = 6, but head 0 has only 2 tokens.
  EXPECT_EQ(SelectTokens(scores.data(), 2, n, present.data(), options, indices,
                         offsets),
            2);
  EXPECT_THAT(indices, ElementsAre(4, 8, 0, 1));  // Ties: lower positions.
  EXPECT_THAT(offsets, ElementsAre(0, 2, 4));
}

TEST(SelectTokens, HeadWithNoPresentTokenReturnsZero) {
  std::vector<float> scores(2 * 4, 1.0f);
  std::vector<uint8_t> present = {1, 1, 1, 1, 0, 0, 0, 0};
  std::vector<int32_t> indices = {9, 9}, offsets = {9};
  EXPECT_EQ(SelectTokens(scores.data(), 2, 4, present.data(),
                         SelectionOptions(), indices, offsets),
            0);
  EXPECT_TRUE(indices.empty());
  EXPECT_THAT(offsets, ElementsAre(0, 0, 0));
  EXPECT_EQ(SelectTokens(scores.data(), 2, 0, nullptr, SelectionOptions(),
                         indices, offsets),
            0);
}

TEST(SelectTokens, HugeAlphaSelectsEveryPresentToken) {
  const int n = 12;
  std::mt19937 rng(14);
  std::vector<float> scores = RandomMatrix(3, n, rng, 10.0f);
  SelectionOptions options;
  options.alpha = 1e30f;
  options.max_fraction = 1.0f;
  std::vector<int32_t> indices, offsets;
  EXPECT_EQ(
      SelectTokens(scores.data(), 3, n, nullptr, options, indices, offsets), n);
  for (int g = 0; g < 3; ++g) {
    std::vector<int32_t> all(n);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_THAT(Slice(indices, g * n, (g + 1) * n), ElementsAreArray(all));
  }
  // With evictions every head keeps its own present tokens.
  std::vector<uint8_t> present(3 * n, 1);
  present[0] = present[n + 5] = present[2 * n + 11] = 0;
  EXPECT_EQ(SelectTokens(scores.data(), 3, n, present.data(), options, indices,
                         offsets),
            n - 1);
  EXPECT_EQ(Slice(indices, 0, 3), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(std::count(indices.begin() + n - 1, indices.begin() + 2 * n - 2, 5),
            0);
  EXPECT_EQ(indices.back(), 10);
}

TEST(SelectTokens, NanScoresRankBelowEveryNumber) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> scores = {nan, 3, nan, 1, 2, nan};
  SelectionOptions options;
  options.alpha = 100.0f;
  options.max_fraction = 1.0f;
  std::vector<int32_t> indices, offsets;
  // Three numbers are counted; NaN is never within alpha of anything.
  EXPECT_EQ(
      SelectTokens(scores.data(), 1, 6, nullptr, options, indices, offsets), 3);
  EXPECT_THAT(indices, ElementsAre(1, 3, 4));
  // All NaN: every position is still a real, distinct token.
  std::vector<float> all_nan(6, nan);
  options.alpha = 1.0f;
  const int k =
      SelectTokens(all_nan.data(), 1, 6, nullptr, options, indices, offsets);
  ASSERT_EQ(indices.size(), k);
  for (int i = 0; i < k; ++i) EXPECT_EQ(indices[i], i);

  // k larger than a head's numbers: the head takes its numbers, then its
  // first present NaNs. Head 0 counts 4, head 1 counts 1: k = round(2.5).
  std::vector<float> two_heads = {1, 2, 3, 4,  //
                                  nan, 5, nan, nan};
  std::vector<uint8_t> present = {1, 1, 1, 1,  //
                                  1, 1, 0, 1};
  options.alpha = 10.0f;
  EXPECT_EQ(SelectTokens(two_heads.data(), 2, 4, present.data(), options,
                         indices, offsets),
            3);
  EXPECT_THAT(indices, ElementsAre(1, 2, 3, 0, 1, 3));
}

TEST(SelectTokens, MatchesNaiveOnRandomInputs) {
  std::mt19937 rng(15);
  std::uniform_int_distribution<int> coin(0, 9);
  for (int trial = 0; trial < 200; ++trial) {
    const int n_kv_heads = 1 + trial % 4;
    const int n_tokens = 1 + (trial * 37) % 300;
    std::vector<float> scores = RandomMatrix(n_kv_heads, n_tokens, rng, 3.0f);
    // Quantize some scores to create ties.
    if (trial % 3 == 0) {
      for (float& s : scores) s = std::round(s);
    }
    std::vector<uint8_t> present(scores.size());
    for (uint8_t& p : present) p = coin(rng) != 0;
    SelectionOptions options;
    options.alpha = 0.5f + (trial % 7);
    options.max_fraction = (trial % 5) * 0.1f + 0.05f;
    const bool use_present = trial % 2 == 1;
    std::vector<int32_t> indices, offsets, expected;
    const int k = SelectTokens(scores.data(), n_kv_heads, n_tokens,
                               use_present ? present.data() : nullptr, options,
                               indices, offsets);
    const int expected_k =
        NaiveSelect(scores, n_kv_heads, n_tokens,
                    use_present ? &present : nullptr, options, expected);
    ASSERT_EQ(k, expected_k) << "trial " << trial;
    ASSERT_EQ(indices, expected) << "trial " << trial;
    ASSERT_EQ(offsets.size(), n_kv_heads + 1);
    for (int g = 0; g <= n_kv_heads; ++g) ASSERT_EQ(offsets[g], g * k);
  }
}

TEST(SelectTokens, ReusesCapacityAndDoesNotAllocateInSteadyState) {
  const int n_kv_heads = 3, n_tokens = 4096;
  std::mt19937 rng(16);
  std::vector<float> scores = RandomMatrix(n_kv_heads, n_tokens, rng);
  SelectionOptions options;
  options.alpha = 2.0f;
  std::vector<int32_t> indices, offsets;
  const int k1 = SelectTokens(scores.data(), n_kv_heads, n_tokens, nullptr,
                              options, indices, offsets);
  ASSERT_GT(k1, 0);
  const int32_t* indices_data = indices.data();
  const int32_t* offsets_data = offsets.data();
  const size_t indices_capacity = indices.capacity();
  const size_t offsets_capacity = offsets.capacity();

  // Next step: new scores, same shape.
  scores = RandomMatrix(n_kv_heads, n_tokens, rng);
  const int64_t before = g_allocations.load();
  const int k2 = SelectTokens(scores.data(), n_kv_heads, n_tokens, nullptr,
                              options, indices, offsets);
  EXPECT_EQ(g_allocations.load(), before);
  EXPECT_GT(k2, 0);
  EXPECT_EQ(indices.data(), indices_data);
  EXPECT_EQ(offsets.data(), offsets_data);
  EXPECT_EQ(indices.capacity(), indices_capacity);
  EXPECT_EQ(offsets.capacity(), offsets_capacity);
}

}  // namespace
}  // namespace infinigen::speculator

namespace infinigen::speculator {
namespace {

// SelectByMass: a peaked head takes few tokens, a flat one many; the cap
// and evicted tokens bound both.
TEST(SelectByMass, TakesTokensUntilTheyCarryTheMass) {
  const int n = 10;
  std::vector<float> scores(2 * n, 0.0f);
  // Head 0: one token carries e^8 / (e^8 + 9) = 99.7% of the mass.
  scores[6] = 8.0f;
  // Head 1: flat, so 0.5 of the mass needs half the tokens.
  std::vector<int32_t> indices, offsets;
  EXPECT_EQ(SelectByMass(scores.data(), 2, n, nullptr, 0.5f, 1.0f, indices,
                         offsets),
            6);
  EXPECT_THAT(offsets, ::testing::ElementsAre(0, 1, 6));
  EXPECT_EQ(indices[0], 6);
  // Ties go to the lower positions, emitted ascending.
  EXPECT_THAT(std::vector<int32_t>(indices.begin() + 1, indices.end()),
              ::testing::ElementsAre(0, 1, 2, 3, 4));

  // A cap of 30% holds the flat head to 3; more mass, still 1 for head 0.
  EXPECT_EQ(SelectByMass(scores.data(), 2, n, nullptr, 0.99f, 0.3f, indices,
                         offsets),
            4);
  EXPECT_THAT(offsets, ::testing::ElementsAre(0, 1, 4));

  // Evicted tokens are never chosen, and the mass is over those present.
  std::vector<uint8_t> present(2 * n, 1);
  present[6] = 0;
  for (int t = 0; t < 8; ++t) present[n + t] = 0;
  EXPECT_EQ(SelectByMass(scores.data(), 2, n, present.data(), 0.5f, 1.0f,
                         indices, offsets),
            6);
  EXPECT_THAT(offsets, ::testing::ElementsAre(0, 5, 6));
  for (int j = 0; j < offsets[1]; ++j) EXPECT_NE(indices[j], 6);
  EXPECT_EQ(indices[5], 8);
  // A head with nothing present: nothing at all.
  std::fill(present.begin(), present.begin() + n, 0);
  EXPECT_EQ(SelectByMass(scores.data(), 2, n, present.data(), 0.5f, 1.0f,
                         indices, offsets),
            0);
  EXPECT_TRUE(indices.empty());
}

}  // namespace
}  // namespace infinigen::speculator
