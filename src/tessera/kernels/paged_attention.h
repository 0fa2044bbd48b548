// Attention over a paged KV cache (vLLM's PagedAttention): one call serves a flattened
// batch that mixes prefill chunks and single-token decodes, each reading its keys and
// values through its own block table. Also the cache writes and copy-on-write copies.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tessera/tensor/tensor.h"

namespace tessera::kernels {

// What a KV cache stores, told by the cache tensor's dtype. One (token, head) row of D
// values is one of:
//   kF32  f32 (num_blocks, block_size, Hkv, D)
//   kBF16 bf16 (num_blocks, block_size, Hkv, D), rounded to nearest even
//   kInt8 i8 (num_blocks, block_size, Hkv, D + 4): D codes, then the row's f32 scale
//         absmax / 127 (little-endian bytes; 1 for a row of zeros); value = scale * code
//   kFp8  u8 (num_blocks, block_size, Hkv, D + 4): D fp8 e4m3 codes, then the row's f32
//         scale absmax / 448; value = scale * e4m3(code)
// Scales live inside their row, so a block is self-contained: copy-on-write and prefix
// sharing copy or share bytes, whatever the dtype. Attention reads the stored form and
// widens each key and value tile to f32 as it goes.
enum class KvCacheDtype : uint8_t { kF32, kBF16, kInt8, kFp8 };
const char* kv_cache_dtype_name(KvCacheDtype d);  // "f32" | "bf16" | "int8" | "fp8"
// One-line error naming `flag` otherwise.
KvCacheDtype parse_kv_cache_dtype(const std::string& name, const char* flag = "--kv-cache-dtype");
// Bytes one (token, head) row of head dim D takes.
int64_t kv_cache_row_bytes(KvCacheDtype d, int64_t D);
// An uninitialised cache of one layer's K or V (pages are touched as blocks are written).
Tensor make_kv_cache(int64_t num_blocks, int64_t block_size, int64_t heads, int64_t D, KvCacheDtype d);
KvCacheDtype kv_cache_dtype(const Tensor& cache);  // from its dtype; one-line error otherwise
int64_t kv_cache_head_dim(const Tensor& cache);    // D (size(3), less the scale bytes)

// KV cache pool of one layer: k_cache, v_cache (num_blocks, block_size, Hkv, D) in one of
// the forms above, contiguous, the same dtype. A sequence's logical token t lives in
// physical block block_table[t / block_size], row t % block_size.
struct PagedSequence {
  int64_t q_begin = 0;      // first row of this sequence's queries in q / out
  int64_t q_len = 0;        // query tokens this step (1 = decode)
  int64_t context_len = 0;  // keys in the cache, including this step's tokens (already written)
  const int32_t* block_table = nullptr;  // at least ceil(context_len / block_size) entries
};

struct PagedAttentionParams {
  float scale = 0.f;  // usually 1 / sqrt(D)
  // Reduction order (both modes): keys are cut into partitions of `decode_split` keys
  // from key 0, each partition is an online softmax over 64-key tiles, and partitions are
  // merged in order with the log-sum-exp rule. That order depends only on the sequence's
  // own context_len, never on the other sequences or the thread count, so a sequence's
  // output bits are the same in any batch.
  // batch_invariant additionally fixes the partition size (256 when decode_split is 0)
  // so it does not depend on context_len either: a query row then gets the same bits
  // whether it is computed as a decode, inside a prefill chunk, or with any chunking.
  // (Bits are per machine: the AVX-512 and portable paths round differently.)
  bool batch_invariant = false;
  // Keys per split-K partition (decodes and prefill chunks alike); 0 = auto: 256 when
  // batch_invariant, else context_len / 16 rounded up to 64, within [256, 1024] (so the two
  // modes agree up to 4096 keys).
  int64_t decode_split = 0;
  // Sliding window (0 = none): a query at position p sees keys (p - window, p]. Keys before
  // the first row of a query block's window are never read, so their cache blocks may have
  // been freed (the engine frees blocks that leave every layer's window).
  int64_t window = 0;
  float softcap = 0.f;  // logit soft-capping (Gemma 2; AttentionParams::softcap)
};

// q (Ntok, Hq, D) f32, head dim contiguous and head stride D; the token stride may be
// larger (a slice of a fused qkv buffer). out (Ntok, Hq, D), same rules; rows of out that
// no sequence covers are left untouched. Query row i of a sequence is at absolute position
// context_len - q_len + i and attends causally to keys [0, that position].
// GQA: query head h reads kv head h / (Hq / Hkv).
void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                     const std::vector<PagedSequence>& seqs, Tensor& out,
                     const PagedAttentionParams& p);

// Writes this step's keys / values into the cache: row q_begin + i of k, v (Ntok, Hkv, D)
// (token stride free, head stride D) goes to slot (block_table[pos / bs], pos % bs) with
// pos = context_len - q_len + i, converted to the cache's form (bf16 rounding; int8 / fp8
// with the row's own scale). Two tokens may not write the same slot.
void write_kv_cache(const Tensor& k, const Tensor& v, const std::vector<PagedSequence>& seqs,
                    Tensor& k_cache, Tensor& v_cache);

// Latent attention (model/mla.h) caches one tensor of rows: write_kv_cache and
// copy_kv_blocks take an undefined v_cache (and v) for it, and read_kv_rows hands a
// sequence's rows [0, context_len) back as f32: out (context_len, Hkv, D), contiguous.
void read_kv_rows(const Tensor& cache, const PagedSequence& seq, Tensor& out);

// Copy-on-write: copies whole blocks src -> dst (pairs (src, dst)) in both caches, in
// list order. A dst may appear only once.
void copy_kv_blocks(Tensor& k_cache, Tensor& v_cache,
                    const std::vector<std::pair<int32_t, int32_t>>& copies);

}  // namespace tessera::kernels
