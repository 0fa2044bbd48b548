// Reads a JSON file (config.json, tokenizer.json, safetensors index) into nlohmann::json,
// with errors that name the file and, for syntax errors, the line, column and byte.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace tessera::io {

// Bounds for untrusted JSON (request bodies, config.json, tokenizer.json, tokenizer_config.json),
// enforced before anything is built: nlohmann's DOM is parsed iteratively but copied, dumped
// and compared recursively, so unbounded nesting would overflow the stack later.
struct JsonLimits {
  int max_depth = 128;                 // arrays/objects nested; real files need < 10
  size_t max_bytes = size_t{1} << 30;  // whole text (the largest tokenizer.json is ~35 MB)
};

// Byte offset of the first '[' or '{' nested deeper than max_depth in JSON text, or npos.
// One pass with string state, exact for valid JSON (invalid JSON is left to the parser,
// which is iterative, so an underestimate there cannot recurse).
size_t find_json_nesting_over(const std::string& text, int max_depth);

// Throws tessera::Error: "PATH: cannot open: No such file or directory",
// "PATH: is a directory", "PATH:3:15 (byte 42): invalid JSON: syntax error ...",
// "PATH:1:129 (byte 128): invalid JSON: nested deeper than 128 levels".
nlohmann::json read_json_file(const std::string& path, const JsonLimits& limits = {});

// Parses JSON text; `source` names where it came from in errors (a path, "request body").
nlohmann::json parse_json_text(const std::string& text, const std::string& source,
                               const JsonLimits& limits = {});

// The JSON library's own message without its "[json.exception.type_error.302] " prefix, for
// turning a type_error / out_of_range raised while reading `source` into a tessera::Error.
std::string json_error_text(const nlohmann::json::exception& e);

// A short description of a value for error messages: numbers, booleans and strings (cut
// at 40 bytes) as JSON; "an array of N items" / "an object" otherwise. Never recursive,
// so a hostile value cannot make the error message itself the problem.
std::string json_brief(const nlohmann::json& v);

// True when `v` is an integer in [lo, hi]. nlohmann keeps integers above INT64_MAX as
// unsigned, and get<int64_t>() would wrap them to negatives: this compares them unwrapped,
// so one check serves token ids, counts and sizes from files and requests alike.
inline bool json_int_in(const nlohmann::json& v, int64_t lo, int64_t hi) {
  if (v.is_number_unsigned()) {  // a parsed non-negative integer: lo binds too
    const uint64_t u = v.get<uint64_t>();
    return hi >= 0 && u <= static_cast<uint64_t>(hi) && (lo <= 0 || u >= static_cast<uint64_t>(lo));
  }
  return v.is_number_integer() && v.get<int64_t>() >= lo && v.get<int64_t>() <= hi;
}

// Typed optional keys of an untrusted object: `dflt` when missing or null; a value of the
// wrong type fails "where.key: expected true or false, got 3" (never the library's message).
bool json_bool(const nlohmann::json& j, const char* key, bool dflt, const std::string& where);
std::string json_string(const nlohmann::json& j, const char* key, const std::string& dflt,
                        const std::string& where);

// Whole file as bytes; throws tessera::Error naming the file on failure, or when the file is
// larger than max_bytes (checked before reading).
std::string read_file_bytes(const std::string& path, size_t max_bytes = SIZE_MAX);

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
