// Context parallelism by equivalence. The layer: ring and Ulysses attention over cp = 2
// and 4 local ranks give each rank the whole-sequence causal attention's outputs and
// q / k / v gradients for its tokens (grouped-query heads), with the transfers' bytes
// the analytic count. The trainer: a 4096-token sequence trained with cp2 and cp4 (ring
// and Ulysses) gives the single process's losses and gradient norms within 1e-5, and each
// rank's saved activations shrink with cp.
#include <cstdio>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <mutex>
#include <random>

#include "tessera/comm/communicator.h"
#include "tessera/kernels/attention.h"
#include "tessera/model/context_parallel.h"
#include "tessera/parallel/context_parallel.h"
#include "test_util/tensor_diff.h"
#include "train/trainer_test_util.h"

namespace tessera::parallel {
namespace {

using tessera::testing::max_rel_diff;

Tensor randn(const Shape& shape, uint32_t seed) {
  std::mt19937 rng(seed);
  return tessera::testing::random_normal(shape, rng, 1.f);
}

// Rows `pos` (global token positions, in this rank's order) of x (B, T, H, D).
Tensor take_tokens(const Tensor& x, const std::vector<int64_t>& pos) {
  Tensor out = Tensor::empty({x.size(0), static_cast<int64_t>(pos.size()), x.size(2), x.size(3)}, DType::kF32);
  for (size_t i = 0; i < pos.size(); ++i)
    out.slice(1, static_cast<int64_t>(i), static_cast<int64_t>(i) + 1).copy_from(x.slice(1, pos[i], pos[i] + 1));
  return out;
}

TEST(ContextParallel, RingAndUlyssesAttentionEqualTheWholeSequence) {
  const int64_t B = 2, T = 96, Hq = 8, Hk = 4, D = 16;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const Tensor q = randn({B, T, Hq, D}, 1), k = randn({B, T, Hk, D}, 2), v = randn({B, T, Hk, D}, 3);
  const Tensor dout = randn({B, T, Hq, D}, 4);
  Tensor out = Tensor::empty({B, T, Hq, D}, DType::kF32), lse = Tensor::empty({B, Hq, T}, DType::kF32);
  kernels::AttentionParams p;
  p.scale = scale;
  kernels::attention_forward(q, k, v, out, &lse, p);
  Tensor dq = Tensor::empty(q.shape(), DType::kF32), dk = Tensor::empty(k.shape(), DType::kF32),
         dv = Tensor::empty(v.shape(), DType::kF32);
  kernels::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, p);
  for (auto method : {model::CpMethod::kRing, model::CpMethod::kUlysses})
    for (int P : {2, 4}) {
      SCOPED_TRACE(std::string(model::cp_method_name(method)) + " cp " + std::to_string(P));
      std::mutex mu;
      int64_t bytes = 0;
      comm::run_local(P, [&](comm::Communicator& c) {
        CommCp cp(c);
        const int64_t Tl = T / P;
        const auto pos = model::cp_positions(method, c.rank(), P, Tl);
        const Tensor ql = take_tokens(q, pos), kl = take_tokens(k, pos), vl = take_tokens(v, pos);
        Tensor o = Tensor::empty({B, Tl, Hq, D}, DType::kF32), l;
        model::CpSaved saved;
        model::cp_attention_forward(cp, method, ql, kl, vl, o, l, saved, scale);
        EXPECT_LT(max_rel_diff(o, take_tokens(out, pos)), 1e-5f) << "rank " << c.rank();
        Tensor gq = Tensor::empty(ql.shape(), DType::kF32), gk = Tensor::empty(kl.shape(), DType::kF32),
               gv = Tensor::empty(vl.shape(), DType::kF32);
        model::cp_attention_backward(cp, method, ql, kl, vl, o, l, saved, take_tokens(dout, pos), gq, gk, gv, scale);
        EXPECT_LT(max_rel_diff(gq, take_tokens(dq, pos)), 1e-5f) << "rank " << c.rank();
        EXPECT_LT(max_rel_diff(gk, take_tokens(dk, pos)), 1e-5f) << "rank " << c.rank();
        EXPECT_LT(max_rel_diff(gv, take_tokens(dv, pos)), 1e-5f) << "rank " << c.rank();
        std::lock_guard<std::mutex> lock(mu);
        bytes += cp.bytes_sent;
      });
      // Per rank, f32: ring forward passes its k and v blocks P - 1 times, backward the
      // blocks P - 1 times and their dK / dV P times; Ulysses sends (P - 1) / P of its q,
      // k, v and out forward, of dout, out, dq, dk, dv backward.
      const int64_t local_kv = 2 * B * (T / P) * Hk * D * 4, local_q = B * (T / P) * Hq * D * 4;
      const int64_t want = method == model::CpMethod::kRing
                               ? P * ((P - 1) * local_kv + (P - 1) * local_kv + P * local_kv)
                               : P * (P - 1) * (2 * (local_q + local_kv + local_q) + local_q) / P;
      EXPECT_EQ(bytes, want);
    }
}

TEST(ContextParallel, BadSplitsAreOneLineErrors) {
  EXPECT_THROW(model::cp_local_tokens(Tensor::zeros({1, 10}, DType::kI32), model::CpMethod::kRing, 0, 2), Error);
  EXPECT_THROW(model::parse_cp_method("zigzag", "run.toml"), Error);
}

namespace tt = tessera::train;
namespace fs = std::filesystem;

std::string cp_config(const std::string& root, const std::string& name, const std::string& data,
                      const std::string& parallel, int64_t seq, int64_t steps = 3) {
  std::string c = tt::base_config(root + "/" + name, data, steps, "[parallel]\n" + parallel + "\n") +
                  "[optimizer]\nlr = 0.003\n";
  for (const auto& [key, val] :
       {std::pair<std::string, std::string>{"seq_len = 32\n", "seq_len = " + std::to_string(seq) + "\n"},
        std::pair<std::string, std::string>{"batch_size = 4\n", "batch_size = 1\n"},
        std::pair<std::string, std::string>{"seed = 3\n", "seed = 3\nnum_heads = 4\nnum_kv_heads = 4\n"
                                                          "max_position_embeddings = 16384\n"}})
    c.replace(c.find(key), key.size(), val);
  return c;
}

// cp2 and cp4, ring and Ulysses, on 4096-token sequences over 20 steps; ring cp4 and
// Ulysses cp2 on 16384 over 4 (a 16k step of the three runs takes about 9 s here: 20 of
// them would be three minutes of the suite).
TEST(ContextParallel, TrainerMatchesOneProcessOn4kAnd16kSequences) {
  const std::string root = tt::temp_dir("cp_train");
  const std::string data = tt::make_data(root, 200000);
  for (const int64_t T : {4096, 16384}) {
  const int64_t steps = T > 4096 ? 4 : 20;
  const tt::RunOut ref = tt::train(cp_config(root, "single" + std::to_string(T), data, "", T, steps), 0);
  ASSERT_EQ(ref.losses.size(), static_cast<size_t>(steps));
  const double act1 = ref.records.at(0).at("mem_activations").get<double>();
  for (const std::string method : {"ring", "ulysses"})
    for (int P : {2, 4}) {
      if (T > 4096 && (method == "ring") != (P == 4)) continue;
      const std::string name = method + std::to_string(P) + "_" + std::to_string(T);
      SCOPED_TRACE(name);
      const tt::RunOut got =
          tt::train(cp_config(root, name, data, "cp = " + std::to_string(P) + "\ncp_method = \"" + method + "\"", T,
                              steps), P);
      tt::expect_close(got.losses, ref.losses, 1e-5, name + " loss");
      tt::expect_close(got.grad_norms, ref.grad_norms, 1e-5, name + " grad norm");
      EXPECT_NEAR(got.val_loss, ref.val_loss, 1e-5 * ref.val_loss);
      const auto& rec = got.records.at(0);
      EXPECT_EQ(rec.at("cp_method").get<std::string>(), method);
      EXPECT_GT(rec.at("cp_comm_bytes").get<double>(), 0);
      // Each rank saves its 1/P of the activations (Ulysses: its heads' whole-sequence q, k,
      // v in place of its own tokens', the same bytes).
      const double ratio = rec.at("mem_activations").get<double>() / act1;
      std::printf("%s: mem_activations %.0f bytes, %.4f of one process's (x cp = %.3f)\n", name.c_str(),
                  rec.at("mem_activations").get<double>(), ratio, ratio * P);
      EXPECT_LT(ratio, 1.1 / P) << ratio;
      EXPECT_GT(ratio, 0.9 / P) << ratio;
    }
  }
  fs::remove_all(root);  // (checkpoints and data: leave nothing in /tmp)
}

// cp composes with tp (Ulysses splits each rank's tp heads further; the ring passes each
// rank's tp blocks) and with dp under ZeRO: cp2 x tp2 and dp2 x cp2 (ZeRO-1, ZeRO-3) on 4
// ranks.
TEST(ContextParallel, ComposesWithTensorAndDataParallelism) {
  const std::string root = tt::temp_dir("cp_compose");
  const std::string data = tt::make_data(root, 60000);
  const int64_t T = 1024;
  auto with_batch2 = [](std::string c) {
    const std::string key = "batch_size = 1\n";
    return c.replace(c.find(key), key.size(), "batch_size = 2\n");
  };
  const tt::RunOut ref = tt::train(with_batch2(cp_config(root, "single", data, "", T)), 0);
  for (const auto& [name, parallel] :
       {std::pair<std::string, std::string>{"cp2_tp2_ring", "cp = 2\ntp = 2"},
        std::pair<std::string, std::string>{"cp2_tp2_ulysses", "cp = 2\ntp = 2\ncp_method = \"ulysses\""},
        std::pair<std::string, std::string>{"dp2_cp2_z1", "cp = 2\ndp = 2\nzero_stage = 1"},
        std::pair<std::string, std::string>{"dp2_cp2_z3", "cp = 2\ndp = 2\nzero_stage = 3"}}) {
    const tt::RunOut got = tt::train(with_batch2(cp_config(root, name, data, parallel, T)), 4);
    tt::expect_close(got.losses, ref.losses, 1e-5, name + " loss");
    tt::expect_close(got.grad_norms, ref.grad_norms, 1e-5, name + " grad norm");
    EXPECT_NEAR(got.val_loss, ref.val_loss, 1e-5 * ref.val_loss) << name;
  }
  fs::remove_all(root);  // (checkpoints and data: leave nothing in /tmp)
}

// cp composes with pipeline stages (each stage's ranks of a cp group pass their own
// tokens' activations; RoPE at the global positions on every stage) and with expert
// parallelism (a Mixtral model: the experts' gradients reduced over the ranks of dp x cp
// holding them): pp2 x cp2 and ep2 x cp2 on 4 ranks match one process.
TEST(ContextParallel, ComposesWithPipelineAndExpertParallelism) {
  const std::string root = tt::temp_dir("cp_pp_ep");
  const std::string data = tt::make_data(root, 60000);
  const int64_t T = 512;
  auto with = [](std::string c, const std::string& key, const std::string& val) {
    return c.replace(c.find(key), key.size(), val);
  };
  {
    auto cfg = [&](const std::string& name, const std::string& parallel) {
      return with(cp_config(root, name, data, parallel, T), "batch_size = 1\n", "batch_size = 1\ngrad_accum = 2\n");
    };
    const tt::RunOut ref = tt::train(cfg("single", ""), 0);
    const tt::RunOut got = tt::train(cfg("pp2_cp2", "cp = 2\npp = 2"), 4);
    tt::expect_close(got.losses, ref.losses, 1e-5, "pp2 x cp2 loss");
    tt::expect_close(got.grad_norms, ref.grad_norms, 1e-5, "pp2 x cp2 grad norm");
  }
  {
    const std::string json = root + "/mixtral.json";
    std::ofstream(json) << R"({"model_type": "mixtral", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "max_position_embeddings": 1024, "num_local_experts": 4, "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false})";
    auto cfg = [&](const std::string& name, const std::string& parallel) {
      std::string c = with(cp_config(root, name, data, parallel, T), "batch_size = 1\n", "batch_size = 2\n");
      return with(c, "shape = \"tiny\"\n", "config = \"" + json + "\"\n");
    };
    const tt::RunOut ref = tt::train(cfg("moe_single", ""), 0);
    const tt::RunOut got = tt::train(cfg("ep2_cp2", "cp = 2\nep = 2\nzero_stage = 1"), 4);
    tt::expect_close(got.losses, ref.losses, 1e-5, "ep2 x cp2 loss");
    tt::expect_close(got.grad_norms, ref.grad_norms, 1e-5, "ep2 x cp2 grad norm");
    EXPECT_NEAR(got.val_loss, ref.val_loss, 1e-5 * ref.val_loss);
  }
  fs::remove_all(root);  // (checkpoints and data: leave nothing in /tmp)
}

// Mixed precision (bf16 products, fp32 masters), native and emulated: cp2 with ring and
// Ulysses attention trains a 1k-token sequence to the single process's losses within 1e-3.
TEST(ContextParallel, TrainsInBf16LikeOneProcess) {
  const std::string root = tt::temp_dir("cp_bf16");
  const std::string data = tt::make_data(root, 20000);
  for (const std::string mode : {"native", "emulated"}) {
    SCOPED_TRACE(mode);
    const auto cfg = [&](const std::string& name, const std::string& parallel) {
      std::string c = cp_config(root, name + "_" + mode, data, parallel, 1024, 5);
      const std::string key = "precision = \"fp32\"";
      return c.replace(c.find(key), key.size(), "precision = \"bf16\"\nbf16_mode = \"" + mode + "\"");
    };
    const tt::RunOut ref = tt::train(cfg("single", ""), 0);
    ASSERT_EQ(ref.losses.size(), 5u);
    for (const std::string method : {"ring", "ulysses"}) {
      const tt::RunOut got = tt::train(cfg(method, "cp = 2\ncp_method = \"" + method + "\""), 2);
      tt::expect_close(got.losses, ref.losses, 1e-3, method + " cp2 loss");
    }
  }
  fs::remove_all(root);  // (checkpoints and data: leave nothing in /tmp)
}

// A sequence whose activations do not fit one rank's [training] memory_limit_mb stops with
// one line naming the parts; with cp4 each rank holds a quarter of them and it trains.
TEST(ContextParallel, ASequenceOverOneRanksMemoryLimitTrainsWithCp) {
  const std::string root = tt::temp_dir("cp_memory");
  const std::string data = tt::make_data(root, 60000);
  const int64_t T = 4096;
  const tt::RunOut free = tt::train(cp_config(root, "free", data, "", T), 0);
  const auto& r = free.records.at(0);
  const double mb = 1024.0 * 1024.0;
  const double states = (r.at("mem_params").get<double>() + r.at("mem_grads").get<double>() +
                         r.at("mem_optimizer").get<double>()) / mb;
  const double acts = r.at("mem_activations").get<double>() / mb;
  ASSERT_GT(acts, states);  // the sequence's activations dominate
  const double limit = states + 0.5 * acts;
  auto with_limit = [&](const std::string& name, const std::string& parallel) {
    std::string c = cp_config(root, name, data, parallel, T);
    const std::string key = "precision = \"fp32\"\n";
    return c.replace(c.find(key), key.size(), key + "memory_limit_mb = " + std::to_string(limit) + "\n");
  };
  try {
    tt::train(with_limit("one", ""), 0);
    ADD_FAILURE() << "one rank fit under " << limit << " MiB";
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("need more than [training] memory_limit_mb"), std::string::npos) << msg;
    EXPECT_NE(msg.find("activations"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  const tt::RunOut cp4 = tt::train(with_limit("cp4", "cp = 4"), 4);
  tt::expect_close(cp4.losses, free.losses, 1e-5, "cp4 under the limit");
  fs::remove_all(root);  // (checkpoints and data: leave nothing in /tmp)
}

TEST(ContextParallel, TrainerRefusesLayoutsItCannotRun) {
  const std::string root = tt::temp_dir("cp_bad");
  const std::string data = tt::make_data(root);
  auto fails = [&](const std::string& parallel, int ranks, int64_t seq, const std::string& needle) {
    try {
      tt::train(cp_config(root, "bad", data, parallel, seq), ranks);
      ADD_FAILURE() << parallel << ": no error";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  fails("cp = 2", 2, 62, "data.seq_len = 62 does not split in 4 equal chunks");
  fails("cp = 8\ncp_method = \"ulysses\"", 8, 64, "needs the 4 query and 4 key/value heads");
  fails("cp = 2\ncp_method = \"zigzag\"", 2, 64, "cp_method");
  fs::remove_all(root);  // (checkpoints and data: leave nothing in /tmp)
}

}  // namespace
}  // namespace tessera::parallel
