// `tessera bench structured`: structured outputs' mask cost per token on a real vocabulary
// (see infer/structured/bench_structured.h and docs/performance.md).
#include <cstdio>
#include <memory>

#include "tessera/cli/commands.h"
#include "tessera/infer/structured/bench_structured.h"

namespace tessera::cli {

void add_bench_structured(CLI::App* bench, Action& action) {
  auto o = std::make_shared<infer::structured::StructuredBenchOptions>();
  auto dtype = std::make_shared<std::string>("bf16");
  auto* cmd = bench->add_subcommand("structured", "Structured outputs: JSON-schema mask time per token (computed "
                                                  "and exposed) against the engine step, on a real tokenizer");
  cmd->add_option("--tokenizer", o->tokenizer, "tokenizer.json (or its directory), e.g. a 128k-200k vocabulary")
      ->required();
  cmd->add_option("--schema", o->schema, "JSON schema file (default: a tool-call schema)");
  cmd->add_option("--requests", o->requests, "Requests decoded together")->capture_default_str();
  cmd->add_option("--max-tokens", o->max_tokens, "Tokens per request at most")->capture_default_str();
  cmd->add_option("--hidden", o->hidden, "Random model's hidden size")->capture_default_str();
  cmd->add_option("--layers", o->layers, "Random model's layers")->capture_default_str();
  cmd->add_option("--dtype", *dtype, "Weights: f32 or bf16")->capture_default_str();
  cmd->add_option("--repeats", o->repeats, "Runs (median reported)")->capture_default_str();
  cmd->add_option("--seed", o->seed, "Sampling seed")->capture_default_str();
  cmd->callback([&action, o, dtype] {
    action = [o, dtype] {
      o->dtype = parse_dtype(*dtype);
      const auto r = infer::structured::bench_structured(*o);
      std::fputs(infer::structured::format_structured_bench(*o, r).c_str(), stdout);
      return 0;
    };
  });
}

}  // namespace tessera::cli
