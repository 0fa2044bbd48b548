// Memory model against hand-computed cases: mixed-precision Adam's 16 bytes per parameter,
// the ZeRO paper's per-stage formulas, Korthikanti et al.'s activation formulas (Table 2),
// pipeline in-flight micro-batches, offload.
#include <gtest/gtest.h>

#include "tessera/plan/memory.h"

namespace tessera::plan {
namespace {

// A device with memory to spare and no allowances, so totals are model states + activations.
Hardware big_device() {
  Hardware h = hardware_preset("h100-80g");
  h.memory_bytes = 1e15;
  h.reserved_bytes = 0;
  h.fragmentation = 0;
  return h;
}

TrainSetup setup(int64_t devices, int64_t seq = 2048, int64_t batch = 64) {
  TrainSetup s;
  s.devices = devices, s.seq = seq, s.global_batch = batch;
  return s;
}

TEST(Memory, SevenBillionWithMixedPrecisionAdamIs16BytesPerParam) {
  StateBytes b;  // bf16 weights and grads, fp32 master, AdamW moments
  EXPECT_DOUBLE_EQ(zero_bytes_per_param(0, 1, b), 16.0);
  EXPECT_DOUBLE_EQ(7e9 * zero_bytes_per_param(0, 1, b), 112e9);  // 112 GB on one device
  // The full estimate for a 7B model on one device: model states are exactly 16 x N.
  ParametricOptions o;
  o.params = 7e9;
  const ModelSpec m = parametric_model(o);
  const MemoryEstimate est = estimate_memory(m, big_device(), setup(1), Layout{});
  const StageMemory& p = est.peak();
  EXPECT_DOUBLE_EQ(p.weights + p.grads + p.master + p.moments, 16.0 * m.total_params());
  EXPECT_DOUBLE_EQ(p.weights, 2.0 * m.total_params());
  EXPECT_DOUBLE_EQ(p.moments, 8.0 * m.total_params());
}

TEST(Memory, ZeroStagesOnEightDevices) {
  StateBytes b;
  EXPECT_DOUBLE_EQ(zero_bytes_per_param(1, 8, b), 4 + 12.0 / 8);
  EXPECT_DOUBLE_EQ(zero_bytes_per_param(2, 8, b), 2 + 14.0 / 8);
  EXPECT_DOUBLE_EQ(zero_bytes_per_param(3, 8, b), 16.0 / 8);
  // Through the estimate: dp = 8, each stage.
  const ModelSpec m = model_preset("llama2-7b");
  const double P = static_cast<double>(m.total_params());
  const double want[] = {16, 4 + 12.0 / 8, 2 + 14.0 / 8, 16.0 / 8};
  for (int z = 0; z <= 3; ++z) {
    Layout l;
    l.dp = 8, l.zero = z;
    const StageMemory p = estimate_memory(m, big_device(), setup(8), l).peak();
    EXPECT_NEAR((p.weights + p.grads + p.master + p.moments) / P, want[z], 1e-12) << "zero " << z;
  }
  // Offload keeps master weights and moments (and a gradient copy) in host memory.
  Layout off;
  off.dp = 8, off.zero = 2, off.offload = true;
  const StageMemory p = estimate_memory(m, big_device(), setup(8), off).peak();
  EXPECT_EQ(p.master + p.moments, 0);
  EXPECT_NEAR(p.host / P, 12.0 / 8 + 2.0 / 8, 1e-12);
}

// GPT-3-shaped layer: MHA, GELU MLP of 4h, LayerNorm, dropout, no flash attention, 16-bit.
ModelSpec gpt_like() {
  ModelSpec m = model_preset("gpt3-175b");
  return m;
}

TEST(Memory, KorthikantiActivationFormulas) {
  const ModelSpec m = gpt_like();
  TrainSetup s = setup(8, 2048, 8);
  s.flash_attention = false;
  s.dropout = true;
  const double sq = 2048, b = 1, h = 12288, a = 96, t = 8;
  auto layer = [&](int tp, bool sp, Recompute rc) {
    Layout l;
    l.tp = tp, l.dp = 8 / tp, l.sp = sp, l.recompute = rc;
    const ActivationTerms at = layer_activation_terms(m, 0, s, l, 2.0);
    if (rc == Recompute::kNone) return at.total() - at.norm_stats;  // the paper omits these
    if (rc == Recompute::kSelective) return at.total() - at.norm_stats - at.attention_core;
    return layer_activation_bytes(m, 0, s, l, 2.0);
  };
  const double sbh = sq * b * h, score = 5 * a * sq / h;
  // Table 2 of Korthikanti et al. 2022, per layer.
  EXPECT_DOUBLE_EQ(layer(1, false, Recompute::kNone), sbh * (34 + score));
  EXPECT_DOUBLE_EQ(layer(8, false, Recompute::kNone), sbh * (10 + 24 / t + score / t));
  EXPECT_DOUBLE_EQ(layer(8, true, Recompute::kNone), sbh * (34 / t + score / t));
  EXPECT_DOUBLE_EQ(layer(8, false, Recompute::kSelective), sbh * (10 + 24 / t));
  EXPECT_DOUBLE_EQ(layer(8, true, Recompute::kSelective), sbh * 34 / t);
  EXPECT_DOUBLE_EQ(layer(1, false, Recompute::kFull), 2 * sbh);
  // layer_activation_bytes applies the same rule (selective drops the scores).
  Layout l;
  l.tp = 8, l.dp = 1, l.sp = true, l.recompute = Recompute::kSelective;
  const ActivationTerms at = layer_activation_terms(m, 0, s, l, 2.0);
  EXPECT_DOUBLE_EQ(layer_activation_bytes(m, 0, s, l, 2.0), sbh * 34 / t + at.norm_stats);
}

TEST(Memory, FlashAttentionStoresLogSumExpNotScores) {
  const ModelSpec m = model_preset("llama2-7b");
  TrainSetup s = setup(1, 4096, 1);
  Layout l;
  const ActivationTerms at = layer_activation_terms(m, 0, s, l, 2.0);
  EXPECT_DOUBLE_EQ(at.attention_core, 4.0 * 32 * 4096);  // f32 per head and token
  // Llama layer: 4 e T h (norm in/out x2) + QKV 3 e T h + attention out e T h + SwiGLU 3 e T f.
  const double T = 4096, h = 4096, f = 11008, e = 2;
  EXPECT_DOUBLE_EQ(at.total() - at.norm_stats - at.attention_core,
                   e * T * (4 * h + 3 * h + h + 3 * f));
  // Tessera's selective recomputation drops the attention output too.
  s.selective_keeps_attention_output = false;
  l.recompute = Recompute::kSelective;
  EXPECT_DOUBLE_EQ(layer_activation_bytes(m, 0, s, l, 2.0),
                   at.total() - at.attention_core - at.attention_out);
}

TEST(Memory, PipelineInFlightMicroBatches) {
  Layout l;
  l.pp = 4;
  EXPECT_DOUBLE_EQ(in_flight_micro_batches(l, 32, 0), 4);  // 1F1B: pp on the first stage
  EXPECT_DOUBLE_EQ(in_flight_micro_batches(l, 32, 3), 1);
  EXPECT_DOUBLE_EQ(in_flight_micro_batches(l, 2, 0), 2);   // fewer micro-batches than stages
  l.schedule = Schedule::kGPipe;
  EXPECT_DOUBLE_EQ(in_flight_micro_batches(l, 32, 3), 32);
  // Interleaved, v chunks: the first stage holds L (1 + (p-1)/(p v)) layers' worth,
  // Korthikanti et al. 2022 section 4.2.3, i.e. p (1 + (p-1)/(p v)) of its own L/p layers.
  l.schedule = Schedule::kInterleaved;
  l.vpp = 2;
  EXPECT_DOUBLE_EQ(in_flight_micro_batches(l, 32, 0), 4 * (1 + 3.0 / (4 * 2)));
  // Stage layers: 126 layers on 4 stages -> 31, 31, 32, 32.
  using Range = std::pair<int64_t, int64_t>;
  EXPECT_EQ(stage_layers(126, 4, 0), Range(0, 31));
  EXPECT_EQ(stage_layers(126, 4, 3), Range(94, 126));
}

TEST(Memory, TensorPipelineAndExpertSharding) {
  const ModelSpec m = model_preset("mixtral-8x7b");
  TrainSetup s = setup(64, 4096, 64);
  Layout l;
  l.dp = 8, l.tp = 2, l.pp = 4, l.ep = 8;
  const MemoryEstimate est = estimate_memory(m, big_device(), s, l);
  ASSERT_EQ(est.stages.size(), 4u);
  // Stage 1 (no embeddings, no head): 8 layers of attention/tp + norms + router, experts / (ep tp).
  const double layer = m.attention_params() / 2.0 + m.norm_params() + m.router_params() +
                       m.experts * m.expert_params() / 16.0;
  EXPECT_NEAR(est.stages[1].params, 8 * layer, 1e-3);
  EXPECT_NEAR(est.stages[0].params - est.stages[1].params, m.embedding_params() / 2.0, 1e-3);
}

}  // namespace
}  // namespace tessera::plan
