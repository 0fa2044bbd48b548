// libFuzzer target: ModelConfig::from_json on a config.json text, then the size formulas
// (num_parameters, matmul_weight_elements; UBSan reports signed overflow) and a to_json
// round trip. tessera::Error is the expected failure; anything else is a bug.
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "tessera/io/json_file.h"
#include "tessera/model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessera;
  const std::string text(reinterpret_cast<const char*>(data), size);
  model::ModelConfig c;
  try {
    c = model::ModelConfig::from_json(io::parse_json_text(text, "config.json"), "config.json");
  } catch (const Error&) {
    return 0;
  } catch (...) {
    fuzz::unexpected_exception();
  }
  try {
    (void)c.q_dim();
    (void)c.qkv_dim();
    (void)c.num_parameters();
    (void)c.matmul_weight_elements();
  } catch (const Error&) {
    // The checked arithmetic refusing an accepted config: allowed (from_json could reject it).
  } catch (...) {
    fuzz::unexpected_exception();
  }
  // What from_json accepted, to_json writes and from_json accepts again, unchanged.
  try {
    const model::ModelConfig again = model::ModelConfig::from_json(c.to_json(), "to_json()");
    if (again.to_json() != c.to_json()) fuzz::invariant_failed("to_json -> from_json -> to_json changed the config");
  } catch (const Error& e) {
    fuzz::invariant_failed(std::string("from_json rejects its own to_json: ") + e.what());
  } catch (...) {
    fuzz::unexpected_exception();
  }
  return 0;
}
