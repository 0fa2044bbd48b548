// Writing a file so that readers see either the old file or the complete new one: the bytes
// go to PATH.tmp, which is fsynced and renamed over PATH only once everything is written.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace tessera::io {

class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path);  // creates path + ".tmp"
  // Without commit() (an error interrupted the write) the temporary file is removed.
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(const void* data, size_t n);
  uint64_t written() const { return written_; }
  // fsync + close, then rename over the final path.
  void commit();

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  uint64_t written_ = 0;
};

}  // namespace tessera::io
