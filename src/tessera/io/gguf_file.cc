// Opening GGUF files (one read-only mmap, tensors read in place) and writing them.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <unordered_set>

#include "tessera/base/error.h"
#include "tessera/io/atomic_file.h"
#include "tessera/io/gguf.h"

namespace tessera::io {
namespace {

int64_t mtime_ns(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

}  // namespace

bool is_gguf_path(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return false;  // a model directory, whatever its name
  if (path.size() >= 5 && path.compare(path.size() - 5, 5, ".gguf") == 0) return true;
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  std::ifstream f(path, std::ios::binary);
  char magic[4] = {};
  return f.read(magic, 4) && std::memcmp(magic, "GGUF", 4) == 0;
}

std::shared_ptr<GgufFile> GgufFile::open(const std::string& path) {
  // Opened files are shared while someone holds them, and the last one opened is held
  // here: the tensor-parallel ranks of one process, and a command reading the config, the
  // weights and the tokenizer one after another, parse the header once. A file replaced
  // since (another inode, size or mtime) is opened afresh.
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<GgufFile>> open_files;
  static std::shared_ptr<GgufFile> last;
  std::lock_guard<std::mutex> lock(mu);
  struct stat now;
  if (::stat(path.c_str(), &now) == 0) {
    auto it = open_files.find(path);
    if (it != open_files.end())
      if (auto f = it->second.lock(); f && f->map_.stat().st_ino == now.st_ino && f->map_.stat().st_dev == now.st_dev &&
                                      f->map_.stat().st_size == now.st_size &&
                                      mtime_ns(f->map_.stat()) == mtime_ns(now))
        return last = f;
  }
  std::shared_ptr<GgufFile> f = open_uncached(path);
  for (auto it = open_files.begin(); it != open_files.end();) it = it->second.expired() ? open_files.erase(it) : std::next(it);
  open_files[path] = f;
  last = f;
  return f;
}

std::shared_ptr<GgufFile> GgufFile::open_uncached(const std::string& path) {
  std::shared_ptr<GgufFile> f(new GgufFile());
  f->path_ = path;
  f->map_ = base::MappedFile::map(path);
  if (f->map_.size() == 0) fail(path, ": empty file, not a GGUF file");
  f->header_ = parse_gguf_header(f->map_.data(), f->map_.size(), path);
  for (size_t i = 0; i < f->header_.tensors.size(); ++i) f->index_.emplace(f->header_.tensors[i].name, i);
  return f;
}

const GgufTensorInfo* GgufFile::tensor(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

const uint8_t* GgufFile::data(const GgufTensorInfo& t) const {
  return map_.data() + header_.data_start + t.offset;
}

// ---- writer ----------------------------------------------------------------------------

namespace {

void put_u32(std::string& s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s += static_cast<char>(v >> (8 * i));
}
void put_u64(std::string& s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s += static_cast<char>(v >> (8 * i));
}
void put_string(std::string& s, const std::string& v) {
  put_u64(s, v.size());
  s += v;
}

}  // namespace

void write_gguf(const std::string& path, const GgufMetadata& metadata,
                const std::vector<GgufTensorSpec>& tensors, const GgufTensorBytes& bytes,
                uint64_t alignment) {
  TESSERA_CHECK(alignment > 0 && (alignment & (alignment - 1)) == 0 && alignment <= UINT32_MAX, path,
                ": alignment ", alignment, " is not a power of two");
  GgufMetadata meta = metadata;
  std::unordered_set<std::string> keys;
  for (const auto& [k, v] : meta) TESSERA_CHECK(keys.insert(k).second, path, ": duplicate metadata key '", k, "'");
  if (keys.count("general.alignment")) {
    for (const auto& [k, v] : meta)
      if (k == "general.alignment")
        TESSERA_CHECK(v.type() == GgufType::kU32 && v.as_uint(k) == alignment, path,
                      ": general.alignment ", v.describe(), " disagrees with the alignment ", alignment);
  } else if (alignment != kGgufDefaultAlignment) {
    meta.emplace_back("general.alignment", GgufValue::u32(static_cast<uint32_t>(alignment)));
  }

  std::string head = "GGUF";
  put_u32(head, 3);
  put_u64(head, tensors.size());
  put_u64(head, meta.size());
  for (const auto& [k, v] : meta) {
    put_string(head, k);
    put_u32(head, static_cast<uint32_t>(v.type()));
    v.append_to(head);
  }
  std::unordered_set<std::string> names;
  std::vector<uint64_t> sizes;
  uint64_t offset = 0;
  for (const GgufTensorSpec& t : tensors) {
    const std::string what = path + ": tensor '" + t.name + "'";
    TESSERA_CHECK(!t.name.empty() && t.name.size() <= kGgufMaxNameBytes, what, ": names are 1 to ",
                  kGgufMaxNameBytes, " bytes in GGUF");
    TESSERA_CHECK(names.insert(t.name).second, path, ": duplicate tensor name '", t.name, "'");
    TESSERA_CHECK(!t.ne.empty() && t.ne.size() <= static_cast<size_t>(kGgufMaxDims), what, " has ",
                  t.ne.size(), " dims (1 to ", kGgufMaxDims, " are valid)");
    int64_t rows = 1;
    for (size_t d = 0; d < t.ne.size(); ++d) {
      TESSERA_CHECK(t.ne[d] >= 0, what, ": dim ", d, " is negative");
      if (d > 0) rows *= t.ne[d];
    }
    const uint64_t n = static_cast<uint64_t>(ggml_row_bytes(t.type, t.ne[0], what) * rows);
    put_string(head, t.name);
    put_u32(head, static_cast<uint32_t>(t.ne.size()));
    for (int64_t d : t.ne) put_u64(head, static_cast<uint64_t>(d));
    put_u32(head, static_cast<uint32_t>(t.type));
    put_u64(head, offset);
    sizes.push_back(n);
    offset = (offset + n + alignment - 1) / alignment * alignment;
  }
  head.append((alignment - head.size() % alignment) % alignment, '\0');

  AtomicFileWriter w(path);
  w.write(head.data(), head.size());
  const uint64_t data_start = head.size();
  static const char kZeros[64] = {};
  for (size_t i = 0; i < tensors.size(); ++i) {
    while ((w.written() - data_start) % alignment != 0)
      w.write(kZeros, std::min<uint64_t>(sizeof kZeros, alignment - (w.written() - data_start) % alignment));
    const std::string b = bytes(i);
    TESSERA_CHECK(b.size() == sizes[i], path, ": tensor '", tensors[i].name, "' came with ", b.size(),
                  " bytes, its dims and type need ", sizes[i]);
    w.write(b.data(), b.size());
  }
  w.commit();
}

}  // namespace tessera::io
