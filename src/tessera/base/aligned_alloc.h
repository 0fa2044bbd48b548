// 64-byte aligned allocation for tensor storage (one cache line, one AVX-512 vector).
#pragma once
#include <cstddef>

namespace tessera::base {

constexpr size_t kAlignment = 64;
void* aligned_malloc(size_t bytes);  // throws tessera::Error when out of memory
void aligned_free(void* p);

}  // namespace tessera::base
