// Checkpoint verification (sizes and XXH3-64 checksums from checksums.json) and the
// search for the newest checkpoint that verifies, falling back to older ones.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/base/logging.h"
#include "tessera/io/json_file.h"
#include "tessera/train/checkpoint.h"
#include "tessera/train/checkpoint_files.h"

namespace tessera::train {

namespace fs = std::filesystem;

std::string checkpoint_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

namespace detail {

FileDigest digest_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, ": cannot open: ", std::strerror(errno));
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                  &XXH3_freeState);
  if (!state) {
    ::close(fd);
    fail(path, ": out of memory for the checksum state");
  }
  XXH3_64bits_reset(state.get());
  constexpr size_t kChunk = size_t{4} << 20;
  std::unique_ptr<char[]> buf(new char[kChunk]);
  FileDigest d;
  for (;;) {
    const ssize_t n = ::read(fd, buf.get(), kChunk);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      fail(path, ": read failed: ", std::strerror(err));
    }
    if (n == 0) break;
    XXH3_64bits_update(state.get(), buf.get(), static_cast<size_t>(n));
    d.size += static_cast<uint64_t>(n);
  }
  ::close(fd);
  d.hash = XXH3_64bits_digest(state.get());
  return d;
}

uint64_t digest_bytes(const void* data, size_t size) { return XXH3_64bits(data, size); }

std::string hash_hex(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail(dir, ": cannot open directory to sync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) fail(dir, ": cannot flush directory to disk: ", std::strerror(err));
}

bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find('/') == std::string::npos && name.find('\0') == std::string::npos;
}

std::optional<int64_t> parse_step_dir_name(const std::string& name) {
  if (name.size() < 13 || name.size() > 23 || name.rfind("step_", 0) != 0) return std::nullopt;
  int64_t step = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    step = step * 10 + (name[i] - '0');
  }
  if (checkpoint_dir_name(step) != name) return std::nullopt;  // one spelling per step
  return step;
}

std::map<int64_t, std::string> list_step_dirs(const std::string& root) {
  std::map<int64_t, std::string> dirs;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    const auto step = parse_step_dir_name(name);
    if (step && entry.is_directory(ec)) dirs.emplace(*step, name);
  }
  return dirs;
}

}  // namespace detail

bool CheckpointManager::verify(const std::string& step_dir, std::string* why) {
  auto bad = [&](const std::string& msg) {
    if (why) *why = msg;
    return false;
  };
  const fs::path dir(step_dir);
  const std::string sums_path = (dir / detail::kChecksumsName).string();
  nlohmann::json sums;
  try {
    sums = io::read_json_file(sums_path);
  } catch (const Error& e) {
    return bad(e.what());
  }
  if (!sums.is_object() || sums.value("format", "") != detail::kFormat ||
      !sums.contains("files") || !sums["files"].is_object())
    return bad(sums_path + ": not a Tessera checksums file (want {\"format\": \"" +
               detail::kFormat + "\", \"files\": {...}})");
  const auto dir_step = detail::parse_step_dir_name(dir.filename().string());
  if (dir_step && (!sums.contains("step") || !sums["step"].is_number_integer() ||
                   sums["step"].get<int64_t>() != *dir_step))
    return bad(sums_path + ": records step " + sums.value("step", nlohmann::json()).dump() +
               ", but the directory is " + dir.filename().string());

  struct Entry {
    std::string path;
    uint64_t size;
    std::string hash;
  };
  std::vector<Entry> entries;
  for (const auto& [name, e] : sums["files"].items()) {
    if (!detail::is_plain_file_name(name) || name == detail::kChecksumsName)
      return bad(sums_path + ": bad file name '" + name + "'");
    if (!e.is_object() || !e.contains("size") || !e["size"].is_number_unsigned() ||
        !e.contains(detail::kHashKey) || !e[detail::kHashKey].is_string())
      return bad(sums_path + ": entry '" + name + "' needs \"size\" and \"" + detail::kHashKey +
                 "\"");
    entries.push_back({(dir / name).string(), e["size"].get<uint64_t>(),
                       e[detail::kHashKey].get<std::string>()});
  }
  // Sizes first: a truncated file is reported without reading gigabytes.
  for (const auto& e : entries) {
    struct stat st;
    if (::stat(e.path.c_str(), &st) != 0)
      return bad(e.path + ": listed in checksums.json but cannot be read: " + std::strerror(errno));
    if (!S_ISREG(st.st_mode)) return bad(e.path + ": not a regular file");
    if (static_cast<uint64_t>(st.st_size) != e.size)
      return bad(e.path + ": " + std::to_string(st.st_size) + " bytes, checksums.json says " +
                 std::to_string(e.size) + " (truncated or changed)");
  }
  for (const auto& e : entries) {
    try {
      const detail::FileDigest d = detail::digest_file(e.path);
      if (d.size != e.size)
        return bad(e.path + ": changed while being verified (" + std::to_string(d.size) +
                   " bytes)");
      if (detail::hash_hex(d.hash) != e.hash)
        return bad(e.path + ": XXH3-64 checksum " + detail::hash_hex(d.hash) +
                   " does not match " + e.hash + " in checksums.json (corrupt)");
    } catch (const Error& err) {
      return bad(err.what());
    }
  }
  return true;
}

std::optional<LoadedCheckpoint> CheckpointManager::find_latest_in(const std::string& run_dir) {
  const fs::path root = fs::path(run_dir) / detail::kCheckpointsDirName;
  std::error_code ec;
  if (!fs::exists(root, ec)) return std::nullopt;
  TESSERA_CHECK(fs::is_directory(root, ec), root.string(), ": not a directory");
  const std::map<int64_t, std::string> dirs = detail::list_step_dirs(root.string());

  // Where `latest` points, when it names an existing step directory.
  const fs::path latest_path = root / detail::kLatestName;
  std::optional<int64_t> latest;
  if (fs::exists(latest_path, ec)) {
    std::string text;
    try {
      text = io::read_file_bytes(latest_path.string());
    } catch (const Error& e) {
      TESSERA_LOG(kWarn, e.what(), "; using the highest step directory instead");
    }
    while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' '))
      text.pop_back();
    const auto step = detail::parse_step_dir_name(text);
    if (!step) {
      TESSERA_LOG(kWarn, latest_path.string(), ": does not name a step directory ('",
                  text.substr(0, 40), "'); using the highest step directory instead");
    } else if (!dirs.count(*step)) {
      if (dirs.empty())
        fail(latest_path.string(), ": points to ", text, ", but there is no step directory in ",
             root.string());
      TESSERA_LOG(kWarn, latest_path.string(), ": points to ", text,
                  ", which does not exist; falling back to the highest step directory");
    } else {
      latest = step;
    }
  } else if (!dirs.empty()) {
    TESSERA_LOG(kWarn, latest_path.string(), ": missing; using the highest step directory");
  }
  if (dirs.empty()) return std::nullopt;

  // `latest` first, then older steps newest first; steps above `latest` (a save killed
  // before it moved `latest`, or a run resumed from an older step) last.
  std::vector<int64_t> order;
  if (latest) order.push_back(*latest);
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it)
    if (!latest || it->first < *latest) order.push_back(it->first);
  if (latest)
    for (auto it = dirs.rbegin(); it != dirs.rend() && it->first > *latest; ++it)
      order.push_back(it->first);

  std::string failures;
  for (int64_t step : order) {
    const std::string dir = (root / dirs.at(step)).string();
    std::string why;
    if (verify(dir, &why)) return LoadedCheckpoint{step, dir};
    TESSERA_LOG(kWarn, "checkpoint ", dir, " is unusable: ", why, "; trying an older one");
    failures += (failures.empty() ? "" : "; ") + dirs.at(step) + ": " + why;
  }
  fail("no usable checkpoint in ", root.string(), " (", failures, ")");
}

}  // namespace tessera::train
