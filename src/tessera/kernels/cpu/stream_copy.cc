// Copies of f32 rows that go around the cache (streaming stores): for results written once
// and read much later, where a plain store would first read every line it overwrites.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "tessera/base/thread_pool.h"
#include "tessera/kernels/cpu/matmul_cpu.h"
#include "tessera/kernels/dispatch.h"

namespace tessera::kernels::cpu {
namespace {

__attribute__((target("avx512f"))) void stream_row_avx512(const float* src, float* dst, int64_t n) {
  int64_t i = 0;
  // Plain stores up to the first 64-byte boundary of dst, streamed lines after it.
  while (i < n && reinterpret_cast<uintptr_t>(dst + i) % 64 != 0) dst[i] = src[i], ++i;
  for (; i + 16 <= n; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
  for (; i < n; ++i) dst[i] = src[i];
}

}  // namespace

void stream_copy_rows(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows, int64_t cols) {
  const bool avx512 = cpu_has(IsaLevel::kAvx512);
  base::parallel_for(rows, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(cols, 1)),
                     [&](int64_t r0, int64_t r1) {
                       for (int64_t r = r0; r < r1; ++r) {
                         if (avx512)
                           stream_row_avx512(src + r * lds, dst + r * ldd, cols);
                         else
                           std::memcpy(dst + r * ldd, src + r * lds, sizeof(float) * static_cast<size_t>(cols));
                       }
                       if (avx512) _mm_sfence();  // this thread's streamed lines, before the join
                     });
}

}  // namespace tessera::kernels::cpu
