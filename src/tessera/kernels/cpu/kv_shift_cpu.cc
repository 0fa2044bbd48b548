// The window shift on the CPU: per (sequence, kv head), rows move down in increasing order
// (a source row is read before any later destination overwrites it), keys through f32 with
// one rotation table per shift.
#include "tessera/kernels/cpu/kv_shift_cpu.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "tessera/base/thread_pool.h"

namespace tessera::kernels::cpu {

void shift_kv_window_cpu(const PagedDims& d, const KvCacheView& k_cache, const KvCacheView& v_cache,
                         const std::vector<KvWindowShift>& shifts, const RopeFreqs& freqs) {
  const int64_t half = freqs.rotary_dim() / 2, bs = d.block_size, D = d.D;
  const AttnIsa isa = best_attention_isa();
  const int64_t jobs = static_cast<int64_t>(shifts.size()) * d.Hkv;
  base::parallel_for(jobs, 1, [&](int64_t b, int64_t e) {
    std::vector<float> row(static_cast<size_t>(D)), c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
    for (int64_t job = b; job < e; ++job) {
      const KvWindowShift& sh = shifts[static_cast<size_t>(job / d.Hkv)];
      const int64_t h = job % d.Hkv;
      // Rotation by -delta: the angle in double (one rounding to f32 for cos and sin).
      for (int64_t i = 0; i < half; ++i) {
        const double a = static_cast<double>(sh.delta) * static_cast<double>(freqs.inv_freq[static_cast<size_t>(i)]);
        c[static_cast<size_t>(i)] = static_cast<float>(std::cos(a));
        s[static_cast<size_t>(i)] = static_cast<float>(-std::sin(a));
      }
      for (int64_t t = sh.sinks; t + sh.delta < sh.length; ++t) {
        const int64_t from = t + sh.delta;
        const int64_t fb = sh.block_table[from / bs], tb = sh.block_table[t / bs];
        kv_row_to_f32(k_cache.dtype, k_cache.row(fb, from % bs, h), D, row.data(), isa);
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = row[static_cast<size_t>(i)], x2 = row[static_cast<size_t>(i + half)];
          const float ci = c[static_cast<size_t>(i)], si = s[static_cast<size_t>(i)];
          row[static_cast<size_t>(i)] = x1 * ci - x2 * si;
          row[static_cast<size_t>(i + half)] = x2 * ci + x1 * si;
        }
        kv_row_from_f32(k_cache.dtype, row.data(), D, k_cache.row(tb, t % bs, h), isa);
        std::memmove(v_cache.row(tb, t % bs, h), v_cache.row(fb, from % bs, h), static_cast<size_t>(v_cache.row_bytes));
      }
    }
  });
}

}  // namespace tessera::kernels::cpu
