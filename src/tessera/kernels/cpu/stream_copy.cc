// Copies that go around the cache (stream_copy.h).
#include "tessera/kernels/cpu/stream_copy.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "tessera/base/thread_pool.h"
#include "tessera/kernels/cpu/pointwise_common.h"

namespace tessera::kernels::cpu {
namespace {

// Plain copies up to dst's first 64-byte boundary and after its last whole line, streamed
// lines between. Not fenced.
__attribute__((target("avx512f"))) void stream_bytes_avx512(char* dst, const char* src, size_t n) {
  const size_t head = std::min(n, (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64);
  std::memcpy(dst, src, head);
  size_t i = head;
  for (; i + 64 <= n; i += 64)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
  std::memcpy(dst + i, src + i, n - i);
}

}  // namespace

void stream_copy(void* dst, const void* src, size_t bytes) {
  if (!use_avx512()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  stream_bytes_avx512(static_cast<char*>(dst), static_cast<const char*>(src), bytes);
  _mm_sfence();
}

void stream_copy_rows(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows, int64_t cols) {
  const bool avx512 = use_avx512();
  const size_t row_bytes = sizeof(float) * static_cast<size_t>(cols);
  base::parallel_for(rows, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(cols, 1)),
                     [&](int64_t r0, int64_t r1) {
                       for (int64_t r = r0; r < r1; ++r) {
                         char* d = reinterpret_cast<char*>(dst + r * ldd);
                         const char* s = reinterpret_cast<const char*>(src + r * lds);
                         if (avx512)
                           stream_bytes_avx512(d, s, row_bytes);
                         else
                           std::memcpy(d, s, row_bytes);
                       }
                       if (avx512) _mm_sfence();  // this thread's streamed lines, before the join
                     });
}

}  // namespace tessera::kernels::cpu
