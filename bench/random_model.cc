// Writes a model directory of random weights of a named shape (config.json,
// model.safetensors), for benchmarks that load a model from disk (bench/tp_decode.sh).
// Usage: random_model OUT_DIR [SHAPE=small] [SEED=1]
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tessera/base/error.h"
#include "tessera/model/config.h"
#include "tessera/model/model.h"

int main(int argc, char** argv) {
  if (argc < 2 || argc > 4) {
    std::fprintf(stderr, "usage: random_model OUT_DIR [SHAPE=small] [SEED=1]\n");
    return 2;
  }
  using namespace tessera;
  try {
    const std::string shape = argc > 2 ? argv[2] : "small";
    const uint64_t seed = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 1;
    model::Model::random(model::ModelConfig::named_shape(shape), DType::kF32, seed).save(argv[1]);
  } catch (const Error& e) {
    std::fprintf(stderr, "random_model: %s\n", e.what());
    return 1;
  }
  return 0;
}
