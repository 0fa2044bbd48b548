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

// One layer's K or V cache as bytes: row (block, slot, head) is one (token, head) row in
// the cache's dtype (paged_attention.h), row_bytes = kv_cache_row_bytes(dtype, D).
struct KvCacheView {
  KvCacheDtype dtype = KvCacheDtype::kF32;
  uint8_t* data = nullptr;
  int64_t block_bytes = 0, token_bytes = 0, row_bytes = 0;
  uint8_t* row(int64_t block, int64_t slot, int64_t head) const {
    return data + block * block_bytes + slot * token_bytes + head * row_bytes;
  }
};
KvCacheView kv_cache_view(const Tensor& cache);  // a contiguous cache tensor

// One cached row of D values to f32 and back (the row's scale included for int8 / fp8), with
// the vectors of `isa` (one this CPU has); every level gives the same bits.
void kv_row_to_f32(KvCacheDtype d, const uint8_t* src, int64_t D, float* dst, AttnIsa isa);
void kv_row_from_f32(KvCacheDtype d, const float* src, int64_t D, uint8_t* dst, AttnIsa isa);

// Keys per partition for a sequence with `context_len` keys (see PagedAttentionParams).
int64_t paged_partition_keys(int64_t context_len, const PagedAttentionParams& p);

// q, out: (Ntok, Hq, D) rows as AttnView{data, 0, token_stride} (batch index 0).
// k_cache, v_cache: (num_blocks, block_size, Hkv, D) caches of one dtype.
void paged_attention_cpu(const PagedDims& dims, const AttnView& q, const KvCacheView& k_cache,
                         const KvCacheView& v_cache, const std::vector<PagedSequence>& seqs,
                         const AttnView& out, const PagedAttentionParams& p, AttnIsa isa);

// One (source row, destination slot) copy of write_kv_cache: Hkv rows of k and of v.
struct KvSlotWrite {
  int64_t token = 0;                // row of k / v
  int64_t block = 0, slot = 0;      // destination in the caches
};
// k, v: (Ntok, Hkv, D) as AttnView{data, 0, token_stride}; caches as above.
void write_kv_cache_cpu(const PagedDims& dims, const AttnView& k, const AttnView& v,
                        const std::vector<KvSlotWrite>& writes, const KvCacheView& k_cache,
                        const KvCacheView& v_cache, AttnIsa isa);
// A sequence's cached rows [0, context_len) widened to f32: out (context_len, Hkv, D).
void read_kv_rows_cpu(const PagedDims& dims, const KvCacheView& cache, const PagedSequence& s, float* out,
                      AttnIsa isa);
void copy_kv_blocks_cpu(const KvCacheView& k_cache, const KvCacheView& v_cache,
                        const std::vector<std::pair<int32_t, int32_t>>& copies);

}  // namespace tessera::kernels::cpu
