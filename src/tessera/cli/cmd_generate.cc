// `tessera generate` and `tessera eval perplexity`.
#include <cstdio>
#include <filesystem>
#include <optional>

#include "tessera/base/error.h"
#include "tessera/base/timer.h"
#include "tessera/cli/commands.h"
#include "tessera/infer/generate.h"
#include "tessera/infer/offline.h"
#include "tessera/infer/structured/convert.h"
#include "tessera/infer/tp_serving.h"
#include "tessera/io/gguf_tokenizer.h"
#include "tessera/io/json_file.h"
#include "tessera/io/tokenizer.h"
#include "tessera/model/perplexity.h"
#include "tessera/model/quantize.h"

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
  int64_t beam_width = 0;  // 0: off
  float length_penalty = 1.f;
  bool stream = false;
  std::string input, output;  // JSON-lines batch mode
  infer::EngineConfig engine;
  bool no_prefix_caching = false;
  std::string draft_model;
  int tp = 1;
  int ep = 1;
  model::LoadQuantization quantization;
  std::string json_schema, regex, grammar;  // structured outputs (one at most)
};

// --json-schema FILE / --regex PATTERN / --grammar FILE as the request's constraint,
// compiled once here so that a bad one fails naming the flag.
infer::GuidedDecoding guided_flags(const GenerateFlags& f) {
  infer::GuidedDecoding g;
  std::string flag;
  auto set = [&](const char* name, infer::GuidedDecoding v) {
    TESSERA_CHECK(g.empty(), "give one of --json-schema, --regex, --grammar; got ", flag, " and ", name);
    g = std::move(v);
    flag = name;
  };
  if (!f.json_schema.empty()) set("--json-schema", {"json_schema", io::read_file_bytes(f.json_schema)});
  if (!f.regex.empty()) set("--regex", {"regex", f.regex});
  if (!f.grammar.empty()) set("--grammar", {"grammar", io::read_file_bytes(f.grammar)});
  if (g.empty()) return g;
  try {
    infer::structured::compile_guided(g);
  } catch (const Error& e) {
    fail(flag, " '", flag == "--regex" ? f.regex : flag == "--json-schema" ? f.json_schema : f.grammar, "': ", e.what());
  }
  return g;
}

// A file of requests through the engine, all in flight at once.
int run_generate_batch(const GenerateFlags& f, const model::Model& model, infer::TpGroup* tp) {
  TESSERA_CHECK(!f.output.empty(), "--input needs --output FILE for the results");
  TESSERA_CHECK(f.prompt.empty() && f.prompt_ids.empty(), "--input cannot be combined with --prompt / --prompt-ids");
  TESSERA_CHECK(f.json_schema.empty() && f.regex.empty() && f.grammar.empty(), "--json-schema / --regex / --grammar "
                "apply to --prompt; give --input requests response_format or guided_* fields");
  const std::optional<io::Tokenizer> tok = io::load_model_tokenizer(f.model);
  const auto requests = infer::read_offline_requests(f.input, tok ? &*tok : nullptr, f.max_tokens);
  std::optional<model::Model> draft;
  if (!f.draft_model.empty()) draft = model::Model::load(f.draft_model, parse_dtype(f.dtype));
  infer::EngineConfig ec = f.engine;
  ec.prefix_caching = !f.no_prefix_caching;
  if (draft && ec.speculative_method.empty()) ec.speculative_method = "draft";
  infer::Engine engine(model, ec, tok ? &*tok : nullptr, draft ? &*draft : nullptr, tp);
  base::Timer timer;
  const auto results = infer::run_offline(engine, tok ? &*tok : nullptr, requests, true);
  std::string text;
  int64_t completion = 0;
  for (const auto& r : results) {
    text += r.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";  // bad UTF-8 -> U+FFFD
    completion += r["usage"]["completion_tokens"].get<int64_t>();
  }
  if (f.output == "-") {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
  } else {
    io::write_file_atomic(f.output, text);
  }
  const auto st = engine.stats();
  std::fprintf(stderr,
               "%zu requests, %lld tokens generated in %.1f s (%.1f tokens/s); prefix cache hits "
               "%lld of %lld blocks, %lld preemptions; wrote %s\n",
               results.size(), static_cast<long long>(completion), timer.seconds(),
               completion / std::max(1e-9, timer.seconds()),
               static_cast<long long>(st.prefix_hit_blocks),
               static_cast<long long>(st.prefix_hit_blocks + st.prefix_miss_blocks),
               static_cast<long long>(st.preemptions), f.output.c_str());
  return 0;
}


int run_generate_one(const GenerateFlags& f, const model::Model& model, infer::TpGroup* tp) {
  if (!f.input.empty()) return run_generate_batch(f, model, tp);
  const std::optional<io::Tokenizer> tok = io::load_model_tokenizer(f.model);
  std::vector<int32_t> prompt;
  if (!f.prompt.empty()) {
    TESSERA_CHECK(tok, "--prompt: ", f.model, " has no tokenizer (tokenizer.json, or a GGUF file's ",
                  "tokenizer.ggml.*); pass token ids with --prompt-ids");
    prompt = tok->encode(f.prompt);
    TESSERA_CHECK(!prompt.empty(), "--prompt: the prompt encodes to no tokens");
  } else {
    prompt = parse_id_list(f.prompt_ids, "--prompt-ids");
  }
  infer::GenerateOptions o;
  o.max_tokens = f.max_tokens;
  o.sampling = {f.temperature, f.top_k, f.top_p, f.seed};
  TESSERA_CHECK(f.beam_width >= 0, "--beam-width must be >= 1, got ", f.beam_width);
  TESSERA_CHECK(f.beam_width > 0 || f.length_penalty == 1.f, "--length-penalty needs --beam-width");
  if (f.beam_width > 0) {  // prints the best hypothesis
    TESSERA_CHECK(f.temperature == 0.f && f.top_k == 0 && f.top_p == 1.f,
                  "--beam-width ranks log-probabilities: it takes no --temperature, --top-k or --top-p");
    o.sampling.use_beam_search = true;
    o.sampling.best_of = f.beam_width;
    o.sampling.length_penalty = f.length_penalty;
  }
  o.sampling.guided = guided_flags(f);
  TESSERA_CHECK(o.sampling.guided.empty() || tok, "--json-schema / --regex / --grammar: ", f.model, " has no tokenizer");
  o.tokenizer = tok ? &*tok : nullptr;
  o.engine = f.engine;
  o.engine.prefix_caching = !f.no_prefix_caching;
  o.tp = tp;
  std::optional<model::Model> draft;
  if (!f.draft_model.empty()) {
    draft = model::Model::load(f.draft_model, parse_dtype(f.dtype));
    if (o.engine.speculative_method.empty()) o.engine.speculative_method = "draft";
    o.draft = &*draft;
  }
  // Text when the model has a tokenizer and the prompt was text; token ids otherwise.
  const bool text = tok && !f.prompt.empty();
  bool first = true, echoed = false;
  std::string pending;
  // The prompt is echoed with the first token, not before: a configuration the engine
  // rejects leaves only its one-line error.
  auto echo = [&] {
    if (text && !echoed) std::printf("%s", f.prompt.c_str());
    echoed = true;
  };
  auto print = [&](int32_t t) {
    echo();
    if (text) {
      if (tok->is_special(t)) return;
      pending += tok->decode_token(t);
      const size_t n = io::complete_utf8_prefix(pending);
      std::fwrite(pending.data(), 1, n, stdout);
      pending.erase(0, n);
    } else {
      std::printf("%s%d", first ? "" : ",", t);
    }
    first = false;
    std::fflush(stdout);
  };
  auto r = infer::generate(model, prompt, o, f.stream ? print : std::function<void(int32_t)>{});
  if (!f.stream)
    for (int32_t t : r.tokens) print(t);
  echo();  // (no tokens: the prompt alone)
  if (!pending.empty()) std::fwrite(pending.data(), 1, pending.size(), stdout);
  std::printf("\n");
  std::fflush(stdout);  // the text's last line ends before the statistics on stderr
  const double dps = r.tokens.size() > 1 ? (r.tokens.size() - 1) / r.decode_seconds : 0.0;
  if (f.beam_width > 0)  // the hypothesis arrives whole at the end: one time, not prefill + decode
    std::fprintf(stderr, "beam search (%lld beams): best hypothesis of %zu tokens (%s) in %.3f s\n",
                 static_cast<long long>(f.beam_width), r.tokens.size(), r.finish_reason.c_str(),
                 r.prefill_seconds + r.decode_seconds);
  else
    std::fprintf(stderr, "generated %zu tokens (%s); prefill %zu tokens in %.3f s, decode %.1f tokens/s\n",
                 r.tokens.size(), r.finish_reason.c_str(), prompt.size(), r.prefill_seconds, dps);
  if (r.spec_proposed > 0)
    std::fprintf(stderr, "speculative: %lld of %lld proposed tokens accepted (%.0f%%)\n",
                 static_cast<long long>(r.spec_accepted), static_cast<long long>(r.spec_proposed),
                 100.0 * r.spec_accepted / r.spec_proposed);
  return 0;
}

// Tensor-parallel over --tp ranks (threads, or mpirun's processes) when asked; or the
// experts over --ep ranks.
int run_generate(const GenerateFlags& f) {
  if (f.input.empty()) {
    TESSERA_CHECK(f.output.empty(), "--output needs --input FILE of requests");
    TESSERA_CHECK(f.prompt.empty() != f.prompt_ids.empty(),
                  "give exactly one of --prompt TEXT or --prompt-ids 1,2,3");
  }
  return infer::run_tensor_parallel(f.tp, f.model, parse_dtype(f.dtype),
                                    [&](const model::Model& m, infer::TpGroup* tp) {
                                      return run_generate_one(f, m, tp);
                                    },
                                    f.quantization, f.ep);
}

}  // namespace

void add_generate(CLI::App& app, Action& action) {
  auto f = std::make_shared<GenerateFlags>();
  auto* cmd = app.add_subcommand("generate", "Generate tokens from a model directory");
  cmd->add_option("--model", f->model, "Hugging Face model directory or GGUF file")->required();
  cmd->add_option("--prompt-ids", f->prompt_ids, "Prompt token ids, comma separated");
  cmd->add_option("--prompt", f->prompt, "Text prompt (encoded with DIR/tokenizer.json)");
  cmd->add_option("--max-tokens", f->max_tokens, "Tokens to generate")->capture_default_str();
  cmd->add_option("--temperature", f->temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-k", f->top_k, "Keep the k most likely tokens (0 = off)")->capture_default_str();
  cmd->add_option("--top-p", f->top_p, "Nucleus sampling mass (1 = off)")->capture_default_str();
  cmd->add_option("--seed", f->seed, "Sampling seed")->capture_default_str();
  cmd->add_option("--beam-width", f->beam_width, "Beam search with this many beams (0 = off); prints the best")
      ->capture_default_str();
  cmd->add_option("--length-penalty", f->length_penalty,
                  "Beam search: hypotheses score cum_logprob / length^penalty")->capture_default_str();
  cmd->add_option("--dtype", f->dtype, "Weight dtype: f32 or bf16")->capture_default_str();
  cmd->add_flag("--stream", f->stream, "Print tokens as they are generated");
  cmd->add_option("--json-schema", f->json_schema, "Structured output: a JSON schema file the output must match");
  cmd->add_option("--regex", f->regex, "Structured output: a regular expression the output must match");
  cmd->add_option("--grammar", f->grammar, "Structured output: a GBNF grammar file the output must match");
  cmd->add_option("--input", f->input,
                  "JSON-lines file of requests ({\"prompt\": ..., \"max_tokens\": ...}), run as one batch");
  cmd->add_option("--output", f->output, "With --input: JSON-lines results, one per request (- for standard output)");
  add_engine_flags(cmd, f->engine, f->no_prefix_caching);
  cmd->add_option("--draft-model", f->draft_model, "Draft model directory (same tokenizer)");
  add_quantization_flags(cmd, f->quantization);
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
  cmd->callback([&action, f] { action = [f] { return run_generate(*f); }; });
}

void add_eval(CLI::App& app, Action& action) {
  auto* eval = app.add_subcommand("eval", "Evaluate a model");
  eval->require_subcommand(1);
  auto* ppl = eval->add_subcommand("perplexity", "Mean negative log-likelihood and perplexity");
  struct Flags {
    std::string model, ids, data, dtype = "f32", kl_reference;
    model::LoadQuantization quantization;
    int64_t ctx = 0;
  };
  auto f = std::make_shared<Flags>();
  ppl->add_option("--model", f->model, "Hugging Face model directory or GGUF file")->required();
  ppl->add_option("--data", f->data, "Text file, encoded with the model's tokenizer.json");
  ppl->add_option("--ids", f->ids, "File of whitespace-separated token ids (instead of --data)");
  ppl->add_option("--ctx", f->ctx, "Window length (default: min(max positions, 1024))");
  ppl->add_option("--dtype", f->dtype, "Weight dtype: f32 or bf16")->capture_default_str();
  add_quantization_flags(ppl, f->quantization);
  ppl->add_option("--kl-reference", f->kl_reference,
                  "Also run this model (f32, as stored) on the same windows and report the KL divergence of "
                  "--model's next-token distributions from it, ln(PPL ratio) and top-token agreement, each "
                  "with its standard error (llama-perplexity --kl-divergence)");
  ppl->callback([&action, f] {
    action = [f] {
      TESSERA_CHECK(f->data.empty() != f->ids.empty(), "give exactly one of --data FILE or --ids FILE");
      std::vector<int32_t> ids;
      if (f->data.empty()) {
        ids = model::read_token_ids(f->ids);
      } else {
        const auto tok = io::load_model_tokenizer(f->model);
        TESSERA_CHECK(tok, "--data: ", f->model, " has no tokenizer (tokenizer.json, or a GGUF file's ",
                      "tokenizer.ggml.*); pass token ids with --ids");
        ids = tok->encode(io::read_file_bytes(f->data), false);
      }
      auto m = model::Model::load(f->model, parse_dtype(f->dtype));
      model::quantize_on_load(m, f->quantization);
      const int64_t ctx = f->ctx > 0 ? f->ctx : std::min<int64_t>(m.config().max_position_embeddings, 1024);
      if (!f->kl_reference.empty()) {
        const auto ref = model::Model::load(f->kl_reference, DType::kF32);
        const auto r = model::evaluate_kl_divergence(m, ref, ids, ctx, true);
        std::printf("tokens %lld windows %lld ctx %lld\nmean_nll %.6f\nperplexity %.6f\n"
                    "ref_nll %.6f\nref_ppl %.6f\n"
                    "ln_ppl_ratio %.6f +- %.2g\n"
                    "kld_mean %.6g +- %.2g\nkld_median %.6g\nkld_p99 %.6g\nkld_max %.6g\n"
                    "same_top %.4f%% +- %.2g%%\nrms_delta_p %.4f%%\n",
                    static_cast<long long>(r.model.tokens), static_cast<long long>(r.model.windows),
                    static_cast<long long>(ctx), r.model.mean_nll, r.model.perplexity, r.reference.mean_nll,
                    r.reference.perplexity, r.log_ratio, r.log_ratio_se, r.kld, r.kld_se, r.kld_median,
                    r.kld_p99, r.kld_max, 100 * r.same_top, 100 * r.same_top_se, 100 * r.rms_delta_p);
        return 0;
      }
      const auto r = model::evaluate_perplexity(m, ids, ctx, true);
      std::printf("tokens %lld windows %lld ctx %lld\nmean_nll %.6f\nperplexity %.6f\n",
                  static_cast<long long>(r.tokens), static_cast<long long>(r.windows),
                  static_cast<long long>(ctx), r.mean_nll, r.perplexity);
      return 0;
    };
  });
}

}  // namespace tessera::cli
