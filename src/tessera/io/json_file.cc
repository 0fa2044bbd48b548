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

// "source:line:col (byte N): invalid JSON: what" for the 0-based byte offset `byte`.
[[noreturn]] void fail_at(const std::string& text, size_t byte, const std::string& source,
                          const std::string& what) {
  if (byte > text.size()) byte = text.size();
  const size_t line = 1 + std::count(text.begin(), text.begin() + byte, '\n');
  const size_t line_start = byte == 0 ? std::string::npos : text.rfind('\n', byte - 1);
  const size_t col = line_start == std::string::npos ? byte + 1 : byte - line_start;
  fail(source, ":", line, ":", col, " (byte ", byte, "): invalid JSON: ", what);
}

}  // namespace

size_t find_json_nesting_over(const std::string& text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return i;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return std::string::npos;
}


std::string json_error_text(const nlohmann::json::exception& e) {
  const std::string what = e.what();
  const size_t close = what.find("] ");
  return what.rfind("[json.exception.", 0) == 0 && close != std::string::npos ? what.substr(close + 2) : what;
}

std::string json_brief(const nlohmann::json& v) {
  if (v.is_array()) return "an array of " + std::to_string(v.size()) + " items";
  if (v.is_object()) return "an object";
  if (v.is_string() && v.get_ref<const std::string&>().size() > 40) {
    std::string head = v.get_ref<const std::string&>().substr(0, 40);
    while (!head.empty() && (static_cast<unsigned char>(head.back()) & 0xC0) == 0x80) head.pop_back();
    if (!head.empty() && static_cast<unsigned char>(head.back()) >= 0xC0) head.pop_back();
    return nlohmann::json(head).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "...";
  }
  return v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

bool json_bool(const nlohmann::json& j, const char* key, bool dflt, const std::string& where) {
  const auto it = j.is_object() ? j.find(key) : j.end();
  if (it == j.end() || it->is_null()) return dflt;
  TESSERA_CHECK(it->is_boolean(), where, ".", key, ": expected true or false, got ", json_brief(*it));
  return it->get<bool>();
}

std::string json_string(const nlohmann::json& j, const char* key, const std::string& dflt,
                        const std::string& where) {
  const auto it = j.is_object() ? j.find(key) : j.end();
  if (it == j.end() || it->is_null()) return dflt;
  TESSERA_CHECK(it->is_string(), where, ".", key, ": expected a string, got ", json_brief(*it));
  return it->get<std::string>();
}

nlohmann::json parse_json_text(const std::string& text, const std::string& source, const JsonLimits& limits) {
  if (text.size() > limits.max_bytes)
    fail(source, ": ", text.size(), " bytes of JSON exceed the limit of ", limits.max_bytes);
  // nlohmann treats a NUL as the end of input and would ignore whatever follows it.
  const size_t nul = text.find('\0');
  if (nul != std::string::npos) fail_at(text, nul, source, "NUL byte");
  const size_t deep = find_json_nesting_over(text, limits.max_depth);
  if (deep != std::string::npos)
    fail_at(text, deep, source, "nested deeper than " + std::to_string(limits.max_depth) + " levels");
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    // e.byte is 1-based and counts the offending character.
    fail_at(text, e.byte > 0 ? e.byte - 1 : 0, source, short_parse_message(e.what()));
  } catch (const nlohmann::json::exception& e) {  // out_of_range.406: a number such as 1e999
    fail(source, ": invalid JSON: ", json_error_text(e));
  }
}

std::string read_file_bytes(const std::string& path, size_t max_bytes) {
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
  if (S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    fail(path, ": ", st.st_size, " bytes exceed the limit of ", max_bytes, " for this file");
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
    if (out.size() + static_cast<size_t>(n) > max_bytes) {  // a pipe or device that keeps going
      ::close(fd);
      fail(path, ": more than ", max_bytes, " bytes, the limit for this file");
    }
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

nlohmann::json read_json_file(const std::string& path, const JsonLimits& limits) {
  return parse_json_text(read_file_bytes(path, limits.max_bytes), path, limits);
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
