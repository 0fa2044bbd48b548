// GGUF files (llama.cpp's model format, versions 2 and 3): a validating header parser, an
// mmap'd reader and a streaming writer.
//
// Layout, little-endian: "GGUF", u32 version, u64 tensor count, u64 metadata count; the
// metadata (string key, u32 value type, value); the tensor infos (string name, u32 n_dims,
// u64 dims innermost first, u32 ggml type, u64 offset into the data section); padding to
// the alignment (metadata "general.alignment", default 32); the data section. A string is a
// u64 byte length and the bytes; an array is a u32 element type, a u64 count and the elements.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tessera/base/mapped_file.h"

namespace tessera::io {

constexpr uint64_t kGgufDefaultAlignment = 32;
constexpr int kGgufMaxDims = 4;         // GGML_MAX_DIMS
constexpr size_t kGgufMaxNameBytes = 63;  // GGML_MAX_NAME - 1: llama.cpp refuses longer names

// Metadata value types (gguf_type).
enum class GgufType : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
  kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};
const char* gguf_type_name(GgufType t);  // "u32", "string", "array", ...

// Tensor element types (ggml_type). Ids that no ggml version defines, and those ggml has
// removed (4, 5, 31-33, 36-38), are not listed and read as unknown.
enum class GgmlType : uint32_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ8_1 = 9,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kQ8_K = 15, kIQ2_XXS = 16,
  kIQ2_XS = 17, kIQ3_XXS = 18, kIQ1_S = 19, kIQ4_NL = 20, kIQ3_S = 21, kIQ2_S = 22,
  kIQ4_XS = 23, kI8 = 24, kI16 = 25, kI32 = 26, kI64 = 27, kF64 = 28, kIQ1_M = 29,
  kBF16 = 30, kTQ1_0 = 34, kTQ2_0 = 35, kMXFP4 = 39,
};

// Block size (elements) and bytes per block of a ggml type, as ggml's type_traits list them.
struct GgmlTypeTraits {
  const char* name;  // "F32", "Q4_K", ... (ggml's type names, upper case)
  int64_t block;
  int64_t bytes;
};
// nullptr for an unknown id.
const GgmlTypeTraits* ggml_type_traits(uint32_t type);
const char* ggml_type_name(GgmlType t);
// Bytes of `n` elements (n a multiple of the block size: a one-line error naming `what`
// otherwise).
int64_t ggml_row_bytes(GgmlType t, int64_t n, const std::string& what);

// One metadata value. Numbers and bools keep their exact type (so a file round-trips and
// llama.cpp, which checks types, reads them); an array of numbers is stored packed (its
// bytes as in the file), so a large array costs what it costs on disk.
class GgufValue {
 public:
  GgufValue() = default;
  static GgufValue u32(uint32_t v);
  static GgufValue f32(float v);
  static GgufValue boolean(bool v);
  static GgufValue string(std::string v);
  static GgufValue strings(std::vector<std::string> v);
  static GgufValue i32s(const std::vector<int32_t>& v);
  static GgufValue f32s(const std::vector<float>& v);
  // A scalar of numeric type `t` from its little-endian bytes (used by the parser).
  static GgufValue scalar(GgufType t, const uint8_t* bytes);
  // An array of numbers of type `elem` (or bools), `count` packed little-endian values.
  static GgufValue packed_array(GgufType elem, uint64_t count, std::string bytes);
  static GgufValue array_of_arrays(std::vector<GgufValue> items);

  GgufType type() const { return type_; }
  uint64_t size() const;                          // arrays: element count

  bool is_integer() const;  // any of the eight integer types
  // Checked reads; `what` names the key in the one-line error on a type or range mismatch.
  uint64_t as_uint(const std::string& what) const;  // an integer type holding a value >= 0
  int64_t as_int(const std::string& what) const;    // an integer type holding a value in int64
  double as_float(const std::string& what) const;   // f32 or f64
  bool as_bool(const std::string& what) const;
  const std::string& as_string(const std::string& what) const;
  const std::vector<std::string>& as_strings(const std::string& what) const;  // array of strings
  // Element i of an array of integers.
  int64_t int_at(uint64_t i, const std::string& what) const;
  // Element i of an array of f32 or f64.
  double float_at(uint64_t i, const std::string& what) const;

  // The value's bytes as GGUF stores them after the u32 type tag.
  void append_to(std::string& out) const;
  std::string describe() const;  // "u32 7", "string \"llama\"", "array of 32000 string"

 private:
  GgufType type_ = GgufType::kU8;
  GgufType elem_ = GgufType::kU8;
  uint64_t count_ = 0;
  std::string bytes_;  // scalar numbers / bools and numeric arrays: little-endian; string: itself
  std::vector<std::string> strings_;
  std::vector<GgufValue> arrays_;
};

using GgufMetadata = std::vector<std::pair<std::string, GgufValue>>;

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> ne;  // dims innermost first: ne[0] is the row length (columns)
  GgmlType type = GgmlType::kF32;
  uint64_t offset = 0;      // into the data section, a multiple of the alignment
  uint64_t nbytes = 0;
  int64_t rows() const;     // product of ne[1..]
};

struct GgufHeader {
  uint32_t version = 3;
  GgufMetadata metadata;               // file order, keys unique
  std::vector<GgufTensorInfo> tensors;  // file order, names unique, data disjoint
  uint64_t alignment = kGgufDefaultAlignment;
  uint64_t data_start = 0;  // file offset of the data section
  const GgufValue* find(const std::string& key) const;
};

// Validates a whole file image: magic, version, every count, length and offset against the
// bytes there are (so nothing is allocated for what the file cannot hold), duplicate keys and
// names, value and tensor types, general.alignment, dims (1-4, row length a whole number of
// blocks, no overflow), tensor data aligned, inside the file and not overlapping another's.
// Never reads outside [data, data+size). Errors: "SOURCE: ..." naming the key or tensor.
GgufHeader parse_gguf_header(const uint8_t* data, size_t size, const std::string& source);

// A path to open as GGUF: not a directory, and its name ends in ".gguf" or it is a regular
// file starting with "GGUF".
bool is_gguf_path(const std::string& path);

// One mmap'd GGUF file; tensor data is read in place.
class GgufFile {
 public:
  // While a file is held (and the last file opened is always held), opening the same
  // unchanged path again returns it: one header parse for a command's config, weights and
  // tokenizer, and for in-process tp ranks.
  static std::shared_ptr<GgufFile> open(const std::string& path);
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const GgufHeader& header() const { return header_; }
  const std::string& path() const { return path_; }
  const GgufValue* find(const std::string& key) const { return header_.find(key); }
  const GgufTensorInfo* tensor(const std::string& name) const;  // nullptr when absent
  const uint8_t* data(const GgufTensorInfo& t) const;

 private:
  GgufFile() = default;
  static std::shared_ptr<GgufFile> open_uncached(const std::string& path);
  std::string path_;
  base::MappedFile map_;
  GgufHeader header_;
  std::unordered_map<std::string, size_t> index_;
};

// A tensor to write: its name, dims innermost first and type; the writer asks for its
// bytes (exactly ggml_row_bytes(type, ne[0]) * rows) when it reaches it.
struct GgufTensorSpec {
  std::string name;
  std::vector<int64_t> ne;
  GgmlType type = GgmlType::kF32;
};
using GgufTensorBytes = std::function<std::string(size_t index)>;

// Writes a GGUF v3 file to path + ".tmp" and renames it over `path`: the metadata (plus
// general.alignment when `alignment` is not the default), the tensor infos, then each
// tensor's bytes at the next multiple of `alignment`, in the given order, one at a time.
// Names longer than 63 bytes, duplicates and bad dims are one-line errors.
void write_gguf(const std::string& path, const GgufMetadata& metadata,
                const std::vector<GgufTensorSpec>& tensors, const GgufTensorBytes& bytes,
                uint64_t alignment = kGgufDefaultAlignment);

}  // namespace tessera::io
