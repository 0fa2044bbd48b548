// Copies that go around the cache (streaming stores) where the pointwise kernels run AVX-512
// (pointwise_common.h): for data written once and read much later, where a plain store
// would first read every line it overwrites. Elsewhere plain copies.
#pragma once
#include <cstddef>
#include <cstdint>

namespace tessera::kernels::cpu {

// bytes from src to dst on the calling thread; the streamed lines are fenced before it returns.
void stream_copy(void* dst, const void* src, size_t bytes);
// dst rows = src rows (f32, row strides lds / ldd), over the threads.
void stream_copy_rows(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows, int64_t cols);

}  // namespace tessera::kernels::cpu
