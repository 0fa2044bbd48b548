// 64-byte aligned allocation for tensor storage (one cache line, one AVX-512 vector).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

namespace tessera::base {

constexpr size_t kAlignment = 64;
// Blocks of at least kHugePageBytes start on a 2 MiB boundary and their whole 2 MiB pages
// are advised MADV_HUGEPAGE, so a kernel whose transparent huge pages run in "madvise" mode
// (the common default) backs them with huge pages. Decode streams every weight once per
// token, and on 4 KiB pages the TLB misses and the hardware prefetcher, which stops at
// every 4 KiB page, cost a third of the bandwidth (docs/performance.md, "Huge pages").
// TESSERA_HUGEPAGES=0 turns the advice off; `huge_pages = false` leaves one block out
// (the STREAM probe, which measures memory as STREAM's own binary does).
constexpr size_t kHugePageBytes = size_t{2} << 20;
void* aligned_malloc(size_t bytes, bool huge_pages = true);  // throws tessera::Error when out of memory
void aligned_free(void* p);

// An owned aligned_malloc array of n T (at least one), freed with aligned_free.
struct AlignedFree {
  void operator()(void* p) const { aligned_free(p); }
};
template <typename T>
using AlignedArray = std::unique_ptr<T[], AlignedFree>;
template <typename T>
AlignedArray<T> aligned_array(int64_t n, bool huge_pages = true) {
  return AlignedArray<T>(static_cast<T*>(aligned_malloc(sizeof(T) * static_cast<size_t>(n > 1 ? n : 1), huge_pages)));
}
// Whether blocks of kHugePageBytes and more are advised (TESSERA_HUGEPAGES, read once).
bool huge_pages_enabled();

// Tensor storage: like aligned_malloc, but blocks of 1 MiB and more are recycled by
// exact size instead of going back to the OS. A training or prefill step allocates
// the same activation sizes every time; without reuse, each step page-faults every
// large buffer in again (measured: ~8% of a GPT-2 step in the kernel). At most
// TESSERA_ALLOC_CACHE_MB (default 2048) MiB sit idle in the cache.
// Training lowers the floor to 64 KiB (set_cache_floor, from Model::forward_chunk): glibc
// serves blocks above its mmap threshold (128 KiB at first) with fresh pages too, and a
// GPT-2 4 x 64 step's (256, 768) activations then took ~1,100 page faults and ~3% of its
// forward + backward. Serving keeps 1 MiB: its requests allocate many distinct sizes,
// which exact-size reuse would keep (a 5,000-request soak's RSS doubled at 64 KiB).
void* allocate_cached(size_t bytes);
// Caches blocks from `bytes` on (never raises the floor; 1 MiB until called).
void set_cache_floor(size_t bytes);
void release_cached(void* p, size_t bytes);
size_t cached_bytes();  // idle bytes held now
// Returns every idle block to the OS (and trims the heap): after one-off work such as a
// run's set-up, whose buffers the steps will not reuse.
void trim_cached();

}  // namespace tessera::base
