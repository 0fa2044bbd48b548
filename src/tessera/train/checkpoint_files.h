// Internal to the checkpoint manager: on-disk names, XXH3-64 file digests, directory
// fsync and step-directory listing, shared by checkpoint.cc and checkpoint_verify.cc.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace tessera::train::detail {

constexpr const char* kCheckpointsDirName = "checkpoints";
constexpr const char* kChecksumsName = "checksums.json";
constexpr const char* kLatestName = "latest";
constexpr const char* kTmpPrefix = ".tmp-";
constexpr const char* kFormat = "tessera-checkpoint-v1";
constexpr const char* kHashKey = "xxh3_64";  // XXH3 64-bit, seed 0 (`xxhsum -H3` prints it)

struct FileDigest {
  uint64_t size = 0;
  uint64_t hash = 0;
};
// Throws tessera::Error naming the file.
FileDigest digest_file(const std::string& path);
uint64_t digest_bytes(const void* data, size_t size);
inline uint64_t digest_bytes(const std::string& bytes) {
  return digest_bytes(bytes.data(), bytes.size());
}
std::string hash_hex(uint64_t h);  // 16 lowercase hex digits, as xxhsum prints

// Makes the directory's entries (creates, renames) durable; throws naming it.
void fsync_dir(const std::string& dir);

bool is_plain_file_name(const std::string& name);
// "step_00000100" -> 100; nullopt unless the name is exactly checkpoint_dir_name(step).
std::optional<int64_t> parse_step_dir_name(const std::string& name);
// step -> directory name, for every step_ directory under `root` (none when it is absent).
std::map<int64_t, std::string> list_step_dirs(const std::string& root);

}  // namespace tessera::train::detail
