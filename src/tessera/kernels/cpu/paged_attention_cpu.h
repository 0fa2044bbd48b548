// Internal interface of the CPU paged-attention kernels: raw views already checked by
// kernels/paged_attention.cc. Tests include it to run the portable path on AVX-512 machines.
#pragma once
#include <cstdint>
#include <vector>

#include "tessera/kernels/cpu/attention_cpu.h"
#include "tessera/kernels/paged_attention.h"

namespace tessera::kernels::cpu {

struct PagedDims {
  int64_t Hq = 0, Hkv = 0, D = 0;
  int64_t num_blocks = 0, block_size = 0;
};

// Keys per partition for a sequence with `context_len` keys (see PagedAttentionParams).
int64_t paged_partition_keys(int64_t context_len, const PagedAttentionParams& p);

// q, out: (Ntok, Hq, D) rows as AttnView{data, 0, token_stride} (batch index 0).
// k_cache, v_cache: (num_blocks, block_size, Hkv, D) as AttnView{data, block stride,
// Hkv * D}, so row(block, slot, kvh, D) is one cached key.
void paged_attention_cpu(const PagedDims& dims, const AttnView& q, const AttnView& k_cache,
                         const AttnView& v_cache, const std::vector<PagedSequence>& seqs,
                         const AttnView& out, const PagedAttentionParams& p, AttnIsa isa);

// One (source row, destination slot) copy of write_kv_cache: Hkv * D floats of k and of v.
struct KvSlotWrite {
  int64_t token = 0;                // row of k / v
  int64_t block = 0, slot = 0;      // destination in the caches
};
// k, v: (Ntok, Hkv, D) as AttnView{data, 0, token_stride}; caches as above.
void write_kv_cache_cpu(const PagedDims& dims, const AttnView& k, const AttnView& v,
                        const std::vector<KvSlotWrite>& writes, const AttnView& k_cache,
                        const AttnView& v_cache);
void copy_kv_blocks_cpu(const PagedDims& dims, const AttnView& k_cache, const AttnView& v_cache,
                        const std::vector<std::pair<int32_t, int32_t>>& copies);

}  // namespace tessera::kernels::cpu
