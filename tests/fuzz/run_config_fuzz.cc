// libFuzzer target: a run-config TOML text through TrainConfig::parse, as `tessera train
// --config` reads it (TrainConfig::load is read_file_bytes + parse). tessera::Error is the
// expected failure; any other exception (toml++'s, std::) or a sanitizer report is a bug.
// toml++ itself is compiled with these flags and its assertions on (clang/toml_impl.cc), so
// the fuzzer also checks that io/toml_text.cc's pre-scan keeps toml++ 3.3.0 away from its
// known undefined behaviour (TOML_UNREACHABLE on some non-ASCII code points, upstream
// marzer/tomlplusplus#190 / #295; assume-violations on "[&", "a = [}", ...).
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "tessera/train/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessera;
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const train::TrainConfig c = train::TrainConfig::parse(text, "run.toml");
    if (c.data.dir.empty() || c.out_dir.empty()) fuzz::invariant_failed("accepted without data.dir / run.out_dir");
  } catch (const Error&) {
    return 0;
  } catch (...) {
    fuzz::unexpected_exception();
  }
  return 0;
}
