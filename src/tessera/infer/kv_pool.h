// The paged KV cache of every layer: one pool of fixed-size blocks per layer (the same
// block ids in every layer), sized from a byte budget, and the model::KvAttention that
// writes a step's keys/values into it and attends through the block tables.
#pragma once
#include <cstdint>
#include <vector>

#include "tessera/kernels/paged_attention.h"
#include "tessera/model/model.h"
#include "tessera/tensor/tensor.h"

namespace tessera::infer {

struct KvPool {
  // per layer: (num_blocks, block_size, Hkv, D) in `dtype`'s form (kernels/paged_attention.h)
  std::vector<Tensor> k, v;
  int64_t num_blocks = 0, block_size = 0;
  kernels::KvCacheDtype dtype = kernels::KvCacheDtype::kBF16;

  // kv_heads: the heads this rank caches (model::LocalDims::kv_heads under tensor
  // parallelism); 0 = the config's.
  static KvPool create(const model::ModelConfig& c, int64_t num_blocks, int64_t block_size,
                       int64_t kv_heads, kernels::KvCacheDtype dtype);
  // Bytes one block costs across all layers (K and V; int8 / fp8 scales included); the
  // defaults are the config's heads and the engine's default dtype.
  // Latent attention (deepseek) caches one row of kv_lora + rope values per token and
  // layer (k; v is undefined).
  static int64_t bytes_per_block(const model::ModelConfig& c, int64_t block_size, int64_t kv_heads = 0,
                                 kernels::KvCacheDtype dtype = kernels::KvCacheDtype::kBF16);
  // Bytes per token the same model would cache as multi-head attention (every head's key
  // and value): what latent attention is compared with. bytes_per_block(1) for others.
  static int64_t mha_bytes_per_token(const model::ModelConfig& c, kernels::KvCacheDtype dtype);

  // One block's bytes, the unit the KV tiers (host / disk) and KV transfer move. A block is
  // self-contained in every dtype (scales live in their rows), so its bytes are its K/V.
  // Layout of block_bytes(): for each layer, the block's K rows then its V rows (latent
  // attention: the rows only), in the cache's stored form.
  int64_t layer_block_bytes(int64_t layer) const;  // one layer's share
  int64_t block_bytes() const;                     // every layer's
  int64_t num_layers() const { return static_cast<int64_t>(k.size()); }
  // Copies block b of one layer (layer_block_bytes(layer) bytes) out of / into the pool.
  void read_block_layer(int32_t b, int64_t layer, uint8_t* dst) const;
  void write_block_layer(int32_t b, int64_t layer, const uint8_t* src);
  // The same over every layer, block_bytes() bytes in the layout above.
  void read_block(int32_t b, uint8_t* dst) const;
  void write_block(int32_t b, const uint8_t* src);
};

// Blocks that fit in `bytes` (at least 1; throws naming the budget when not even one fits).
int64_t kv_blocks_for_memory(const model::ModelConfig& c, int64_t block_size, int64_t bytes,
                             int64_t kv_heads, kernels::KvCacheDtype dtype);
// MemAvailable from /proc/meminfo (0 when unknown).
int64_t available_memory_bytes();

// KvAttention over a KvPool for one engine step: `seqs` says which rows of the step's
// tokens belong to which sequence and where its blocks are.
class PagedKvAttention final : public model::KvAttention {
 public:
  // `config` gives each layer's sliding window.
  PagedKvAttention(KvPool& pool, std::vector<kernels::PagedSequence> seqs,
                   kernels::PagedAttentionParams params, const model::ModelConfig& config)
      : pool_(pool), seqs_(std::move(seqs)), params_(params), config_(config) {}
  void attend(int64_t layer, const Tensor& q, const Tensor& k, const Tensor& v,
              Tensor& out) override {
    kernels::write_kv_cache(k, v, seqs_, pool_.k[layer], pool_.v[layer]);
    kernels::PagedAttentionParams p = params_;
    p.window = config_.layer_window(layer);
    p.softcap = config_.attn_softcap;
    kernels::paged_attention(q, pool_.k[layer], pool_.v[layer], seqs_, out, p);
  }
  void attend_latent(int64_t layer, const Tensor& rows, const LatentFn& fn) override;

 private:
  KvPool& pool_;
  std::vector<kernels::PagedSequence> seqs_;
  kernels::PagedAttentionParams params_;
  const model::ModelConfig& config_;
};

}  // namespace tessera::infer
