// Internal interface of the CPU window shift (kernels/kv_shift.h), views already checked.
#pragma once
#include <vector>

#include "tessera/kernels/cpu/paged_attention_cpu.h"
#include "tessera/kernels/kv_shift.h"

namespace tessera::kernels::cpu {

void shift_kv_window_cpu(const PagedDims& dims, const KvCacheView& k_cache, const KvCacheView& v_cache,
                         const std::vector<KvWindowShift>& shifts, const RopeFreqs& freqs);

}  // namespace tessera::kernels::cpu
