// The host tier of the KV cache: a second, bigger block store in plain host memory. It holds
// committed blocks evicted from the pool (keyed by chain hash, LRU) and the blocks of
// requests preempted by swap (pinned until resumed or dropped). Bookkeeping and memcpy only.
#pragma once
#include <cstdint>
#include <list>
#include <memory>
#include <unordered_map>
#include <vector>

#include "tessera/infer/kv_offload.h"

namespace tessera::infer {

class HostKvTier {
 public:
  // Slots of block_bytes in capacity_bytes (throws naming --kv-host-memory when not even one
  // fits). The memory is reserved untouched; pages are touched as blocks are first stored.
  HostKvTier(int64_t capacity_bytes, int64_t block_bytes);

  int64_t capacity_blocks() const { return capacity_; }
  int64_t block_bytes() const { return block_bytes_; }
  int64_t num_cached_blocks() const { return static_cast<int64_t>(cached_.size()); }
  int64_t num_swapped_blocks() const { return swapped_blocks_; }
  int64_t evictions() const { return evictions_; }

  // The bytes of key's block (and it becomes the most recently used); nullptr when absent
  // or held under the same hash for another parent / tokens (a collision).
  const uint8_t* find(const BlockKey& key);
  // A slot to copy key's block_bytes into, evicting least-recently-used cached blocks as
  // needed; nullptr when key is already held (it is touched) or every slot is pinned by swaps.
  uint8_t* insert(const BlockKey& key);

  // Swap preemption: slots for a request's nblocks blocks (its first num_tokens tokens),
  // evicting cached blocks as needed; empty (nothing reserved) when the pinned swaps leave
  // no room. The caller fills them. Throws when id already has swapped blocks.
  std::vector<uint8_t*> reserve_swap(RequestId id, int64_t nblocks, int64_t num_tokens);
  int64_t swapped_tokens(RequestId id) const;  // 0: none
  const uint8_t* swap_block(RequestId id, int64_t i) const;  // its i-th block; throws when absent
  void drop_swap(RequestId id);

  // Every slot is exactly one of free / cached / swapped, the LRU list matches the map.
  void check_invariants() const;  // throws tessera::Error describing the first violation

 private:
  struct Entry {
    int64_t slot = 0;
    uint64_t parent = 0;
    std::vector<int32_t> tokens;
    std::list<uint64_t>::iterator lru_pos;
  };
  struct Swap {
    std::vector<int64_t> slots;
    int64_t num_tokens = 0;
  };
  uint8_t* slot_data(int64_t slot) const { return data_.get() + slot * block_bytes_; }
  bool free_one();  // evicts the least recently used cached block; false when none

  int64_t block_bytes_ = 0, capacity_ = 0;
  std::unique_ptr<uint8_t[]> data_;  // (capacity, block_bytes)
  std::vector<int64_t> free_slots_;
  std::unordered_map<uint64_t, Entry> cached_;  // chain hash -> entry
  std::list<uint64_t> lru_;                     // cached hashes, front = least recently used
  std::unordered_map<RequestId, Swap> swaps_;
  int64_t swapped_blocks_ = 0, evictions_ = 0;
};

}  // namespace tessera::infer
