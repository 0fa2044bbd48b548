// splitmix64's output function (Steele, Lea, Flood 2014): the one bit mixer behind the
// data order, LoRA's initialisation and its dropout masks.
#pragma once
#include <cstdint>

namespace tessera::base {

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace tessera::base
