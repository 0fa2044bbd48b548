// The real multi-process path: `mpirun -np 2 tessera train` (OpenMPI, the mpi backend)
// trains to the single-process run's losses, ZeRO-2 included.
#include <gtest/gtest.h>

#include <cmath>

#include "tessera/model/model.h"
#include "tessera/train/metrics.h"
#include "tessera/train/trainer.h"
#include "test_util/run_command.h"
#include "train/trainer_test_util.h"

namespace tessera::train {
namespace {

// mpirun as the tests in tests/comm_mpi run it: this host only, shared memory.
std::string mpirun(int np) {
  return "OMPI_MCA_plm=isolated OMPI_MCA_btl=self,vader OMP_NUM_THREADS=1 "
         "mpirun --allow-run-as-root --oversubscribe -np " + std::to_string(np) + " ";
}

std::vector<double> losses_of(const std::string& out_dir) {
  std::vector<double> l;
  for (const auto& rec : read_metrics(out_dir + "/metrics.jsonl"))
    if (rec.contains("loss")) l.push_back(rec.at("loss").get<double>());
  return l;
}

TEST(DataParallelMpi, TwoProcessesMatchOneProcess) {
  const std::string root = temp_dir("dp_mpi");
  const std::string data = make_data(root);
  const std::string extra = "[optimizer]\nlr = 0.003\n[parallel]\nbucket_mb = 0.02\n";
  const auto single = run_training(TrainConfig::parse(base_config(root + "/single", data, 4, extra), "s.toml"));
  for (int stage : {0, 2}) {
    const std::string out = root + "/mpi" + std::to_string(stage);
    const std::string cfg = root + "/mpi" + std::to_string(stage) + ".toml";
    io_write(cfg, base_config(out, data, 4, extra + "zero_stage = " + std::to_string(stage) + "\n"));
    const auto r = testing::run_command(mpirun(2) + TESSERA_CLI_PATH + " train --config " + cfg);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("2 ranks (ZeRO stage " + std::to_string(stage) + ")"), std::string::npos)
        << r.out;
    const auto got = losses_of(out);
    ASSERT_EQ(got.size(), single.losses.size()) << r.out;
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_NEAR(got[i], single.losses[i], 1e-5 * single.losses[i]) << "stage " << stage << " step " << i + 1;
  }
}

// Tensor parallelism across processes: dp2 x tp2 on 4 ranks (the tp pairs are consecutive
// ranks), ZeRO-1, to the single-process losses; the mesh is printed by every rank.
TEST(TensorParallelMpi, Dp2xTp2MatchesOneProcess) {
  const std::string root = temp_dir("tp_mpi");
  const std::string data = make_data(root);
  const std::string extra = "[optimizer]\nlr = 0.003\n[parallel]\n";
  const auto single = run_training(TrainConfig::parse(base_config(root + "/single", data, 4, extra), "s.toml"));
  const std::string out = root + "/mpi";
  const std::string cfg = root + "/mpi.toml";
  io_write(cfg, base_config(out, data, 4, extra + "tp = 2\ndp = 2\nzero_stage = 1\n"));
  const auto r = testing::run_command(mpirun(4) + TESSERA_CLI_PATH + " train --config " + cfg);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("train: mesh dp2 x tp2"), std::string::npos) << r.out;
  const auto got = losses_of(out);
  ASSERT_EQ(got.size(), single.losses.size()) << r.out;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], single.losses[i], 1e-5 * single.losses[i]) << "step " << i + 1;
  // The model it wrote is whole: it loads as one process's model.
  EXPECT_NO_THROW(model::Model::load(out + "/model"));
}

// Expert parallelism across processes: a Mixtral model's 4 experts over ep = 2 inside
// dp = 2 (4 ranks, ZeRO-2), its tokens exchanged by MPI's all-to-all, to the
// single-process losses; the model it writes holds every expert.
TEST(ExpertParallelMpi, Dp2xEp2MatchesOneProcess) {
  const std::string root = temp_dir("ep_mpi");
  const std::string data = make_data(root);
  const std::string json = root + "/mixtral.json";
  io_write(json, R"({"model_type": "mixtral", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "max_position_embeddings": 128, "num_local_experts": 4, "num_experts_per_tok": 2,
      "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false})");
  auto cfg_text = [&](const std::string& out, const std::string& parallel) {
    std::string c = base_config(out, data, 4, "[optimizer]\nlr = 0.003\n[parallel]\n" + parallel);
    const std::string shape = "shape = \"tiny\"\n";
    return c.replace(c.find(shape), shape.size(), "config = \"" + json + "\"\n");
  };
  const auto single = run_training(TrainConfig::parse(cfg_text(root + "/single", ""), "s.toml"));
  const std::string out = root + "/mpi", cfg = root + "/mpi.toml";
  io_write(cfg, cfg_text(out, "ep = 2\ndp = 2\nzero_stage = 2\n"));
  const auto r = testing::run_command(mpirun(4) + TESSERA_CLI_PATH + " train --config " + cfg);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("train: mesh dp2 x ep2"), std::string::npos) << r.out;
  const auto got = losses_of(out);
  ASSERT_EQ(got.size(), single.losses.size()) << r.out;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], single.losses[i], 1e-5 * single.losses[i]) << "step " << i + 1;
  const auto m = model::Model::load(out + "/model");
  EXPECT_EQ(m.weights().layers[0].moe.gate_up.size(0), 4);
}

TEST(PipelineParallelMpi, Pp2And1F1BMatchesOneProcess) {
  // Two processes as the two stages of a 4-layer model (activations and gradients over
  // MPI point to point), four micro-batches per step.
  const std::string root = temp_dir("pp_mpi");
  const std::string data = make_data(root);
  const std::string extra = "[optimizer]\nlr = 0.003\n[parallel]\n";
  auto with = [&](const std::string& out, const std::string& parallel) {
    std::string cfg = base_config(out, data, 4, extra + parallel);
    cfg.replace(cfg.find("[model]\n"), 8, "[model]\nnum_layers = 4\n");
    cfg.replace(cfg.find("batch_size = 4\n"), 15, "batch_size = 4\ngrad_accum = 4\n");
    return cfg;
  };
  const auto single = run_training(TrainConfig::parse(with(root + "/single", ""), "s.toml"));
  const std::string out = root + "/mpi";
  const std::string cfg = root + "/mpi.toml";
  io_write(cfg, with(out, "pp = 2\n"));
  const auto r = testing::run_command(mpirun(2) + TESSERA_CLI_PATH + " train --config " + cfg);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("train: mesh pp2"), std::string::npos) << r.out;
  const auto got = losses_of(out);
  ASSERT_EQ(got.size(), single.losses.size()) << r.out;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], single.losses[i], 1e-5 * single.losses[i]) << "step " << i + 1;
  EXPECT_NO_THROW(model::Model::load(out + "/model"));
  EXPECT_TRUE(fs::exists(out + "/pipeline_timeline.svg"));
}

}  // namespace
}  // namespace tessera::train
