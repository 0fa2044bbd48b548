// The optimizer publishes the new weights in its own pass (update_weights with
// DataParallel::piece_copies): checked against the formula, weight = its master rounded
// to the compute precision and every native bf16 compute copy = that weight's bf16 bits,
// after each step, on one process and on 2 ranks under ZeRO 1 and 2 (whose copies of the
// other rank's part come from the gather), for native and emulated bf16 and fp16, AdamW
// and Muon; and the run follows the separate passes (in-place clip, step, publish_params)
// bit for bit.
#include <gtest/gtest.h>

#include <cstring>
#include <mutex>
#include <random>

#include <nlohmann/json.hpp>

#include "tessera/comm/communicator.h"
#include "tessera/kernels/packed_b.h"
#include "tessera/model/model.h"
#include "tessera/parallel/data_parallel.h"
#include "tessera/train/grad_utils.h"
#include "tessera/train/trainer_setup.h"

namespace tessera::train {
namespace {

struct Outcome {
  std::vector<std::vector<float>> masters;  // rank 0's pieces after the last step
  int checked_copies = 0;                   // compute-copy elements compared (rank 0)
  int checked_packed = 0;                   // packed copies compared (rank 0)
};

// A mixture-of-experts model (Mixtral-style: 4 experts, top-2) for the experts' stacked
// packed copies.
model::ModelConfig moe_config() {
  return model::ModelConfig::from_json(
      nlohmann::json::parse(R"({"model_type": "mixtral", "vocab_size": 64, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": false})"),
      "fused_update_test");
}

// Every packed copy the model keeps of `weight` equals its compute copy packed afresh.
int check_packed(model::Model& m, const Tensor& weight, const std::string& name, int step) {
  const auto targets = m.packed_targets_of(weight);
  if (!targets) return 0;
  const Tensor copy = m.compute_copy_of(weight);
  EXPECT_TRUE(copy.defined()) << name;
  if (!copy.defined()) return 0;
  const Tensor stacked = copy.view({static_cast<int64_t>(targets->fwd.size()), targets->rows, targets->cols});
  for (size_t i = 0; i < targets->fwd.size(); ++i)
    for (const kernels::PackedB* p : {targets->fwd[i], targets->dx[i]}) {
      kernels::PackedB want;
      kernels::pack_b(stacked.select(0, static_cast<int64_t>(i)), p->trans, want);
      EXPECT_EQ(std::memcmp(want.data.raw_data(), p->data.raw_data(), want.data.numel() * 2), 0)
          << name << " matrix " << i << (p->trans ? " forward" : " input-gradient") << " copy, step " << step;
    }
  return static_cast<int>(targets->fwd.size());
}

model::TokenBatch batch(const model::ModelConfig& c, int rank) {
  std::mt19937 rng(100 + rank);
  model::TokenBatch b{Tensor::empty({2, 16}, DType::kI32), Tensor::empty({2, 16}, DType::kI32), Tensor()};
  for (int64_t i = 0; i < 32; ++i) {
    b.ids.data<int32_t>()[i] = static_cast<int32_t>(rng() % c.vocab_size);
    b.targets.data<int32_t>()[i] = static_cast<int32_t>(rng() % c.vocab_size);
  }
  return b;
}

float rounded(float x, DType format) {
  return format == DType::kF16 ? f16_to_f32(f32_to_f16(x)) : bf16_to_f32(f32_to_bf16(x));
}

// Trains 3 steps and checks the formula after each (on every rank); `fused`: the
// trainer's update_weights, else the separate passes.
void train(comm::Communicator& comm, int stage, DType compute, model::Bf16Request mode, bool fused,
           Outcome& out, const std::string& optimizer = "adamw", bool packed = false, bool moe = false) {
  const model::ModelConfig c = moe ? moe_config() : model::ModelConfig::named_shape("tiny");
  model::Model m = model::Model::random(c, DType::kF32, 5);
  parallel::DataParallelConfig dc;
  dc.zero_stage = stage;
  dc.bucket_bytes = 20000;  // several buckets, so a shard boundary falls inside tensors
  dc.compute_dtype = compute;
  dc.bf16_request = mode;
  dc.packed_weights = packed;
  parallel::DataParallel dp(m, comm, dc);
  auto refs = dp_param_refs(dp, param_flags(m), optimizer);
  OptimizerConfig oc;
  oc.name = optimizer;
  oc.lr = 0.01;
  Optimizer opt(oc, refs);
  const bool native = m.bf16_mode() == model::Bf16Mode::kNative && compute == DType::kBF16;
  EXPECT_EQ(dp.optimizer_publishes(), true);
  EXPECT_EQ(dp.piece_copies().size(), dp.pieces().size());
  const std::function<double(double)> across = [&](double x) { return dp.sharded() ? dp.sum_over_ranks(x) : x; };
  for (int step = 0; step < 3; ++step) {
    accumulate_gradients(m, dp, 1, 1.f, [&](int64_t) { return batch(c, comm.rank()); });
    if (fused) {
      const GradClip clip = grad_clip(refs, 0.05, across);
      EXPECT_LT(clip.coef, 1.f);  // the clip is in play
      update_weights(opt, dp, 1.0, clip.coef);
    } else {
      clip_grad_norm(refs, 0.05, across);
      opt.step(1.0);
      dp.publish_params();
    }
    // Every piece of this rank's: the model's weight holds its master rounded.
    const auto views = m.weights().pieces(c, m.tp_shard());
    for (const auto& piece : dp.pieces()) {
      const auto* v = &views[0];
      for (const auto& w : views)
        if (w.name == piece.name) v = &w;
      ASSERT_EQ(v->name, piece.name);
      ASSERT_TRUE(v->view.is_contiguous());
      const float* weight = v->view.data<float>() + piece.offset;
      const float* master = piece.master.data<float>();
      for (int64_t i = 0; i < piece.master.numel(); ++i)
        ASSERT_EQ(weight[i], rounded(master[i], compute)) << piece.name << " element " << piece.offset + i
                                                         << " step " << step << " rank " << comm.rank();
    }
    // Every matmul weight's compute copy (native bf16): the weight's bf16 bits, the parts
    // other ranks updated included.
    for (int u = 0; u < m.num_units(); ++u)
      for (const auto& [name, t] : m.weights().unit_tensors(c, u)) {
        const Tensor copy = m.compute_copy_of(*t);
        if (!copy.defined()) continue;
        EXPECT_TRUE(native) << name;
        ASSERT_EQ(copy.numel(), t->numel());
        const float* w = t->data<float>();
        const auto* b = reinterpret_cast<const uint16_t*>(copy.data<bf16>());
        for (int64_t i = 0; i < t->numel(); ++i)
          ASSERT_EQ(b[i], f32_to_bf16(w[i])) << name << " element " << i << " step " << step;
        if (comm.rank() == 0) out.checked_copies += static_cast<int>(t->numel());
        const int packs = check_packed(m, *t, name, step);
        if (comm.rank() == 0) out.checked_packed += packs;
      }
  }
  for (const auto& piece : dp.pieces())
    out.masters.push_back(piece.master.to_f32_vector());
}

Outcome run(int ranks, int stage, DType compute, model::Bf16Request mode, bool fused,
            const std::string& optimizer = "adamw", bool packed = false, bool moe = false) {
  Outcome r0;
  std::mutex mu;
  comm::run_local(ranks, [&](comm::Communicator& comm) {
    Outcome r;
    train(comm, stage, compute, mode, fused, r, optimizer, packed, moe);
    std::lock_guard<std::mutex> lock(mu);
    if (comm.rank() == 0) r0 = std::move(r);
  });
  return r0;
}

TEST(FusedUpdate, Bf16WeightsAndCopiesAreTheRoundedMastersOnEveryStage) {
  for (const auto& [ranks, stage] : {std::pair{1, 0}, std::pair{2, 0}, std::pair{2, 1}, std::pair{2, 2}}) {
    SCOPED_TRACE("ranks " + std::to_string(ranks) + " stage " + std::to_string(stage));
    const Outcome fused = run(ranks, stage, DType::kBF16, model::Bf16Request::kNative, true);
    EXPECT_GT(fused.checked_copies, 0);  // native bf16 keeps copies on every machine
    // The separate passes reach the same masters bit for bit.
    const Outcome separate = run(ranks, stage, DType::kBF16, model::Bf16Request::kNative, false);
    ASSERT_EQ(fused.masters.size(), separate.masters.size());
    for (size_t i = 0; i < fused.masters.size(); ++i)
      ASSERT_EQ(std::memcmp(fused.masters[i].data(), separate.masters[i].data(), fused.masters[i].size() * 4), 0)
          << "piece " << i;
  }
}

// Muon's matrices are updated outside the AdamW pass: their copies come from write_copies.
TEST(FusedUpdate, Bf16MuonWeightsAndCopiesAreTheRoundedMasters) {
  const Outcome fused = run(1, 0, DType::kBF16, model::Bf16Request::kNative, true, "muon");
  EXPECT_GT(fused.checked_copies, 0);
  const Outcome separate = run(1, 0, DType::kBF16, model::Bf16Request::kNative, false, "muon");
  ASSERT_EQ(fused.masters, separate.masters);
}

TEST(FusedUpdate, EmulatedBf16AndFp16WeightsAreTheRoundedMasters) {
  for (DType compute : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(compute));
    const Outcome fused = run(2, 1, compute, model::Bf16Request::kEmulated, true);
    EXPECT_EQ(fused.checked_copies, 0);  // emulated modes keep no copies
    const Outcome separate = run(2, 1, compute, model::Bf16Request::kEmulated, false);
    ASSERT_EQ(fused.masters, separate.masters);
  }
}

// Weights kept packed (DataParallelConfig::packed_weights): the optimizer's pass writes
// them (chunked on whole groups of rows; ZeRO 1 and 2 shards start mid-row and their
// gathered parts are packed after the gather), Muon's and the experts' stacked copies too.
// Every packed copy equals its compute copy packed afresh after each step, and the run
// equals the plain weights' bit for bit: a packed product is the plain one's (these
// products have 32 rows, which oneDNN multiplies natively either way).
TEST(FusedUpdate, PackedWeightsFollowTheCopiesAndTheRunIsUnchanged) {
  if (!kernels::packed_products_supported()) GTEST_SKIP() << "packed products need AVX512-BF16 or AMX";
  struct Case {
    int ranks, stage;
    const char* optimizer;
    bool moe;
  };
  for (const Case k : {Case{1, 0, "adamw", false}, Case{2, 1, "adamw", false}, Case{2, 2, "adamw", false},
                       Case{1, 0, "muon", false}, Case{1, 0, "adamw", true}, Case{2, 2, "adamw", true}}) {
    SCOPED_TRACE(std::string("ranks ") + std::to_string(k.ranks) + " stage " + std::to_string(k.stage) + " " +
                 k.optimizer + (k.moe ? " moe" : ""));
    const Outcome packed = run(k.ranks, k.stage, DType::kBF16, model::Bf16Request::kNative, true, k.optimizer, true, k.moe);
    EXPECT_GT(packed.checked_packed, 0);
    const Outcome plain = run(k.ranks, k.stage, DType::kBF16, model::Bf16Request::kNative, true, k.optimizer, false, k.moe);
    EXPECT_EQ(plain.checked_packed, 0);
    ASSERT_EQ(packed.masters, plain.masters);
  }
}

}  // namespace
}  // namespace tessera::train
