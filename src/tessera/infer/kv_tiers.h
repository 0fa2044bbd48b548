// Tiered KV cache: the lower tiers under the pool (vLLM's KV offloading, LMCache, SGLang's
// HiCache). Committed blocks evicted from the pool are copied to a host-memory tier (LRU) and,
// write-through, to a disk tier (files that survive a restart); a prefix lookup continues in
// them where the pool's chain ends and copies hits back instead of recomputing them. Requests
// preempted by swap keep their blocks in the host tier. See docs/serving.md.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/infer/engine.h"
#include "tessera/infer/kv_disk_tier.h"
#include "tessera/infer/kv_host_tier.h"
#include "tessera/infer/kv_offload.h"
#include "tessera/infer/kv_pool.h"
#include "tessera/model/model.h"

namespace tessera::infer {

struct KvTierConfig {
  int64_t host_bytes = 0;    // host tier size (0: none)
  std::string disk_dir;      // disk tier directory ("" : none)
  int64_t disk_bytes = 0;    // its size limit
};

struct KvTierStats {
  int64_t host_hit_blocks = 0, disk_hit_blocks = 0;  // prefix blocks copied back from each tier
  int64_t offloaded_blocks = 0;  // evicted pool blocks copied to the host tier
  int64_t disk_written_blocks = 0;
  int64_t swap_out_blocks = 0, swap_in_blocks = 0, swap_failures = 0;  // failures: no room, recomputed
  int64_t bytes_to_tiers = 0, bytes_from_tiers = 0;  // copied out of / into the pool
  int64_t host_blocks_total = 0, host_blocks_cached = 0, host_blocks_swapped = 0;
  DiskTierStats disk;
};

class KvTiers final : public KvOffloader {
 public:
  // pool: the engine's (outlives this). fingerprint: kv_fingerprint() of the model and pool,
  // what the disk tier's files must carry to be loaded.
  KvTiers(KvPool& pool, const KvTierConfig& c, uint64_t fingerprint);

  void offload(BlockId b, const BlockKey& key) override;
  bool contains(const BlockKey& key) override;
  bool load(const BlockKey& key, BlockId dst) override;
  bool swap_out(RequestId id, const std::vector<BlockId>& blocks, int64_t num_tokens) override;
  int64_t swapped_tokens(RequestId id) const override;
  void swap_in(RequestId id, int64_t first, const std::vector<BlockId>& dst) override;
  void drop_swap(RequestId id) override;

  KvTierStats stats() const;
  HostKvTier* host() { return host_.get(); }  // nullptr without a host tier
  DiskKvTier* disk() { return disk_.get(); }  // nullptr without a disk tier
  std::string summary() const;  // "host tier 812 blocks (53.2 MB), disk tier DIR 4096 blocks (...)"

 private:
  KvPool& pool_;
  int64_t block_bytes_ = 0;
  std::unique_ptr<HostKvTier> host_;
  std::unique_ptr<DiskKvTier> disk_;
  std::vector<uint8_t> scratch_;  // (block_bytes) one block on its way to or from the disk
  KvTierStats stats_;
};

// Everything that makes a cached block's bytes valid, hashed: the model's config, a digest
// of its weights (every tensor's name, shape, dtype and bytes, large ones sampled at both
// ends) and LoRA bank, the cache dtype, block size, heads and block bytes.
// extra_id: more identity (EngineConfig::kv_offload_model_id).
uint64_t kv_fingerprint(const model::Model& m, const KvPool& pool, const std::string& extra_id = "");

// The engine's side: EngineConfig's tier fields checked (throws naming the flag), the tiers
// an engine config asks for (nullptr: none; throws under tensor parallelism), and their
// figures in EngineStats.
void validate_kv_tiers(const EngineConfig& c);
std::unique_ptr<KvTiers> make_kv_tiers(const model::Model& m, const EngineConfig& c, KvPool& pool,
                                       bool tensor_parallel);
void add_kv_tier_stats(const KvTiers& t, EngineStats& s);
// "config.json:SIZE:MTIME;model.safetensors:SIZE:MTIME;..." for a model directory (or one
// file, e.g. a GGUF): the weights' identity the CLI passes as kv_offload_model_id.
std::string model_files_identity(const std::string& path);

}  // namespace tessera::infer
