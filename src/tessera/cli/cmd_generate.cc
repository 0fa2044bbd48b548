// `tessera generate`, `tessera eval perplexity` and `tessera quickstart`.
#include <cstdio>
#include <filesystem>

#include "tessera/base/error.h"
#include "tessera/base/timer.h"
#include "tessera/cli/commands.h"
#include "tessera/infer/generate.h"
#include "tessera/model/perplexity.h"

namespace tessera::cli {

std::vector<int32_t> parse_id_list(const std::string& text, const std::string& flag) {
  std::vector<int32_t> ids;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    const std::string item = text.substr(pos, comma - pos);
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (...) {
      used = 0;
    }
    TESSERA_CHECK(!item.empty() && used == item.size() && v >= 0 && v <= INT32_MAX, flag,
                  ": '", item, "' is not a non-negative token id");
    ids.push_back(static_cast<int32_t>(v));
    pos = comma + 1;
  }
  return ids;
}

namespace {

struct GenerateFlags {
  std::string model;
  std::string prompt_ids;
  std::string prompt;
  std::string dtype = "f32";
  int64_t max_tokens = 32;
  float temperature = 0.f;
  int64_t top_k = 0;
  float top_p = 1.f;
  uint64_t seed = 0;
  bool stream = false;
};

int run_generate(const GenerateFlags& f) {
  TESSERA_CHECK(f.prompt.empty(),
                "--prompt: text prompts need a tokenizer, which this build does not have yet; "
                "pass token ids with --prompt-ids");
  TESSERA_CHECK(!f.prompt_ids.empty(), "--prompt-ids is required (e.g. --prompt-ids 1,2,3)");
  const auto prompt = parse_id_list(f.prompt_ids, "--prompt-ids");
  const auto model = model::Model::load(f.model, parse_dtype(f.dtype));
  infer::GenerateOptions o;
  o.max_tokens = f.max_tokens;
  o.sampling = {f.temperature, f.top_k, f.top_p, f.seed};
  bool first = true;
  auto print = [&](int32_t tok) {
    std::printf("%s%d", first ? "" : ",", tok);
    first = false;
    std::fflush(stdout);
  };
  auto r = infer::generate(model, prompt, o, f.stream ? print : std::function<void(int32_t)>{});
  if (!f.stream)
    for (int32_t t : r.tokens) print(t);
  std::printf("\n");
  const double dps = r.tokens.size() > 1 ? (r.tokens.size() - 1) / r.decode_seconds : 0.0;
  std::fprintf(stderr, "generated %zu tokens (%s); prefill %zu tokens in %.3f s, decode %.1f tokens/s\n",
               r.tokens.size(), r.finish_reason.c_str(), prompt.size(), r.prefill_seconds, dps);
  return 0;
}

}  // namespace

void add_generate(CLI::App& app, Action& action) {
  auto f = std::make_shared<GenerateFlags>();
  auto* cmd = app.add_subcommand("generate", "Generate tokens from a model directory");
  cmd->add_option("--model", f->model, "Hugging Face model directory")->required();
  cmd->add_option("--prompt-ids", f->prompt_ids, "Prompt token ids, comma separated");
  cmd->add_option("--prompt", f->prompt, "Text prompt (needs a tokenizer)");
  cmd->add_option("--max-tokens", f->max_tokens, "Tokens to generate")->capture_default_str();
  cmd->add_option("--temperature", f->temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-k", f->top_k, "Keep the k most likely tokens (0 = off)")->capture_default_str();
  cmd->add_option("--top-p", f->top_p, "Nucleus sampling mass (1 = off)")->capture_default_str();
  cmd->add_option("--seed", f->seed, "Sampling seed")->capture_default_str();
  cmd->add_option("--dtype", f->dtype, "Weight dtype: f32 or bf16")->capture_default_str();
  cmd->add_flag("--stream", f->stream, "Print tokens as they are generated");
  cmd->callback([&action, f] { action = [f] { return run_generate(*f); }; });
}

void add_eval(CLI::App& app, Action& action) {
  auto* eval = app.add_subcommand("eval", "Evaluate a model");
  eval->require_subcommand(1);
  auto* ppl = eval->add_subcommand("perplexity", "Mean negative log-likelihood and perplexity");
  struct Flags {
    std::string model, ids, dtype = "f32";
    int64_t ctx = 0;
  };
  auto f = std::make_shared<Flags>();
  ppl->add_option("--model", f->model, "Hugging Face model directory")->required();
  ppl->add_option("--ids", f->ids, "File of whitespace-separated token ids")->required();
  ppl->add_option("--ctx", f->ctx, "Window length (default: min(max positions, 1024))");
  ppl->add_option("--dtype", f->dtype, "Weight dtype: f32 or bf16")->capture_default_str();
  ppl->callback([&action, f] {
    action = [f] {
      const auto ids = model::read_token_ids(f->ids);
      const auto m = model::Model::load(f->model, parse_dtype(f->dtype));
      const int64_t ctx = f->ctx > 0 ? f->ctx : std::min<int64_t>(m.config().max_position_embeddings, 1024);
      const auto r = model::evaluate_perplexity(m, ids, ctx, true);
      std::printf("tokens %lld windows %lld ctx %lld\nmean_nll %.6f\nperplexity %.6f\n",
                  static_cast<long long>(r.tokens), static_cast<long long>(r.windows),
                  static_cast<long long>(ctx), r.mean_nll, r.perplexity);
      return 0;
    };
  });
}

void add_quickstart(CLI::App& app, Action& action) {
  struct Flags {
    std::string out = "runs/quickstart";
  };
  auto f = std::make_shared<Flags>();
  auto* cmd = app.add_subcommand(
      "quickstart", "Create a small random Llama-shaped model, save it in Hugging Face layout, "
                    "reload it and generate from it");
  cmd->add_option("--out", f->out, "Where to write the model directory")->capture_default_str();
  cmd->callback([&action, f] {
    action = [f] {
      const std::string dir = f->out + "/model";
      std::printf("[1/3] creating a random 'small' Llama-shaped model (%s)\n", dir.c_str());
      auto cfg = model::ModelConfig::named_shape("small");
      cfg.num_layers = 4;
      model::Model::random(cfg, DType::kF32, 42).save(dir);
      std::printf("[2/3] loading %s in bf16\n", dir.c_str());
      const auto m = model::Model::load(dir, DType::kBF16);
      std::printf("[3/3] generating 32 tokens after prompt 1,2,3,4 (greedy):\n");
      infer::GenerateOptions o;
      o.max_tokens = 32;
      o.stop_at_eos = false;
      const auto r = infer::generate(m, {1, 2, 3, 4}, o);
      for (size_t i = 0; i < r.tokens.size(); ++i) std::printf("%s%d", i ? "," : "", r.tokens[i]);
      std::printf("\ndecode: %.1f tokens/s. Next: tessera generate --model %s --prompt-ids 1,2,3\n",
                  (r.tokens.size() - 1) / r.decode_seconds, dir.c_str());
      return 0;
    };
  });
}

}  // namespace tessera::cli
