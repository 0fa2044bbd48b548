// StreamingLLM attention sinks over a paged KV cache: dropping the oldest tokens of a
// sequence's window while its first tokens (the sinks) stay. The cache keeps keys rotated
// (RoPE applied at their cache position); the kept window moves down to close the gap and
// its keys are rotated back by the distance moved, since rotations compose:
// R(-delta) R(p) = R(p - delta). Positions are thus always positions within the cache.
#pragma once
#include <cstdint>
#include <vector>

#include "tessera/kernels/rope.h"
#include "tessera/tensor/tensor.h"

namespace tessera::kernels {

// One sequence's shift. Its cache rows (cache position t at block_table[t / block_size],
// row t % block_size) are [0, sinks) sinks then the window [sinks, length). Rows
// [sinks + delta, length) move to [sinks, length - delta); rows [0, sinks) are untouched.
struct KvWindowShift {
  const int32_t* block_table = nullptr;  // at least ceil(length / block_size) entries
  int64_t sinks = 0, length = 0, delta = 0;  // 0 < delta <= length - sinks
};

// Applies the shifts to one layer's caches (paged_attention.h forms; every dtype): each
// moved key row is widened to f32, its first freqs.rotary_dim() features of every head
// rotated by -delta positions (Hugging Face rotate_half pairs (i, i + rotary_dim / 2),
// angle delta x inv_freq[i]; attention_factor is not applied again: it is already in the
// key), and stored again in the cache's form (bf16 rounding, int8 / fp8 with a new row
// scale); value rows are copied as stored. Sequences must not share a block a shift
// writes (copy-on-write first). Both caches are required (latent attention is not shifted).
void shift_kv_window(Tensor& k_cache, Tensor& v_cache, const std::vector<KvWindowShift>& shifts,
                     const RopeFreqs& freqs);

}  // namespace tessera::kernels
