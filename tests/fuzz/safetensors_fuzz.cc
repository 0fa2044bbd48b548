// libFuzzer target: parse_safetensors_header on arbitrary bytes must either throw
// tessera::Error or return a header whose invariants hold; anything else is a bug
// (crash, sanitizer report, other exception type, broken invariant).
#include <cstddef>
#include <cstdint>
#include <set>

#include "tessera/base/error.h"
#include "tessera/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessera;
  io::SafetensorsHeader h;
  try {
    h = io::parse_safetensors_header(data, size, "fuzz.safetensors");
  } catch (const Error&) {
    return 0;
  }
  // Accepted: tensors tile [data_start, size) exactly, in order, each sized by its shape.
  if (h.data_start < 8 || h.data_start > size) __builtin_trap();
  uint64_t pos = 0;
  std::set<std::string> names;
  for (const io::TensorInfo& t : h.tensors) {
    if (!names.insert(t.name).second) __builtin_trap();
    if (t.begin != pos || t.end < t.begin) __builtin_trap();
    uint64_t n = dtype_size(t.dtype);
    for (int64_t d : t.shape) {
      if (d < 0) __builtin_trap();
      n *= static_cast<uint64_t>(d);
    }
    if (t.end - t.begin != n) __builtin_trap();
    pos = t.end;
  }
  if (h.data_start + pos != size) __builtin_trap();
  return 0;
}
