// `tessera train` under pipeline parallelism, by equivalence with one process (torchtitan
// style): pp2 under each schedule, dp2 x pp2, tp2 x pp2 and dp2 x tp2 x pp2 (8 ranks, local
// backend) with ZeRO-1 on dp, gradient accumulation (the micro-batches of the pipeline)
// and clipping train to the single-process losses and gradient norms over 20 steps; a
// checkpoint written at dp2 x tp2 resumes at tp2 x pp2 and at one process on the same
// curve; the run leaves its measured timeline; layouts it cannot run are one line.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "tessera/base/error.h"
#include "tessera/model/model.h"
#include "train/trainer_test_util.h"

namespace tessera::train {
namespace {

std::string config(const std::string& root, const std::string& name, const std::string& data,
                   int64_t steps, const std::string& parallel, int64_t accum = 4) {
  std::string cfg = base_config(root + "/" + name, data, steps, "[parallel]\n" + parallel + "\n") +
                    "[optimizer]\nlr = 0.003\n[checkpoint]\nevery = 5\nasync = true\n";
  const std::string key = "batch_size = 4\n";
  cfg.replace(cfg.find(key), key.size(), "batch_size = 4\ngrad_accum = " + std::to_string(accum) + "\n");
  cfg.replace(cfg.find("[training]\n"), 11, "[training]\nmax_grad_norm = 0.5\n");
  cfg.replace(cfg.find("[model]\n"), 8, "[model]\nnum_layers = 4\n");
  return cfg;
}

TEST(PipelineTraining, EveryLayoutMatchesOneProcessOver20Steps) {
  const std::string root = temp_dir("pp_train");
  const std::string data = make_data(root);
  const RunOut ref = train(config(root, "single", data, 20, "zero_stage = 0"), 0);
  ASSERT_EQ(ref.losses.size(), 20u);
  const struct {
    const char* name;
    const char* parallel;
    int ranks;
  } cases[] = {
      {"pp2_gpipe", "pp = 2\npp_schedule = \"gpipe\"", 2},
      {"pp2_1f1b", "pp = 2", 2},
      {"pp2_interleaved", "pp = 2\npp_schedule = \"interleaved\"\npp_virtual_stages = 2", 2},
      {"pp4", "pp = 4", 4},
      {"dp2pp2_z1", "pp = 2\ndp = 2\nzero_stage = 1", 4},
      {"dp2pp2_z3", "pp = 2\ndp = 2\nzero_stage = 3", 4},
      {"dp2pp2_z3_interleaved",
       "pp = 2\ndp = 2\nzero_stage = 3\npp_schedule = \"interleaved\"\npp_virtual_stages = 2", 4},
      {"tp2pp2", "pp = 2\ntp = 2", 4},
      {"tp2pp2_sp", "pp = 2\ntp = 2\nsequence_parallel = true", 4},
      {"dp2tp2pp2_z1", "pp = 2\ntp = 2\ndp = 2\nzero_stage = 1", 8},
      {"dp2tp2pp2_z3", "pp = 2\ntp = 2\ndp = 2\nzero_stage = 3", 8},
  };
  for (const auto& k : cases) {
    const RunOut got = train(config(root, k.name, data, 20, k.parallel), k.ranks);
    expect_close(got.losses, ref.losses, 1e-5, std::string(k.name) + " loss");
    expect_close(got.grad_norms, ref.grad_norms, 1e-5, std::string(k.name) + " grad norm");
    ASSERT_FALSE(got.records.empty());
    const auto& rec = got.records.back();
    EXPECT_TRUE(rec.contains("pp_bubble")) << k.name;
    EXPECT_GE(rec.value("pp_bubble", -1.0), 0.0) << k.name;
    EXPECT_LT(rec.value("pp_bubble", 1.0), 1.0) << k.name;
    EXPECT_TRUE(fs::exists(root + "/" + k.name + "/pipeline_timeline.svg")) << k.name;
  }
  // The model written at the end is the whole model (every tensor, gathered from the stages).
  const auto a = model::Model::load(root + "/single/model");
  const auto b = model::Model::load(root + "/dp2tp2pp2_z1/model");
  std::map<std::string, Tensor> want;
  for (auto& [name, t] : a.weights().named(a.config())) want.emplace(name, t);
  size_t n = 0;
  for (auto& [name, t] : b.weights().named(b.config())) {
    const Tensor& w = want.at(name);
    double num = 0, den = 0;
    for (int64_t i = 0; i < t.numel(); ++i) {
      num = std::max(num, static_cast<double>(std::abs(t.data<float>()[i] - w.data<float>()[i])));
      den = std::max(den, static_cast<double>(std::abs(w.data<float>()[i])));
    }
    // Adam divides each gradient by its own magnitude, so the few elements whose gradient
    // is near zero move by up to lr per step whatever its rounding: 20 steps of 8 ranks'
    // summation orders leave them within 1e-3 of the largest weight, the rest far closer.
    EXPECT_LT(num, 1e-3 * den) << name;
    ++n;
  }
  EXPECT_EQ(n, want.size());
}

TEST(PipelineTraining, TiedEmbeddingsAndGpt2MatchOneProcess) {
  // The tied table lives on stage 0 (embedding) and as a copy on the last stage (lm_head);
  // their gradients are summed between the two ends of each pipeline, so both take the
  // one-process step. GPT-2 (tied, LayerNorm, biases, learned positions) the same way.
  const std::string root = temp_dir("pp_tied");
  const std::string data = make_data(root);
  for (const char* model : {"tie_word_embeddings = true\n", "arch = \"gpt2\"\ntie_word_embeddings = true\n"}) {
    auto with = [&](std::string cfg) {
      cfg.replace(cfg.find("[model]\n"), 8, std::string("[model]\n") + model);
      return cfg;
    };
    const std::string tag = model[0] == 'a' ? "gpt2_" : "llama_";
    const RunOut ref = train(with(config(root, tag + "single", data, 10, "zero_stage = 0")), 0);
    const struct {
      const char* name;
      const char* parallel;
      int ranks;
    } cases[] = {{"pp2", "pp = 2", 2},
                 {"pp4", "pp = 4", 4},
                 {"dp2pp2_z1", "pp = 2\ndp = 2\nzero_stage = 1", 4},
                 // ZeRO-2/3: each end's dp pieces of the table assembled, summed, cut back.
                 {"dp2pp2_z2", "pp = 2\ndp = 2\nzero_stage = 2", 4},
                 {"dp2pp2_z3", "pp = 2\ndp = 2\nzero_stage = 3", 4},
                 {"dp2tp2pp2_z2", "pp = 2\ntp = 2\ndp = 2\nzero_stage = 2", 8}};
    for (const auto& k : cases) {
      if (tag == "gpt2_" && std::string(k.name) == "dp2tp2pp2_z2") continue;  // 8 ranks once
      const RunOut got = train(with(config(root, tag + k.name, data, 10, k.parallel)), k.ranks);
      expect_close(got.losses, ref.losses, 1e-5, tag + k.name + " loss");
      expect_close(got.grad_norms, ref.grad_norms, 1e-5, tag + k.name + " grad norm");
    }
    // The saved model is tied: the embedding only, loadable as the one process's.
    const auto m = model::Model::load(root + "/" + tag + "dp2pp2_z1/model");
    for (auto& [name, t] : m.weights().named(m.config())) EXPECT_EQ(name.find("lm_head"), std::string::npos) << name;
  }
  // Resumed across layouts: written at pp2, continued at one process.
  TrainOptions stop;
  stop.stop_after = 5;
  auto tied = [](std::string cfg) {
    cfg.replace(cfg.find("[model]\n"), 8, "[model]\ntie_word_embeddings = true\n");
    return cfg;
  };
  const RunOut ref = train(tied(config(root, "tied_ref", data, 10, "zero_stage = 0")), 0);
  train(tied(config(root, "tied_resume", data, 10, "pp = 2\nzero_stage = 1")), 2, stop);
  TrainOptions resume;
  resume.resume = true;
  const RunOut got = train(tied(config(root, "tied_resume", data, 10, "zero_stage = 0")), 0, resume);
  expect_close(got.losses, {ref.losses.begin() + 5, ref.losses.end()}, 1e-5, "tied pp2 -> one process");
  train(tied(config(root, "tied_resume2", data, 10, "zero_stage = 0")), 0, stop);
  const RunOut got2 = train(tied(config(root, "tied_resume2", data, 10, "pp = 2")), 2, resume);
  expect_close(got2.losses, {ref.losses.begin() + 5, ref.losses.end()}, 1e-5, "tied one process -> pp2");
}

TEST(PipelineTraining, Bf16FollowsTheOneProcessCurve) {
  // Mixed precision (bf16 compute, fp32 masters): the stages round the same values the one
  // process rounds, so the curves agree within bf16 tolerance (in fact far closer).
  const std::string root = temp_dir("pp_bf16");
  const std::string data = make_data(root);
  auto bf16 = [](std::string cfg) {
    cfg.replace(cfg.find("\"fp32\""), 6, "\"bf16\"");
    return cfg;
  };
  const RunOut ref = train(bf16(config(root, "single", data, 10, "zero_stage = 0")), 0);
  const RunOut pp2 = train(bf16(config(root, "pp2", data, 10, "pp = 2")), 2);
  expect_close(pp2.losses, ref.losses, 1e-2, "pp2 bf16 loss");
  const RunOut mix = train(bf16(config(root, "dp2tp2pp2", data, 10, "pp = 2\ntp = 2\ndp = 2\nzero_stage = 1")), 8);
  expect_close(mix.losses, ref.losses, 1e-2, "dp2 x tp2 x pp2 bf16 loss");
}

TEST(PipelineTraining, ACheckpointResumesOnTheSameCurveUnderAnotherLayout) {
  const std::string root = temp_dir("pp_resume");
  const std::string data = make_data(root);
  const RunOut ref = train(config(root, "single", data, 10, "zero_stage = 0"), 0);
  const struct {
    const char* name;
    const char* first;
    int first_ranks;
    const char* then;
    int then_ranks;
  } cases[] = {{"dp2tp2_to_tp2pp2", "tp = 2\ndp = 2\nzero_stage = 1", 4, "tp = 2\npp = 2", 4},
               {"dp2tp2_to_one", "tp = 2\ndp = 2\nzero_stage = 1", 4, "zero_stage = 0", 0},
               {"pp2_to_dp2", "pp = 2", 2, "zero_stage = 1", 2},
               {"tp2pp2_to_pp2", "tp = 2\npp = 2\nzero_stage = 1", 4, "pp = 2", 2},
               {"dp2pp2_z3_to_tp2", "pp = 2\ndp = 2\nzero_stage = 3", 4, "tp = 2", 2}};
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

TEST(PipelineTraining, TheTimelineShowsEveryPassAndTheBubbleNearTheFormula) {
  const std::string root = temp_dir("pp_timeline");
  const std::string data = make_data(root);
  const RunOut got = train(config(root, "pp2", data, 3, "pp = 2", 8), 2);
  std::ifstream in(root + "/pp2/pipeline_timeline.svg");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string svg = ss.str();
  size_t boxes = 0;
  for (size_t at = svg.find("<rect x="); at != std::string::npos; at = svg.find("<rect x=", at + 1)) ++boxes;
  EXPECT_EQ(boxes, 2u * 2 * 8);  // 2 ranks x (8 forwards + 8 backwards)
  EXPECT_NE(svg.find("rank 1"), std::string::npos);
  const auto& rec = got.records.back();
  EXPECT_DOUBLE_EQ(rec.at("pp_bubble_formula").get<double>(), 1.0 / 9.0);
  EXPECT_EQ(rec.at("pp_messages").get<int64_t>(), 8);  // each rank: 8 activations or 8 gradients
}

TEST(PipelineTraining, LayoutsTheTrainerCannotRunAreOneLine) {
  const std::string root = temp_dir("pp_bad");
  const std::string data = make_data(root);
  const struct {
    const char* parallel;
    const char* extra_model;
    int64_t accum;
    const char* want;
  } cases[] = {
      {"pp = 2", "", 1, "pp = 2 needs at least 2 micro-batches"},
      {"pp = 4\npp_virtual_stages = 2\npp_schedule = \"interleaved\"", "", 4, "exceeds the model's 4 layers"},
      {"pp = 2\npp_virtual_stages = 2", "", 4, "needs schedule = \"interleaved\""},
      {"pp = 2\npp_schedule = \"interleaved\"\npp_virtual_stages = 2", "", 3, "multiple of pp"},
      {"pp = 2\npp_layers = [1, 2]", "", 4, "pp_layers sums to 3 layers"},
      {"pp = 2\npp_schedule = \"zigzag\"", "", 4, "pp_schedule is 'zigzag'"},
      {"pp_virtual_stages = 2", "", 4, "need pp > 1"},
      {"pp = 3", "", 4, "does not divide the 4 ranks"},
      {"pp = 8", "", 8, "does not divide the 4 ranks"},
  };
  for (const auto& k : cases) {
    std::string cfg = config(root, "bad", data, 2, k.parallel, k.accum);
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
