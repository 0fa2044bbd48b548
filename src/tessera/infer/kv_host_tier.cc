// Host tier of the KV cache (see kv_host_tier.h): slots, LRU of cached blocks, pinned swaps.
#include "tessera/infer/kv_host_tier.h"

#include <algorithm>
#include <unordered_set>

#include "tessera/base/error.h"

namespace tessera::infer {

HostKvTier::HostKvTier(int64_t capacity_bytes, int64_t block_bytes) : block_bytes_(block_bytes) {
  TESSERA_CHECK(block_bytes > 0, "HostKvTier: block_bytes must be > 0, got ", block_bytes);
  TESSERA_CHECK(capacity_bytes >= block_bytes, "--kv-host-memory ", capacity_bytes,
                " bytes does not hold one KV block (", block_bytes, " bytes)");
  capacity_ = capacity_bytes / block_bytes;
  data_.reset(new uint8_t[static_cast<size_t>(capacity_ * block_bytes)]);  // default-initialised: untouched
  free_slots_.reserve(static_cast<size_t>(capacity_));
  for (int64_t s = capacity_ - 1; s >= 0; --s) free_slots_.push_back(s);
}

const uint8_t* HostKvTier::find(const BlockKey& key) {
  auto it = cached_.find(key.hash);
  if (it == cached_.end()) return nullptr;
  Entry& e = it->second;
  if (e.parent != key.parent || static_cast<int64_t>(e.tokens.size()) != key.num_tokens ||
      !std::equal(e.tokens.begin(), e.tokens.end(), key.tokens))
    return nullptr;
  lru_.splice(lru_.end(), lru_, e.lru_pos);
  return slot_data(e.slot);
}

bool HostKvTier::free_one() {
  if (lru_.empty()) return false;
  auto it = cached_.find(lru_.front());
  free_slots_.push_back(it->second.slot);
  cached_.erase(it);
  lru_.pop_front();
  ++evictions_;
  return true;
}

uint8_t* HostKvTier::insert(const BlockKey& key) {
  if (auto it = cached_.find(key.hash); it != cached_.end()) {
    // Held already (the same block, or a colliding one, which keeps its place).
    lru_.splice(lru_.end(), lru_, it->second.lru_pos);
    return nullptr;
  }
  if (free_slots_.empty() && !free_one()) return nullptr;
  Entry e;
  e.slot = free_slots_.back();
  free_slots_.pop_back();
  e.parent = key.parent;
  e.tokens.assign(key.tokens, key.tokens + key.num_tokens);
  e.lru_pos = lru_.insert(lru_.end(), key.hash);
  uint8_t* dst = slot_data(e.slot);
  cached_.emplace(key.hash, std::move(e));
  return dst;
}

std::vector<uint8_t*> HostKvTier::reserve_swap(RequestId id, int64_t nblocks, int64_t num_tokens) {
  TESSERA_CHECK(!swaps_.count(id), "HostKvTier::reserve_swap: request ", id, " is already swapped out");
  TESSERA_CHECK(nblocks > 0, "HostKvTier::reserve_swap: request ", id, ": nblocks must be > 0");
  if (nblocks > capacity_ - swapped_blocks_) return {};
  while (static_cast<int64_t>(free_slots_.size()) < nblocks) free_one();  // cached blocks give way
  Swap& s = swaps_[id];
  s.num_tokens = num_tokens;
  std::vector<uint8_t*> out;
  for (int64_t i = 0; i < nblocks; ++i) {
    s.slots.push_back(free_slots_.back());
    free_slots_.pop_back();
    out.push_back(slot_data(s.slots.back()));
  }
  swapped_blocks_ += nblocks;
  return out;
}

int64_t HostKvTier::swapped_tokens(RequestId id) const {
  auto it = swaps_.find(id);
  return it == swaps_.end() ? 0 : it->second.num_tokens;
}

const uint8_t* HostKvTier::swap_block(RequestId id, int64_t i) const {
  auto it = swaps_.find(id);
  TESSERA_CHECK(it != swaps_.end() && i >= 0 && i < static_cast<int64_t>(it->second.slots.size()),
                "HostKvTier::swap_block: request ", id, " has no swapped block ", i);
  return slot_data(it->second.slots[static_cast<size_t>(i)]);
}

void HostKvTier::drop_swap(RequestId id) {
  auto it = swaps_.find(id);
  if (it == swaps_.end()) return;
  for (int64_t s : it->second.slots) free_slots_.push_back(s);
  swapped_blocks_ -= static_cast<int64_t>(it->second.slots.size());
  swaps_.erase(it);
}

void HostKvTier::check_invariants() const {
  const char* where = "HostKvTier invariant: ";
  std::vector<int> seen(static_cast<size_t>(capacity_), 0);
  auto mark = [&](int64_t s, const char* what) {
    TESSERA_CHECK(s >= 0 && s < capacity_, where, what, " slot ", s, " out of range");
    TESSERA_CHECK(++seen[static_cast<size_t>(s)] == 1, where, "slot ", s, " is held twice (", what, ")");
  };
  for (int64_t s : free_slots_) mark(s, "free");
  int64_t pinned = 0;
  for (const auto& [id, sw] : swaps_) {
    for (int64_t s : sw.slots) mark(s, "swapped");
    pinned += static_cast<int64_t>(sw.slots.size());
  }
  TESSERA_CHECK(pinned == swapped_blocks_, where, pinned, " swapped slots but the count says ", swapped_blocks_);
  TESSERA_CHECK(lru_.size() == cached_.size(), where, "LRU list has ", lru_.size(), " entries for ",
                cached_.size(), " cached blocks");
  std::unordered_set<uint64_t> in_lru;
  for (uint64_t h : lru_) TESSERA_CHECK(in_lru.insert(h).second, where, "hash listed twice in the LRU list");
  for (const auto& [h, e] : cached_) {
    mark(e.slot, "cached");
    TESSERA_CHECK(in_lru.count(h) && *e.lru_pos == h, where, "cached block has a stale LRU position");
  }
  for (int64_t s = 0; s < capacity_; ++s)
    TESSERA_CHECK(seen[static_cast<size_t>(s)] == 1, where, "slot ", s, " is neither free, cached nor swapped");
}

}  // namespace tessera::infer
