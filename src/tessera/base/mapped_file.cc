// Mapping whole files (mapped_file.h).
#include "tessera/base/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "tessera/base/error.h"

namespace tessera::base {

MappedFile MappedFile::map(const std::string& path, Mode mode, const std::string& what) {
  MappedFile f;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, ": cannot open", what.empty() ? "" : " " + what, ": ", std::strerror(errno));
  if (::fstat(fd, &f.st_) != 0) {
    const int err = errno;
    ::close(fd);
    fail(path, ": cannot stat: ", std::strerror(err));
  }
  if (!S_ISREG(f.st_.st_mode)) {
    ::close(fd);
    fail(path, ": not a regular file");
  }
  const size_t bytes = static_cast<size_t>(f.st_.st_size);
  if (bytes > 0) {
    const bool priv = mode == Mode::kPrivateWritable;
    void* m = ::mmap(nullptr, bytes, priv ? PROT_READ | PROT_WRITE : PROT_READ, priv ? MAP_PRIVATE : MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);  // the mapping keeps the file referenced
    if (m == MAP_FAILED) fail(path, ": mmap of ", bytes, " bytes failed: ", std::strerror(err));
    f.map_ = m;
    f.bytes_ = bytes;
  } else {
    ::close(fd);
  }
  return f;
}

MappedFile::MappedFile(MappedFile&& o) noexcept
    : map_(std::exchange(o.map_, nullptr)), bytes_(std::exchange(o.bytes_, 0)), st_(o.st_) {}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    if (map_) ::munmap(map_, bytes_);
    map_ = std::exchange(o.map_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    st_ = o.st_;
  }
  return *this;
}

MappedFile::~MappedFile() {
  if (map_) ::munmap(map_, bytes_);
}

}  // namespace tessera::base
