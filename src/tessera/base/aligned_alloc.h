// 64-byte aligned allocation for tensor storage (one cache line, one AVX-512 vector).
#pragma once
#include <cstddef>

namespace tessera::base {

constexpr size_t kAlignment = 64;
void* aligned_malloc(size_t bytes);  // throws tessera::Error when out of memory
void aligned_free(void* p);

// Tensor storage: like aligned_malloc, but blocks of 1 MiB and more are recycled by
// exact size instead of going back to the OS. A training or prefill step allocates
// the same activation sizes every time; without reuse, each step page-faults every
// large buffer in again (measured: ~8% of a GPT-2 step in the kernel). At most
// TESSERA_ALLOC_CACHE_MB (default 2048) MiB sit idle in the cache.
void* allocate_cached(size_t bytes);
void release_cached(void* p, size_t bytes);
size_t cached_bytes();  // idle bytes held now
// Returns every idle block to the OS (and trims the heap): after one-off work such as a
// run's set-up, whose buffers the steps will not reuse.
void trim_cached();

}  // namespace tessera::base
