// `tessera bench structured`: what structured outputs cost per token on a real vocabulary.
// A random model over a real tokenizer decodes constrained requests through the engine;
// the figures are the mask work per token (on the worker thread), the part the engine
// thread waited for (exposed, after overlapping with the forward), and the step time
// against the same requests unconstrained. See docs/performance.md.
#pragma once
#include <cstdint>
#include <string>

#include "tessera/tensor/dtype.h"

namespace tessera::infer::structured {

struct StructuredBenchOptions {
  std::string tokenizer;         // tokenizer.json (or a directory holding one)
  std::string schema;            // JSON schema file; "" = a built-in tool-call schema
  int64_t requests = 8;          // decoded together
  int64_t max_tokens = 512;
  int64_t hidden = 512, layers = 4;  // the random model (vocabulary: the tokenizer's)
  DType dtype = DType::kBF16;
  int repeats = 3;               // median of this many runs
  uint64_t seed = 0;
};

struct StructuredBenchResult {
  int64_t vocab = 0, trie_nodes = 0;
  double trie_ms = 0, compile_ms = 0;
  int64_t tokens = 0, steps = 0;          // of the median guided run
  double mask_us_per_token = 0;           // worker time per constrained token
  double walk_us = 0;                     // per trie walk (a mask not in the cache)
  double walk_fraction = 0;               // masks that needed a walk
  double exposed_us_per_token = 0;        // engine-thread wait per constrained token
  double step_ms_guided = 0, step_ms_free = 0;  // per engine step, medians
  int64_t outputs = 0, stopped = 0, parsed = 0;  // over all runs: ended by the schema, parse as JSON
  std::string bad_output;                        // the first that does not parse
};

StructuredBenchResult bench_structured(const StructuredBenchOptions& o);
std::string format_structured_bench(const StructuredBenchOptions& o, const StructuredBenchResult& r);

}  // namespace tessera::infer::structured
