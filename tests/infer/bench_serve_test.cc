// bench serve's figures on the tiny model: token counts, prefix-cache hits and KV
// fragmentation worked out by hand from the request shapes, percentiles against numpy's rule.
#include <gtest/gtest.h>

#include <cstdio>

#include "tessera/base/error.h"
#include "tessera/infer/bench_serve.h"

namespace tessera::infer {
namespace {

TEST(BenchServe, PercentilesInterpolateLikeNumpy) {
  // numpy.percentile([1..10], [50, 90, 99]) = 5.5, 9.1, 9.91 (linear interpolation).
  const Percentiles p = percentiles({10, 3, 1, 2, 4, 5, 6, 7, 8, 9});
  EXPECT_DOUBLE_EQ(p.p50, 5.5);
  EXPECT_NEAR(p.p90, 9.1, 1e-12);
  EXPECT_NEAR(p.p99, 9.91, 1e-12);
  EXPECT_DOUBLE_EQ(p.mean, 5.5);
  EXPECT_DOUBLE_EQ(percentiles({7}).p99, 7.0);
  EXPECT_DOUBLE_EQ(percentiles({}).p50, 0.0);
}

TEST(BenchServe, ParsesLengthRanges) {
  EXPECT_EQ(parse_length_range("128", "--x").min, 128);
  EXPECT_EQ(parse_length_range("128", "--x").max, 128);
  const LengthRange r = parse_length_range("64:192", "--x");
  EXPECT_EQ(r.min, 64);
  EXPECT_EQ(r.max, 192);
  for (const char* bad : {"", "a", "5:3", "-1", "4:", "12x", "1:2:3"}) {
    try {
      parse_length_range(bad, "--output-len");
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--output-len"), std::string::npos) << e.what();
    }
  }
}

// 6 requests of 32 shared + 20 own prompt tokens, 5 outputs each, blocks of 16, context 256.
// After the first step every sequence has its 52 prompt tokens computed; each later step
// computes one more, and the step that samples the 5th token frees the sequence: the samples
// see 52, 53, 54, 55 computed tokens per sequence in 4 blocks, 12..9 slots of the last unused.
TEST(BenchServe, CountsHitsAndFragmentationOnTinyModel) {
  ServeBenchOptions o;
  o.shape = "tiny";
  o.num_requests = 6;
  o.prompt_len = {20, 20};
  o.output_len = {5, 5};
  o.shared_prefix = 32;
  o.compare_prefix_caching = true;
  o.engine.block_size = 16;
  o.engine.kv_cache_memory = 4 << 20;
  const ServeBenchResult r = run_serve_bench(o);
  ASSERT_EQ(r.max_model_len, 256);

  const PhaseResult& m = r.main;
  EXPECT_EQ(m.num_requests, 6);
  EXPECT_EQ(m.prompt_tokens, 6 * 52);
  EXPECT_EQ(m.output_tokens, 6 * 5);
  // (52 - 1) / 16 = 3 candidate blocks per request: the 2 prefix blocks hit, the third misses.
  EXPECT_EQ(m.prefix_lookup_blocks, 18);
  EXPECT_EQ(m.prefix_hit_blocks, 12);
  EXPECT_NEAR(m.prefix_hit_rate, 2.0 / 3.0, 1e-12);
  EXPECT_EQ(m.cached_prompt_tokens, 6 * 32);
  EXPECT_EQ(m.preemptions, 0);
  EXPECT_EQ(m.steps, 5);
  // Distinct blocks: 2 shared + 2 own per sequence = 14 (224 slots); unused 6 * (12..9).
  EXPECT_NEAR(m.frag_mean, 6 * 10.5 / 224, 1e-12);
  EXPECT_NEAR(m.frag_max, 6 * 12.0 / 224, 1e-12);
  EXPECT_EQ(m.kv_blocks_peak, 14);
  EXPECT_NEAR(m.contiguous_frag_mean, (256 - 53.5) / 256, 1e-12);
  EXPECT_NEAR(m.contiguous_frag_max, (256 - 52.0) / 256, 1e-12);
  EXPECT_GT(m.seconds, 0);
  EXPECT_NEAR(m.total_tokens_per_s, (6 * 57) / m.seconds, 1e-9 * m.total_tokens_per_s);
  EXPECT_GT(m.ttft.p50, 0);
  EXPECT_LE(m.ttft.p99, m.e2e.p50 + 1e-9);  // every first token comes before every finish here
  EXPECT_GT(m.tpot.p50, 0);

  ASSERT_TRUE(r.prefix_flipped);
  const PhaseResult& off = *r.prefix_flipped;
  EXPECT_FALSE(off.prefix_caching);
  EXPECT_EQ(off.prefix_lookup_blocks, 0);
  EXPECT_EQ(off.cached_prompt_tokens, 0);
  EXPECT_EQ(off.output_tokens, 30);
  // No sharing: 4 private blocks per sequence.
  EXPECT_EQ(off.kv_blocks_peak, 24);
  EXPECT_NEAR(off.frag_mean, 10.5 / 64, 1e-12);
  EXPECT_NEAR(r.ttft_p50_off_over_on, off.ttft.p50 / m.ttft.p50, 1e-12);

  // One at a time: the first min(6, 4) requests, each alone: the same per-sequence samples.
  ASSERT_TRUE(r.baseline);
  const PhaseResult& b = *r.baseline;
  EXPECT_EQ(b.num_requests, 4);
  EXPECT_EQ(b.output_tokens, 20);
  EXPECT_EQ(b.prefix_hit_blocks, 8);
  EXPECT_EQ(b.steps, 4 * 5);
  EXPECT_NEAR(b.frag_mean, 10.5 / 64, 1e-12);
  EXPECT_EQ(b.kv_blocks_peak, 4);
  EXPECT_NEAR(r.speedup_vs_one_at_a_time, m.total_tokens_per_s / b.total_tokens_per_s, 1e-12);

  const std::string report = format_serve_bench(r);
  char line[64];
  std::snprintf(line, sizeof line, "%.2fx one-at-a-time\n", r.speedup_vs_one_at_a_time);
  EXPECT_NE(report.find(line), std::string::npos) << report;
}

// --lora-adapters: both phases run every request to its length (one adapter, then spread over
// K), the ratio is theirs, and what the mode does not combine with is refused.
TEST(BenchServe, LoraAdaptersPhasesAndRatio) {
  ServeBenchOptions o;
  o.shape = "tiny";
  o.num_requests = 8;
  o.prompt_len = {6, 6};
  o.output_len = {4, 4};
  o.lora_adapters = 4;
  o.lora_rank = 4;
  o.lora_repeats = 1;
  o.baseline_requests = 0;
  o.engine.kv_cache_memory = 4 << 20;
  const ServeBenchResult r = run_serve_bench(o);
  ASSERT_TRUE(r.lora_spread);
  EXPECT_EQ(r.main.label, "one adapter");
  EXPECT_EQ(r.lora_spread->label, "4 adapters");
  EXPECT_EQ(r.main.output_tokens, 32);
  EXPECT_EQ(r.lora_spread->output_tokens, 32);
  EXPECT_DOUBLE_EQ(r.lora_spread_ratio, r.lora_spread->output_tokens_per_s / r.main.output_tokens_per_s);
  EXPECT_NE(format_serve_bench(r).find("multi-LoRA, 4 adapters of rank 4 / one adapter"), std::string::npos);
  EXPECT_NE(serve_bench_json(r).find("\"lora_spread_ratio\""), std::string::npos);
  o.compare_prefix_caching = true;
  EXPECT_THROW(run_serve_bench(o), Error);
}

TEST(BenchServe, SpeculativeCountersAndErrors) {
  ServeBenchOptions o;
  o.shape = "tiny";
  o.num_requests = 2;
  o.prompt_len = {40, 40};
  o.output_len = {12, 12};
  o.repetitive_prompts = true;
  o.repeat_segment = 8;
  o.baseline_requests = 0;
  o.compare_speculative = true;
  o.engine.speculative_method = "ngram";
  o.engine.num_speculative_tokens = 3;
  o.engine.kv_cache_memory = 4 << 20;
  const ServeBenchResult r = run_serve_bench(o);
  EXPECT_FALSE(r.baseline);
  EXPECT_EQ(r.main.output_tokens, 24);
  EXPECT_LE(r.main.spec_accepted, r.main.spec_proposed);
  EXPECT_LE(r.main.spec_proposed, 3 * r.main.spec_steps);
  ASSERT_TRUE(r.no_speculation);
  EXPECT_EQ(r.no_speculation->spec_steps, 0);
  EXPECT_EQ(r.no_speculation->output_tokens, 24);

  ServeBenchOptions bad = o;
  bad.output_len = {250, 250};  // 40 + 250 > 256
  EXPECT_THROW(run_serve_bench(bad), Error);
  bad = o;
  bad.baseline_requests = 3;
  EXPECT_THROW(run_serve_bench(bad), Error);
  bad = o;
  bad.engine.speculative_method = "draft";
  EXPECT_THROW(run_serve_bench(bad), Error);  // no --draft-model
}

}  // namespace
}  // namespace tessera::infer
