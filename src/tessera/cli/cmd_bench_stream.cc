// `tessera bench stream-ppl`: StreamingLLM's perplexity experiment (Fig. 3 of Xiao et al.
// 2023) over a long text: next-token NLL scored token by token as the stream arrives, for
// attention sinks + window, the same cache as a window without sinks, and dense attention
// (every token kept, positions growing past the training context). Writes a JSON of the
// numbers and an SVG of log-perplexity against tokens (docs/serving.md, "Long streams").
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/cli/commands.h"
#include "tessera/infer/stream_eval.h"
#include "tessera/io/gguf_tokenizer.h"
#include "tessera/io/json_file.h"
#include "tessera/model/perplexity.h"
#include "tessera/train/plot.h"

namespace tessera::cli {
namespace {

struct StreamFlags {
  std::string model, text, ids, dtype = "f32", kv_dtype = "f32", json, svg;
  int64_t tokens = 0, context = 0, sinks = 4, window = 0, block_size = 16, chunk = 16, smooth = 256;
  bool no_dense = false;
};

double mean(const std::vector<double>& v, int64_t b, int64_t e) {
  b = std::clamp<int64_t>(b, 0, static_cast<int64_t>(v.size()));
  e = std::clamp<int64_t>(e, b, static_cast<int64_t>(v.size()));
  if (e == b) return std::nan("");
  double s = 0;
  for (int64_t i = b; i < e; ++i) s += v[static_cast<size_t>(i)];
  return s / static_cast<double>(e - b);
}

nlohmann::json finite_or_null(double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(); }

int run_stream_ppl(const StreamFlags& f) {
  TESSERA_CHECK(f.text.empty() != f.ids.empty(), "give exactly one of --text FILE or --ids FILE");
  TESSERA_CHECK(f.window > 0, "--window must be > 0, got ", f.window);
  TESSERA_CHECK(f.sinks >= 0, "--attention-sinks must be >= 0, got ", f.sinks);
  TESSERA_CHECK(f.smooth >= 1, "--smooth must be >= 1, got ", f.smooth);
  const auto m = model::Model::load(f.model, parse_dtype(f.dtype));
  std::vector<int32_t> ids;
  if (f.ids.empty()) {
    const auto tok = io::load_model_tokenizer(f.model);
    TESSERA_CHECK(tok, "--text: ", f.model, " has no tokenizer.json; pass token ids with --ids");
    ids = tok->encode(io::read_file_bytes(f.text), false);
  } else {
    ids = model::read_token_ids(f.ids);
  }
  if (f.tokens > 0) {
    TESSERA_CHECK(static_cast<int64_t>(ids.size()) >= f.tokens, "--tokens ", f.tokens, ": the text has only ",
                  ids.size(), " tokens");
    ids.resize(static_cast<size_t>(f.tokens));
  }
  const int64_t n = static_cast<int64_t>(ids.size());
  const int64_t context = f.context > 0 ? f.context : m.config().max_position_embeddings;
  TESSERA_CHECK(f.sinks + f.window <= context, "--attention-sinks ", f.sinks, " + --window ", f.window,
                " exceeds --context ", context);
  infer::StreamEvalOptions base;
  base.block_size = f.block_size;
  base.chunk = f.chunk;
  base.kv_cache_dtype = kernels::parse_kv_cache_dtype(f.kv_dtype);
  struct Method {
    std::string name;
    int64_t sinks, window;
  };
  std::vector<Method> methods = {
      {"attention sinks (" + std::to_string(f.sinks) + " + " + std::to_string(f.window) + ")", f.sinks, f.window},
      {"window, no sinks (" + std::to_string(f.sinks + f.window) + ")", 0, f.sinks + f.window}};
  if (!f.no_dense) methods.push_back({"dense (no eviction)", 0, 0});

  std::printf("stream of %lld tokens, context %lld, block %lld, chunk %lld, KV cache %s\n", (long long)n,
              (long long)context, (long long)f.block_size, (long long)f.chunk, f.kv_dtype.c_str());
  std::printf("%-32s %12s %12s %12s %10s %10s\n", "method", "nll<context", "nll>context", "ppl>context",
              "max blocks", "tokens/s");
  nlohmann::json out = {{"model", f.model}, {"tokens", n}, {"context", context}, {"attention_sinks", f.sinks},
                        {"window", f.window}, {"block_size", f.block_size}, {"chunk", f.chunk},
                        {"kv_cache_dtype", f.kv_dtype}, {"smooth", f.smooth}, {"methods", nlohmann::json::array()}};
  std::vector<train::PlotSeries> series;
  for (const Method& me : methods) {
    infer::StreamEvalOptions o = base;
    o.attention_sinks = me.sinks;
    o.window = me.window;
    const auto r = infer::evaluate_stream(m, ids, o);
    // nll[i] predicts token i + 1: predictions within the context are i + 1 < context.
    const double in = mean(r.nll, 0, context - 1), past = mean(r.nll, context - 1, n - 1);
    std::printf("%-32s %12.4f %12.4f %12.2f %10lld %10.1f\n", me.name.c_str(), in, past, std::exp(past),
                (long long)r.max_blocks, static_cast<double>(n) / r.seconds);
    out["methods"].push_back({{"name", me.name}, {"attention_sinks", me.sinks}, {"window", me.window},
                              {"mean_nll_within_context", finite_or_null(in)},
                              {"mean_nll_past_context", finite_or_null(past)}, {"max_kv_blocks", r.max_blocks},
                              {"shifts", r.shifts}, {"seconds", r.seconds}, {"nll", r.nll}});
    train::PlotSeries s;
    s.name = me.name;
    double acc = 0;  // trailing mean over the last `smooth` predictions
    for (size_t i = 0; i < r.nll.size(); ++i) {
      acc += r.nll[i];
      if (i >= static_cast<size_t>(f.smooth)) acc -= r.nll[i - static_cast<size_t>(f.smooth)];
      if (i + 1 < static_cast<size_t>(std::min<int64_t>(f.smooth, 16))) continue;
      s.x.push_back(static_cast<double>(i + 1));
      s.y.push_back(acc / static_cast<double>(std::min<size_t>(i + 1, static_cast<size_t>(f.smooth))));
    }
    series.push_back(std::move(s));
  }
  if (!f.json.empty()) io::write_file_atomic(f.json, out.dump() + "\n");
  if (!f.svg.empty()) {
    train::PlotOptions po;
    po.x_label = "tokens";
    po.events.push_back({static_cast<double>(context), "context " + std::to_string(context)});
    const std::string title = "Streaming log-perplexity (mean NLL of the last " + std::to_string(f.smooth) +
                              " tokens), " + std::to_string(n) + " tokens";
    io::write_file_atomic(f.svg, train::render_svg_panels({series}, {"log perplexity"}, title, po));
  }
  return 0;
}

}  // namespace

void add_bench_stream_ppl(CLI::App* bench, Action& action) {
  auto f = std::make_shared<StreamFlags>();
  auto* c = bench->add_subcommand("stream-ppl", "StreamingLLM perplexity over a long text: attention sinks + window "
                                                "vs a window without sinks vs dense attention");
  c->add_option("--model", f->model, "Hugging Face model directory")->required();
  c->add_option("--text", f->text, "Text file, encoded with the model's tokenizer.json");
  c->add_option("--ids", f->ids, "File of whitespace-separated token ids (instead of --text)");
  c->add_option("--tokens", f->tokens, "Score the first N tokens (0 = all)");
  c->add_option("--context", f->context, "The model's training context, marked on the plot "
                                         "(default: max_position_embeddings)");
  c->add_option("--attention-sinks", f->sinks, "Sink tokens S")->capture_default_str();
  c->add_option("--window", f->window, "Window W: the sinks run keeps S + W tokens, the no-sink run S + W")->required();
  c->add_option("--block-size", f->block_size, "Tokens per KV block")->capture_default_str();
  c->add_option("--chunk", f->chunk, "Tokens per step (scores do not depend on it)")->capture_default_str();
  c->add_option("--kv-cache-dtype", f->kv_dtype, "f32, bf16, int8 or fp8")->capture_default_str();
  c->add_option("--dtype", f->dtype, "Weight dtype: f32 or bf16")->capture_default_str();
  c->add_option("--smooth", f->smooth, "Plot the mean NLL of the last N tokens")->capture_default_str();
  c->add_flag("--no-dense", f->no_dense, "Skip the dense run (quadratic in the stream length)");
  c->add_option("--json", f->json, "Write the numbers (per-token NLL included) to this JSON file");
  c->add_option("--svg", f->svg, "Write the plot to this SVG file");
  c->callback([&action, f] { action = [f] { return run_stream_ppl(*f); }; });
}

}  // namespace tessera::cli
