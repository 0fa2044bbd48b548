// `tessera serve`: the OpenAI-compatible HTTP server (serve/server.h) on a model directory.
#include <cstdlib>
#include <filesystem>
#include <optional>

#include "tessera/base/error.h"
#include "tessera/cli/commands.h"
#include "tessera/io/gguf_tokenizer.h"
#include "tessera/io/json_file.h"
#include "tessera/model/quantize.h"
#include "tessera/infer/kv_tiers.h"
#include "tessera/infer/tp_serving.h"
#include "tessera/model/config.h"
#include "tessera/model/lora.h"
#include "tessera/model/lora_io.h"
#include "tessera/serve/jinja.h"
#include "tessera/serve/server.h"

namespace tessera::cli {
namespace {

struct ServeFlags {
  std::string model, shape, dtype = "f32", chat_template_limits, chat_template;
  uint64_t seed = 1234;
  serve::ServerConfig server;
  infer::EngineConfig engine;
  bool no_prefix_caching = false;
  int tp = 1;
  int ep = 1;
  model::LoadQuantization quantization;
  std::vector<std::string> lora;  // --lora NAME=DIR
};

// --lora NAME=DIR specs: (name, dir) in order. One-line errors for a bad spec or a name given
// twice (a name equal to the base model's is caught once that name is known).
std::vector<std::pair<std::string, std::string>> parse_lora_specs(const std::vector<std::string>& specs) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const std::string& spec : specs) {
    const size_t eq = spec.find('=');
    TESSERA_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < spec.size(), "--lora '", spec,
                  "': expected NAME=ADAPTER_DIR");
    out.emplace_back(spec.substr(0, eq), spec.substr(eq + 1));
    for (size_t j = 0; j + 1 < out.size(); ++j)
      TESSERA_CHECK(out[j].first != out.back().first, "--lora ", out.back().first, ": the name is given twice");
  }
  return out;
}

// The model's tokenizer (DIR/tokenizer.json or a GGUF file's tokenizer.ggml.*) and the chat
// template it carries. Neither when the model has no tokenizer.
void load_tokenizer(const std::string& model, std::optional<io::Tokenizer>& tok,
                    std::optional<serve::ChatTemplate>& tmpl) {
  tok = io::load_model_tokenizer(model);
  if (tok) tmpl = serve::ChatTemplate::from_tokenizer(*tok);
}

// --chat-template FILE (or the template text itself, as vLLM accepts): replaces the model's
// template, keeping its bos / eos tokens.
serve::ChatTemplate override_chat_template(const std::string& spec, const serve::ChatTemplate& model_template) {
  std::string source = spec;
  if (std::filesystem::is_regular_file(spec)) {
    source = io::read_file_bytes(spec, size_t{16} << 20);
  } else if (spec.find("{{") == std::string::npos && spec.find("{%") == std::string::npos) {
    fail("--chat-template ", spec, ": no such file (and not a Jinja template)");
  }
  try {
    return serve::ChatTemplate(source, model_template.bos_token(), model_template.eos_token());
  } catch (const Error& e) {
    fail("--chat-template ", spec.size() > 80 ? "(inline)" : spec, ": ", e.what());
  }
}

int run_serve(ServeFlags f) {
  namespace fs = std::filesystem;
  TESSERA_CHECK(f.model.empty() != f.shape.empty(), "give exactly one of --model DIR or --shape NAME");
  if (f.server.api_key.empty())
    if (const char* k = std::getenv("TESSERA_API_KEY"); k && *k) f.server.api_key = k;
  if (const char* d = std::getenv("TESSERA_SERVE_STEP_DELAY_MS"); d && *d)
    f.server.debug_step_delay_s = std::atof(d) / 1000.0;
  f.server.loras = parse_lora_specs(f.lora);
  f.server.validate();
  f.engine.prefix_caching = !f.no_prefix_caching;
  if (!f.model.empty() && !f.engine.kv_offload_dir.empty())  // the disk tier's files name these weights
    f.engine.kv_offload_model_id = infer::model_files_identity(f.model);
  TESSERA_CHECK(f.server.role.empty() || f.engine.prefix_caching, "--role ", f.server.role,
                " needs prefix caching (KV blocks move as prefix-cache blocks); drop --no-prefix-caching");
  TESSERA_CHECK(f.server.role == "decode" || (f.server.kv_port == 0 && f.server.kv_transport == "tcp"),
                "--kv-port and --kv-transport are decode-worker flags (--role decode)");
  f.engine.validate();
  // Checked before the model loads: a bad spec is a one-line error at once.
  serve::jinja::Limits template_limits;
  try {
    if (!f.chat_template_limits.empty()) template_limits = serve::jinja::parse_template_limits(f.chat_template_limits);
  } catch (const Error& e) {
    fail("--chat-template-limits: ", e.what());
  }
  std::optional<model::Model> model;
  std::optional<io::Tokenizer> tok;
  std::optional<serve::ChatTemplate> tmpl;
  if (f.tp > 1 || f.ep > 1) {
    // Tensor- or expert-parallel: every rank loads its shard; rank 0 serves, the others run
    // its steps.
    TESSERA_CHECK(!f.model.empty(), f.tp > 1 ? "--tp" : "--ep", " needs --model DIR (the shards are read from it)");
    TESSERA_CHECK(f.lora.empty(), "--lora is not supported with ", f.tp > 1 ? "--tp" : "--ep", " yet");
    TESSERA_CHECK(f.server.role.empty(), "--role is not supported with ", f.tp > 1 ? "--tp" : "--ep", " yet");
    load_tokenizer(f.model, tok, tmpl);
    if (f.server.model_name.empty()) f.server.model_name = fs::path(f.model).lexically_normal().filename().string();
    if (!tmpl) tmpl = serve::ChatTemplate::chatml();
    if (!f.chat_template.empty()) tmpl = override_chat_template(f.chat_template, *tmpl);
    tmpl->set_limits(template_limits);
    return infer::run_tensor_parallel(f.tp, f.model, parse_dtype(f.dtype),
                                      [&](const model::Model& m, infer::TpGroup* group) {
                                        serve::Server server(m, f.engine, tok ? &*tok : nullptr, *tmpl,
                                                             f.server, group);
                                        return server.run(true);
                                      },
                                      f.quantization, f.ep);
  }
  if (!f.model.empty()) {
    model = model::Model::load(f.model, parse_dtype(f.dtype));
    model::quantize_on_load(*model, f.quantization);
    load_tokenizer(f.model, tok, tmpl);
    if (f.server.model_name.empty()) f.server.model_name = fs::path(f.model).lexically_normal().filename().string();
    if (f.server.model_name.empty()) f.server.model_name = fs::path(f.model).lexically_normal().parent_path().filename().string();
  } else {
    // Random weights of a named shape: for benchmarks (token-id prompts only).
    model = model::Model::random(model::ModelConfig::named_shape(f.shape), parse_dtype(f.dtype), f.seed);
    model::quantize_on_load(*model, f.quantization);
    if (f.server.model_name.empty()) f.server.model_name = f.shape;
  }
  if (!tmpl) tmpl = serve::ChatTemplate::chatml();
  if (!f.chat_template.empty()) tmpl = override_chat_template(f.chat_template, *tmpl);
  tmpl->set_limits(template_limits);
  // Multi-LoRA: every adapter loaded and checked against the model before serving starts.
  f.server.validate();  // now that the base model's name is known
  std::vector<model::LoraWeights> adapters;
  adapters.reserve(f.server.loras.size());
  std::vector<const model::LoraWeights*> bank;
  for (const auto& [name, dir] : f.server.loras) {
    try {
      adapters.push_back(model::load_peft_adapter(dir, model->config()));
    } catch (const Error& e) {
      fail("--lora ", name, ": ", e.what());
    }
    bank.push_back(&adapters.back());
  }
  try {
    model->set_lora_bank(bank);
  } catch (const Error& e) {
    fail("--lora: ", e.what());
  }
  serve::Server server(*model, f.engine, tok ? &*tok : nullptr, *tmpl, f.server);
  return server.run(true);
}

}  // namespace

void add_serve(CLI::App& app, Action& action) {
  auto f = std::make_shared<ServeFlags>();
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (see docs/serving.md)");
  cmd->add_option("--model", f->model, "Hugging Face model directory or GGUF file");
  cmd->add_option("--shape", f->shape, "Serve random weights of a named shape (small, 1b, tiny) for benchmarks");
  cmd->add_option("--dtype", f->dtype, "Weight dtype: f32 or bf16")->capture_default_str();
  add_quantization_flags(cmd, f->quantization);
  cmd->add_option("--seed", f->seed, "Seed of the random weights (--shape)")->capture_default_str();
  auto& s = f->server;
  cmd->add_option("--host", s.host, "Address to bind (0.0.0.0 to expose)")->capture_default_str();
  cmd->add_option("--port", s.port, "Port (0 = any free port)")->capture_default_str();
  cmd->add_option("--api-key", s.api_key, "Require 'Authorization: Bearer KEY' on /v1 routes (or env TESSERA_API_KEY)");
  cmd->add_option("--served-model-name", s.model_name, "The model id clients send (default: the directory name)");
  cmd->add_option("--max-queue", s.max_queue, "Requests waiting at most; beyond it 429 + Retry-After")
      ->capture_default_str();
  cmd->add_option("--request-timeout", s.request_timeout_s, "Seconds a request may take (0 = none)")
      ->capture_default_str();
  add_size_option(cmd, "--max-body-bytes", s.max_body_bytes, "Largest request body; larger is 413")->capture_default_str();
  cmd->add_option("--grace-period", s.grace_period_s, "SIGTERM: seconds in-flight requests get before cancel")
      ->capture_default_str();
  cmd->add_option("--http-threads", s.http_threads, "HTTP worker threads (0 = max-num-seqs + max-queue + 16)");
  cmd->add_option("--default-max-tokens", s.default_max_tokens, "max_tokens of completions that give none")
      ->capture_default_str();
  cmd->add_option("--health-timeout", s.health_timeout_s,
                  "/health turns 503 when the engine loop stalls this long (or 5x its last step)")
      ->capture_default_str();
  cmd->add_flag("--log-requests", s.log_requests, "One line per request on stderr");
  cmd->add_option("--chat-template-limits", f->chat_template_limits,
                  "Budget of one chat-template render, e.g. depth=512,iterations=1000000,output=16M,"
                  "string=16M,list=1000000,time=2s (defaults: those)");
  cmd->add_option("--chat-template", f->chat_template,
                  "A Jinja chat template file (or the template text) to use instead of the model's, "
                  "e.g. one with tool-calling support");
  cmd->add_option("--tool-call-parser", s.tool_call_parser,
                  "How tool calls are read from the output: hermes (<tool_call> blocks), llama3_json, "
                  "none, or auto (from the chat template)")
      ->capture_default_str();
  cmd->add_option("--lora", f->lora,
                  "Serve a LoRA adapter (a PEFT adapter directory) as model NAME beside the base; "
                  "repeat for more (multi-LoRA: one batch serves them all)")
      ->type_name("NAME=DIR")
      ->take_all();
  cmd->add_option("--role", s.role,
                  "Prefill/decode disaggregation worker: prefill or decode (behind tessera router; docs/serving.md)");
  cmd->add_option("--kv-port", s.kv_port, "--role decode: port of the KV receiver (0 = any free port)")
      ->capture_default_str();
  cmd->add_option("--kv-transport", s.kv_transport,
                  "--role decode: tcp, or shm (the KV pool in POSIX shared memory for prefill workers on this host; "
                  "tcp works too)")
      ->capture_default_str();
  add_engine_flags(cmd, f->engine, f->no_prefix_caching);
  cmd->add_option("--tp", f->tp,
                  "Tensor-parallel ranks: threads of this process, or mpirun's -np ranks "
                  "(docs/parallelism.md)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  cmd->add_option("--ep", f->ep,
                  "Expert-parallel ranks for a mixture-of-experts model: each holds 1/ep of the "
                  "experts (threads, or mpirun's -np ranks; docs/moe.md)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  cmd->callback([&action, f] { action = [f] { return run_serve(*f); }; });
}

}  // namespace tessera::cli
