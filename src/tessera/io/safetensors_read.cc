// Opening safetensors checkpoints: one mmap per file, tensors as zero-copy views, and
// sharded checkpoints resolved through model.safetensors.index.json.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "tessera/base/error.h"
#include "tessera/io/json_file.h"
#include "tessera/io/safetensors.h"

namespace tessera::io {

namespace fs = std::filesystem;

// ---- SafetensorsFile ----

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::shared_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  // Private and writable: in-place updates to loaded weights (fine-tuning) copy the
  // touched pages instead of faulting, and the file on disk never changes.
  f->map_ = base::MappedFile::map(path, base::MappedFile::Mode::kPrivateWritable);
  f->header_ = parse_safetensors_header(f->map_.data(), f->map_.size(), path);  // "too small" under 8 bytes
  f->index_.reserve(f->header_.tensors.size());
  for (size_t i = 0; i < f->header_.tensors.size(); ++i)
    f->index_.emplace(f->header_.tensors[i].name, i);
  return f;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = index_.find(name);
  TESSERA_CHECK(it != index_.end(), path_, ": no tensor '", name, "' (file has ",
                header_.tensors.size(), " tensors)");
  return header_.tensors[it->second];
}

Tensor SafetensorsFile::get(const std::string& name) const {
  const TensorInfo& ti = info(name);
  uint8_t* p = map_.data() + header_.data_start + ti.begin;
  // The mapping is page aligned, so alignment depends only on the file offset.
  const uint64_t item = dtype_size(ti.dtype);
  if ((header_.data_start + ti.begin) % item == 0) {
    auto self = std::const_pointer_cast<SafetensorsFile>(shared_from_this());
    return Tensor::from_blob(p, ti.shape, ti.dtype, std::static_pointer_cast<void>(self));
  }
  Tensor t = Tensor::empty(ti.shape, ti.dtype);
  if (ti.end > ti.begin) std::memcpy(t.raw_data(), p, ti.end - ti.begin);
  return t;
}

// ---- SafetensorsModel ----

namespace {

constexpr const char* kSingleName = "model.safetensors";
constexpr const char* kIndexName = "model.safetensors.index.json";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Shard names in a weight_map are file names relative to the index; refuse anything that
// could point outside the model directory.
void check_shard_name(const std::string& shard, const std::string& tensor,
                      const std::string& index_path) {
  const fs::path p(shard);
  bool ok = !shard.empty() && p.is_relative();
  for (const auto& part : p)
    if (part == "..") ok = false;
  TESSERA_CHECK(ok, index_path, ": weight_map maps tensor '", tensor, "' to '", shard,
                "', which is not a file name inside the model directory");
}

}  // namespace

SafetensorsModel SafetensorsModel::open(const std::string& dir_or_file) {
  SafetensorsModel m;
  m.path_ = dir_or_file;
  std::error_code ec;
  std::string index_path;
  if (fs::is_directory(dir_or_file, ec)) {
    const fs::path single = fs::path(dir_or_file) / kSingleName;
    const fs::path index = fs::path(dir_or_file) / kIndexName;
    if (fs::exists(single, ec)) {
      m.files_.push_back(SafetensorsFile::open(single.string()));
    } else if (fs::exists(index, ec)) {
      index_path = index.string();
    } else {
      fail(dir_or_file, ": no ", kSingleName, " or ", kIndexName, " in this directory");
    }
  } else if (ends_with(dir_or_file, ".json")) {
    index_path = dir_or_file;
  } else {
    m.files_.push_back(SafetensorsFile::open(dir_or_file));
  }

  if (index_path.empty()) {
    for (const TensorInfo& t : m.files_[0]->header().tensors) m.where_[t.name] = 0;
    return m;
  }

  const nlohmann::json idx = read_json_file(index_path);
  TESSERA_CHECK(idx.is_object(), index_path, ": expected a JSON object");
  TESSERA_CHECK(idx.contains("weight_map") && idx["weight_map"].is_object(), index_path,
                ": missing object 'weight_map'");
  const fs::path base = fs::path(index_path).parent_path();
  std::map<std::string, size_t> file_of_shard;
  for (const auto& [name, shard_json] : idx["weight_map"].items()) {
    TESSERA_CHECK(shard_json.is_string(), index_path, ": weight_map entry for tensor '", name,
                  "' must be a file name string");
    const std::string shard = shard_json.get<std::string>();
    auto it = file_of_shard.find(shard);
    if (it == file_of_shard.end()) {
      check_shard_name(shard, name, index_path);
      const fs::path shard_path = base / shard;
      TESSERA_CHECK(fs::exists(shard_path, ec), index_path, ": shard '", shard,
                    "' (holding tensor '", name, "') does not exist at ", shard_path.string());
      m.files_.push_back(SafetensorsFile::open(shard_path.string()));
      it = file_of_shard.emplace(shard, m.files_.size() - 1).first;
    }
    TESSERA_CHECK(m.files_[it->second]->has(name), index_path, ": weight_map puts tensor '",
                  name, "' in ", shard, ", but that file has no such tensor");
    m.where_[name] = it->second;
  }
  return m;
}

std::vector<std::string> SafetensorsModel::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, _] : where_) out.push_back(name);
  return out;
}

const TensorInfo& SafetensorsModel::info(const std::string& name) const {
  auto it = where_.find(name);
  TESSERA_CHECK(it != where_.end(), path_, ": no tensor '", name, "' in this model (",
                where_.size(), " tensors)");
  return files_[it->second]->info(name);
}

Tensor SafetensorsModel::get(const std::string& name) const {
  auto it = where_.find(name);
  TESSERA_CHECK(it != where_.end(), path_, ": no tensor '", name, "' in this model (",
                where_.size(), " tensors)");
  return files_[it->second]->get(name);
}

}  // namespace tessera::io
