// Writing safetensors files (single and sharded) in the byte layout the reference library
// writes, via a temporary file and a rename so a crash never leaves a torn checkpoint.
#include <cstdio>
#include <filesystem>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/io/atomic_file.h"
#include "tessera/io/json_file.h"
#include "tessera/io/safetensors.h"

namespace tessera::io {

namespace fs = std::filesystem;

namespace {

constexpr const char* kSingleName = "model.safetensors";
constexpr const char* kIndexName = "model.safetensors.index.json";

// Builds the padded header text; ordered_json keeps the caller's tensor order.
std::string build_header(const std::string& path,
                         const std::vector<std::pair<std::string, Tensor>>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json md = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) md[k] = v;
    h["__metadata__"] = std::move(md);
  }
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    TESSERA_CHECK(name != "__metadata__", path, ": '__metadata__' is reserved, not a tensor name");
    TESSERA_CHECK(seen.insert(name).second, path, ": duplicate tensor name '", name, "'");
    TESSERA_CHECK(t.defined(), path, ": tensor '", name, "' is undefined");
    TESSERA_CHECK(t.device() == Device::kCPU, path, ": tensor '", name,
                  "' must be on the CPU to be saved");
    nlohmann::ordered_json e;
    e["dtype"] = safetensors_dtype_name(t.dtype());
    e["shape"] = t.shape();
    const uint64_t n = t.nbytes();
    e["data_offsets"] = {offset, offset + n};
    offset += n;
    h[name] = std::move(e);
  }
  std::string text;
  try {
    text = h.dump(-1, ' ', false, nlohmann::json::error_handler_t::strict);
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": a tensor name or metadata string is not valid UTF-8: ", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // the library aligns the data start to 8
  TESSERA_CHECK(text.size() <= kMaxSafetensorsHeaderBytes, path, ": header would be ",
                text.size(), " bytes, over the safetensors limit");
  return text;
}

std::string shard_name(size_t k, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k, n);
  return buf;
}

// Deletes files of an earlier save that the new layout does not use, so a loader never
// mixes old shards (or an old index) with the new weights.
void remove_stale(const fs::path& dir, const std::set<std::string>& keep) {
  static const std::regex kShard(R"(model-\d{5}-of-\d{5}\.safetensors)");
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool ours = name == kSingleName || name == kIndexName ||
                      std::regex_match(name, kShard);
    if (ours && !keep.count(name)) fs::remove(entry.path(), ec);
  }
}

}  // namespace

std::string safetensors_prefix(const std::string& path,
                               const std::vector<std::pair<std::string, Tensor>>& tensors,
                               const std::map<std::string, std::string>& metadata) {
  const std::string header = build_header(path, tensors, metadata);
  std::string prefix(8, '\0');
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>(header.size() >> (8 * i));
  return prefix + header;
}

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  const std::string prefix = safetensors_prefix(path, tensors, metadata);
  AtomicFileWriter w(path);
  w.write(prefix.data(), prefix.size());
  for (const auto& [name, t] : tensors) {
    const Tensor c = t.contiguous();
    if (c.nbytes() > 0) w.write(c.raw_data(), c.nbytes());
  }
  w.commit();
}

void save_safetensors_sharded(const std::string& dir,
                              const std::vector<std::pair<std::string, Tensor>>& tensors,
                              uint64_t max_shard_bytes,
                              const std::map<std::string, std::string>& metadata) {
  TESSERA_CHECK(max_shard_bytes > 0, dir, ": max_shard_bytes must be positive");
  std::error_code ec;
  fs::create_directories(dir, ec);
  TESSERA_CHECK(fs::is_directory(dir), dir, ": cannot create directory: ", ec.message());

  // Greedy in the given order, as huggingface_hub splits state dicts.
  std::vector<std::vector<std::pair<std::string, Tensor>>> shards(1);
  uint64_t cur = 0, total = 0;
  for (const auto& nt : tensors) {
    const uint64_t n = nt.second.defined() ? nt.second.nbytes() : 0;
    if (!shards.back().empty() && cur + n > max_shard_bytes) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(nt);
    cur += n;
    total += n;
  }

  const fs::path d(dir);
  if (shards.size() == 1) {
    save_safetensors((d / kSingleName).string(), tensors, metadata);
    remove_stale(d, {kSingleName});
    return;
  }
  // Reject duplicates across shards before writing anything (each shard checks its own).
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors)
    TESSERA_CHECK(seen.insert(name).second, dir, ": duplicate tensor name '", name, "'");

  nlohmann::json weight_map = nlohmann::json::object();
  std::set<std::string> keep = {kIndexName};
  for (size_t k = 0; k < shards.size(); ++k) {
    const std::string name = shard_name(k + 1, shards.size());
    save_safetensors((d / name).string(), shards[k], metadata);
    for (const auto& nt : shards[k]) weight_map[nt.first] = name;
    keep.insert(name);
  }
  nlohmann::json index;
  index["metadata"] = {{"total_size", total}};
  index["weight_map"] = std::move(weight_map);
  write_file_atomic((d / kIndexName).string(), index.dump(2) + "\n");
  remove_stale(d, keep);
}

}  // namespace tessera::io
