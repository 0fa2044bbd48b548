// The disk tier of the KV cache (--kv-offload-dir): one file per committed block, named by
// its prefix (chain) hash, LRU by access within a byte limit, and kept across restarts.
// Each file carries a header with the fingerprint of everything that makes its bytes valid
// (model config and weights, cache dtype, block size, heads: kv_tiers.h) and a checksum;
// files of another fingerprint or corrupt ones are ignored (one warning), never loaded.
// Writes go through a background thread (temp file + rename), so a step never waits on disk.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tessera/infer/kv_offload.h"

namespace tessera::infer {

struct DiskTierStats {
  int64_t files = 0;          // blocks held (indexed; pending writes included)
  int64_t bytes = 0;          // their file bytes
  int64_t writes = 0;         // files written (queued) by this process
  int64_t evictions = 0;      // files removed to stay within the limit
  int64_t ignored_files = 0;  // found at start-up with another fingerprint, or unreadable
  int64_t corrupt_reads = 0;  // files that failed their checksum when loaded (then removed)
  int64_t dropped_writes = 0; // writes skipped because too many were queued
};

class DiskKvTier {
 public:
  // Creates `dir` if needed and indexes the files there that carry this fingerprint, block
  // size and block bytes, least recently used first (by modification time, which every
  // access renews). Throws naming --kv-offload-dir / --kv-offload-size when the directory
  // cannot be created or the limit does not hold one block file.
  DiskKvTier(std::string dir, int64_t capacity_bytes, uint64_t fingerprint, int64_t block_tokens,
             int64_t block_bytes);
  ~DiskKvTier();  // writes everything queued, then stops the writer
  DiskKvTier(const DiskKvTier&) = delete;
  DiskKvTier& operator=(const DiskKvTier&) = delete;

  // Bytes of one block file: the 64-byte header, the token ids (int32) and the block bytes.
  static int64_t file_bytes(int64_t block_tokens, int64_t block_bytes);
  int64_t capacity_files() const { return capacity_files_; }

  // Whether key's block is held (and it becomes the most recently used).
  bool contains(const BlockKey& key);
  // Stores key's block (block_bytes at `bytes`, copied now, written in the background),
  // evicting the least recently used files past the limit. Held already: only touched.
  void put(const BlockKey& key, const uint8_t* bytes);
  // Reads key's block into dst (block_bytes). False when absent, or when the file fails its
  // checks (warned once; the file is removed).
  bool get(const BlockKey& key, uint8_t* dst);
  void flush();  // returns when every queued write, touch and removal is done

  DiskTierStats stats() const;
  std::string path_for(uint64_t hash) const;  // the file holding a block (tests, docs)

 private:
  struct Entry {
    uint64_t parent = 0;
    std::vector<int32_t> tokens;
    std::list<uint64_t>::iterator lru_pos;
  };
  struct Op {
    enum Kind { kWrite, kTouch, kRemove } kind;
    uint64_t hash = 0;
    std::shared_ptr<const std::vector<uint8_t>> data;  // kWrite: the whole file
  };
  void scan();
  void evict_one();
  void enqueue(Op op);
  void writer_loop();
  bool matches(const Entry& e, const BlockKey& key) const;
  void forget(uint64_t hash, bool remove_file);

  std::string dir_;
  uint64_t fingerprint_ = 0;
  int64_t block_tokens_ = 0, block_bytes_ = 0, file_bytes_ = 0, capacity_files_ = 0;
  std::unordered_map<uint64_t, Entry> index_;  // chain hash -> entry (engine thread only)
  std::list<uint64_t> lru_;                    // front = least recently used
  DiskTierStats stats_;
  bool warned_corrupt_ = false;

  // Shared with the writer thread.
  mutable std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<Op> queue_;
  std::unordered_map<uint64_t, std::shared_ptr<const std::vector<uint8_t>>> pending_;  // written soon
  int64_t queued_bytes_ = 0;
  bool busy_ = false, stop_ = false, warned_write_ = false;
  std::thread writer_;
};

}  // namespace tessera::infer
