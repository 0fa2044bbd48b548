// Paged attention the plain way: gather each sequence's keys and values through its block
// table into contiguous arrays and run the naive double-precision attention on them.
// Used only by tests as the independent reference for kernels/paged_attention.h.
#pragma once
#include <vector>

#include "tessera/kernels/paged_attention.h"
#include "tessera/tensor/tensor.h"

namespace tessera::kernels::reference {

// Keys (or values) [0, context_len) of one sequence from a (num_blocks, bs, Hkv, D) cache of
// any KV cache dtype (decoded here from the format's definition),
// as a contiguous (context_len, Hkv, D) array.
std::vector<double> gather_paged(const Tensor& cache, const PagedSequence& s);

// Same contract as kernels::paged_attention (q, out (Ntok, Hq, D) with any strides).
void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                     const std::vector<PagedSequence>& seqs, Tensor& out,
                     const PagedAttentionParams& p);

}  // namespace tessera::kernels::reference
