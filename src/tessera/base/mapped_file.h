// A whole regular file mapped into memory: what the safetensors, GGUF and token-shard
// readers share. Errors are one line naming the path (cannot open, cannot stat, not a
// regular file, mmap failed). An empty file maps to no bytes (data() null, size() 0);
// each reader says what is too small for its format.
#pragma once
#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace tessera::base {

class MappedFile {
 public:
  enum class Mode {
    kReadOnly,         // PROT_READ, MAP_SHARED
    kPrivateWritable,  // copy-on-write: writes touch private pages, never the file
  };
  // `what` names the file's kind in the open error ("token shard"); "" for none.
  static MappedFile map(const std::string& path, Mode mode = Mode::kReadOnly, const std::string& what = "");

  MappedFile() = default;
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  uint8_t* data() const { return static_cast<uint8_t*>(map_); }
  size_t size() const { return bytes_; }
  const struct stat& stat() const { return st_; }  // of the file when it was mapped

 private:
  void* map_ = nullptr;
  size_t bytes_ = 0;
  struct stat st_ {};
};

}  // namespace tessera::base
