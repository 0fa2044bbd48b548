// Paged KV cache bookkeeping (see block_manager.h): allocation, eviction, prefix cache, CoW.
#include "tessera/infer/block_manager.h"

#include <xxhash.h>

#include <algorithm>
#include <limits>
#include <unordered_set>

#include "tessera/base/error.h"

namespace tessera::infer {

BlockManager::BlockManager(BlockManagerConfig c) : cfg_(c) {
  TESSERA_CHECK(c.num_blocks > 0 && c.num_blocks <= std::numeric_limits<BlockId>::max(),
                "BlockManager: num_blocks must be in [1, 2^31), got ", c.num_blocks);
  TESSERA_CHECK(c.block_size > 0, "BlockManager: block_size must be > 0, got ", c.block_size);
  blocks_.resize(static_cast<size_t>(c.num_blocks));
  for (int64_t b = 0; b < c.num_blocks; ++b) free_.push_back(static_cast<BlockId>(b));
}

uint64_t BlockManager::hash_block(uint64_t parent, const int32_t* tokens, int64_t n) {
  return XXH3_64bits_withSeed(tokens, static_cast<size_t>(n) * sizeof(int32_t), parent);
}

BlockManager::RequestBlocks& BlockManager::get(RequestId id, const char* what) {
  auto it = reqs_.find(id);
  TESSERA_CHECK(it != reqs_.end(), "BlockManager::", what, ": request ", id,
                " has no block table");
  return it->second;
}

const BlockManager::RequestBlocks& BlockManager::get(RequestId id, const char* what) const {
  auto it = reqs_.find(id);
  TESSERA_CHECK(it != reqs_.end(), "BlockManager::", what, ": request ", id,
                " has no block table");
  return it->second;
}

BlockId BlockManager::take_block() {
  BlockId b;
  if (!free_.empty()) {
    b = free_.front();
    free_.pop_front();
  } else {
    // Evict the least recently released cached block: its prefix is forgotten.
    b = evictable_.front();
    evictable_.pop_front();
    Block& blk = blocks_[b];
    // Its bytes are still intact (the step that reuses it has not run): a lower tier keeps them.
    if (offloader_) offloader_->offload(b, {blk.hash, blk.parent_hash, blk.tokens.data(), cfg_.block_size});
    cached_.erase(blk.hash);
    blk.hashed = false;
    blk.tokens.clear();
    ++stats_.evictions;
  }
  Block& blk = blocks_[b];
  blk.ref = 1;
  blk.state = State::kUsed;
  return b;
}

void BlockManager::untake_block(BlockId b) {
  Block& blk = blocks_[b];
  blk.ref = 0;
  blk.state = State::kFree;
  free_.push_front(b);
}

void BlockManager::cache_block(BlockId b, uint64_t hash, uint64_t parent, const int32_t* tokens) {
  Block& blk = blocks_[b];
  blk.hashed = true;
  blk.hash = hash;
  blk.parent_hash = parent;
  blk.tokens.assign(tokens, tokens + cfg_.block_size);
  cached_[hash] = b;
}

void BlockManager::release_block(BlockId b) {
  Block& blk = blocks_[b];
  if (--blk.ref > 0) return;
  if (blk.hashed) {
    blk.state = State::kEvictable;
    blk.lru_pos = evictable_.insert(evictable_.end(), b);
  } else {
    blk.state = State::kFree;
    free_.push_back(b);
  }
}

uint64_t BlockManager::root_hash(uint64_t cache_salt) {
  if (cache_salt == 0) return kRootHash;
  const int32_t words[2] = {static_cast<int32_t>(cache_salt & 0xffffffffu), static_cast<int32_t>(cache_salt >> 32)};
  return hash_block(kRootHash, words, 2);
}

int64_t BlockManager::allocate_cached_prefix(RequestId id, const std::vector<int32_t>& tokens, uint64_t cache_salt) {
  TESSERA_CHECK(!reqs_.count(id), "BlockManager::allocate_cached_prefix: request ", id,
                " already has a block table");
  RequestBlocks& r = reqs_[id];
  r.root = root_hash(cache_salt);
  const int64_t n = static_cast<int64_t>(tokens.size());
  int64_t swapped = offloader_ ? offloader_->swapped_tokens(id) : 0;
  if (swapped > 0 && swapped >= n) {  // cannot happen through the scheduler (a token is always left to compute)
    offloader_->drop_swap(id);
    swapped = 0;
  }
  if (!cfg_.prefix_caching && swapped == 0) return 0;
  const int64_t candidates = n > 0 ? (n - 1) / cfg_.block_size : 0;
  int64_t pool_hits = 0, tier_hits = 0;
  if (cfg_.prefix_caching) {
    ++stats_.queries;
    extend_chain(r, tokens, candidates, swapped == 0, pool_hits, tier_hits);
  }
  if (swapped > 0) {
    r.swap_pending = true;  // copied back or not (no room: recomputed), dropped once admitted
    const int64_t got = swap_in(id, r, swapped);
    if (got > 0) {
      stats_.hit_blocks += pool_hits;
      if (cfg_.prefix_caching)
        stats_.miss_blocks += std::max<int64_t>(0, candidates - std::max(pool_hits, got / cfg_.block_size));
      return got;
    }
    if (cfg_.prefix_caching) extend_chain(r, tokens, candidates, true, pool_hits, tier_hits);  // it recomputes
  }
  stats_.hit_blocks += pool_hits;
  stats_.tier_hit_blocks += tier_hits;
  stats_.miss_blocks += candidates - pool_hits - tier_hits;  // (0 - 0 - 0 with prefix caching off)
  return (pool_hits + tier_hits) * cfg_.block_size;
}

// Extends the request's chain of cached blocks from its table's end: a block in the pool is
// shared (ref + 1); with `tiers`, one found in a lower tier is copied into a fresh pool block
// that joins the prefix cache as committed (its bytes are what the request would compute).
// Stops at the first block found in neither, or at a hash held for other tokens (a collision).
void BlockManager::extend_chain(RequestBlocks& r, const std::vector<int32_t>& tokens, int64_t candidates,
                                bool tiers, int64_t& pool_hits, int64_t& tier_hits) {
  const int64_t bs = cfg_.block_size;
  for (int64_t k = static_cast<int64_t>(r.table.size()); k < candidates; ++k) {
    const uint64_t parent = k == 0 ? r.root : r.hashes[static_cast<size_t>(k - 1)];
    const int32_t* t = tokens.data() + k * bs;
    const uint64_t h = hash_block(parent, t, bs);
    if (auto it = cached_.find(h); it != cached_.end()) {
      Block& blk = blocks_[it->second];
      // A 64-bit collision would silently serve another prompt's K/V: compare what we can.
      if (blk.parent_hash != parent || !std::equal(blk.tokens.begin(), blk.tokens.end(), t)) break;
      if (blk.ref++ == 0) {
        evictable_.erase(blk.lru_pos);
        blk.state = State::kUsed;
      }
      r.table.push_back(it->second);
      r.hashes.push_back(h);
      ++pool_hits;
      continue;
    }
    if (!tiers || !offloader_ || num_free_blocks() == 0) break;
    const BlockKey key{h, parent, t, bs};
    if (!offloader_->contains(key)) break;
    const BlockId b = take_block();  // may offload an evicted block, never this key's (just touched)
    if (!offloader_->load(key, b)) {
      untake_block(b);
      break;
    }
    cache_block(b, h, parent, t);
    r.table.push_back(b);
    r.hashes.push_back(h);
    ++tier_hits;
  }
}

// Copies the swapped blocks the pool prefix did not cover back into fresh blocks. Returns
// the tokens the request now has computed, 0 when the pool has no room for them.
int64_t BlockManager::swap_in(RequestId id, RequestBlocks& r, int64_t swapped) {
  const int64_t bs = cfg_.block_size;
  const int64_t have = static_cast<int64_t>(r.table.size());
  if (have * bs >= swapped) return have * bs;  // the pool still held all of it
  const int64_t need = (swapped + bs - 1) / bs - have;
  if (need > num_free_blocks()) return 0;
  std::vector<BlockId> dst;
  for (int64_t i = 0; i < need; ++i) {
    dst.push_back(take_block());
    r.table.push_back(dst.back());
  }
  offloader_->swap_in(id, have, dst);
  stats_.swap_in_blocks += need;
  return swapped;
}

bool BlockManager::swap_out(RequestId id, int64_t num_tokens) {
  if (!offloader_ || num_tokens <= 0) return false;
  const RequestBlocks& r = get(id, "swap_out");
  if (r.released > 0) return false;
  const int64_t nblocks = (num_tokens + cfg_.block_size - 1) / cfg_.block_size;
  offloader_->drop_swap(id);  // (an earlier copy, if it was never dropped)
  TESSERA_CHECK(nblocks <= static_cast<int64_t>(r.table.size()), "BlockManager::swap_out: request ", id,
                " has ", r.table.size(), " blocks, fewer than its ", num_tokens, " tokens need");
  return offloader_->swap_out(id, {r.table.begin(), r.table.begin() + nblocks}, num_tokens);
}

void BlockManager::drop_swap(RequestId id) {
  if (offloader_) offloader_->drop_swap(id);
}

bool BlockManager::allocate_slots(RequestId id, int64_t num_tokens) {
  TESSERA_CHECK(num_tokens >= 0, "BlockManager::allocate_slots: request ", id,
                ": num_tokens must be >= 0, got ", num_tokens);
  auto it = reqs_.find(id);
  const int64_t have = it == reqs_.end() ? 0 : static_cast<int64_t>(it->second.table.size());
  const int64_t need = (num_tokens + cfg_.block_size - 1) / cfg_.block_size - have;
  if (need <= 0) {
    RequestBlocks& r = reqs_[id];
    if (r.swap_pending) {
      r.swap_pending = false;
      drop_swap(id);
    }
    return true;
  }
  if (need > num_free_blocks()) return false;
  RequestBlocks& r = reqs_[id];
  for (int64_t i = 0; i < need; ++i) r.table.push_back(take_block());
  if (r.swap_pending) {  // admitted after a swap-in: the swapped copy is no longer needed
    r.swap_pending = false;
    drop_swap(id);
  }
  return true;
}

void BlockManager::commit(RequestId id, const std::vector<int32_t>& tokens, int64_t num_computed) {
  RequestBlocks& r = get(id, "commit");
  const int64_t bs = cfg_.block_size;
  TESSERA_CHECK(num_computed >= 0 && num_computed <= static_cast<int64_t>(tokens.size()),
                "BlockManager::commit: request ", id, ": num_computed ", num_computed,
                " outside [0, ", tokens.size(), "]");
  TESSERA_CHECK(num_computed <= static_cast<int64_t>(r.table.size()) * bs,
                "BlockManager::commit: request ", id, ": num_computed ", num_computed,
                " exceeds its ", r.table.size(), " blocks of ", bs, " tokens");
  if (!cfg_.prefix_caching) return;
  const int64_t full = num_computed / bs;
  for (int64_t b = static_cast<int64_t>(r.hashes.size()); b < full; ++b) {
    const uint64_t parent = b == 0 ? r.root : r.hashes[b - 1];
    const int32_t* t = tokens.data() + b * bs;
    const uint64_t h = hash_block(parent, t, bs);
    r.hashes.push_back(h);
    Block& blk = blocks_[r.table[b]];
    if (blk.hashed) {
      // Shared with a fork sibling that committed it first; both wrote the same tokens.
      TESSERA_CHECK(blk.hash == h, "BlockManager::commit: request ", id, ": block ", r.table[b],
                    " is shared but was committed with different token ids");
      continue;
    }
    if (cached_.count(h)) continue;  // computed twice concurrently; the first copy is the cached one
    cache_block(r.table[b], h, parent, t);
  }
}

void BlockManager::fork(RequestId parent, RequestId child) {
  TESSERA_CHECK(!reqs_.count(child), "BlockManager::fork: child request ", child,
                " already has a block table");
  RequestBlocks copy = get(parent, "fork");
  for (size_t i = static_cast<size_t>(copy.released); i < copy.table.size(); ++i) ++blocks_[copy.table[i]].ref;
  reqs_.emplace(child, std::move(copy));
}

CowResult BlockManager::copy_on_write(RequestId id, int64_t pos) {
  RequestBlocks& r = get(id, "copy_on_write");
  const int64_t bs = cfg_.block_size;
  TESSERA_CHECK(pos >= 0 && pos < static_cast<int64_t>(r.table.size()) * bs,
                "BlockManager::copy_on_write: request ", id, ": position ", pos,
                " is not covered by its ", r.table.size(), " blocks of ", bs, " tokens");
  TESSERA_CHECK(pos >= static_cast<int64_t>(r.hashes.size()) * bs,
                "BlockManager::copy_on_write: request ", id, ": position ", pos,
                " lies in committed full block ", pos / bs, "; committed K/V is never rewritten");
  BlockId& slot = r.table[static_cast<size_t>(pos / bs)];
  if (blocks_[slot].ref == 1) return {};
  if (num_free_blocks() == 0) return {false, std::nullopt};
  const BlockId src = slot;
  const BlockId dst = take_block();
  --blocks_[src].ref;  // stays >= 1: another table still holds it
  slot = dst;
  return {true, std::make_pair(src, dst)};
}

void BlockManager::free(RequestId id) {
  auto it = reqs_.find(id);
  if (it == reqs_.end()) return;
  const std::vector<BlockId>& table = it->second.table;
  for (auto b = table.rbegin(); b != table.rend() - it->second.released; ++b) release_block(*b);
  reqs_.erase(it);
}

void BlockManager::release_leading(RequestId id, int64_t num_blocks) {
  RequestBlocks& r = get(id, "release_leading");
  TESSERA_CHECK(num_blocks <= static_cast<int64_t>(r.table.size()), "BlockManager::release_leading: request ", id,
                " has ", r.table.size(), " blocks, not ", num_blocks);
  for (; r.released < num_blocks; ++r.released) release_block(r.table[static_cast<size_t>(r.released)]);
}

int64_t BlockManager::num_released(RequestId id) const { return get(id, "num_released").released; }

const std::vector<BlockId>& BlockManager::block_table(RequestId id) const {
  return get(id, "block_table").table;
}

const std::vector<uint64_t>& BlockManager::block_hashes(RequestId id) const {
  return get(id, "block_hashes").hashes;
}

int32_t BlockManager::ref_count(BlockId b) const {
  TESSERA_CHECK(b >= 0 && b < cfg_.num_blocks, "BlockManager::ref_count: block id ", b,
                " outside [0, ", cfg_.num_blocks, ")");
  return blocks_[b].ref;
}

std::optional<uint64_t> BlockManager::cached_hash(BlockId b) const {
  TESSERA_CHECK(b >= 0 && b < cfg_.num_blocks, "BlockManager::cached_hash: block id ", b,
                " outside [0, ", cfg_.num_blocks, ")");
  if (!blocks_[b].hashed) return std::nullopt;
  return blocks_[b].hash;
}

std::vector<BlockId> BlockManager::eviction_order() const {
  return {evictable_.begin(), evictable_.end()};
}

void BlockManager::check_invariants() const {
  const int64_t n = cfg_.num_blocks;
  const char* where = "BlockManager invariant: ";
  std::vector<int> seen(static_cast<size_t>(n), 0);  // times listed in free_ / evictable_
  for (BlockId b : free_) {
    TESSERA_CHECK(b >= 0 && b < n, where, "free list holds bad id ", b);
    TESSERA_CHECK(++seen[b] == 1, where, "block ", b, " listed twice in free/evictable");
    const Block& blk = blocks_[b];
    TESSERA_CHECK(blk.state == State::kFree && blk.ref == 0 && !blk.hashed, where, "block ", b,
                  " is on the free list but has ref ", blk.ref, " hashed ", blk.hashed);
  }
  for (auto it = evictable_.begin(); it != evictable_.end(); ++it) {
    const BlockId b = *it;
    TESSERA_CHECK(b >= 0 && b < n, where, "evictable list holds bad id ", b);
    TESSERA_CHECK(++seen[b] == 1, where, "block ", b, " listed twice in free/evictable");
    const Block& blk = blocks_[b];
    TESSERA_CHECK(blk.state == State::kEvictable && blk.ref == 0 && blk.hashed, where, "block ",
                  b, " is evictable but has ref ", blk.ref, " hashed ", blk.hashed);
    TESSERA_CHECK(blk.lru_pos == it, where, "block ", b, " has a stale LRU position");
  }
  std::vector<int32_t> refs(static_cast<size_t>(n), 0);
  for (const auto& [id, r] : reqs_) {
    TESSERA_CHECK(r.hashes.size() <= r.table.size(), where, "request ", id, " has ",
                  r.hashes.size(), " block hashes for ", r.table.size(), " blocks");
    TESSERA_CHECK(cfg_.prefix_caching || r.hashes.empty(), where, "request ", id,
                  " has block hashes with prefix caching off");
    std::unordered_set<BlockId> in_table;
    for (size_t i = static_cast<size_t>(r.released); i < r.table.size(); ++i) {  // (stale ids before)
      const BlockId b = r.table[i];
      TESSERA_CHECK(b >= 0 && b < n, where, "request ", id, " holds bad block id ", b);
      TESSERA_CHECK(in_table.insert(b).second, where, "request ", id, " holds block ", b,
                    " twice");
      ++refs[b];
      const Block& blk = blocks_[b];
      if (i < r.hashes.size() && blk.hashed)
        TESSERA_CHECK(blk.hash == r.hashes[i], where, "request ", id, " block ", i, " (id ", b,
                      ") hash differs from the request's chain hash");
    }
  }
  for (int64_t b = 0; b < n; ++b) {
    const Block& blk = blocks_[b];
    TESSERA_CHECK(blk.ref == refs[b], where, "block ", b, " has ref ", blk.ref, " but ",
                  refs[b], " tables hold it");
    if (blk.ref > 0)
      TESSERA_CHECK(blk.state == State::kUsed && seen[b] == 0, where, "block ", b,
                    " is referenced but also free/evictable");
    else
      TESSERA_CHECK(seen[b] == 1, where, "block ", b, " has ref 0 but is on no list");
    if (blk.hashed) {
      auto it = cached_.find(blk.hash);
      TESSERA_CHECK(it != cached_.end() && it->second == b, where, "block ", b,
                    " is hashed but the hash map does not point at it");
      TESSERA_CHECK(static_cast<int64_t>(blk.tokens.size()) == cfg_.block_size, where, "block ",
                    b, " stores ", blk.tokens.size(), " token ids");
    }
  }
  for (const auto& [h, b] : cached_) {
    TESSERA_CHECK(b >= 0 && b < n && blocks_[b].hashed && blocks_[b].hash == h, where,
                  "hash map entry points at block ", b, " which does not hold that hash");
  }
  TESSERA_CHECK(static_cast<int64_t>(free_.size() + evictable_.size()) +
                        std::count_if(blocks_.begin(), blocks_.end(),
                                      [](const Block& b) { return b.ref > 0; }) == n,
                where, "free + evictable + used != num_blocks");
}

}  // namespace tessera::infer
