// `tessera info --model DIR [--context N] [--json]`: what a model directory (or GGUF file)
// holds, and the memory it needs to serve a context, without loading its weights.
#include <cstdio>
#include <filesystem>
#include <map>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/cli/commands.h"
#include "tessera/infer/kv_pool.h"
#include "tessera/io/gguf.h"
#include "tessera/io/gguf_tokenizer.h"
#include "tessera/io/safetensors.h"
#include "tessera/model/rope_scaling.h"

namespace tessera::cli {
namespace {

struct InfoFlags {
  std::string model;
  int64_t context = 0;  // 0: the model's
  std::string kv_cache_dtype = "bf16";
  bool json = false;
};

double gib(double bytes) { return bytes / (1024.0 * 1024.0 * 1024.0); }

int run_info(const InfoFlags& f) {
  namespace fs = std::filesystem;
  const model::ModelConfig c = model::ModelConfig::load(f.model);
  const int64_t context = f.context > 0 ? f.context : model::max_context(c);
  TESSERA_CHECK(context >= 1, "--context must be at least 1, got ", context);
  const auto kv_dtype = kernels::parse_kv_cache_dtype(f.kv_cache_dtype);
  // Weights as stored: dtype by bytes, from the safetensors headers (or the GGUF file size).
  std::map<std::string, int64_t> dtype_bytes;
  int64_t weight_bytes = 0;
  if (io::is_gguf_path(f.model)) {
    weight_bytes = static_cast<int64_t>(fs::file_size(f.model));
    dtype_bytes["gguf"] = weight_bytes;
  } else {
    const io::SafetensorsModel st = io::SafetensorsModel::open(f.model);
    for (const auto& file : st.files())
      for (const auto& t : file->header().tensors) {
        const int64_t n = static_cast<int64_t>(t.end - t.begin);
        dtype_bytes[io::safetensors_dtype_name(t.dtype)] += n;
        weight_bytes += n;
      }
  }
  std::string dtype;
  int64_t most = -1;
  for (const auto& [d, n] : dtype_bytes)
    if (n > most) most = n, dtype = d;
  const int64_t kv_per_token = infer::KvPool::bytes_per_block(c, 1, 0, kv_dtype);
  const int64_t kv_bytes = kv_per_token * context;
  const auto tok = io::load_model_tokenizer(f.model);
  nlohmann::json j = {
      {"model", f.model},
      {"model_type", c.model_type},
      {"parameters", c.num_parameters()},
      {"dtype", dtype},
      {"weight_bytes", weight_bytes},
      {"layers", c.num_layers},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"heads", c.num_heads},
      {"kv_heads", c.num_kv_heads},
      {"head_dim", c.head_dim},
      {"vocab_size", c.vocab_size},
      {"max_context", model::max_context(c)},
      {"experts", c.num_experts},
      {"kv_cache_dtype", f.kv_cache_dtype},
      {"kv_bytes_per_token", kv_per_token},
      {"context", context},
      {"kv_bytes_for_context", kv_bytes},
      {"serve_bytes_for_context", weight_bytes + kv_bytes},
      {"tokenizer", tok ? nlohmann::json({{"vocab_size", tok->vocab_size()},
                                          {"chat_template", !tok->chat_template().empty()}})
                        : nlohmann::json(nullptr)},
  };
  if (f.json) {
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("%s: %s, %.1fM parameters, %s weights (%.2f GiB on disk)\n", f.model.c_str(), c.model_type.c_str(),
              c.num_parameters() / 1e6, dtype.c_str(), gib(static_cast<double>(weight_bytes)));
  std::printf("  %lld layers, hidden %lld, MLP %lld, %lld heads (%lld kv) of %lld, vocabulary %lld, context %lld",
              static_cast<long long>(c.num_layers), static_cast<long long>(c.hidden_size),
              static_cast<long long>(c.intermediate_size), static_cast<long long>(c.num_heads),
              static_cast<long long>(c.num_kv_heads), static_cast<long long>(c.head_dim),
              static_cast<long long>(c.vocab_size), static_cast<long long>(model::max_context(c)));
  if (c.num_experts > 0) std::printf(", %lld experts", static_cast<long long>(c.num_experts));
  std::printf("\n  tokenizer: %s\n",
              !tok ? "none (token ids only)"
                   : (std::to_string(tok->vocab_size()) + " tokens, " +
                      (tok->chat_template().empty() ? "no chat template (serving falls back to ChatML)"
                                                    : "with a chat template")).c_str());
  std::printf("  KV cache (%s): %lld bytes per token; %lld tokens of context: %.3f GiB, with the weights %.3f GiB\n",
              f.kv_cache_dtype.c_str(), static_cast<long long>(kv_per_token), static_cast<long long>(context),
              gib(static_cast<double>(kv_bytes)), gib(static_cast<double>(weight_bytes + kv_bytes)));
  return 0;
}

}  // namespace

void add_info(CLI::App& app, Action& action) {
  auto f = std::make_shared<InfoFlags>();
  auto* cmd = app.add_subcommand("info", "What a model directory or GGUF file holds, and the memory to serve it");
  cmd->add_option("--model", f->model, "Hugging Face model directory or GGUF file")->required();
  cmd->add_option("--context", f->context, "Tokens of context to size the KV cache for (default: the model's)");
  cmd->add_option("--kv-cache-dtype", f->kv_cache_dtype, "KV cache storage: bf16, int8, fp8 or f32")
      ->capture_default_str();
  cmd->add_flag("--json", f->json, "Print JSON");
  cmd->callback([f, &action] { action = [f] { return run_info(*f); }; });
}

}  // namespace tessera::cli
