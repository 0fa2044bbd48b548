// bench structured: the same requests decoded with and without their constraint, each
// unconstrained request given exactly the tokens its constrained twin produced, so both runs
// have the same batches step by step and the step-time difference is the constraint's cost.
#include "tessera/infer/structured/bench_structured.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/base/strings.h"
#include "tessera/infer/engine.h"
#include "tessera/infer/structured/convert.h"
#include "tessera/infer/structured/guided_runner.h"
#include "tessera/io/json_file.h"
#include "tessera/io/tokenizer.h"
#include "tessera/model/model.h"

namespace tessera::infer::structured {
namespace {

// A tool call's shape: names, enums, bounded strings, an integer, a boolean, a short list.
const char* kToolSchema = R"({"type": "object", "properties": {
  "name": {"enum": ["get_weather", "search_flights", "send_email"]},
  "arguments": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer"},
    "hourly": {"type": "boolean"},
    "notes": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3}},
    "required": ["city", "unit", "days"]}},
  "required": ["name", "arguments"]})";

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

struct RunFigures {
  std::vector<int64_t> lengths;  // output tokens per request
  std::vector<std::string> texts;
  std::vector<std::string> reasons;
  int64_t steps = 0;
  double ms = 0;                 // in step() over the whole run
  GuidedStats stats;
};

RunFigures run(const model::Model& m, const io::Tokenizer& tok, const std::vector<SamplingParams>& reqs,
               const std::vector<int32_t>& prompt) {
  EngineConfig ec;
  ec.kv_cache_memory = 256 << 20;
  ec.max_num_seqs = static_cast<int64_t>(reqs.size());
  Engine e(m, ec, &tok);
  std::map<RequestId, size_t> index;
  for (size_t i = 0; i < reqs.size(); ++i) index[e.add_request(prompt, reqs[i])] = i;
  RunFigures f;
  f.lengths.assign(reqs.size(), 0);
  f.texts.assign(reqs.size(), "");
  f.reasons.assign(reqs.size(), "");
  while (e.has_unfinished()) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto outs = e.step();
    f.ms += ms_since(t0);
    ++f.steps;
    for (const auto& o : outs) {
      const size_t i = index.at(o.id);
      f.lengths[i] = o.num_output_tokens;
      f.texts[i] += o.new_text;
      if (o.finished) f.reasons[i] = o.finish_reason;
    }
  }
  f.stats = e.guided_stats();
  return f;
}

}  // namespace

StructuredBenchResult bench_structured(const StructuredBenchOptions& o) {
  TESSERA_CHECK(o.requests >= 1 && o.max_tokens >= 1 && o.repeats >= 1, "bench structured: --requests, "
                "--max-tokens and --repeats must be >= 1");
  TESSERA_CHECK(o.hidden >= 64 && o.hidden % 64 == 0 && o.layers >= 1, "bench structured: --hidden must be a "
                "multiple of 64 and --layers >= 1");
  const io::Tokenizer tok = io::Tokenizer::load(o.tokenizer);
  const std::string schema = o.schema.empty() ? kToolSchema : io::read_file_bytes(o.schema);
  const GuidedDecoding guided{"json_schema", schema};
  StructuredBenchResult r;
  r.vocab = tok.vocab_size();
  {  // the one-off costs, each measured once on its own
    const auto t0 = std::chrono::steady_clock::now();
    const auto trie = VocabTrie::from_tokenizer(tok, r.vocab);
    r.trie_ms = ms_since(t0);
    r.trie_nodes = static_cast<int64_t>(trie->num_nodes());
    const auto t1 = std::chrono::steady_clock::now();
    try {
      TokenGrammar g(compile_guided(guided), trie);
    } catch (const Error& e) {
      fail("bench structured: --schema ", o.schema.empty() ? "(built in)" : o.schema, ": ", e.what());
    }
    r.compile_ms = ms_since(t1);
  }
  model::ModelConfig c = model::ModelConfig::named_shape("tiny");
  c.vocab_size = r.vocab;
  c.hidden_size = o.hidden;
  c.num_layers = o.layers;
  c.num_heads = o.hidden / 64;
  c.num_kv_heads = std::max<int64_t>(1, c.num_heads / 4);
  c.head_dim = 64;
  c.intermediate_size = o.hidden * 8 / 3 / 64 * 64;
  c.max_position_embeddings = 4096;
  c.eos_token_id = tok.eos_id();
  c.bos_token_id = tok.bos_id();
  const model::Model m = model::Model::random(c, o.dtype, 1);
  const std::vector<int32_t> prompt = tok.encode("Call one tool for the user. Reply with JSON only:", false);

  std::vector<double> mask_us, walk_us, walk_frac, exposed_us, step_g, step_f;
  RunFigures median_run;
  for (int rep = 0; rep < o.repeats; ++rep) {
    std::vector<SamplingParams> reqs(static_cast<size_t>(o.requests));
    for (size_t i = 0; i < reqs.size(); ++i) {
      reqs[i].temperature = 1.f;
      reqs[i].seed = o.seed + rep * 1000 + i;
      reqs[i].max_tokens = o.max_tokens;
      reqs[i].guided = guided;
    }
    const RunFigures g = run(m, tok, reqs, prompt);
    for (size_t i = 0; i < reqs.size(); ++i) {  // a sanity check: the outputs are JSON
      ++r.outputs;
      if (g.reasons[i] != "stop") continue;
      ++r.stopped;
      if (nlohmann::json::accept(g.texts[i])) ++r.parsed;
      else if (r.bad_output.empty()) r.bad_output = g.texts[i];
    }
    for (size_t i = 0; i < reqs.size(); ++i) {  // the twin: the same lengths, unconstrained
      reqs[i].guided = {};
      reqs[i].ignore_eos = true;
      reqs[i].max_tokens = std::max<int64_t>(1, g.lengths[i]);
    }
    const RunFigures f = run(m, tok, reqs, prompt);
    const double masks = std::max<int64_t>(1, g.stats.masks);
    mask_us.push_back(g.stats.compute_us / masks);
    walk_us.push_back(g.stats.walks ? g.stats.walk_us / g.stats.walks : 0.0);
    walk_frac.push_back(g.stats.walks / masks);
    exposed_us.push_back(g.stats.exposed_us / masks);
    step_g.push_back(g.ms / std::max<int64_t>(1, g.steps));
    step_f.push_back(f.ms / std::max<int64_t>(1, f.steps));
    if (rep == o.repeats / 2) median_run = g;
  }
  for (int64_t n : median_run.lengths) r.tokens += n;
  r.steps = median_run.steps;
  r.mask_us_per_token = median(mask_us);
  r.walk_us = median(walk_us);
  r.walk_fraction = median(walk_frac);
  r.exposed_us_per_token = median(exposed_us);
  r.step_ms_guided = median(step_g);
  r.step_ms_free = median(step_f);
  return r;
}

std::string format_structured_bench(const StructuredBenchOptions& o, const StructuredBenchResult& r) {
  std::string s;
  s += base::strprintf("vocabulary %lld tokens, trie %lld nodes: built in %.0f ms; schema compiled in %.2f ms\n",
                       (long long)r.vocab, (long long)r.trie_nodes, r.trie_ms, r.compile_ms);
  s += base::strprintf("model: random, hidden %lld, %lld layers, %s; %lld requests, %lld tokens in %lld steps "
                       "(median of %d runs)\n",
                       (long long)o.hidden, (long long)o.layers, dtype_name(o.dtype), (long long)o.requests,
                       (long long)r.tokens, (long long)r.steps, o.repeats);
  s += base::strprintf("outputs: %lld, %lld ended by the schema (the rest by --max-tokens), %lld of those parse "
                       "as JSON\n", (long long)r.outputs, (long long)r.stopped, (long long)r.parsed);
  if (!r.bad_output.empty()) s += "first output that does not parse: " + r.bad_output + "\n";
  s += base::strprintf("mask per token: %.1f us computed (worker thread; %.0f%% needed a trie walk of %.0f us, the "
                       "rest came from the per-state cache), %.1f us exposed (engine thread waiting)\n",
                       r.mask_us_per_token, 100.0 * r.walk_fraction, r.walk_us, r.exposed_us_per_token);
  s += base::strprintf("engine step: %.2f ms constrained vs %.2f ms unconstrained (same tokens per request): "
                       "%+.1f%%\n",
                       r.step_ms_guided, r.step_ms_free, 100.0 * (r.step_ms_guided / r.step_ms_free - 1.0));
  return s;
}

}  // namespace tessera::infer::structured
