// `tessera train` under tensor parallelism, by equivalence with one process (torchtitan
// style): tp2 and dp2 x tp2 (local backend) with ZeRO 0-2, gradient accumulation and
// clipping train to the single-process losses and gradient norms over 20 steps, for llama
// and for gpt2 (fused c_attn column blocks), with AdamW and with Muon (whole matrices
// orthogonalised over the tp group); a checkpoint resumes on the same curve under another
// tp, dp and ZeRO stage; the saved model is the whole model; layouts the trainer cannot
// run are one line naming the key.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>

#include "tessera/base/error.h"
#include "tessera/model/model.h"
#include "train/trainer_test_util.h"

namespace tessera::train {
namespace {

std::string config(const std::string& root, const std::string& name, const std::string& data,
                   int64_t steps, const std::string& parallel) {
  // Accumulation and clipping (the norm is above 0.5 in the first steps) on; checkpoints
  // every 5 steps, written asynchronously.
  std::string cfg = base_config(root + "/" + name, data, steps, "[parallel]\n" + parallel + "\n") +
                    "[optimizer]\nlr = 0.003\n[checkpoint]\nevery = 5\nasync = true\n";
  const std::string key = "batch_size = 4\n";
  cfg.replace(cfg.find(key), key.size(), "batch_size = 4\ngrad_accum = 2\n");
  cfg.replace(cfg.find("[training]\n"), 11, "[training]\nmax_grad_norm = 0.5\n");
  return cfg;
}

TEST(TensorParallelTraining, Tp2AndDp2xTp2MatchOneProcessOver20Steps) {
  const std::string root = temp_dir("tp_train");
  const std::string data = make_data(root);
  const RunOut ref = train(config(root, "single", data, 20, "zero_stage = 0"), 0);
  ASSERT_EQ(ref.losses.size(), 20u);
  const struct {
    const char* name;
    const char* parallel;
    int ranks;
  } cases[] = {{"tp2", "tp = 2", 2},
               {"tp4_kv_replicated", "tp = 4", 4},  // 2 kv heads: each on 2 ranks
               {"dp2tp2_z1", "tp = 2\ndp = 2\nzero_stage = 1", 4},
               {"dp2tp2_z2", "tp = 2\nzero_stage = 2", 4},
               {"dp2tp2_z3", "tp = 2\nzero_stage = 3", 4},
               {"dp2tp2_z3_sp", "tp = 2\nzero_stage = 3\nsequence_parallel = true", 4},
               {"dp2tp2_sp", "tp = 2\ndp = 2\nsequence_parallel = true\nzero_stage = 1", 4},
               {"tp4_sp", "tp = 4\nsequence_parallel = true", 4},
               {"dp2tp2_sp_overlap", "tp = 2\ndp = 2\nsequence_parallel = true\nsp_overlap = true\nzero_stage = 1", 4}};
  for (const auto& k : cases) {
    const RunOut got = train(config(root, k.name, data, 20, k.parallel), k.ranks);
    expect_close(got.losses, ref.losses, 1e-5, std::string(k.name) + " loss");
    expect_close(got.grad_norms, ref.grad_norms, 1e-5, std::string(k.name) + " grad norm");
  }
  // The model written at the end is the whole model, the one process's within fp32
  // rounding of 20 steps.
  const auto a = model::Model::load(root + "/single/model");
  const auto b = model::Model::load(root + "/dp2tp2_z1/model");
  std::map<std::string, Tensor> want;
  for (auto& [name, t] : a.weights().named(a.config())) want.emplace(name, t);
  for (auto& [name, t] : b.weights().named(b.config())) {
    const Tensor& w = want.at(name);
    double num = 0, den = 0;
    for (int64_t i = 0; i < t.numel(); ++i) {
      num = std::max(num, static_cast<double>(std::abs(t.data<float>()[i] - w.data<float>()[i])));
      den = std::max(den, static_cast<double>(std::abs(w.data<float>()[i])));
    }
    EXPECT_LT(num, 1e-4 * den) << name;
  }
}

struct Layout {
  const char* name;
  const char* parallel;
  int ranks;
};
using MakeConfig = std::function<std::string(const std::string& name, const std::string& parallel)>;

// Each layout's run of make(name, parallel) follows ref's loss and gradient norm within 1e-5.
void expect_layouts_match(const RunOut& ref, const std::vector<Layout>& layouts, const MakeConfig& make) {
  for (const Layout& k : layouts) {
    const RunOut got = train(make(k.name, k.parallel), k.ranks);
    expect_close(got.losses, ref.losses, 1e-5, std::string(k.name) + " loss");
    expect_close(got.grad_norms, ref.grad_norms, 1e-5, std::string(k.name) + " grad norm");
  }
}

// make(name, first) stopped after 5 steps, resumed as make(name, then): ref's steps 6 on.
void expect_resume_matches(const RunOut& ref, const std::string& name, const std::string& first,
                           int first_ranks, const std::string& then, int then_ranks,
                           const MakeConfig& make) {
  TrainOptions stop;
  stop.stop_after = 5;
  train(make(name, first), first_ranks, stop);
  TrainOptions resume;
  resume.resume = true;
  const RunOut got = train(make(name, then), then_ranks, resume);
  expect_close(got.losses, {ref.losses.begin() + 5, ref.losses.end()}, 1e-5, name + " resumed");
}

TEST(TensorParallelTraining, Gpt2MatchesOneProcessOver20Steps) {
  // GPT-2's Conv1D weights are (in, out): c_attn's q, k and v blocks are column blocks of
  // one tensor, and its biases, learned positions and layernorm biases ride along.
  const std::string root = temp_dir("tp_train_gpt2");
  const std::string data = make_data(root);
  auto gpt2 = [&](const std::string& name, const std::string& parallel) {
    std::string cfg = config(root, name, data, 20, parallel);
    cfg.replace(cfg.find("[model]\n"), 8, "[model]\narch = \"gpt2\"\n");
    return cfg;
  };
  const RunOut ref = train(gpt2("single", "zero_stage = 0"), 0);
  ASSERT_EQ(ref.losses.size(), 20u);
  expect_layouts_match(ref,
                       {{"tp2", "tp = 2", 2},
                        {"dp2tp2_z1_sp", "tp = 2\ndp = 2\nsequence_parallel = true\nzero_stage = 1", 4},
                        {"tp4_z2", "tp = 4\nzero_stage = 2", 4}},
                       gpt2);
  // A dp2 x tp2 checkpoint (each rank's q, k and v blocks saved apart) resumes in one
  // process and at tp4 on the same curve.
  expect_resume_matches(ref, "gpt2_to_one", "tp = 2\nzero_stage = 1", 4, "zero_stage = 0", 0, gpt2);
  expect_resume_matches(ref, "gpt2_to_tp4", "tp = 2\nzero_stage = 1", 4, "tp = 4", 4, gpt2);
}

TEST(TensorParallelTraining, MuonMatchesOneProcessOver20Steps) {
  // Muon orthogonalises whole matrices: each rank's block of the update is gathered over
  // the tp group, the whole matrix orthogonalised, and the rank's block of it kept.
  const std::string root = temp_dir("tp_train_muon");
  const std::string data = make_data(root);
  auto muon = [&](const std::string& name, const std::string& parallel) {
    std::string cfg = config(root, name, data, 20, parallel);
    cfg.replace(cfg.find("[optimizer]\n"), 12, "[optimizer]\nname = \"muon\"\n");
    return cfg;
  };
  const RunOut ref = train(muon("single", "zero_stage = 0"), 0);
  ASSERT_EQ(ref.losses.size(), 20u);
  expect_layouts_match(ref,
                       {{"tp2", "tp = 2", 2},
                        {"tp4_kv_replicated", "tp = 4", 4},
                        {"dp2tp2_sp", "tp = 2\ndp = 2\nsequence_parallel = true", 4}},
                       muon);
  // Resumed at another tp (the momentum blocks resharded) on the same curve.
  expect_resume_matches(ref, "muon_tp2_to_tp4", "tp = 2", 2, "tp = 4", 4, muon);
  // GPT-2's fused c_attn is held as rows of q, k and v blocks under tp: one line.
  std::string gpt2 = muon("gpt2", "tp = 2");
  gpt2.replace(gpt2.find("[model]\n"), 8, "[model]\narch = \"gpt2\"\n");
  try {
    train(gpt2, 2);
    ADD_FAILURE() << "gpt2 + muon at tp 2 was accepted";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(".attn.c_attn.weight as one matrix"), std::string::npos) << msg;
    EXPECT_NE(msg.find("adamw"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

TEST(TensorParallelTraining, ACheckpointResumesOnTheSameCurveUnderAnotherLayout) {
  // Written at dp2 x tp2 (ZeRO-1, masters and moments in tp blocks and dp pieces), resumed
  // at the same tp, at one process, at dp2 ZeRO-2 and at tp4 (kv heads replicated); and a
  // one-process checkpoint resumed at dp2 x tp2: each on the one-process curve.
  const std::string root = temp_dir("tp_resume");
  const std::string data = make_data(root);
  const RunOut ref = train(config(root, "single", data, 10, "zero_stage = 0"), 0);
  const struct {
    const char* name;
    const char* first;
    int first_ranks;
    const char* then;
    int then_ranks;
  } cases[] = {{"same_tp", "tp = 2\nzero_stage = 1", 4, "tp = 2\nzero_stage = 0", 2},
               {"to_one", "tp = 2\nzero_stage = 1", 4, "zero_stage = 0", 0},
               {"to_dp2", "tp = 2\nzero_stage = 1", 4, "zero_stage = 2", 2},
               {"to_tp4", "tp = 2\nzero_stage = 1", 4, "tp = 4", 4},
               {"from_one", "zero_stage = 0", 0, "tp = 2\nzero_stage = 1", 4},
               {"z3_to_tp4", "tp = 2\nzero_stage = 3", 4, "tp = 4", 4}};
  for (const auto& k : cases) {
    TrainOptions stop;
    stop.stop_after = 5;
    train(config(root, k.name, data, 10, k.first), k.first_ranks, stop);
    TrainOptions resume;
    resume.resume = true;
    const RunOut got = train(config(root, k.name, data, 10, k.then), k.then_ranks, resume);
    expect_close(got.losses, {ref.losses.begin() + 5, ref.losses.end()}, 1e-5,
                 std::string(k.name) + " resumed loss");
  }
}

TEST(TensorParallelTraining, LayoutsTheTrainerCannotRunAreOneLine) {
  const std::string root = temp_dir("tp_bad");
  const std::string data = make_data(root);
  const struct {
    const char* parallel;
    const char* extra_model;
    const char* want;
  } cases[] = {
      {"tp = 3", "", "tp 3 = 3 does not divide the 4 ranks"},
      {"sequence_parallel = true", "", "sequence_parallel = true needs tp > 1"},
      {"tp = 2\nsp_overlap = true", "", "sp_overlap = true needs sequence_parallel = true"},
  };
  for (const auto& k : cases) {
    std::string cfg = config(root, "bad", data, 2, k.parallel);
    cfg.replace(cfg.find("[model]\n"), 8, std::string("[model]\n") + k.extra_model);
    try {
      train(cfg, 4);
      ADD_FAILURE() << k.parallel << " was accepted";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(k.want), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  }
}

}  // namespace
}  // namespace tessera::train
