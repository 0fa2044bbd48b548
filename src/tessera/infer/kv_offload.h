// The seam between the block manager (plain bookkeeping) and the lower tiers of the KV cache
// (host memory, disk: kv_tiers.h): what the block manager asks of them, in block ids and keys.
#pragma once
#include <cstdint>
#include <vector>

namespace tessera::infer {

using BlockId = int32_t;
using RequestId = int64_t;

// A committed block's identity in the prefix cache: its chain hash, and the parent hash and
// token ids the hash was computed from (compared on lookup to rule out 64-bit collisions).
struct BlockKey {
  uint64_t hash = 0, parent = 0;
  const int32_t* tokens = nullptr;  // (block_size) token ids
  int64_t num_tokens = 0;
};

// Lower tiers seen from BlockManager. Every call happens while the block manager runs (in
// Scheduler::schedule), before the step's model run writes any K/V, so a pool block handed
// to offload() still holds the committed bytes and a block filled by load() / swap_in() is
// read by that step at the earliest.
class KvOffloader {
 public:
  virtual ~KvOffloader() = default;
  // Pool block b (committed: key) is about to be reused: keep a copy of its bytes if there is room.
  virtual void offload(BlockId b, const BlockKey& key) = 0;
  // Whether a lower tier holds key's block (an access for LRU order).
  virtual bool contains(const BlockKey& key) = 0;
  // Copies key's block into pool block dst; false when it is gone or unreadable (dst unchanged).
  virtual bool load(const BlockKey& key, BlockId dst) = 0;

  // Swap preemption. swap_out copies `blocks` (a request's table, covering its first
  // num_tokens computed tokens) out of the pool; false when there is no room (nothing kept).
  virtual bool swap_out(RequestId id, const std::vector<BlockId>& blocks, int64_t num_tokens) = 0;
  virtual int64_t swapped_tokens(RequestId id) const = 0;  // 0: nothing swapped for id
  // Copies the swapped blocks [first, first + dst.size()) into pool blocks dst.
  virtual void swap_in(RequestId id, int64_t first, const std::vector<BlockId>& dst) = 0;
  virtual void drop_swap(RequestId id) = 0;  // forgets id's swapped blocks (unknown id: no-op)
};

}  // namespace tessera::infer
