// JSON file reading with errors that point at the file and position at fault.
#include "tessera/io/json_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "tessera/base/error.h"

namespace tessera::io {

namespace {

// nlohmann's what() starts with "[json.exception.parse_error.101] parse error at line 1,
// column 2: "; we print our own position, so keep only the text after the last ": " of
// that prefix.
std::string short_parse_message(const std::string& what) {
  const std::string marker = "parse error";
  size_t p = what.find(marker);
  if (p == std::string::npos) return what;
  size_t colon = what.find(": ", p);
  if (colon == std::string::npos) return what;
  return what.substr(colon + 2);
}

}  // namespace

nlohmann::json parse_json_text(const std::string& text, const std::string& source) {
  // nlohmann treats a NUL as the end of input and would ignore whatever follows it.
  const size_t nul = text.find('\0');
  if (nul != std::string::npos) {
    size_t line = 1 + std::count(text.begin(), text.begin() + nul, '\n');
    size_t line_start = text.rfind('\n', nul);
    size_t col = line_start == std::string::npos ? nul + 1 : nul - line_start;
    fail(source, ":", line, ":", col, " (byte ", nul, "): invalid JSON: NUL byte");
  }
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    // e.byte is 1-based and counts the offending character; turn it into line:column.
    size_t byte = e.byte > 0 ? e.byte - 1 : 0;
    if (byte > text.size()) byte = text.size();
    size_t line = 1, col = 1;
    for (size_t i = 0; i < byte; ++i) {
      if (text[i] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    fail(source, ":", line, ":", col, " (byte ", byte, "): invalid JSON: ",
         short_parse_message(e.what()));
  }
}

std::string read_file_bytes(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, ": cannot open: ", std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    fail(path, ": cannot stat: ", std::strerror(err));
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    fail(path, ": is a directory, expected a file");
  }
  std::string out;
  if (S_ISREG(st.st_mode)) out.reserve(static_cast<size_t>(st.st_size));
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      fail(path, ": read failed: ", std::strerror(err));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

nlohmann::json read_json_file(const std::string& path) {
  return parse_json_text(read_file_bytes(path), path);
}

namespace {

// path + ".tmp" written from `data`, fsync'd and renamed over `path`; the tmp file is
// removed when anything fails. `direct`: O_DIRECT writes of whole aligned blocks (the
// buffer is readable up to the rounded-up size), then truncated to `size`.
void write_atomic(const std::string& path, const char* data, size_t size, bool direct) {
  const std::string tmp = path + ".tmp";
  constexpr int kFlags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
  int fd = direct ? ::open(tmp.c_str(), kFlags | O_DIRECT, 0644) : -1;
  if (fd < 0 && direct && errno != EINVAL) fail(tmp, ": cannot create: ", std::strerror(errno));
  direct = fd >= 0;
  if (fd < 0) fd = ::open(tmp.c_str(), kFlags, 0644);
  if (fd < 0) fail(tmp, ": cannot create: ", std::strerror(errno));
  auto give_up = [&](const char* what, int err) {
    ::close(fd);
    ::unlink(tmp.c_str());
    fail(tmp, what, std::strerror(err));
  };
  size_t done = 0;
  if (direct) {
    constexpr size_t kChunk = size_t{32} << 20;  // each O_DIRECT write waits for the disk
    const size_t padded = round_up_direct_io(size);
    while (done < padded) {
      const ssize_t n = ::pwrite(fd, data + done, std::min(kChunk, padded - done),
                                 static_cast<off_t>(done));
      if (n >= 0) {
        done += static_cast<size_t>(n);
        if (done % kDirectIoAlignment == 0) continue;
      } else if (errno == EINTR) {
        continue;
      } else if (errno != EINVAL) {
        give_up(": write failed: ", errno);
      }
      // The device wants a larger alignment, or a short write left an unaligned offset:
      // the rest goes through the page cache.
      const int flags = ::fcntl(fd, F_GETFL);
      if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_DIRECT) != 0)
        give_up(": cannot leave O_DIRECT: ", errno);
      break;
    }
    done = std::min(done, size);
  }
  while (done < size) {
    const ssize_t n = ::pwrite(fd, data + done, size - done, static_cast<off_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      give_up(": write failed: ", errno);
    }
    done += static_cast<size_t>(n);
  }
  if (direct && ::ftruncate(fd, static_cast<off_t>(size)) != 0)  // drop the block padding
    give_up(": cannot truncate: ", errno);
  int rc = ::fsync(fd);
  int err = errno;
  if (::close(fd) != 0 && rc == 0) {
    rc = -1;
    err = errno;
  }
  if (rc != 0) {
    ::unlink(tmp.c_str());
    fail(tmp, ": cannot flush to disk: ", std::strerror(err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    err = errno;
    ::unlink(tmp.c_str());
    fail(path, ": cannot rename ", tmp, " into place: ", std::strerror(err));
  }
}

}  // namespace

void write_file_atomic(const std::string& path, const std::string& bytes) {
  write_atomic(path, bytes.data(), bytes.size(), /*direct=*/false);
}

void write_file_atomic_direct(const std::string& path, const void* data, size_t size) {
  TESSERA_CHECK(reinterpret_cast<uintptr_t>(data) % kDirectIoAlignment == 0, path,
                ": write_file_atomic_direct needs a ", kDirectIoAlignment,
                "-byte aligned buffer");
  write_atomic(path, static_cast<const char*>(data), size, /*direct=*/true);
}

}  // namespace tessera::io
