// Aligned allocation backed by posix_memalign.
#include "tessera/base/aligned_alloc.h"

#include <malloc.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include "tessera/base/error.h"

namespace tessera::base {

bool huge_pages_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("TESSERA_HUGEPAGES");
    return !(v && std::string(v) == "0");
  }();
  return on;
}

void* aligned_malloc(size_t bytes, bool huge_pages) {
  void* p = nullptr;
  if (bytes == 0) bytes = kAlignment;
  bytes = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  const bool huge = huge_pages && bytes >= kHugePageBytes && huge_pages_enabled();
  // A last, partly used 2 MiB page is advised too when rounding up to it adds at most an
  // eighth of the block (a 5.8 MB int4 down projection: 6 MiB); a touched huge page is
  // faulted in whole, so a 2.1 MB block keeps 4 KiB pages past its first 2 MiB.
  const size_t up = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  const size_t advised = !huge ? 0 : up - bytes <= bytes / 8 ? up : bytes / kHugePageBytes * kHugePageBytes;
  if (posix_memalign(&p, huge ? kHugePageBytes : kAlignment, std::max(bytes, advised)) != 0 || p == nullptr)
    fail("out of memory allocating ", bytes, " bytes");
  // Best effort: a kernel without transparent huge pages answers EINVAL.
  if (advised > 0) madvise(p, advised, MADV_HUGEPAGE);
  return p;
}

void aligned_free(void* p) { std::free(p); }

namespace {

std::atomic<size_t> g_cache_floor{size_t{1} << 20};

struct BlockCache {
  std::mutex mu;
  std::multimap<size_t, void*> free_blocks;  // rounded size -> block
  size_t idle_bytes = 0;
  size_t limit = [] {
    const char* v = std::getenv("TESSERA_ALLOC_CACHE_MB");
    return (v ? static_cast<size_t>(std::strtoull(v, nullptr, 10)) : size_t{2048}) << 20;
  }();
  ~BlockCache() {
    for (auto& [bytes, p] : free_blocks) std::free(p);
  }
};

BlockCache& cache() {
  static BlockCache* c = new BlockCache();  // never destroyed: tensors may outlive statics
  return *c;
}

size_t rounded(size_t bytes) {
  if (bytes == 0) bytes = kAlignment;
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

}  // namespace

void set_cache_floor(size_t bytes) {
  size_t cur = g_cache_floor.load();
  while (bytes < cur && !g_cache_floor.compare_exchange_weak(cur, bytes)) {
  }
}

void* allocate_cached(size_t bytes) {
  bytes = rounded(bytes);
  if (bytes >= g_cache_floor.load(std::memory_order_relaxed)) {
    BlockCache& c = cache();
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.free_blocks.find(bytes);
    if (it != c.free_blocks.end()) {
      void* p = it->second;
      c.free_blocks.erase(it);
      c.idle_bytes -= bytes;
      return p;
    }
  }
  return aligned_malloc(bytes);
}

void release_cached(void* p, size_t bytes) {
  if (!p) return;
  bytes = rounded(bytes);
  if (bytes >= g_cache_floor.load(std::memory_order_relaxed)) {
    BlockCache& c = cache();
    std::lock_guard<std::mutex> lock(c.mu);
    if (c.idle_bytes + bytes <= c.limit) {
      c.free_blocks.emplace(bytes, p);
      c.idle_bytes += bytes;
      return;
    }
  }
  aligned_free(p);
}

void trim_cached() {
  BlockCache& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    for (auto& [bytes, p] : c.free_blocks) aligned_free(p);
    c.free_blocks.clear();
    c.idle_bytes = 0;
  }
  malloc_trim(0);  // and what glibc's heap holds free at its top
}

size_t cached_bytes() {
  BlockCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.idle_bytes;
}

}  // namespace tessera::base
