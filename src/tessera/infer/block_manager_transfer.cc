// BlockManager's entry point for KV transfer between engines (prefill/decode disaggregation):
// holding a cached chain of full blocks, on the side that sends it and on the side that imports it.
#include "tessera/base/error.h"
#include "tessera/infer/block_manager.h"

namespace tessera::infer {

int64_t BlockManager::hold_cached_chain(RequestId holder, const std::vector<int32_t>& tokens, uint64_t cache_salt) {
  TESSERA_CHECK(!reqs_.count(holder), "BlockManager::hold_cached_chain: request ", holder,
                " already has a block table");
  RequestBlocks& r = reqs_[holder];
  r.root = root_hash(cache_salt);
  if (!cfg_.prefix_caching) return 0;
  // The pool's cached blocks only: the lookup a prompt makes, without the lower tiers.
  int64_t held = 0, tier_hits = 0;
  extend_chain(r, tokens, static_cast<int64_t>(tokens.size()) / cfg_.block_size, false, held, tier_hits);
  return held;
}

}  // namespace tessera::infer
