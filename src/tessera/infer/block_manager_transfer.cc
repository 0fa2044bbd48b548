// BlockManager's entry point for KV transfer between engines (prefill/decode disaggregation):
// holding a cached chain of full blocks, on the side that sends it and on the side that imports it.
#include <algorithm>

#include "tessera/base/error.h"
#include "tessera/infer/block_manager.h"

namespace tessera::infer {

int64_t BlockManager::hold_cached_chain(RequestId holder, const std::vector<int32_t>& tokens, uint64_t cache_salt) {
  TESSERA_CHECK(!reqs_.count(holder), "BlockManager::hold_cached_chain: request ", holder,
                " already has a block table");
  RequestBlocks& r = reqs_[holder];
  r.root = root_hash(cache_salt);
  if (!cfg_.prefix_caching) return 0;
  const int64_t bs = cfg_.block_size;
  const int64_t full = static_cast<int64_t>(tokens.size()) / bs;
  uint64_t parent = r.root;
  int64_t held = 0;
  for (; held < full; ++held) {
    const int32_t* t = tokens.data() + held * bs;
    const uint64_t h = hash_block(parent, t, bs);
    auto it = cached_.find(h);
    if (it == cached_.end()) break;
    Block& blk = blocks_[it->second];
    if (blk.parent_hash != parent || !std::equal(blk.tokens.begin(), blk.tokens.end(), t)) break;
    if (blk.ref++ == 0) {
      evictable_.erase(blk.lru_pos);
      blk.state = State::kUsed;
    }
    r.table.push_back(it->second);
    r.hashes.push_back(h);
    parent = h;
  }
  return held;
}

}  // namespace tessera::infer
