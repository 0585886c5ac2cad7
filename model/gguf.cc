#include "model/gguf.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/half.h"
#include "common/log.h"
#include "common/status.h"
#include "model/ggml_quants.h"

namespace infinigen::model {
namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read little-endian
constexpr uint64_t kDefaultAlignment = 32;
constexpr int kMaxDims = 4;        // GGML_MAX_DIMS
constexpr int kMaxArrayDepth = 8;  // arrays of arrays of ...

// ---------------------------------------------------------------------------
// Parsing.

// Bounds-checked little-endian reads over the mapped file; every failure
// names the file, what was being read and where.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size, const std::string& path)
      : data_(data), size_(size), path_(path) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }

  absl::Status Truncated(const std::string& what, size_t need) const {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: truncated GGUF file: %s needs %d bytes at offset %d, but the "
        "file has %d bytes",
        path_, what, need, pos_, size_));
  }

  template <typename T>
  absl::Status Read(T* v, const std::string& what) {
    if (remaining() < sizeof(T)) return Truncated(what, sizeof(T));
    std::memcpy(v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return absl::OkStatus();
  }

  absl::Status ReadString(std::string* s, const std::string& what) {
    uint64_t len = 0;
    IG_RETURN_IF_ERROR(Read(&len, what + " length"));
    if (len > remaining()) return Truncated(what, len);
    s->assign(reinterpret_cast<const char*>(data_ + pos_), len);
    pos_ += len;
    return absl::OkStatus();
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& path_;
};

bool IsIntegerType(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kBool:
      return true;
    default:
      return false;
  }
}

bool IsFloatType(GgufValueType t) {
  return t == GgufValueType::kFloat32 || t == GgufValueType::kFloat64;
}

const char* ValueTypeName(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
      return "uint8";
    case GgufValueType::kInt8:
      return "int8";
    case GgufValueType::kUint16:
      return "uint16";
    case GgufValueType::kInt16:
      return "int16";
    case GgufValueType::kUint32:
      return "uint32";
    case GgufValueType::kInt32:
      return "int32";
    case GgufValueType::kFloat32:
      return "float32";
    case GgufValueType::kBool:
      return "bool";
    case GgufValueType::kString:
      return "string";
    case GgufValueType::kArray:
      return "array";
    case GgufValueType::kUint64:
      return "uint64";
    case GgufValueType::kInt64:
      return "int64";
    case GgufValueType::kFloat64:
      return "float64";
  }
  return "unknown";
}

// Reads one integer or float scalar of type `t`.
absl::Status ReadNumber(Reader& r, GgufValueType t, const std::string& what,
                        int64_t* i, double* f) {
  switch (t) {
#define IG_GGUF_INT(enumerator, ctype)    \
  case GgufValueType::enumerator: {       \
    ctype v = 0;                          \
    IG_RETURN_IF_ERROR(r.Read(&v, what)); \
    *i = static_cast<int64_t>(v);         \
    return absl::OkStatus();              \
  }
    IG_GGUF_INT(kUint8, uint8_t)
    IG_GGUF_INT(kInt8, int8_t)
    IG_GGUF_INT(kUint16, uint16_t)
    IG_GGUF_INT(kInt16, int16_t)
    IG_GGUF_INT(kUint32, uint32_t)
    IG_GGUF_INT(kInt32, int32_t)
    IG_GGUF_INT(kUint64, uint64_t)
    IG_GGUF_INT(kInt64, int64_t)
    IG_GGUF_INT(kBool, uint8_t)
#undef IG_GGUF_INT
    case GgufValueType::kFloat32: {
      float v = 0;
      IG_RETURN_IF_ERROR(r.Read(&v, what));
      *f = v;
      return absl::OkStatus();
    }
    case GgufValueType::kFloat64:
      return r.Read(f, what);
    default:
      return absl::InternalError("ReadNumber on a non-number");
  }
}

size_t MinEncodedSize(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
      return 2;
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kFloat32:
      return 4;
    case GgufValueType::kString:  // uint64 length
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kFloat64:
      return 8;
    case GgufValueType::kArray:  // uint32 type + uint64 count
      return 12;
  }
  return 1;
}

absl::Status ReadValue(Reader& r, const std::string& path,
                       const std::string& key, uint32_t raw_type, int depth,
                       GgufValue* v) {
  if (raw_type > static_cast<uint32_t>(GgufValueType::kFloat64)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: metadata key %s has unknown value type %d", path, key, raw_type));
  }
  v->type = static_cast<GgufValueType>(raw_type);
  const std::string what = "metadata value of " + key;
  if (v->type == GgufValueType::kString) {
    return r.ReadString(&v->string_value, what);
  }
  if (v->type != GgufValueType::kArray) {
    return ReadNumber(r, v->type, what, &v->int_value, &v->float_value);
  }
  if (depth >= kMaxArrayDepth) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: metadata key %s nests arrays deeper than %d", path,
                        key, kMaxArrayDepth));
  }
  uint32_t elem_raw = 0;
  uint64_t count = 0;
  IG_RETURN_IF_ERROR(r.Read(&elem_raw, what + " element type"));
  IG_RETURN_IF_ERROR(r.Read(&count, what + " element count"));
  if (elem_raw > static_cast<uint32_t>(GgufValueType::kFloat64)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: metadata key %s is an array of unknown value type %d", path, key,
        elem_raw));
  }
  const auto elem = static_cast<GgufValueType>(elem_raw);
  v->element_type = elem;
  if (count > r.remaining() / MinEncodedSize(elem)) {
    return r.Truncated(absl::StrFormat("%s (%d elements)", what, count),
                       count * MinEncodedSize(elem));
  }
  if (elem == GgufValueType::kString) {
    v->string_array.resize(count);
    for (auto& s : v->string_array) IG_RETURN_IF_ERROR(r.ReadString(&s, what));
  } else if (elem == GgufValueType::kArray) {
    v->array_array.resize(count);
    for (auto& a : v->array_array) {
      uint32_t t = static_cast<uint32_t>(GgufValueType::kArray);
      IG_RETURN_IF_ERROR(ReadValue(r, path, key, t, depth + 1, &a));
    }
  } else if (IsFloatType(elem)) {
    v->float_array.resize(count);
    int64_t unused;
    for (auto& f : v->float_array) {
      IG_RETURN_IF_ERROR(ReadNumber(r, elem, what, &unused, &f));
    }
  } else {
    v->int_array.resize(count);
    double unused;
    for (auto& i : v->int_array) {
      IG_RETURN_IF_ERROR(ReadNumber(r, elem, what, &i, &unused));
    }
  }
  return absl::OkStatus();
}

}  // namespace

bool GgufValue::is_integer() const { return IsIntegerType(type); }
bool GgufValue::is_float() const { return IsFloatType(type); }

size_t GgufValue::array_size() const {
  if (type != GgufValueType::kArray) return 0;
  switch (element_type) {
    case GgufValueType::kString:
      return string_array.size();
    case GgufValueType::kArray:
      return array_array.size();
    case GgufValueType::kFloat32:
    case GgufValueType::kFloat64:
      return float_array.size();
    default:
      return int_array.size();
  }
}

int64_t GgufTensorInfo::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string GgufTensorInfo::ShapeString() const {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// ---------------------------------------------------------------------------
// GgufFile.

absl::StatusOr<GgufFile> GgufFile::Open(const std::string& path) {
  IG_ASSIGN_OR_RETURN(MappedFile mapped, MappedFile::Open(path));
  GgufFile file(std::move(mapped));
  IG_RETURN_IF_ERROR(file.Parse());
  return file;
}

absl::Status GgufFile::Parse() {
  const std::string& p = file_.path();
  Reader r(file_.data(), file_.size(), p);
  uint32_t magic = 0;
  IG_RETURN_IF_ERROR(r.Read(&magic, "magic"));
  if (magic != kGgufMagic) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s is not a GGUF file: it starts with %s, not \"GGUF\"", p,
        absl::CEscape(std::string(file_.view().substr(0, 4)))));
  }
  IG_RETURN_IF_ERROR(r.Read(&version_, "version"));
  if (version_ != 2 && version_ != 3) {
    if ((version_ & 0xFFFF) == 0 && version_ != 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: big-endian GGUF files are not supported", p));
    }
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: unsupported GGUF version %d (this loader reads 2 and 3)", p,
        version_));
  }
  uint64_t tensor_count = 0, kv_count = 0;
  IG_RETURN_IF_ERROR(r.Read(&tensor_count, "tensor count"));
  IG_RETURN_IF_ERROR(r.Read(&kv_count, "metadata count"));
  // Each key/value takes at least 8 + 4 + 1 bytes, each tensor info at
  // least 8 + 4 + 4 + 8.
  if (kv_count > r.remaining() / 13) {
    return r.Truncated(absl::StrFormat("%d metadata entries", kv_count),
                       kv_count * 13);
  }
  if (tensor_count > r.remaining() / 24) {
    return r.Truncated(absl::StrFormat("%d tensor infos", tensor_count),
                       tensor_count * 24);
  }

  for (uint64_t i = 0; i < kv_count; ++i) {
    std::string key;
    IG_RETURN_IF_ERROR(r.ReadString(&key, absl::StrCat("metadata key ", i)));
    uint32_t type = 0;
    IG_RETURN_IF_ERROR(r.Read(&type, "value type of " + key));
    GgufValue v;
    IG_RETURN_IF_ERROR(ReadValue(r, p, key, type, 0, &v));
    if (!metadata_.emplace(key, std::move(v)).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: duplicate metadata key %s", p, key));
    }
    keys_.push_back(std::move(key));
  }

  IG_ASSIGN_OR_RETURN(alignment_,
                      GetIntOr("general.alignment", kDefaultAlignment));
  if (alignment_ == 0 || (alignment_ & (alignment_ - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: general.alignment %d is not a power of two", p, alignment_));
  }

  tensors_.resize(tensor_count);
  for (uint64_t i = 0; i < tensor_count; ++i) {
    GgufTensorInfo& t = tensors_[i];
    IG_RETURN_IF_ERROR(
        r.ReadString(&t.name, absl::StrCat("name of tensor ", i)));
    uint32_t n_dims = 0;
    IG_RETURN_IF_ERROR(r.Read(&n_dims, "dimension count of " + t.name));
    if (n_dims > kMaxDims) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tensor %s has %d dimensions, at most %d are allowed", p, t.name,
          n_dims, kMaxDims));
    }
    t.shape.resize(n_dims);
    int64_t elems = 1;
    for (auto& d : t.shape) {
      IG_RETURN_IF_ERROR(r.Read(&d, "shape of " + t.name));
      if (d < 0 || (d > 0 && elems > std::numeric_limits<int64_t>::max() / d)) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: tensor %s has an invalid shape", p, t.name));
      }
      elems *= d;
    }
    IG_RETURN_IF_ERROR(r.Read(&t.type, "type of " + t.name));
    IG_RETURN_IF_ERROR(r.Read(&t.offset, "data offset of " + t.name));
    const GgmlTypeTraits* traits = FindGgmlType(t.type);
    if (traits == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tensor %s has unknown ggml type id %d", p, t.name, t.type));
    }
    const int64_t row = t.shape.empty() ? 1 : t.shape[0];
    if (row % traits->block_elems != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tensor %s of type %s has rows of %d values, not a multiple of "
          "its block size %d",
          p, t.name, traits->name, row, traits->block_elems));
    }
    t.num_bytes = static_cast<uint64_t>(elems / traits->block_elems) *
                  traits->block_bytes;
    if (t.offset % alignment_ != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tensor %s data offset %d is not a multiple of the alignment %d",
          p, t.name, t.offset, alignment_));
    }
    if (!tensor_index_.emplace(t.name, i).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: duplicate tensor %s", p, t.name));
    }
  }

  data_offset_ = (r.pos() + alignment_ - 1) / alignment_ * alignment_;
  const uint64_t size = file_.size();
  for (const GgufTensorInfo& t : tensors_) {
    const uint64_t begin = data_offset_ + t.offset;
    if (begin < t.offset || begin > size || t.num_bytes > size - begin) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tensor %s data [%d, %d) extends beyond the end of the file "
          "(%d bytes); the file is truncated or corrupt",
          p, t.name, begin, begin + t.num_bytes, size));
    }
  }
  return absl::OkStatus();
}

const GgufValue* GgufFile::Find(const std::string& key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

namespace {

absl::Status WrongType(const std::string& path, const std::string& key,
                       const GgufValue& v, const char* want) {
  return absl::InvalidArgumentError(
      absl::StrFormat("%s: metadata key %s is a %s, expected %s", path, key,
                      ValueTypeName(v.type), want));
}

absl::Status MissingKey(const std::string& path, const std::string& key) {
  return absl::InvalidArgumentError(
      absl::StrFormat("%s: missing metadata key %s", path, key));
}

}  // namespace

absl::StatusOr<int64_t> GgufFile::GetInt(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path(), key);
  if (!v->is_integer()) return WrongType(path(), key, *v, "an integer");
  return v->int_value;
}

absl::StatusOr<double> GgufFile::GetFloat(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path(), key);
  if (v->is_float()) return v->float_value;
  if (v->is_integer()) return static_cast<double>(v->int_value);
  return WrongType(path(), key, *v, "a number");
}

absl::StatusOr<std::string> GgufFile::GetString(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path(), key);
  if (v->type != GgufValueType::kString) {
    return WrongType(path(), key, *v, "a string");
  }
  return v->string_value;
}

absl::StatusOr<bool> GgufFile::GetBool(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path(), key);
  if (!v->is_integer()) return WrongType(path(), key, *v, "a bool");
  return v->int_value != 0;
}

absl::StatusOr<int64_t> GgufFile::GetIntOr(const std::string& key,
                                           int64_t fallback) const {
  if (Find(key) == nullptr) return fallback;
  return GetInt(key);
}

absl::StatusOr<double> GgufFile::GetFloatOr(const std::string& key,
                                            double fallback) const {
  if (Find(key) == nullptr) return fallback;
  return GetFloat(key);
}

absl::StatusOr<bool> GgufFile::GetBoolOr(const std::string& key,
                                         bool fallback) const {
  if (Find(key) == nullptr) return fallback;
  return GetBool(key);
}

absl::StatusOr<const std::vector<std::string>*> GgufFile::GetStringArray(
    const std::string& key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path(), key);
  if (v->type != GgufValueType::kArray ||
      v->element_type != GgufValueType::kString) {
    return WrongType(path(), key, *v, "an array of strings");
  }
  return &v->string_array;
}

absl::StatusOr<const std::vector<int64_t>*> GgufFile::GetIntArray(
    const std::string& key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path(), key);
  if (v->type != GgufValueType::kArray || !IsIntegerType(v->element_type)) {
    return WrongType(path(), key, *v, "an array of integers");
  }
  return &v->int_array;
}

const GgufTensorInfo* GgufFile::FindTensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

absl::StatusOr<std::vector<float>> GgufFile::ReadTensor(
    const GgufTensorInfo& t) const {
  const GgmlTypeTraits* traits = FindGgmlType(t.type);
  if (traits == nullptr || traits->dequant == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: tensor %s has type %s (id %d), which this loader cannot "
        "dequantize",
        path(), t.name, GgmlTypeName(t.type), t.type));
  }
  const int64_t n = t.num_elements();
  std::vector<float> out(n);
  const uint8_t* src = TensorData(t);
  const int64_t blocks = n / traits->block_elems;
  // Dequantizing is memory-bound but not free (a 7B model is ~7e9 values);
  // split big tensors by blocks across a few threads.
  constexpr int64_t kValuesPerThread = 1 << 20;
  const int threads = static_cast<int>(std::clamp<int64_t>(
      std::min<int64_t>(n / kValuesPerThread,
                        std::max(1u, std::thread::hardware_concurrency())),
      1, 16));
  const auto run = [&](int64_t b0, int64_t b1) {
    traits->dequant(src + b0 * traits->block_bytes, b1 - b0,
                    out.data() + b0 * traits->block_elems);
  };
  if (threads == 1) {
    run(0, blocks);
  } else {
    std::vector<std::thread> pool;
    const int64_t per = (blocks + threads - 1) / threads;
    for (int i = 0; i < threads; ++i) {
      const int64_t b0 = std::min(blocks, i * per);
      const int64_t b1 = std::min(blocks, b0 + per);
      pool.emplace_back(run, b0, b1);
    }
    for (auto& th : pool) th.join();
  }
  // The quantized bytes are not needed resident once converted: a loader
  // then holds the fp32 weights plus one tensor of the file at a time, not
  // the whole file besides.
  file_.DropPages(src, t.num_bytes);
  return out;
}

}  // namespace infinigen::model
