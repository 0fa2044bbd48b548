// Entry point of kv_shift.h: checks the caches, the shifts and their block tables, then
// runs the CPU kernel.
#include "tessera/kernels/kv_shift.h"

#include <algorithm>
#include <set>
#include <utility>

#include "tessera/kernels/cpu/kv_shift_cpu.h"
#include "tessera/kernels/dispatch.h"
#include "tessera/kernels/paged_attention.h"

namespace tessera::kernels {

void shift_kv_window(Tensor& k_cache, Tensor& v_cache, const std::vector<KvWindowShift>& shifts,
                     const RopeFreqs& freqs) {
  const char* op = "shift_kv_window";
  TESSERA_CHECK(k_cache.defined() && v_cache.defined(), op, ": needs both the key and the value cache");
  TESSERA_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.shape() == k_cache.shape() &&
                    v_cache.dtype() == k_cache.dtype() && v_cache.is_contiguous(),
                op, ": caches must be contiguous (num_blocks, block_size, Hkv, D) of one dtype, got ",
                k_cache.describe(), " and ", v_cache.describe());
  kv_cache_dtype(k_cache);  // one-line error for a tensor that is no KV cache
  cpu::PagedDims d;
  d.num_blocks = k_cache.size(0);
  d.block_size = k_cache.size(1);
  d.Hkv = k_cache.size(2);
  d.D = kv_cache_head_dim(k_cache);
  d.Hq = d.Hkv;
  TESSERA_CHECK(freqs.rotary_dim() > 0 && freqs.rotary_dim() <= d.D, op, ": ", freqs.inv_freq.size(),
                " frequencies rotate ", freqs.rotary_dim(), " features, not within head_dim ", d.D);
  std::set<int32_t> written;  // blocks some shift writes: no two shifts may share one
  for (size_t i = 0; i < shifts.size(); ++i) {
    const KvWindowShift& s = shifts[i];
    TESSERA_CHECK(s.sinks >= 0 && s.delta > 0 && s.sinks + s.delta <= s.length, op, ": shifts[", i, "] (sinks ",
                  s.sinks, ", length ", s.length, ", delta ", s.delta, ") needs 0 < delta <= length - sinks");
    TESSERA_CHECK(s.block_table != nullptr, op, ": shifts[", i, "] has no block_table");
    const int64_t blocks = (s.length + d.block_size - 1) / d.block_size;
    for (int64_t b = 0; b < blocks; ++b)
      TESSERA_CHECK(s.block_table[b] >= 0 && s.block_table[b] < d.num_blocks, op, ": shifts[", i, "] block_table[",
                    b, "] = ", s.block_table[b], " is outside the cache's ", d.num_blocks, " blocks");
    std::set<int32_t> mine;
    for (int64_t b = s.sinks / d.block_size; b * d.block_size < s.length - s.delta; ++b) mine.insert(s.block_table[b]);
    for (int32_t b : mine)
      TESSERA_CHECK(written.insert(b).second, op, ": two shifts write block ", b,
                    " (a shared block must be copied before it is written)");
  }
  if (shifts.empty()) return;
  TESSERA_KERNEL(op, cpu::shift_kv_window_cpu(d, cpu::kv_cache_view(k_cache), cpu::kv_cache_view(v_cache), shifts, freqs),
                 k_cache, v_cache);
}

}  // namespace tessera::kernels
