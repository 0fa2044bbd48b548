// Hugging Face safetensors files: a validating header parser, zero-copy mmap reading of
// single and sharded checkpoints, and crash-safe writing in the layout the library writes.
//
// File layout: u64 little-endian N, N bytes of JSON header, then the data buffer. The
// header maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]} with
// offsets relative to the buffer start, plus an optional "__metadata__" {str: str}.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tessera/base/mapped_file.h"
#include "tessera/tensor/tensor.h"

namespace tessera::io {

// The reference library refuses headers above 100 MB; so do we (reading and writing).
constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t begin = 0;  // byte offsets into the data buffer, end exclusive
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;  // sorted by data offsets, as the library orders them
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // file offset of the data buffer: 8 + N
};

// Safetensors dtype names ("F32", "BF16", ...) for the dtypes Tessera has.
const char* safetensors_dtype_name(DType dt);

// Validates a whole file image (header and data buffer) the way the safetensors library
// does, plus duplicate names and exact field sets. Never reads outside [data, data+size).
// `source` names the file in errors: "SOURCE: tensor 'NAME': ...". Throws tessera::Error.
SafetensorsHeader parse_safetensors_header(const uint8_t* data, size_t size,
                                           const std::string& source);

// One mmap'd safetensors file. Tensors are views into the mapping (zero-copy) that keep
// it alive. The mapping is private copy-on-write: writing to a returned tensor changes
// only this process's copy, never the file.
class SafetensorsFile : public std::enable_shared_from_this<SafetensorsFile> {
 public:
  static std::shared_ptr<SafetensorsFile> open(const std::string& path);
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const SafetensorsHeader& header() const { return header_; }
  const std::string& path() const { return path_; }
  bool has(const std::string& name) const { return index_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;  // throws naming tensor and file
  // A view of the tensor's bytes, or an aligned copy when the file places the data at an
  // offset that is not a multiple of the element size (the library never writes that).
  Tensor get(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  base::MappedFile map_;
  SafetensorsHeader header_;
  std::unordered_map<std::string, size_t> index_;  // name -> header_.tensors index
};

// A model's weights: a directory holding model.safetensors or a sharded checkpoint
// (model.safetensors.index.json + shards), or a path to either file. Like transformers,
// model.safetensors wins when both exist, and a sharded checkpoint holds exactly the
// names in the index's weight_map (extra tensors inside shards are ignored).
class SafetensorsModel {
 public:
  static SafetensorsModel open(const std::string& dir_or_file);

  std::vector<std::string> names() const;  // sorted
  bool has(const std::string& name) const { return where_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;
  Tensor get(const std::string& name) const;  // throws naming the tensor and the model
  const std::string& path() const { return path_; }
  const std::vector<std::shared_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  std::string path_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;  // name -> files_ index
};

// The bytes a safetensors file of these tensors starts with: the 8-byte little-endian
// header length and the JSON header (padded with spaces to a multiple of 8 bytes like
// the library pads it). The tensors' bytes follow in the given order, back to back.
// Checks names and tensors as save_safetensors does; `path` names the file in errors.
std::string safetensors_prefix(const std::string& path,
                               const std::vector<std::pair<std::string, Tensor>>& tensors,
                               const std::map<std::string, std::string>& metadata = {});

// Writes tensors in the given order to path + ".tmp", then renames it over `path`.
// The header is padded with spaces to a multiple of 8 bytes like the library pads it.
// Non-contiguous tensors are written contiguously. Throws on duplicate names.
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Writes `dir`/model.safetensors when everything fits in max_shard_bytes, else shards
// model-0000k-of-0000n.safetensors filled greedily in order (a tensor larger than the
// limit gets a shard of its own) plus model.safetensors.index.json with
// metadata.total_size and the weight_map. `metadata` goes into every shard's header.
// Stale files of the other layout left in `dir` by an earlier save are removed.
void save_safetensors_sharded(const std::string& dir,
                              const std::vector<std::pair<std::string, Tensor>>& tensors,
                              uint64_t max_shard_bytes,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace tessera::io
