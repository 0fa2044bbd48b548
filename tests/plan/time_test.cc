// Time model against hand-computed cases: the 1F1B bubble, alpha-beta collectives, MFU and
// time to train, the failure allowance, the roofline, and which link a group spans.
#include <gtest/gtest.h>

#include <cmath>

#include "tessera/plan/comm_model.h"
#include "tessera/plan/search.h"

namespace tessera::plan {
namespace {

TEST(Time, OneF1BBubbleForTwoStagesAnd32MicroBatchesIsOneIn33) {
  const ModelSpec m = model_preset("llama2-7b");
  TrainSetup s;
  s.devices = 2, s.seq = 2048, s.global_batch = 32;
  Layout l;
  l.pp = 2;  // m = 32 micro-batches of 1
  const Hardware hw = hardware_preset("h100-80g");
  const StepTime t = estimate_step_time(m, hw, s, l);
  ASSERT_EQ(t.micro_batches, 32);
  const double pipeline = t.compute + t.tp_comm + t.cp_comm + t.ep_comm + t.bubble;
  EXPECT_NEAR(t.bubble / pipeline, 1.0 / 33, 1e-12);  // (pp-1)/(m+pp-1)
  // Interleaved with v = 2: (pp-1)/(v m + pp-1).
  l.pp = 4, l.vpp = 2, l.schedule = Schedule::kInterleaved;
  s.devices = 4;
  const StepTime ti = estimate_step_time(m, hw, s, l);
  const double pi = ti.compute + ti.tp_comm + ti.cp_comm + ti.ep_comm + ti.bubble;
  EXPECT_NEAR(ti.bubble / pi, 3.0 / (2 * 32 + 3), 1e-12);
}

TEST(Time, AlphaBetaCollectives) {
  Link link;
  link.latency = 5e-6;
  link.bandwidth = 100e9;
  const double n = 1e9;
  // Ring all-reduce on 8 ranks: 2 (p-1) alpha + 2 (p-1)/p n / beta.
  EXPECT_DOUBLE_EQ(ring_all_reduce_seconds(n, 8, link), 2 * 7 * 5e-6 + 2 * 7.0 / 8 * n / 100e9);
  // Tree: 2 log2(p) alpha + 2 n / beta; for 1 GB the ring wins, for 8 bytes on 1024 ranks the tree.
  EXPECT_DOUBLE_EQ(tree_all_reduce_seconds(n, 8, link), 2 * 3 * 5e-6 + 2 * n / 100e9);
  EXPECT_STREQ(collective_cost(Collective::kAllReduce, n, 8, link).algorithm, "ring");
  const CollectiveCost small = collective_cost(Collective::kAllReduce, 8, 1024, link);
  EXPECT_STREQ(small.algorithm, "tree");
  EXPECT_NEAR(small.seconds, 2 * 10 * 5e-6 + 16 / 100e9, 1e-15);
  // All-gather / reduce-scatter: (p-1) alpha + (p-1)/p n / beta; one rank costs nothing.
  EXPECT_DOUBLE_EQ(collective_cost(Collective::kAllGather, n, 4, link).seconds,
                   3 * 5e-6 + 0.75 * n / 100e9);
  EXPECT_EQ(collective_cost(Collective::kReduceScatter, n, 1, link).seconds, 0);
  EXPECT_DOUBLE_EQ(collective_cost(Collective::kSendRecv, n, 2, link).seconds, 5e-6 + n / 100e9);
}

TEST(Time, GroupsSpanTheLinkTheirRanksSit) {
  const Hardware hw = hardware_preset("h100-80g");  // 8 per node
  EXPECT_FALSE(group_link(hw, 8, 1).inter_node);   // TP = 8 inside a node
  EXPECT_TRUE(group_link(hw, 16, 1).inter_node);
  EXPECT_TRUE(group_link(hw, 2, 8).inter_node);    // DP across nodes after TP = 8
  EXPECT_FALSE(group_link(hw, 2, 4).inter_node);   // DP = 2 after TP = 4 fits in the node
  EXPECT_DOUBLE_EQ(group_link(hw, 2, 8).bandwidth, 50e9 * hw.link_efficiency);
}

// A device with flat rates and nothing but compute: time and MFU follow by hand.
Hardware flat_device() {
  Hardware h = hardware_preset("h100-80g");
  h.compute_efficiency = 0.5;
  h.memory_bandwidth = 1e30;  // elementwise and optimizer cost nothing; GEMMs compute-bound
  return h;
}

TEST(Time, MfuAndTimeToTrain) {
  const ModelSpec m = model_preset("llama2-7b");
  TrainSetup s;
  s.devices = 1, s.seq = 4096, s.global_batch = 8, s.tokens = 1e12;
  const Hardware hw = flat_device();
  const StepTime t = estimate_step_time(m, hw, s, Layout{});
  // GEMMs at half of peak; attention FLOPs counted non-causal in the model FLOPs (PaLM)
  // but executed causal, so MFU = 0.5 x model / (GEMM + causal attention) FLOPs.
  const double tokens = 8.0 * 4096;
  const double gemm = 6.0 * m.active_matmul_params() * tokens;
  const double attn_model = 6.0 * 32 * 4096 * 32 * 256 * tokens;  // 6 L s heads (dqk + dv)
  const double attn_run = attn_model / 2 * 3.5 / 3;  // causal half, backward 2.5x forward
  EXPECT_NEAR(t.total, (gemm + attn_run) / (989e12 * 0.5), 1e-9 * t.total);
  EXPECT_NEAR(t.mfu, 0.5 * (gemm + attn_model) / (gemm + attn_run), 1e-9);
  EXPECT_DOUBLE_EQ(model_flops_per_token(m, 4096), 6.0 * m.active_matmul_params() + attn_model / tokens);
  // Time to train on D tokens = D / tokens/s = 6 N D / (devices x peak x MFU) with N's
  // FLOPs per token including attention.
  const Evaluation ev = evaluate_layout(m, hw, s, Layout{});
  EXPECT_NEAR(ev.training.ideal_s, 1e12 / t.tokens_per_s, 1e-6 * ev.training.ideal_s);
  EXPECT_NEAR(ev.training.ideal_s, model_flops_per_token(m, 4096) * 1e12 / (989e12 * t.mfu),
              1e-6 * ev.training.ideal_s);
}

TEST(Time, FailureAllowance) {
  TrainSetup s;
  s.devices = 16384, s.seq = 1, s.global_batch = 1, s.tokens = 1;
  s.device_mtbf_hours = 50000, s.checkpoint_stall_s = 30, s.restart_s = 600;
  const TrainingTime t = estimate_training_time(s, 1.0 / 86400 / 30);  // 30 days ideal
  const double M = 50000 * 3600.0 / 16384;                           // 10,986 s
  const double tau = std::sqrt(2 * 30 * M);                          // Young: 812 s
  EXPECT_NEAR(t.job_mtbf_s, M, 1e-9);
  EXPECT_NEAR(t.checkpoint_interval_s, tau, 1e-9);
  const double wall = 30 * 86400 * (1 + 30 / tau) / (1 - (tau / 2 + 600) / M);
  EXPECT_NEAR(t.wall_s, wall, 1e-6 * wall);
  EXPECT_NEAR(t.expected_failures, wall / M, 1e-6);
  // Failures faster than a checkpoint interval: the run never ends.
  s.checkpoint_interval_s = 4 * M;
  EXPECT_TRUE(std::isinf(estimate_training_time(s, 1.0).wall_s));
}

TEST(Time, RooflineMakesThinGemmsMemoryBound) {
  const Hardware hw = hardware_preset("h100-80g");
  // One token against a 8192 x 8192 weight: 2 FLOP per 2-byte weight = 1 FLOP/byte.
  const double f = hw.gemm_flops("bf16", 1, 8192, 8192, 2);
  EXPECT_NEAR(f, 2.0 * 8192 * 8192 / (2.0 * (8192 + 8192 * 8192 + 8192)) * 3350e9 * 0.8, 1e3);
  EXPECT_DOUBLE_EQ(hw.gemm_flops("bf16", 8192, 8192, 8192, 2), 989e12 * hw.compute_efficiency);
  // A calibrated table is looked up at (k, sqrt(m n)), log-log between grid points, flat
  // past the large ends and falling with size below the small ones.
  Hardware c = hw;
  GemmTable t;
  t.k = {100, 400};
  t.mn = {100, 400};
  t.flops = {{1e11, 4e11}, {2e11, 8e11}};
  c.gemm["bf16"] = t;
  EXPECT_NEAR(c.gemm_flops("bf16", 400, 100, 100, 2), 2e11, 1e2);   // mn = 200: log midpoint
  EXPECT_NEAR(c.gemm_flops("bf16", 100, 100, 200, 2), std::sqrt(2.0) * 1e11, 1e2);
  EXPECT_NEAR(c.gemm_flops("bf16", 4000, 4000, 4000, 2), 8e11, 1e2);
  EXPECT_NEAR(c.gemm_flops("bf16", 50, 50, 100, 2), 0.5e11, 1e2);
}

TEST(Time, CommunicationTermsAppearWhereTheLayoutPutsThem) {
  const ModelSpec m = model_preset("llama2-70b");
  TrainSetup s;
  s.devices = 64, s.seq = 4096, s.global_batch = 256;
  const Hardware hw = hardware_preset("h100-80g");
  Layout l;
  l.dp = 2, l.tp = 8, l.pp = 4, l.zero = 1, l.sp = true, l.recompute = Recompute::kSelective;
  const StepTime t = estimate_step_time(m, hw, s, l);
  EXPECT_GT(t.tp_comm, 0);
  EXPECT_GT(t.pp_comm, 0);
  EXPECT_GT(t.bubble, 0);
  EXPECT_EQ(t.cp_comm, 0);
  EXPECT_EQ(t.ep_comm, 0);
  EXPECT_NEAR(t.total, t.compute + t.comm_exposed() + t.bubble + t.optimizer, 1e-12 * t.total);
  // TP across nodes costs more than inside one.
  Layout wide = l;
  wide.tp = 16, wide.pp = 2;
  EXPECT_GT(estimate_step_time(m, hw, s, wide).tp_comm / 2, t.tp_comm);
}

}  // namespace
}  // namespace tessera::plan
