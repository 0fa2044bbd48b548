// AtomicFileWriter: write to PATH.tmp, fsync, rename over PATH.
#include "tessera/io/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "tessera/base/error.h"

namespace tessera::io {

AtomicFileWriter::AtomicFileWriter(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(tmp_, ": cannot create: ", std::strerror(errno));
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void AtomicFileWriter::write(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  written_ += n;
  while (n > 0) {
    ssize_t w = ::write(fd_, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail(tmp_, ": write failed: ", std::strerror(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void AtomicFileWriter::commit() {
  int rc = ::fsync(fd_);
  int err = errno;
  if (::close(fd_) != 0 && rc == 0) {
    rc = -1;
    err = errno;
  }
  fd_ = -1;
  if (rc != 0) {
    ::unlink(tmp_.c_str());
    fail(tmp_, ": cannot flush to disk: ", std::strerror(err));
  }
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    err = errno;
    ::unlink(tmp_.c_str());
    fail(path_, ": cannot rename ", tmp_, " into place: ", std::strerror(err));
  }
}

}  // namespace tessera::io
