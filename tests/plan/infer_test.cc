// Serving model against hand-computed cases: Llama-2-70B's KV cache (327,680 bytes per
// token in fp16, 1.25 GiB per 4,096-token request), quantization, TP, MLA, concurrency,
// the decode bandwidth bound and the prefill compute bound.
#include <gtest/gtest.h>

#include <cmath>

#include "tessera/base/error.h"
#include "tessera/plan/infer.h"

namespace tessera::plan {
namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;

TEST(Infer, Llama2_70bKvCache) {
  const ModelSpec m = model_preset("llama2-70b");
  EXPECT_DOUBLE_EQ(kv_bytes_per_token(m, "fp16"), 327680);  // 2 x 80 x 8 x 128 x 2
  EXPECT_DOUBLE_EQ(kv_bytes_per_token(m, "bf16") * 4096, 1.25 * kGiB);
  EXPECT_DOUBLE_EQ(kv_bytes_per_token(m, "fp8"), 163840);
  EXPECT_DOUBLE_EQ(kv_bytes_per_token(m, "int8"), 163840 + 2 * 80 * 8 * 2);  // + fp16 scale per head
  // DeepSeek-V3 caches the 512 + 64 latent per layer: 61 x 576 x 2 bytes.
  EXPECT_DOUBLE_EQ(kv_bytes_per_token(model_preset("deepseek-v3"), "bf16"), 61 * 576 * 2);
}

TEST(Infer, ConcurrencyDecodeAndPrefillByHand) {
  const ModelSpec m = model_preset("llama2-70b");
  const Hardware hw = hardware_preset("h100-80g");
  InferSetup s;
  s.context = 4096;
  const InferEvaluation ev = evaluate_inference(m, hw, s, 1, "int4", "bf16");
  // Weights: the layers' matrices at 4 bits + an fp16 scale per 128, the rest 16-bit.
  const double outside = 2.0 * 32000 * 8192, norms = 80.0 * 2 * 8192 + 8192;
  const double mats = 68976648192.0 - outside - norms;
  const double weights = mats * (0.5 + 2.0 / 128) + 2 * outside + 2 * norms;
  EXPECT_NEAR(ev.weight_bytes, weights, 1.0);
  const double workspace = 2.0 * 8192 * (4 * 8192 + (8192 + 1024 + 1024) + 3 * 28672) +
                           4.0 * 256 * 32000;
  EXPECT_NEAR(ev.workspace_bytes, workspace, 1.0);
  const double budget = hw.memory_bytes * 0.9 - weights - workspace;
  EXPECT_EQ(ev.max_concurrency, static_cast<int64_t>(std::floor(budget / (1.25 * kGiB))));
  EXPECT_GE(ev.max_concurrency, 20);
  // One request: memory-bound, weights + its KV read once per token.
  const double bw = 3350e9 * 0.8;
  EXPECT_TRUE(ev.decode_memory_bound);
  EXPECT_NEAR(ev.decode_step_single_s, (weights + 4096 * 327680.0) / bw, 1e-9);
  // Prefill of 4,096 tokens: compute-bound, 2 N P + P^2 L heads (d_qk + d_v) FLOPs.
  const double flops = 2.0 * m.active_matmul_params() * 4096 + 4096.0 * 4096 * 80 * 64 * 256;
  EXPECT_TRUE(ev.prefill_compute_bound);
  EXPECT_NEAR(ev.ttft_s, flops / (989e12 * hw.compute_efficiency), 1e-9);
  // bf16 weights (138 GB) do not fit one 80 GB card at all.
  EXPECT_FALSE(evaluate_inference(m, hw, s, 1, "bf16", "bf16").fits());
}

TEST(Infer, TensorParallelismSplitsWeightsAndKvHeads) {
  const ModelSpec m = model_preset("llama2-70b");
  const Hardware hw = hardware_preset("h100-80g");
  InferSetup s;
  s.context = 4096;
  const InferEvaluation one = evaluate_inference(m, hw, s, 2, "bf16", "bf16");
  const InferEvaluation eight = evaluate_inference(m, hw, s, 8, "bf16", "bf16");
  EXPECT_DOUBLE_EQ(one.kv_bytes_per_token_device, 327680.0 / 2);
  EXPECT_DOUBLE_EQ(eight.kv_bytes_per_token_device, 327680.0 / 8);  // one KV head per device
  EXPECT_NEAR(eight.weight_bytes * 8, one.weight_bytes * 2, 0.001 * one.weight_bytes);
  EXPECT_GT(eight.max_concurrency, one.max_concurrency);
  EXPECT_LT(eight.ttft_s, one.ttft_s);
  // fp8 KV halves the cache: about twice the requests.
  const InferEvaluation fp8 = evaluate_inference(m, hw, s, 8, "bf16", "fp8");
  EXPECT_NEAR(static_cast<double>(fp8.max_concurrency) / eight.max_concurrency, 2.0, 0.05);
}

TEST(Infer, SearchRanksFittingConfigurations) {
  const ModelSpec m = model_preset("llama2-70b");
  const Hardware hw = hardware_preset("h100-80g");
  InferSetup s;
  s.context = 4096;
  const InferSearchResult r = search_inference(m, hw, s);
  ASSERT_FALSE(r.ranked.empty());
  EXPECT_EQ(r.ranked.size() + r.rejected.size(), 4u * 3 * 3);  // tp 1 2 4 8, 3 weights, 3 KV
  for (size_t i = 0; i < r.ranked.size(); ++i) {
    EXPECT_TRUE(r.ranked[i].fits());
    if (i) {
      EXPECT_GE(r.ranked[i - 1].decode_tokens_per_s_per_device,
                r.ranked[i].decode_tokens_per_s_per_device);
    }
  }
  for (const auto& ev : r.rejected) EXPECT_FALSE(ev.fits());
  InferSetup bad = s;
  bad.tp = 3;
  EXPECT_THROW(search_inference(m, hw, bad), Error);
}

}  // namespace
}  // namespace tessera::plan
