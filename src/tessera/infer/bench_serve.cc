// bench serve: seeded request sets, one measured phase per engine (fresh each time, after a
// warm-up request), per-request timestamps from a steady clock, and the report.
#include "tessera/infer/bench_serve.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <random>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/base/strings.h"
#include "tessera/base/timer.h"
#include "tessera/model/lora.h"

namespace tessera::infer {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

int64_t draw_length(std::mt19937_64& rng, const LengthRange& r) {
  if (r.min == r.max) return r.min;
  return std::uniform_int_distribution<int64_t>(r.min, r.max)(rng);
}

// Token ids from [3, vocab): 0..2 are commonly pad / bos / eos.
std::vector<int32_t> random_tokens(std::mt19937_64& rng, int64_t vocab, int64_t n) {
  std::uniform_int_distribution<int32_t> d(3, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = d(rng);
  return t;
}

}  // namespace

// The N measured requests, then the warm-up request (shared prefix + 16 other tokens, one
// output token), all from one seeded generator.
std::vector<BenchRequest> make_bench_requests(const ServeBenchOptions& o, int64_t vocab, int64_t max_len,
                                              BenchRequest* warmup, std::vector<BenchRequest>* more_warmups) {
  TESSERA_CHECK(vocab >= 4, "bench serve: the model's vocabulary (", vocab, ") is too small");
  TESSERA_CHECK(o.num_prefixes >= 1, "--num-prefixes must be >= 1, got ", o.num_prefixes);
  std::mt19937_64 rng(o.seed);
  const std::vector<int32_t> prefix = random_tokens(rng, vocab, o.shared_prefix);
  std::vector<std::vector<int32_t>> prefixes{prefix};
  for (int64_t k = 1; k < o.num_prefixes; ++k) prefixes.push_back(random_tokens(rng, vocab, o.shared_prefix));
  std::vector<BenchRequest> reqs;
  for (int64_t i = 0; i < o.num_requests; ++i) {
    const int64_t plen = draw_length(rng, o.prompt_len), olen = draw_length(rng, o.output_len);
    TESSERA_CHECK(o.shared_prefix + plen + olen <= max_len, "bench serve: --shared-prefix ",
                  o.shared_prefix, " + --prompt-len ", plen, " + --output-len ", olen,
                  " exceeds the context length ", max_len, " (--max-model-len)");
    BenchRequest r;
    r.prompt = prefixes[static_cast<size_t>(i % o.num_prefixes)];
    if (o.repetitive_prompts) {
      const auto seg = random_tokens(rng, vocab, std::min(o.repeat_segment, plen));
      for (int64_t k = 0; k < plen; ++k) r.prompt.push_back(seg[static_cast<size_t>(k) % seg.size()]);
    } else {
      const auto t = random_tokens(rng, vocab, plen);
      r.prompt.insert(r.prompt.end(), t.begin(), t.end());
    }
    r.max_tokens = olen;
    reqs.push_back(std::move(r));
  }
  warmup->prompt = prefix;
  const auto t = random_tokens(rng, vocab, std::min<int64_t>(16, max_len - o.shared_prefix - 1));
  warmup->prompt.insert(warmup->prompt.end(), t.begin(), t.end());
  warmup->max_tokens = 1;
  for (int64_t k = 1; k < o.num_prefixes && more_warmups; ++k) {
    BenchRequest w{prefixes[static_cast<size_t>(k)], 1};
    const auto tail = random_tokens(rng, vocab, std::min<int64_t>(16, max_len - o.shared_prefix - 1));
    w.prompt.insert(w.prompt.end(), tail.begin(), tail.end());
    more_warmups->push_back(std::move(w));
  }
  return reqs;
}

namespace {

SamplingParams greedy(int64_t max_tokens) {
  SamplingParams p;
  p.temperature = 0.f;
  p.ignore_eos = true;  // every output has the asked length
  p.max_tokens = max_tokens;
  return p;
}

std::string tiers_text(const EngineConfig& c) {
  std::string s = c.kv_host_memory > 0 ? base::strprintf("host %.1f MB", static_cast<double>(c.kv_host_memory) / 1e6)
                                       : "no host tier";
  if (!c.kv_offload_dir.empty())
    s += base::strprintf(", disk %.1f MB", static_cast<double>(c.kv_offload_size) / 1e6);
  return s + ", preemption " + c.preemption;
}

// Runs `reqs` on a fresh engine after `warmup`: all submitted at once, or one at a time
// (each added when the previous one finished). Stats are the measured requests' only.
PhaseResult run_phase(const model::Model& model, const model::Model* draft, const EngineConfig& cfg,
                      const std::vector<BenchRequest>& reqs, const std::vector<BenchRequest>& warmups,
                      bool one_at_a_time, const std::string& label, int64_t* kv_blocks_total,
                      const std::vector<int32_t>* adapters = nullptr) {
  Engine e(model, cfg, nullptr, cfg.speculative_method == "draft" ? draft : nullptr);
  if (kv_blocks_total) *kv_blocks_total = e.stats().kv_blocks_total;
  for (const BenchRequest& w : warmups) {  // one at a time: each prefix is computed once
    e.add_request(w.prompt, greedy(w.max_tokens));
    while (e.has_unfinished()) e.step();
  }
  const EngineStats s0 = e.stats();
  const int64_t bs = cfg.block_size, max_len = e.max_model_len();

  const size_t n = reqs.size();
  std::vector<Clock::time_point> arrival(n), first(n), finish(n);
  std::vector<int64_t> produced(n, 0), cached(n, 0);
  std::vector<bool> got_first(n, false), done(n, false);
  std::unordered_map<RequestId, size_t> index;
  std::vector<double> frag, contiguous;
  int64_t peak_blocks = 0;
  size_t num_done = 0;
  base::ProgressBar bar("bench serve: " + label, static_cast<int64_t>(n));
  auto drain = [&] {
    while (e.has_unfinished()) {
      const auto outs = e.step();
      const auto now = Clock::now();
      for (const RequestOutput& o : outs) {
        const size_t i = index.at(o.id);
        if (!o.new_tokens.empty() && !got_first[i]) {
          got_first[i] = true;
          first[i] = now;
        }
        produced[i] += static_cast<int64_t>(o.new_tokens.size());
        if (o.finished) {
          done[i] = true;
          finish[i] = now;
          cached[i] = o.num_cached_tokens;
          ++num_done;
          TESSERA_CHECK(produced[i] == reqs[i].max_tokens, "bench serve: request ", i, " finished (",
                        o.finish_reason, ") after ", produced[i], " of ", reqs[i].max_tokens, " tokens");
        }
      }
      const KvUsage u = e.kv_usage();
      if (u.sequences > 0 && u.blocks > 0) {
        const double slots = static_cast<double>(u.blocks * bs);
        frag.push_back((slots - static_cast<double>(u.tokens)) / slots);
        const double reserved = static_cast<double>(u.sequences * max_len);
        contiguous.push_back((reserved - static_cast<double>(u.seq_tokens)) / reserved);
        peak_blocks = std::max(peak_blocks, u.blocks);
      }
      if (num_done < n) bar.update(static_cast<int64_t>(num_done));
    }
  };
  const auto t0 = Clock::now();
  for (size_t i = 0; i < n; ++i) {
    arrival[i] = Clock::now();
    index[e.add_request(reqs[i].prompt, greedy(reqs[i].max_tokens), 0, adapters ? (*adapters)[i] : -1)] = i;
    if (one_at_a_time) drain();
  }
  drain();
  const auto t1 = Clock::now();
  bar.finish();

  PhaseResult r;
  r.label = label;
  r.prefix_caching = cfg.prefix_caching;
  r.speculative = cfg.speculative_method;
  r.num_requests = static_cast<int64_t>(n);
  r.seconds = seconds_between(t0, t1);
  std::vector<double> ttft, tpot, e2e;
  for (size_t i = 0; i < n; ++i) {
    TESSERA_CHECK(done[i] && got_first[i], "bench serve: request ", i, " did not finish");
    r.prompt_tokens += static_cast<int64_t>(reqs[i].prompt.size());
    r.output_tokens += produced[i];
    r.cached_prompt_tokens += cached[i];
    ttft.push_back(seconds_between(arrival[i], first[i]));
    e2e.push_back(seconds_between(arrival[i], finish[i]));
    if (produced[i] > 1) tpot.push_back(seconds_between(first[i], finish[i]) / static_cast<double>(produced[i] - 1));
  }
  r.total_tokens_per_s = static_cast<double>(r.prompt_tokens + r.output_tokens) / r.seconds;
  r.output_tokens_per_s = static_cast<double>(r.output_tokens) / r.seconds;
  r.ttft = percentiles(ttft);
  r.tpot = percentiles(tpot);
  r.e2e = percentiles(e2e);
  const EngineStats s1 = e.stats();
  r.steps = s1.steps - s0.steps;
  r.prefix_hit_blocks = s1.prefix_hit_blocks - s0.prefix_hit_blocks;
  r.prefix_lookup_blocks = r.prefix_hit_blocks + s1.prefix_miss_blocks - s0.prefix_miss_blocks;
  r.prefix_hit_rate = r.prefix_lookup_blocks > 0
                          ? static_cast<double>(r.prefix_hit_blocks) / static_cast<double>(r.prefix_lookup_blocks)
                          : 0.0;
  r.preemptions = s1.preemptions - s0.preemptions;
  r.computed_tokens = s1.batched_tokens - s0.batched_tokens;
  r.kv_tiers = tiers_text(cfg);
  r.host_hit_blocks = s1.kv_host_hit_blocks - s0.kv_host_hit_blocks;
  r.disk_hit_blocks = s1.kv_disk_hit_blocks - s0.kv_disk_hit_blocks;
  r.swapped_preemptions = s1.swapped_preemptions - s0.swapped_preemptions;
  r.swap_out_blocks = s1.kv_swap_out_blocks - s0.kv_swap_out_blocks;
  r.swap_in_blocks = s1.kv_swap_in_blocks - s0.kv_swap_in_blocks;
  r.bytes_to_tiers = s1.kv_bytes_to_tiers - s0.kv_bytes_to_tiers;
  r.bytes_from_tiers = s1.kv_bytes_from_tiers - s0.kv_bytes_from_tiers;
  r.spec_steps = s1.spec_steps - s0.spec_steps;
  r.spec_proposed = s1.spec_proposed - s0.spec_proposed;
  r.spec_accepted = s1.spec_accepted - s0.spec_accepted;
  if (r.spec_proposed > 0)
    r.spec_acceptance_rate = static_cast<double>(r.spec_accepted) / static_cast<double>(r.spec_proposed);
  if (r.spec_steps > 0)
    r.spec_mean_accepted = static_cast<double>(r.spec_accepted) / static_cast<double>(r.spec_steps);
  auto mean = [](const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return v.empty() ? 0.0 : s / static_cast<double>(v.size());
  };
  auto max_of = [](const std::vector<double>& v) { return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end()); };
  r.frag_mean = mean(frag);
  r.frag_max = max_of(frag);
  r.contiguous_frag_mean = mean(contiguous);
  r.contiguous_frag_max = max_of(contiguous);
  r.kv_blocks_peak = peak_blocks;
  return r;
}

void check_range(const LengthRange& r, const char* flag, int64_t lowest) {
  TESSERA_CHECK(r.min >= lowest && r.max >= r.min, flag, ": ", r.min, ":", r.max,
                " must satisfy ", lowest, " <= min <= max");
}

std::string range_text(const LengthRange& r) {
  return r.min == r.max ? std::to_string(r.min) : std::to_string(r.min) + ":" + std::to_string(r.max);
}

std::string phase_lines(const PhaseResult& p, bool full) {
  std::string s;
  s += base::strprintf("[%s] %lld requests in %.2f s, %lld engine steps (prefix caching %s, speculative %s)\n",
           p.label.c_str(), (long long)p.num_requests, p.seconds, (long long)p.steps,
           p.prefix_caching ? "on" : "off", p.speculative.empty() ? "off" : p.speculative.c_str());
  s += base::strprintf("  throughput: total %.1f tokens/s, output %.1f tokens/s (%lld prompt + %lld output tokens)\n",
           p.total_tokens_per_s, p.output_tokens_per_s, (long long)p.prompt_tokens,
           (long long)p.output_tokens);
  auto pct = [&](const char* name, const Percentiles& q, double scale, const char* unit) {
    s += base::strprintf("  %-4s (%s): p50 %.1f  p90 %.1f  p99 %.1f  mean %.1f\n", name, unit, q.p50 * scale,
             q.p90 * scale, q.p99 * scale, q.mean * scale);
  };
  pct("ttft", p.ttft, 1e3, "ms");
  pct("tpot", p.tpot, 1e3, "ms");
  pct("e2e", p.e2e, 1e3, "ms");
  if (!full) return s;
  s += base::strprintf("  prefix cache: hit rate %.1f%% (%lld of %lld looked-up blocks), %lld prompt tokens from cache\n",
           100 * p.prefix_hit_rate, (long long)p.prefix_hit_blocks, (long long)p.prefix_lookup_blocks,
           (long long)p.cached_prompt_tokens);
  s += base::strprintf("  preemptions: %lld (%lld by swap); %lld tokens run through the model\n",
                       (long long)p.preemptions, (long long)p.swapped_preemptions, (long long)p.computed_tokens);
  if (p.kv_tiers != "no host tier, preemption recompute")
    s += base::strprintf("  kv tiers (%s): host hits %lld blocks, disk hits %lld, swapped out %lld / in %lld blocks, "
                       "%.1f MB to the tiers, %.1f MB back\n",
                       p.kv_tiers.c_str(), (long long)p.host_hit_blocks, (long long)p.disk_hit_blocks,
                       (long long)p.swap_out_blocks, (long long)p.swap_in_blocks, p.bytes_to_tiers / 1e6,
                       p.bytes_from_tiers / 1e6);
  if (!p.speculative.empty())
    s += base::strprintf("  speculative (%s): acceptance rate %.1f%% (%lld of %lld proposed), mean accepted length "
             "%.2f per verification step (%lld steps)\n",
             p.speculative.c_str(), 100 * p.spec_acceptance_rate, (long long)p.spec_accepted,
             (long long)p.spec_proposed, p.spec_mean_accepted, (long long)p.spec_steps);
  s += base::strprintf("  kv fragmentation (unused slots of the blocks running sequences hold): mean %.2f%%, max "
           "%.2f%% (peak %lld blocks); contiguous max_model_len per sequence: mean %.2f%%, max %.2f%%\n",
           100 * p.frag_mean, 100 * p.frag_max, (long long)p.kv_blocks_peak, 100 * p.contiguous_frag_mean,
           100 * p.contiguous_frag_max);
  return s;
}

nlohmann::json phase_json(const PhaseResult& p) {
  auto pj = [](const Percentiles& q) {
    return nlohmann::json{{"p50", q.p50}, {"p90", q.p90}, {"p99", q.p99}, {"mean", q.mean}};
  };
  return {{"label", p.label},
          {"prefix_caching", p.prefix_caching},
          {"speculative", p.speculative},
          {"num_requests", p.num_requests},
          {"prompt_tokens", p.prompt_tokens},
          {"output_tokens", p.output_tokens},
          {"seconds", p.seconds},
          {"total_tokens_per_s", p.total_tokens_per_s},
          {"output_tokens_per_s", p.output_tokens_per_s},
          {"ttft_s", pj(p.ttft)},
          {"tpot_s", pj(p.tpot)},
          {"e2e_s", pj(p.e2e)},
          {"steps", p.steps},
          {"prefix_hit_blocks", p.prefix_hit_blocks},
          {"prefix_lookup_blocks", p.prefix_lookup_blocks},
          {"prefix_hit_rate", p.prefix_hit_rate},
          {"cached_prompt_tokens", p.cached_prompt_tokens},
          {"preemptions", p.preemptions},
          {"computed_tokens", p.computed_tokens},
          {"kv_tiers", p.kv_tiers},
          {"kv_host_hit_blocks", p.host_hit_blocks},
          {"kv_disk_hit_blocks", p.disk_hit_blocks},
          {"swapped_preemptions", p.swapped_preemptions},
          {"kv_swap_out_blocks", p.swap_out_blocks},
          {"kv_swap_in_blocks", p.swap_in_blocks},
          {"kv_bytes_to_tiers", p.bytes_to_tiers},
          {"kv_bytes_from_tiers", p.bytes_from_tiers},
          {"spec_steps", p.spec_steps},
          {"spec_proposed", p.spec_proposed},
          {"spec_accepted", p.spec_accepted},
          {"spec_acceptance_rate", p.spec_acceptance_rate},
          {"spec_mean_accepted", p.spec_mean_accepted},
          {"kv_fragmentation_mean", p.frag_mean},
          {"kv_fragmentation_max", p.frag_max},
          {"contiguous_fragmentation_mean", p.contiguous_frag_mean},
          {"contiguous_fragmentation_max", p.contiguous_frag_max},
          {"kv_blocks_peak", p.kv_blocks_peak}};
}

}  // namespace

LengthRange parse_length_range(const std::string& text, const std::string& flag) {
  auto parse = [&](const std::string& part) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(part, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    TESSERA_CHECK(used > 0 && used == part.size(), flag, ": '", text,
                  "' is not a token count or a range MIN:MAX");
    return static_cast<int64_t>(v);
  };
  LengthRange r;
  const auto colon = text.find(':');
  if (colon == std::string::npos) {
    r.min = r.max = parse(text);
  } else {
    r.min = parse(text.substr(0, colon));
    r.max = parse(text.substr(colon + 1));
  }
  TESSERA_CHECK(r.min >= 0 && r.max >= r.min, flag, ": '", text, "' must be N or MIN:MAX with 0 <= MIN <= MAX");
  return r;
}

Percentiles percentiles(std::vector<double> v) {
  Percentiles p;
  if (v.empty()) return p;
  std::sort(v.begin(), v.end());
  auto at = [&](double q) {
    const double pos = q * static_cast<double>(v.size() - 1);
    const size_t lo = static_cast<size_t>(std::floor(pos));
    const size_t hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (pos - static_cast<double>(lo)) * (v[hi] - v[lo]);
  };
  p.p50 = at(0.5);
  p.p90 = at(0.9);
  p.p99 = at(0.99);
  double s = 0;
  for (double x : v) s += x;
  p.mean = s / static_cast<double>(v.size());
  return p;
}

// --lora-adapters K: the same requests on one adapter, then spread over K (a copy of the
// model holds the bank; its weights are shared).
static ServeBenchResult run_lora_bench(const model::Model& base, const ServeBenchOptions& o, ServeBenchResult& res,
                                const std::vector<BenchRequest>& reqs, const std::vector<BenchRequest>& warmup) {
  model::Model m = base;
  std::vector<model::LoraWeights> adapters;
  model::LoraConfig lc;
  lc.rank = o.lora_rank;
  lc.alpha = 2.0 * static_cast<double>(o.lora_rank);
  lc.targets = {model::LoraModule::kQ, model::LoraModule::kK, model::LoraModule::kV, model::LoraModule::kO,
                model::LoraModule::kGate, model::LoraModule::kUp, model::LoraModule::kDown};
  std::mt19937 rng(static_cast<uint32_t>(o.seed + 77));
  std::normal_distribution<float> nd(0.f, 0.01f);
  for (int64_t k = 0; k < o.lora_adapters; ++k) {
    adapters.push_back(model::LoraWeights::init(m.config(), lc, o.seed + 100 + static_cast<uint64_t>(k)));
    for (auto& layer : adapters.back().layers)  // B nonzero: the products are not skipped by zeros
      for (auto& p : layer)
        for (int64_t i = 0; p.b.defined() && i < p.b.numel(); ++i) p.b.data<float>()[i] = nd(rng);
  }
  std::vector<const model::LoraWeights*> bank;
  for (const auto& a : adapters) bank.push_back(&a);
  m.set_lora_bank(bank);
  const size_t n = reqs.size();
  std::vector<int32_t> one(n, 0), spread(n);
  for (size_t i = 0; i < n; ++i) spread[i] = static_cast<int32_t>(i % static_cast<size_t>(o.lora_adapters));
  // Alternating runs (one, K, one, K, ...): load from other processes on a shared machine
  // then weighs on both alike; each phase reports its median run by output tokens/s.
  std::vector<PhaseResult> ones, spreads;
  for (int64_t rep = 0; rep < o.lora_repeats; ++rep) {
    ones.push_back(run_phase(m, nullptr, o.engine, reqs, warmup, false, "one adapter", &res.kv_blocks_total, &one));
    spreads.push_back(run_phase(m, nullptr, o.engine, reqs, warmup, false,
                                base::strprintf("%lld adapters", (long long)o.lora_adapters), nullptr, &spread));
  }
  auto median = [](std::vector<PhaseResult> v) {
    std::sort(v.begin(), v.end(), [](const PhaseResult& a, const PhaseResult& b) {
      return a.output_tokens_per_s < b.output_tokens_per_s;
    });
    return v[v.size() / 2];
  };
  res.main = median(ones);
  res.lora_spread = median(spreads);
  res.kv_bytes_total = res.kv_blocks_total * KvPool::bytes_per_block(m.config(), o.engine.block_size,
                                                                      m.dims().kv_heads, o.engine.kv_cache_dtype);
  if (res.main.output_tokens_per_s > 0)
    res.lora_spread_ratio = res.lora_spread->output_tokens_per_s / res.main.output_tokens_per_s;
  if (res.lora_spread->tpot.p50 > 0) res.lora_tpot_ratio = res.main.tpot.p50 / res.lora_spread->tpot.p50;
  return res;
}

// --compare-kv-tiers: the measured phase without the host / disk tiers (recompute);
// --compare-preemption: with the other preemption mode.
static void compare_kv_tiers(const model::Model& model, const model::Model* draft, const ServeBenchOptions& o,
                             const std::vector<BenchRequest>& reqs, const std::vector<BenchRequest>& warmups,
                             ServeBenchResult& res) {
  const EngineConfig& e = o.engine;
  const bool tiers = e.kv_host_memory > 0 || !e.kv_offload_dir.empty();
  TESSERA_CHECK(!o.compare_kv_tiers || tiers, "--compare-kv-tiers needs --kv-host-memory or --kv-offload-dir");
  TESSERA_CHECK(!o.compare_preemption || e.kv_host_memory > 0, "--compare-preemption needs --kv-host-memory");
  if (o.compare_kv_tiers) {
    EngineConfig c = e;
    c.kv_host_memory = 0;
    c.kv_offload_dir.clear();
    c.kv_offload_size = 0;
    c.preemption = "recompute";
    res.no_tiers = run_phase(model, draft, c, reqs, warmups, false, "no kv tiers", nullptr);
    if (res.main.ttft.p50 > 0) res.ttft_p50_no_tiers_over_tiers = res.no_tiers->ttft.p50 / res.main.ttft.p50;
    if (res.no_tiers->total_tokens_per_s > 0)
      res.throughput_tiers_over_no_tiers = res.main.total_tokens_per_s / res.no_tiers->total_tokens_per_s;
  }
  if (o.compare_preemption) {
    EngineConfig c = e;
    c.preemption = e.preemption == "swap" ? "recompute" : "swap";
    res.other_preemption = run_phase(model, draft, c, reqs, warmups, false, "preemption " + c.preemption, nullptr);
    const PhaseResult& swap = e.preemption == "swap" ? res.main : *res.other_preemption;
    const PhaseResult& recompute = e.preemption == "swap" ? *res.other_preemption : res.main;
    if (recompute.total_tokens_per_s > 0)
      res.throughput_swap_over_recompute = swap.total_tokens_per_s / recompute.total_tokens_per_s;
    if (swap.ttft.p50 > 0) res.ttft_p50_recompute_over_swap = recompute.ttft.p50 / swap.ttft.p50;
  }
}

ServeBenchResult run_serve_bench(const model::Model& model, const ServeBenchOptions& o,
                                 const model::Model* draft, const std::string& name) {
  TESSERA_CHECK(o.num_requests >= 1, "--num-requests must be >= 1, got ", o.num_requests);
  check_range(o.prompt_len, "--prompt-len", 1);
  check_range(o.output_len, "--output-len", 1);
  TESSERA_CHECK(o.shared_prefix >= 0, "--shared-prefix must not be negative, got ", o.shared_prefix);
  TESSERA_CHECK(o.repeat_segment >= 1, "--repeat-segment must be >= 1, got ", o.repeat_segment);
  TESSERA_CHECK(o.baseline_requests >= -1 && o.baseline_requests <= o.num_requests,
                "--baseline-requests ", o.baseline_requests, " must be in [0, --num-requests ",
                o.num_requests, "] (or -1 for min(N, 4))");
  TESSERA_CHECK(!o.compare_speculative || !o.engine.speculative_method.empty(),
                "--compare-speculative needs --speculative ngram|draft");
  o.engine.validate();

  ServeBenchResult res;
  res.options = o;
  res.model = name.empty() ? (o.model_dir.empty() ? o.shape : o.model_dir) : name;
  res.num_parameters = model.config().num_parameters();
  res.block_size = o.engine.block_size;
  res.max_model_len = o.engine.max_model_len > 0 ? o.engine.max_model_len : model::max_context(model.config());
  BenchRequest warmup;
  std::vector<BenchRequest> warmups;
  const auto reqs = make_bench_requests(o, model.config().vocab_size, res.max_model_len, &warmup, &warmups);
  warmups.insert(warmups.begin(), warmup);

  TESSERA_CHECK(o.lora_adapters >= 0 && o.lora_rank >= 1 && o.lora_repeats >= 1,
                "--lora-adapters must be >= 0, --lora-rank and --lora-repeats >= 1");
  TESSERA_CHECK(o.lora_adapters == 0 || (!o.compare_prefix_caching && !o.compare_speculative &&
                                         !o.compare_kv_cache_dtype && o.engine.speculative_method.empty()),
                "--lora-adapters runs its own two phases; not with --compare-* or --speculative");
  if (o.lora_adapters > 0) return run_lora_bench(model, o, res, reqs, warmups);
  res.main = run_phase(model, draft, o.engine, reqs, warmups, false, "concurrent", &res.kv_blocks_total);
  res.kv_bytes_total = res.kv_blocks_total * KvPool::bytes_per_block(model.config(), o.engine.block_size,
                                                                      model.dims().kv_heads,
                                                                      o.engine.kv_cache_dtype);
  if (o.compare_prefix_caching) {
    EngineConfig c = o.engine;
    c.prefix_caching = !c.prefix_caching;
    res.prefix_flipped = run_phase(model, draft, c, reqs, warmups, false,
                                   c.prefix_caching ? "prefix caching on" : "no prefix caching", nullptr);
    const PhaseResult& on = o.engine.prefix_caching ? res.main : *res.prefix_flipped;
    const PhaseResult& off = o.engine.prefix_caching ? *res.prefix_flipped : res.main;
    if (on.ttft.p50 > 0) res.ttft_p50_off_over_on = off.ttft.p50 / on.ttft.p50;
  }
  if (o.compare_speculative) {
    EngineConfig c = o.engine;
    c.speculative_method.clear();
    c.num_speculative_tokens = 0;
    res.no_speculation = run_phase(model, nullptr, c, reqs, warmups, false, "no speculation", nullptr);
    if (res.no_speculation->output_tokens_per_s > 0)
      res.spec_speedup = res.main.output_tokens_per_s / res.no_speculation->output_tokens_per_s;
  }
  if (o.compare_kv_cache_dtype) {
    EngineConfig c = o.engine;
    c.kv_cache_dtype = *o.compare_kv_cache_dtype;
    res.other_kv_dtype = run_phase(model, draft, c, reqs, warmups, false,
                                   std::string("kv cache ") + kernels::kv_cache_dtype_name(c.kv_cache_dtype),
                                   &res.other_kv_blocks_total);
    if (res.other_kv_dtype->total_tokens_per_s > 0)
      res.kv_dtype_speedup = res.main.total_tokens_per_s / res.other_kv_dtype->total_tokens_per_s;
  }
  compare_kv_tiers(model, draft, o, reqs, warmups, res);
  const int64_t m = o.baseline_requests < 0 ? std::min<int64_t>(o.num_requests, 4) : o.baseline_requests;
  if (m > 0) {
    const std::vector<BenchRequest> first(reqs.begin(), reqs.begin() + m);
    res.baseline = run_phase(model, draft, o.engine, first, warmups, true, "one-at-a-time", nullptr);
    if (res.baseline->total_tokens_per_s > 0)
      res.speedup_vs_one_at_a_time = res.main.total_tokens_per_s / res.baseline->total_tokens_per_s;
  }
  return res;
}

ServeBenchResult run_serve_bench(const ServeBenchOptions& o) {
  const std::string& method = o.engine.speculative_method;
  TESSERA_CHECK(method != "draft" || !o.draft_model_dir.empty(), "--speculative draft needs --draft-model DIR");
  TESSERA_CHECK(o.draft_model_dir.empty() || method == "draft", "--draft-model ", o.draft_model_dir,
                " needs --speculative draft");
  const model::Model m = o.model_dir.empty()
                             ? model::Model::random(model::ModelConfig::named_shape(o.shape), o.dtype, o.model_seed)
                             : model::Model::load(o.model_dir, o.dtype);
  std::optional<model::Model> draft;
  if (!o.draft_model_dir.empty()) draft = model::Model::load(o.draft_model_dir, o.dtype);
  const std::string name = o.model_dir.empty() ? o.shape + " (random weights)" : o.model_dir;
  return run_serve_bench(m, o, draft ? &*draft : nullptr, name);
}

std::string format_serve_bench(const ServeBenchResult& r) {
  const ServeBenchOptions& o = r.options;
  const EngineConfig& e = o.engine;
  std::string s;
  s += base::strprintf("model: %s, %.1fM parameters, %s\n", r.model.c_str(), static_cast<double>(r.num_parameters) / 1e6,
           dtype_name(o.dtype));
  s += base::strprintf("requests: %lld, prompt %s tokens%s, output %s tokens, shared prefix %lld, seed %llu\n",
           (long long)o.num_requests, range_text(o.prompt_len).c_str(),
           o.repetitive_prompts ? base::strprintf(" (repeating a %lld-token segment)", (long long)o.repeat_segment).c_str() : "",
           range_text(o.output_len).c_str(), (long long)o.shared_prefix, (unsigned long long)o.seed);
  s += base::strprintf("engine: block size %lld, kv cache %s, kv pool %lld blocks (%.2f GB), max_model_len %lld, max_num_seqs %lld, "
           "max_num_batched_tokens %lld, prefix caching %s, speculative %s\n",
           (long long)r.block_size, kernels::kv_cache_dtype_name(e.kv_cache_dtype), (long long)r.kv_blocks_total,
           static_cast<double>(r.kv_bytes_total) / 1e9,
           (long long)r.max_model_len, (long long)e.max_num_seqs, (long long)e.max_num_batched_tokens,
           e.prefix_caching ? "on" : "off",
           e.speculative_method.empty()
               ? "off"
               : base::strprintf("%s k=%lld", e.speculative_method.c_str(), (long long)e.num_speculative_tokens).c_str());
  s += phase_lines(r.main, true);
  if (r.prefix_flipped) {
    s += phase_lines(*r.prefix_flipped, true);
    s += base::strprintf("ttft p50 without / with prefix caching: %.2fx\n", r.ttft_p50_off_over_on);
  }
  if (r.no_speculation) {
    s += phase_lines(*r.no_speculation, false);
    s += base::strprintf("speculative speed-up (output tokens/s, with / without): %.2fx\n", r.spec_speedup);
  }
  if (r.other_kv_dtype) {
    s += phase_lines(*r.other_kv_dtype, true);
    s += base::strprintf("total throughput, kv cache %s (%lld blocks) / %s (%lld blocks): %.2fx\n",
                         kernels::kv_cache_dtype_name(e.kv_cache_dtype), (long long)r.kv_blocks_total,
                         kernels::kv_cache_dtype_name(*o.compare_kv_cache_dtype),
                         (long long)r.other_kv_blocks_total, r.kv_dtype_speedup);
  }
  if (r.lora_spread) {
    s += phase_lines(*r.lora_spread, false);
    s += base::strprintf("multi-LoRA, %lld adapters of rank %lld / one adapter: output tokens/s %.2fx, "
                         "tpot p50 %.2fx (higher is better)\n",
                         (long long)o.lora_adapters, (long long)o.lora_rank, r.lora_spread_ratio, r.lora_tpot_ratio);
  }
  if (r.no_tiers) {
    s += phase_lines(*r.no_tiers, true);
    s += base::strprintf("kv tiers: ttft p50 without / with %.2fx, total throughput with / without %.2fx\n",
                         r.ttft_p50_no_tiers_over_tiers, r.throughput_tiers_over_no_tiers);
  }
  if (r.other_preemption) {
    s += phase_lines(*r.other_preemption, true);
    s += base::strprintf("preemption: total throughput swap / recompute %.2fx, ttft p50 recompute / swap %.2fx\n",
                         r.throughput_swap_over_recompute, r.ttft_p50_recompute_over_swap);
  }
  if (r.baseline) {
    s += phase_lines(*r.baseline, false);
    s += base::strprintf("total throughput: %.2fx one-at-a-time\n", r.speedup_vs_one_at_a_time);
  }
  return s;
}

std::string serve_bench_json(const ServeBenchResult& r) {
  nlohmann::json j{{"model", r.model},
                   {"num_parameters", r.num_parameters},
                   {"kv_blocks_total", r.kv_blocks_total},
                   {"block_size", r.block_size},
                   {"max_model_len", r.max_model_len},
                   {"main", phase_json(r.main)}};
  if (r.prefix_flipped) {
    j["prefix_flipped"] = phase_json(*r.prefix_flipped);
    j["ttft_p50_off_over_on"] = r.ttft_p50_off_over_on;
  }
  if (r.no_speculation) {
    j["no_speculation"] = phase_json(*r.no_speculation);
    j["spec_speedup"] = r.spec_speedup;
  }
  j["kv_cache_dtype"] = kernels::kv_cache_dtype_name(r.options.engine.kv_cache_dtype);
  if (r.other_kv_dtype) {
    j["other_kv_dtype"] = phase_json(*r.other_kv_dtype);
    j["other_kv_blocks_total"] = r.other_kv_blocks_total;
    j["kv_dtype_speedup"] = r.kv_dtype_speedup;
  }
  if (r.lora_spread) {
    j["lora_spread"] = phase_json(*r.lora_spread);
    j["lora_spread_ratio"] = r.lora_spread_ratio;
    j["lora_tpot_ratio"] = r.lora_tpot_ratio;
  }
  if (r.no_tiers) {
    j["no_tiers"] = phase_json(*r.no_tiers);
    j["ttft_p50_no_tiers_over_tiers"] = r.ttft_p50_no_tiers_over_tiers;
    j["throughput_tiers_over_no_tiers"] = r.throughput_tiers_over_no_tiers;
  }
  if (r.other_preemption) {
    j["other_preemption"] = phase_json(*r.other_preemption);
    j["throughput_swap_over_recompute"] = r.throughput_swap_over_recompute;
    j["ttft_p50_recompute_over_swap"] = r.ttft_p50_recompute_over_swap;
  }
  if (r.baseline) {
    j["baseline"] = phase_json(*r.baseline);
    j["speedup_vs_one_at_a_time"] = r.speedup_vs_one_at_a_time;
  }
  return j.dump();
}

}  // namespace tessera::infer
