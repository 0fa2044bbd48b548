// Disk tier of the KV cache (see kv_disk_tier.h): file format, start-up scan, LRU within the
// byte limit, background writer.
#include "tessera/infer/kv_disk_tier.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "tessera/base/error.h"
#include "tessera/base/logging.h"
#include "tessera/base/strings.h"

namespace tessera::infer {
namespace {

namespace fs = std::filesystem;

constexpr char kMagic[8] = {'T', 'S', 'R', 'K', 'V', 'B', '0', '1'};
constexpr int64_t kMaxQueuedBytes = int64_t{256} << 20;  // writes beyond this are dropped

// Native byte order: the files are for machines like the one that wrote them.
struct FileHeader {
  char magic[8];
  uint64_t fingerprint;
  uint64_t hash, parent;      // the block's chain hash and its parent's
  int64_t num_tokens;         // then num_tokens int32 token ids
  int64_t payload_bytes;      // then the block's bytes (KvPool::read_block layout)
  uint64_t checksum;          // XXH3-64 of the token ids and the block bytes
  uint64_t header_checksum;   // XXH3-64 of the fields above
};
static_assert(sizeof(FileHeader) == 64);

uint64_t header_checksum(const FileHeader& h) { return XXH3_64bits(&h, offsetof(FileHeader, header_checksum)); }

bool read_exact(int fd, void* dst, size_t n) {
  auto* p = static_cast<uint8_t*>(dst);
  while (n > 0) {
    const ssize_t got = ::read(fd, p, n);
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

bool write_file(const std::string& path, const std::vector<uint8_t>& data) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  const uint8_t* p = data.data();
  size_t n = data.size();
  bool ok = true;
  while (n > 0 && ok) {
    const ssize_t put = ::write(fd, p, n);
    ok = put > 0;
    if (ok) {
      p += put;
      n -= static_cast<size_t>(put);
    }
  }
  ok = (::close(fd) == 0) && ok;
  if (ok) ok = std::rename(tmp.c_str(), path.c_str()) == 0;  // readers see the old file or the whole new one
  if (!ok) ::unlink(tmp.c_str());
  return ok;
}

}  // namespace

int64_t DiskKvTier::file_bytes(int64_t block_tokens, int64_t block_bytes) {
  return static_cast<int64_t>(sizeof(FileHeader)) + block_tokens * 4 + block_bytes;
}

DiskKvTier::DiskKvTier(std::string dir, int64_t capacity_bytes, uint64_t fingerprint, int64_t block_tokens,
                       int64_t block_bytes)
    : dir_(std::move(dir)), fingerprint_(fingerprint), block_tokens_(block_tokens), block_bytes_(block_bytes) {
  TESSERA_CHECK(!dir_.empty(), "--kv-offload-dir must not be empty");
  file_bytes_ = file_bytes(block_tokens, block_bytes);
  TESSERA_CHECK(capacity_bytes >= file_bytes_, "--kv-offload-size ", capacity_bytes,
                " bytes does not hold one KV block file (", file_bytes_, " bytes)");
  capacity_files_ = capacity_bytes / file_bytes_;
  std::error_code ec;
  fs::create_directories(dir_, ec);
  TESSERA_CHECK(fs::is_directory(dir_, ec), "--kv-offload-dir ", dir_, ": not a directory and cannot be created",
                ec ? " (" + ec.message() + ")" : std::string());
  scan();
  writer_ = std::thread([this] { writer_loop(); });
}

DiskKvTier::~DiskKvTier() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  writer_.join();
}

std::string DiskKvTier::path_for(uint64_t hash) const {
  // Keyed by the chain hash within this fingerprint: another model's block of the same
  // tokens lives under another name.
  const uint64_t name = XXH3_64bits_withSeed(&hash, sizeof(hash), fingerprint_);
  return dir_ + "/" + base::strprintf("%016llx.kvb", (unsigned long long)name);
}

void DiskKvTier::scan() {
  struct Found {
    fs::file_time_type mtime;
    uint64_t hash, parent;
    std::vector<int32_t> tokens;
  };
  std::vector<Found> found;
  int64_t other = 0, corrupt = 0;
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(dir_, ec)) {
    if (!de.is_regular_file(ec) || de.path().extension() != ".kvb") continue;
    const std::string path = de.path().string();
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    FileHeader h{};
    const bool read_ok = fd >= 0 && read_exact(fd, &h, sizeof(h));
    if (!read_ok || std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0 || header_checksum(h) != h.header_checksum) {
      if (fd >= 0) ::close(fd);
      ++corrupt;
      continue;
    }
    if (h.fingerprint != fingerprint_ || h.num_tokens != block_tokens_ || h.payload_bytes != block_bytes_) {
      ::close(fd);
      ++other;
      continue;
    }
    Found f;
    f.hash = h.hash;
    f.parent = h.parent;
    f.tokens.resize(static_cast<size_t>(block_tokens_));
    const bool ok = read_exact(fd, f.tokens.data(), f.tokens.size() * 4) &&
                    static_cast<int64_t>(de.file_size(ec)) == file_bytes_ && path_for(h.hash) == path;
    ::close(fd);
    if (!ok) {
      ++corrupt;
      continue;
    }
    f.mtime = de.last_write_time(ec);
    found.push_back(std::move(f));
  }
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.mtime < b.mtime; });
  for (Found& f : found) {
    Entry e;
    e.parent = f.parent;
    e.tokens = std::move(f.tokens);
    e.lru_pos = lru_.insert(lru_.end(), f.hash);
    index_.emplace(f.hash, std::move(e));
  }
  while (static_cast<int64_t>(index_.size()) > capacity_files_) {  // a smaller limit than last time
    const uint64_t h = lru_.front();
    ::unlink(path_for(h).c_str());
    forget(h, false);
    ++stats_.evictions;
  }
  stats_.ignored_files = other + corrupt;
  if (other + corrupt > 0)
    TESSERA_LOG(kWarn, "KV offload dir ", dir_, ": ignoring ", other + corrupt, " block files (", other,
                " of another model, weights, KV cache dtype or block size; ", corrupt, " unreadable or corrupt)");
}

bool DiskKvTier::matches(const Entry& e, const BlockKey& key) const {
  return e.parent == key.parent && static_cast<int64_t>(e.tokens.size()) == key.num_tokens &&
         std::equal(e.tokens.begin(), e.tokens.end(), key.tokens);
}

bool DiskKvTier::contains(const BlockKey& key) {
  auto it = index_.find(key.hash);
  if (it == index_.end() || !matches(it->second, key)) return false;
  lru_.splice(lru_.end(), lru_, it->second.lru_pos);
  enqueue({Op::kTouch, key.hash, nullptr});
  return true;
}

void DiskKvTier::forget(uint64_t hash, bool remove_file) {
  auto it = index_.find(hash);
  if (it == index_.end()) return;
  lru_.erase(it->second.lru_pos);
  index_.erase(it);
  if (remove_file) enqueue({Op::kRemove, hash, nullptr});
}

void DiskKvTier::evict_one() {
  forget(lru_.front(), true);
  ++stats_.evictions;
}

void DiskKvTier::put(const BlockKey& key, const uint8_t* bytes) {
  if (auto it = index_.find(key.hash); it != index_.end()) {
    lru_.splice(lru_.end(), lru_, it->second.lru_pos);  // (a colliding block keeps its file)
    enqueue({Op::kTouch, key.hash, nullptr});
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (queued_bytes_ + file_bytes_ > kMaxQueuedBytes) {
      ++stats_.dropped_writes;
      return;
    }
  }
  while (static_cast<int64_t>(index_.size()) >= capacity_files_) evict_one();
  auto data = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(file_bytes_));
  FileHeader h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.fingerprint = fingerprint_;
  h.hash = key.hash;
  h.parent = key.parent;
  h.num_tokens = block_tokens_;
  h.payload_bytes = block_bytes_;
  uint8_t* p = data->data() + sizeof(FileHeader);
  std::memcpy(p, key.tokens, static_cast<size_t>(block_tokens_) * 4);
  std::memcpy(p + block_tokens_ * 4, bytes, static_cast<size_t>(block_bytes_));
  h.checksum = XXH3_64bits(p, static_cast<size_t>(block_tokens_ * 4 + block_bytes_));
  h.header_checksum = header_checksum(h);
  std::memcpy(data->data(), &h, sizeof(h));
  Entry e;
  e.parent = key.parent;
  e.tokens.assign(key.tokens, key.tokens + key.num_tokens);
  e.lru_pos = lru_.insert(lru_.end(), key.hash);
  index_.emplace(key.hash, std::move(e));
  ++stats_.writes;
  enqueue({Op::kWrite, key.hash, std::move(data)});
}

bool DiskKvTier::get(const BlockKey& key, uint8_t* dst) {
  auto it = index_.find(key.hash);
  if (it == index_.end() || !matches(it->second, key)) return false;
  const size_t payload_at = sizeof(FileHeader) + static_cast<size_t>(block_tokens_) * 4;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto p = pending_.find(key.hash); p != pending_.end()) {  // not on disk yet
      std::memcpy(dst, p->second->data() + payload_at, static_cast<size_t>(block_bytes_));
      return true;
    }
  }
  std::vector<uint8_t> file(static_cast<size_t>(file_bytes_));
  const std::string path = path_for(key.hash);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  bool ok = fd >= 0 && read_exact(fd, file.data(), file.size());
  if (fd >= 0) {
    uint8_t extra = 0;
    ok = ok && ::read(fd, &extra, 1) == 0;  // exactly file_bytes_ long
    ::close(fd);
  }
  FileHeader h{};
  if (ok) std::memcpy(&h, file.data(), sizeof(h));
  ok = ok && std::memcmp(h.magic, kMagic, sizeof(kMagic)) == 0 && h.header_checksum == header_checksum(h) &&
       h.fingerprint == fingerprint_ && h.hash == key.hash && h.parent == key.parent &&
       h.num_tokens == block_tokens_ && h.payload_bytes == block_bytes_ &&
       h.checksum == XXH3_64bits(file.data() + sizeof(FileHeader), file.size() - sizeof(FileHeader)) &&
       std::memcmp(file.data() + sizeof(FileHeader), key.tokens, static_cast<size_t>(block_tokens_) * 4) == 0;
  if (!ok) {
    ++stats_.corrupt_reads;
    if (!warned_corrupt_)
      TESSERA_LOG(kWarn, "KV offload: ", path, " is missing or corrupt (header or checksum mismatch); ignored and "
                  "removed (further ones are only counted)");
    warned_corrupt_ = true;
    forget(key.hash, true);
    return false;
  }
  std::memcpy(dst, file.data() + payload_at, static_cast<size_t>(block_bytes_));
  lru_.splice(lru_.end(), lru_, it->second.lru_pos);
  enqueue({Op::kTouch, key.hash, nullptr});
  return true;
}

void DiskKvTier::enqueue(Op op) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (op.kind == Op::kWrite) {
      pending_[op.hash] = op.data;
      queued_bytes_ += static_cast<int64_t>(op.data->size());
    } else if (op.kind == Op::kRemove) {
      pending_.erase(op.hash);  // a queued write of it still runs first, then the removal
    }
    queue_.push_back(std::move(op));
  }
  cv_.notify_one();
}

void DiskKvTier::writer_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) {
      if (stop_) return;
      continue;
    }
    Op op = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    const std::string path = path_for(op.hash);
    bool ok = true;
    if (op.kind == Op::kWrite) {
      ok = write_file(path, *op.data);
    } else if (op.kind == Op::kTouch) {
      ::utimensat(AT_FDCWD, path.c_str(), nullptr, 0);  // the LRU order survives a restart
    } else {
      ::unlink(path.c_str());
    }
    lock.lock();
    if (op.kind == Op::kWrite) {
      queued_bytes_ -= static_cast<int64_t>(op.data->size());
      if (auto p = pending_.find(op.hash); p != pending_.end() && p->second == op.data) pending_.erase(p);
      if (!ok && !warned_write_) {
        warned_write_ = true;
        TESSERA_LOG(kWarn, "KV offload: cannot write ", path, " (", std::strerror(errno),
                    "); such blocks are recomputed when needed");
      }
    }
    busy_ = false;
    if (queue_.empty()) idle_cv_.notify_all();
  }
}

void DiskKvTier::flush() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
}

DiskTierStats DiskKvTier::stats() const {
  DiskTierStats s = stats_;
  s.files = static_cast<int64_t>(index_.size());
  s.bytes = s.files * file_bytes_;
  return s;
}

}  // namespace tessera::infer
