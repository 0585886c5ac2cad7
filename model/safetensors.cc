#include "model/safetensors.h"

#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/half.h"
#include "common/log.h"
#include "common/status.h"
#include "model/safetensors_json.h"

namespace infinigen::model {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// safetensors is little-endian on disk; the conversions below read it as
// native, which is right on every machine the project targets.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the safetensors reader assumes a little-endian host");

// Bytes per element of each dtype the format defines; 0 for one we do not
// know (the header entry is kept, but its size cannot be checked).
size_t DtypeSize(const std::string& dtype) {
  static const std::map<std::string, size_t> kSizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2},  {"BF16", 2},    {"I64", 8},
      {"I32", 4}, {"I16", 2}, {"I8", 1},   {"U64", 8},     {"U32", 4},
      {"U16", 2}, {"U8", 1},  {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1},
  };
  auto it = kSizes.find(dtype);
  return it == kSizes.end() ? 0 : it->second;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

void F64ToFloat(const uint8_t* src, size_t n, float* dst) {
  for (size_t i = 0; i < n; ++i) {
    double d;
    std::memcpy(&d, src + 8 * i, sizeof(d));
    dst[i] = static_cast<float>(d);
  }
}

// A JSON value as a non-negative integer, or false.
bool AsSize(const json& v, uint64_t* out) {
  if (!v.is_number_unsigned()) return false;
  *out = v.get<uint64_t>();
  return true;
}

// One header entry -> info. `data_size` is the length of the data section.
absl::StatusOr<SafetensorsTensorInfo> ParseTensorEntry(const std::string& path,
                                                       const std::string& name,
                                                       const json& entry,
                                                       size_t data_size) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: tensor %s: %s", path, name, what));
  };
  if (!entry.is_object()) return bad("header entry is not a JSON object");
  SafetensorsTensorInfo info;
  auto dtype = entry.find("dtype");
  if (dtype == entry.end() || !dtype->is_string()) {
    return bad("missing or non-string \"dtype\"");
  }
  info.dtype = dtype->get<std::string>();
  auto shape = entry.find("shape");
  if (shape == entry.end() || !shape->is_array()) {
    return bad("missing or non-array \"shape\"");
  }
  uint64_t count = 1;
  bool overflow = false;
  for (const json& d : *shape) {
    uint64_t dim;
    if (!AsSize(d, &dim) ||
        dim > uint64_t(std::numeric_limits<int64_t>::max())) {
      return bad(
          absl::StrCat("shape ", shape->dump(),
                       " has an entry that is not a non-negative integer"));
    }
    info.shape.push_back(int64_t(dim));
    overflow |= __builtin_mul_overflow(count, dim, &count);
  }
  auto offsets = entry.find("data_offsets");
  uint64_t begin = 0, end = 0;
  if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 ||
      !AsSize((*offsets)[0], &begin) || !AsSize((*offsets)[1], &end) ||
      begin > end) {
    return bad("\"data_offsets\" is not a pair [begin, end] with begin <= end");
  }
  if (end > data_size) {
    return bad(absl::StrFormat(
        "data_offsets [%d, %d] lie beyond the end of the data section (%d "
        "bytes); the file is truncated",
        begin, end, data_size));
  }
  const size_t elem = DtypeSize(info.dtype);
  if (elem != 0) {
    uint64_t bytes;
    overflow |= __builtin_mul_overflow(count, uint64_t(elem), &bytes);
    if (overflow || bytes != end - begin) {
      return bad(absl::StrFormat(
          "shape %s of %s needs %s bytes, data_offsets [%d, %d] give %d",
          ShapeString(info.shape), info.dtype,
          overflow ? "too many" : absl::StrCat(bytes), begin, end,
          end - begin));
    }
  }
  info.begin = begin;
  info.end = end;
  return info;
}


}  // namespace

absl::StatusOr<nlohmann::json> ParseJson(std::string_view text, const std::string& path,
                               const char* what) {
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s is not valid JSON: %s", path, what, e.what()));
  }
}

int64_t SafetensorsTensorInfo::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  IG_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(path));
  const size_t size = file.size();
  if (size < 8) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %d bytes is too short for a safetensors header length", path,
        size));
  }
  uint64_t header_len;
  std::memcpy(&header_len, file.data(), sizeof(header_len));
  if (header_len > size - 8) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: header length %d is larger than the %d bytes that follow it", path,
        header_len, size - 8));
  }
  IG_ASSIGN_OR_RETURN(json header, ParseJson(file.view().substr(8, header_len),
                                             path, "the safetensors header"));
  if (!header.is_object()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the safetensors header is not a JSON object", path));
  }
  const size_t data_start = 8 + header_len;
  const size_t data_size = size - data_start;
  std::map<std::string, SafetensorsTensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: __metadata__ is not a JSON object", path));
      }
      for (const auto& [key, value] : entry.items()) {
        metadata[key] =
            value.is_string() ? value.get<std::string>() : value.dump();
      }
      continue;
    }
    IG_ASSIGN_OR_RETURN(tensors[name],
                        ParseTensorEntry(path, name, entry, data_size));
  }
  return SafetensorsFile(std::move(file), data_start, std::move(tensors),
                         std::move(metadata));
}

absl::StatusOr<std::vector<float>> SafetensorsFile::ReadFloat32(
    const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: no tensor %s", path(), name));
  }
  const SafetensorsTensorInfo& info = it->second;
  const uint8_t* src = file_.data() + data_start_ + info.begin;
  const size_t n = size_t(info.num_elements());
  std::vector<float> out(n);
  if (info.dtype == "F32") {
    if (n > 0) std::memcpy(out.data(), src, n * sizeof(float));
  } else if (info.dtype == "F16") {
    HalfToFloat(reinterpret_cast<const uint16_t*>(src), n, out.data());
  } else if (info.dtype == "BF16") {
    Bf16ToFloat(reinterpret_cast<const uint16_t*>(src), n, out.data());
  } else if (info.dtype == "F64") {
    F64ToFloat(src, n, out.data());
  } else {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: tensor %s has dtype %s; only F32, F16, BF16 and F64 can be read "
        "as floats",
        path(), name, info.dtype));
  }
  return out;
}

absl::StatusOr<SafetensorsCheckpoint> SafetensorsCheckpoint::Open(
    const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) {
    return absl::NotFoundError(
        absl::StrFormat("%s: no such file or directory", path));
  }
  std::string file = path;
  if (fs::is_directory(st)) {
    const fs::path dir(path);
    const std::string index = (dir / "model.safetensors.index.json").string();
    const std::string single = (dir / "model.safetensors").string();
    if (fs::exists(index, ec)) {
      file = index;
    } else if (fs::exists(single, ec)) {
      file = single;
    } else {
      return absl::NotFoundError(absl::StrFormat(
          "%s: no model.safetensors or model.safetensors.index.json in this "
          "directory",
          path));
    }
  }

  SafetensorsCheckpoint ckpt;
  ckpt.path_ = file;
  if (!absl::EndsWith(file, ".index.json")) {
    IG_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::Open(file));
    for (const auto& entry : f.tensors()) ckpt.file_of_tensor_[entry.first] = 0;
    ckpt.files_.push_back(std::move(f));
    return ckpt;
  }

  IG_ASSIGN_OR_RETURN(std::string text, ReadFileToString(file));
  IG_ASSIGN_OR_RETURN(json index, ParseJson(text, file, "the index"));
  auto map = index.is_object() ? index.find("weight_map") : index.end();
  if (map == index.end() || !map->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: no \"weight_map\" object", file));
  }
  // Shard name -> tensors the index puts there.
  std::map<std::string, std::vector<std::string>> shards;
  for (const auto& [name, shard] : map->items()) {
    if (!shard.is_string() || shard.get<std::string>().empty() ||
        absl::StrContains(shard.get<std::string>(), "/") ||
        shard.get<std::string>() == "..") {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: weight_map entry for %s is not a file name: %s",
                          file, name, shard.dump()));
    }
    shards[shard.get<std::string>()].push_back(name);
  }
  const fs::path dir = fs::path(file).parent_path();
  for (const auto& [shard, names] : shards) {
    IG_ASSIGN_OR_RETURN(SafetensorsFile f,
                        SafetensorsFile::Open((dir / shard).string()));
    const int idx = int(ckpt.files_.size());
    for (const std::string& name : names) {
      if (f.tensors().count(name) == 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: weight_map puts tensor %s in %s, which has no such tensor",
            file, name, f.path()));
      }
      ckpt.file_of_tensor_[name] = idx;
    }
    ckpt.files_.push_back(std::move(f));
  }
  return ckpt;
}

std::pair<int, const SafetensorsTensorInfo*> SafetensorsCheckpoint::Locate(
    const std::string& name) const {
  auto it = file_of_tensor_.find(name);
  if (it == file_of_tensor_.end()) return {-1, nullptr};
  return {it->second, &files_[it->second].tensors().at(name)};
}

bool SafetensorsCheckpoint::Contains(const std::string& name) const {
  return file_of_tensor_.count(name) != 0;
}

std::vector<std::string> SafetensorsCheckpoint::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(file_of_tensor_.size());
  for (const auto& entry : file_of_tensor_) names.push_back(entry.first);
  return names;
}

const SafetensorsTensorInfo* SafetensorsCheckpoint::Find(
    const std::string& name) const {
  return Locate(name).second;
}

absl::StatusOr<std::vector<float>> SafetensorsCheckpoint::ReadFloat32(
    const std::string& name, const std::vector<int64_t>& shape) const {
  auto [idx, info] = Locate(name);
  if (info == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: missing tensor %s", path_, name));
  }
  const SafetensorsFile& f = files_[idx];
  if (info->shape != shape) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: tensor %s has shape %s, the config wants %s", f.path(), name,
        ShapeString(info->shape), ShapeString(shape)));
  }
  return f.ReadFloat32(name);
}

}  // namespace infinigen::model
