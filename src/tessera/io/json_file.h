// Reads a JSON file (config.json, tokenizer.json, safetensors index) into nlohmann::json,
// with errors that name the file and, for syntax errors, the line, column and byte.
#pragma once
#include <cstddef>
#include <string>

#include <nlohmann/json.hpp>

namespace tessera::io {

// Throws tessera::Error: "PATH: cannot open: No such file or directory",
// "PATH: is a directory", "PATH:3:15 (byte 42): invalid JSON: syntax error ...".
nlohmann::json read_json_file(const std::string& path);

// Parses JSON text; `source` names where it came from in errors (a path, "request body").
nlohmann::json parse_json_text(const std::string& text, const std::string& source);

// Whole file as bytes; throws tessera::Error naming the file on failure.
std::string read_file_bytes(const std::string& path);

// Writes `bytes` to path + ".tmp", fsyncs, then renames over `path`, so readers see
// either the old file or the complete new one, never a torn write.
void write_file_atomic(const std::string& path, const std::string& bytes);

// Alignment write_file_atomic_direct needs of its buffer (start and readable length).
constexpr size_t kDirectIoAlignment = 4096;
// n rounded up to a multiple of kDirectIoAlignment.
constexpr size_t round_up_direct_io(size_t n) {
  return (n + kDirectIoAlignment - 1) / kDirectIoAlignment * kDirectIoAlignment;
}

// write_file_atomic for a large image already in memory, written with O_DIRECT: the
// bytes go from `data` to the disk without the page cache's copy and writeback (on the
// dev box 3x faster and a tenth of the CPU time of a buffered write + fsync). `data`
// must be kDirectIoAlignment-aligned and readable up to `size` rounded up to that
// alignment; the file gets exactly `size` bytes. A file system that refuses O_DIRECT
// (EINVAL) is written the buffered way instead.
void write_file_atomic_direct(const std::string& path, const void* data, size_t size);

}  // namespace tessera::io
