// Helpers the bench/ programs share (header-only: each bench/*.cc is its own program).
#pragma once
#include <cstdio>
#include <vector>

namespace tessera::bench {

// Evicts the caches, as a training step's other work would between two uses of a
// weight: writes and reads a 256 MB buffer, larger than any last-level cache.
inline void flush_caches() {
  static std::vector<float> junk(64 << 20);
  float s = 0;
  for (size_t i = 0; i < junk.size(); i += 16) {
    junk[i] += 1.f;
    s += junk[i];
  }
  if (s == -1.f) std::puts("");  // keeps the loop
}

}  // namespace tessera::bench
