// Aligned allocation backed by posix_memalign.
#include "tessera/base/aligned_alloc.h"

#include <cstdlib>

#include "tessera/base/error.h"

namespace tessera::base {

void* aligned_malloc(size_t bytes) {
  void* p = nullptr;
  if (bytes == 0) bytes = kAlignment;
  bytes = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  if (posix_memalign(&p, kAlignment, bytes) != 0 || p == nullptr)
    fail("out of memory allocating ", bytes, " bytes");
  return p;
}

void aligned_free(void* p) { std::free(p); }

}  // namespace tessera::base
