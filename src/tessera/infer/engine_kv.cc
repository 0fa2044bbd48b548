// Engine entry points for KV transfer between engines (prefill/decode disaggregation): pin a
// prompt's cached blocks for export, reserve and commit blocks for an import. Engine thread only;
// the bytes themselves are copied by the caller through kv_pool() (KvPool::read/write_block*).
#include "tessera/base/error.h"
#include "tessera/infer/engine.h"

namespace tessera::infer {

Engine::KvChain Engine::hold_kv_prefix(const std::vector<int32_t>& tokens, int32_t adapter) {
  KvChain c;
  c.holder = next_holder_--;
  c.have = blocks_->hold_cached_chain(c.holder, tokens, static_cast<uint64_t>(adapter + 1));
  c.blocks = blocks_->block_table(c.holder);
  c.hashes = blocks_->block_hashes(c.holder);
  return c;
}

std::optional<Engine::KvChain> Engine::reserve_kv_import(const std::vector<int32_t>& tokens, int32_t adapter,
                                                          const std::vector<uint64_t>& hashes) {
  const int64_t bs = config_.block_size;
  const int64_t n = static_cast<int64_t>(hashes.size());
  TESSERA_CHECK(n * bs <= static_cast<int64_t>(tokens.size()), "KV import: ", n, " blocks of ", bs,
                " tokens need ", n * bs, " token ids, got ", tokens.size());
  TESSERA_CHECK(blocks_->prefix_caching(), "KV import needs prefix caching (the blocks arrive as cached blocks)");
  const int32_t bank = static_cast<int32_t>(model_.lora_bank().size());
  TESSERA_CHECK(adapter >= -1 && adapter < bank, "KV import: LoRA adapter ", adapter, " does not exist here");
  // The sender's chain must be ours: same block size, salt and hash function.
  uint64_t parent = BlockManager::root_hash(static_cast<uint64_t>(adapter + 1));
  for (int64_t b = 0; b < n; ++b) {
    const uint64_t h = BlockManager::hash_block(parent, tokens.data() + b * bs, bs);
    TESSERA_CHECK(h == hashes[b], "KV import: block ", b, "'s chain hash ", hashes[b],
                  " differs from this engine's (", h, "): the workers differ in block size, adapter or hashing");
    parent = h;
  }
  KvChain c;
  c.holder = next_holder_--;
  const std::vector<int32_t> chain(tokens.begin(), tokens.begin() + n * bs);
  c.have = blocks_->hold_cached_chain(c.holder, chain, static_cast<uint64_t>(adapter + 1));
  if (!blocks_->allocate_slots(c.holder, n * bs)) {
    blocks_->free(c.holder);
    return std::nullopt;
  }
  c.blocks = blocks_->block_table(c.holder);
  c.hashes = hashes;
  return c;
}

void Engine::commit_kv_import(const KvChain& chain, const std::vector<int32_t>& tokens) {
  const int64_t n = static_cast<int64_t>(chain.blocks.size());
  const std::vector<int32_t> t(tokens.begin(), tokens.begin() + n * config_.block_size);
  blocks_->commit(chain.holder, t, n * config_.block_size);
}

void Engine::release_kv(RequestId holder) { blocks_->free(holder); }

}  // namespace tessera::infer
