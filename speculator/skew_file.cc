#include "speculator/speculator.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_format.h"
#include "common/file.h"
#include "common/status.h"

namespace infinigen::speculator {

namespace {

constexpr char kSkewMagic[8] = {'I', 'G', 'S', 'K', 'E', 'W', '0', '1'};
constexpr size_t kSkewHeaderBytes = sizeof(kSkewMagic) + 3 * sizeof(int32_t);
// The optional profile section after the matrices: magic, int32 n_layers,
// n_kv_heads, n_fractions, float partial_ratio, then the fractions, the
// errors and the speculated errors (floats).
constexpr char kProfileMagic[8] = {'I', 'G', 'P', 'R', 'O', 'F', '0', '1'};
constexpr size_t kProfileHeaderBytes =
    sizeof(kProfileMagic) + 3 * sizeof(int32_t) + sizeof(float);

size_t SkewFloatCount(int n_layers, int n_kv_heads, int head_dim) {
  return static_cast<size_t>(n_layers) * n_kv_heads * head_dim * head_dim;
}

}  // namespace

SkewMatrices SkewMatrices::Identity(int n_layers, int n_kv_heads,
                                    int head_dim) {
  SkewMatrices m;
  m.n_layers = n_layers;
  m.n_kv_heads = n_kv_heads;
  m.head_dim = head_dim;
  m.a.assign(SkewFloatCount(n_layers, n_kv_heads, head_dim), 0.0f);
  for (int l = 0; l < n_layers; ++l) {
    for (int g = 0; g < n_kv_heads; ++g) {
      float* a = m.at(l, g);
      for (int i = 0; i < head_dim; ++i) a[i * head_dim + i] = 1.0f;
    }
  }
  return m;
}

absl::Status SkewMatrices::Save(const std::string& path) const {
  if (n_layers < 0 || n_kv_heads < 0 || head_dim < 0 ||
      a.size() != SkewFloatCount(n_layers, n_kv_heads, head_dim)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "skew matrices [%d, %d, %d, %d] hold %d floats, not saving %s",
        n_layers, n_kv_heads, head_dim, head_dim, a.size(), path));
  }
  if (!profile.empty() &&
      (profile.n_layers != n_layers || profile.n_kv_heads != n_kv_heads ||
       profile.error.size() != static_cast<size_t>(n_layers) * n_kv_heads *
                                   profile.fractions.size() ||
       profile.speculated_error.size() != profile.error.size())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the head profile [%d, %d] x %d fractions holds %d errors and does "
        "not match the skew's %d layers x %d KV heads, not saving %s",
        profile.n_layers, profile.n_kv_heads, profile.fractions.size(),
        profile.error.size(), n_layers, n_kv_heads, path));
  }
  // Write a sibling file and rename it over `path`, so a reader never maps a
  // half-written file and a failed save leaves the old one intact.
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    return absl::InternalError(
        absl::StrFormat("cannot create %s: %s", tmp, std::strerror(errno)));
  }
  const int32_t dims[3] = {n_layers, n_kv_heads, head_dim};
  bool ok = std::fwrite(kSkewMagic, sizeof(kSkewMagic), 1, f) == 1 &&
            std::fwrite(dims, sizeof(dims), 1, f) == 1 &&
            (a.empty() ||
             std::fwrite(a.data(), sizeof(float), a.size(), f) == a.size());
  if (ok && !profile.empty()) {
    const int32_t pdims[3] = {profile.n_layers, profile.n_kv_heads,
                              static_cast<int32_t>(profile.fractions.size())};
    ok = std::fwrite(kProfileMagic, sizeof(kProfileMagic), 1, f) == 1 &&
         std::fwrite(pdims, sizeof(pdims), 1, f) == 1 &&
         std::fwrite(&profile.partial_ratio, sizeof(float), 1, f) == 1 &&
         std::fwrite(profile.fractions.data(), sizeof(float),
                     profile.fractions.size(),
                     f) == profile.fractions.size() &&
         std::fwrite(profile.error.data(), sizeof(float),
                     profile.error.size(), f) == profile.error.size() &&
         std::fwrite(profile.speculated_error.data(), sizeof(float),
                     profile.speculated_error.size(),
                     f) == profile.speculated_error.size();
  }
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return absl::InternalError(
        absl::StrFormat("cannot write %s: %s", path, std::strerror(err)));
  }
  return absl::OkStatus();
}

absl::StatusOr<SkewMatrices> SkewMatrices::Load(const std::string& path) {
  IG_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(path));
  const uint8_t* p = file.data();
  const size_t size = file.size();
  if (size < kSkewHeaderBytes ||
      std::memcmp(p, kSkewMagic, sizeof(kSkewMagic)) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s is not a skew matrix file (no IGSKEW01 header)", path));
  }
  int32_t dims[3];
  std::memcpy(dims, p + sizeof(kSkewMagic), sizeof(dims));
  if (dims[0] < 0 || dims[1] < 0 || dims[2] < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: negative dimensions [%d, %d, %d]", path, dims[0],
                        dims[1], dims[2]));
  }
  // Products of int32 dimensions fit in 128 bits; comparing there means a
  // corrupt header cannot overflow into a plausible size.
  const unsigned __int128 floats =
      static_cast<unsigned __int128>(dims[0]) * dims[1] * dims[2] * dims[2];
  const unsigned __int128 payload = size - kSkewHeaderBytes;
  const size_t rest = payload > floats * sizeof(float)
                          ? static_cast<size_t>(payload - floats * sizeof(float))
                          : 0;
  const uint8_t* section =
      rest > 0 ? p + kSkewHeaderBytes +
                     static_cast<size_t>(floats * sizeof(float))
               : nullptr;
  const bool has_profile =
      rest >= sizeof(kProfileMagic) &&
      std::memcmp(section, kProfileMagic, sizeof(kProfileMagic)) == 0;
  if (payload != floats * sizeof(float) && !has_profile) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: [%d, %d, %d, %d] skew matrices need %d bytes of floats, the file "
        "has %d (%s)",
        path, dims[0], dims[1], dims[2], dims[2],
        static_cast<uint64_t>(std::min<unsigned __int128>(
            floats * sizeof(float), std::numeric_limits<uint64_t>::max())),
        static_cast<uint64_t>(payload),
        payload < floats * sizeof(float) ? "truncated" : "trailing bytes"));
  }
  SkewMatrices m;
  m.n_layers = dims[0];
  m.n_kv_heads = dims[1];
  m.head_dim = dims[2];
  m.a.resize(static_cast<size_t>(floats));
  if (!m.a.empty()) {
    std::memcpy(m.a.data(), p + kSkewHeaderBytes, m.a.size() * sizeof(float));
  }
  if (!has_profile) return m;
  int32_t pdims[3] = {0, 0, 0};
  if (rest >= kProfileHeaderBytes) {
    std::memcpy(pdims, section + sizeof(kProfileMagic), sizeof(pdims));
  }
  if (rest < kProfileHeaderBytes || pdims[0] != m.n_layers ||
      pdims[1] != m.n_kv_heads || pdims[2] < 1 || pdims[2] > 4096) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the head profile section is for [%d, %d] x %d fractions, the "
        "skew is %d layers x %d KV heads", path, pdims[0], pdims[1], pdims[2],
        m.n_layers, m.n_kv_heads));
  }
  const size_t n_f = static_cast<size_t>(pdims[2]);
  const size_t n_err = static_cast<size_t>(m.n_layers) * m.n_kv_heads * n_f;
  if (rest != kProfileHeaderBytes + (n_f + 2 * n_err) * sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the head profile section has %d bytes, [%d, %d] x %d fractions "
        "need %d", path, rest, pdims[0], pdims[1], pdims[2],
        kProfileHeaderBytes + (n_f + 2 * n_err) * sizeof(float)));
  }
  m.profile.n_layers = m.n_layers;
  m.profile.n_kv_heads = m.n_kv_heads;
  std::memcpy(&m.profile.partial_ratio,
              section + sizeof(kProfileMagic) + sizeof(pdims), sizeof(float));
  m.profile.fractions.resize(n_f);
  m.profile.error.resize(n_err);
  m.profile.speculated_error.resize(n_err);
  const uint8_t* floats_at = section + kProfileHeaderBytes;
  std::memcpy(m.profile.fractions.data(), floats_at, n_f * sizeof(float));
  std::memcpy(m.profile.error.data(), floats_at + n_f * sizeof(float),
              n_err * sizeof(float));
  std::memcpy(m.profile.speculated_error.data(),
              floats_at + (n_f + n_err) * sizeof(float),
              n_err * sizeof(float));
  for (size_t i = 0; i < n_err; ++i) {
    if (!(m.profile.error[i] >= 0.0f) ||
        !(m.profile.speculated_error[i] >= 0.0f) ||
        !std::isfinite(m.profile.error[i]) ||
        !std::isfinite(m.profile.speculated_error[i])) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: the head profile holds a negative or non-finite error",
          path));
    }
  }
  for (size_t i = 0; i < n_f; ++i) {
    const float fr = m.profile.fractions[i];
    if (!(fr > 0.0f && fr <= 1.0f) ||
        (i > 0 && !(fr > m.profile.fractions[i - 1]))) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: the head profile's fractions must ascend in (0, 1]", path));
    }
  }
  return m;
}

absl::Status SkewMatrices::CheckShape(int n_layers, int n_kv_heads,
                                      int head_dim) const {
  if (this->n_layers != n_layers || this->n_kv_heads != n_kv_heads ||
      this->head_dim != head_dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "skew matrices are for %d layers x %d KV heads x head_dim %d, the "
        "model has %d x %d x %d",
        this->n_layers, this->n_kv_heads, this->head_dim, n_layers, n_kv_heads,
        head_dim));
  }
  if (a.size() != SkewFloatCount(n_layers, n_kv_heads, head_dim)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "skew matrices hold %d floats, [%d, %d, %d, %d] needs %d", a.size(),
        n_layers, n_kv_heads, head_dim, head_dim,
        SkewFloatCount(n_layers, n_kv_heads, head_dim)));
  }
  return absl::OkStatus();
}

}  // namespace infinigen::speculator
