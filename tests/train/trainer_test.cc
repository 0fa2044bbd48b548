// The trainer end to end on a tiny model: config errors, the 200-step loss curve against
// PyTorch (AdamW, accumulation, clipping, cosine schedule), bit-identical resume in fp32
// and bf16, fp16 loss scaling, the spike guard's rollback, and the run directory.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "tessera/base/timer.h"
#include "tessera/io/json_file.h"
#include "tessera/io/safetensors.h"
#include "tessera/model/model.h"
#include "tessera/train/checkpoint.h"
#include "tessera/train/data_loader.h"
#include "tessera/train/metrics.h"
#include "tessera/train/token_shard.h"
#include "tessera/train/trainer.h"
#include "train/trainer_test_util.h"

namespace tessera::train {
namespace {

namespace fs = std::filesystem;

TrainConfig parse(const std::string& text) { return TrainConfig::parse(text, "test.toml"); }

void expect_error(const std::string& text, const std::string& needle) {
  try {
    parse(text);
    ADD_FAILURE() << "no error for: " << text;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(TrainConfig, ErrorsNameTheKey) {
  const std::string ok = base_config("/tmp/x", "/tmp/d", 10);
  EXPECT_NO_THROW(parse(ok));
  expect_error(ok + "[optimizer]\nname = \"sgd\"\n", "optimizer.name");
  expect_error(ok + "[optimizer]\nlrr = 0.1\n", "unknown key 'optimizer.lrr'");
  expect_error(ok + "[optimizer]\nlr = -1.0\n", "optimizer.lr");
  expect_error(ok + "[optimiser]\nlr = 0.1\n", "unknown table or key 'optimiser'");
  expect_error(ok + "[schedule]\nwarmup_steps = 11\n", "schedule.warmup_steps");
  expect_error(ok + "[spike_guard]\npolicy = \"ignore\"\n", "spike_guard.policy");
  expect_error(ok + "[checkpoint]\nkeep = 0\n", "checkpoint.keep");
  expect_error(ok + "[parallel]\nzero_stage = 4\n", "parallel.zero_stage");
  expect_error(ok + "[parallel]\nalgorithm = \"tree\"\n", "parallel.algorithm");
  expect_error(ok + "[parallel]\nbucket_mb = 0\n", "parallel.bucket_mb");
  expect_error(ok + "[parallel]\nzero = 1\n", "unknown key 'parallel.zero'");
  expect_error("[data]\ndir = \"d\"\n[training]\nsteps = \"ten\"\n",
               "training.steps must be an integer");
  expect_error("[training\n", "invalid TOML");
  expect_error("[run]\nout_dir = \"x\"\n", "data.dir is required");
}

// The same batches, in order, that a run with this config consumes.
void dump_batches(const TrainConfig& c, const std::string& path) {
  DataLoader loader(c.data.dir, "train", c.data.seq_len, c.data.seed);
  const int64_t S = c.training.steps, A = c.data.grad_accum, B = c.data.batch_size,
                T = c.data.seq_len;
  Tensor all_ids = Tensor::empty({S, A, B, T}, DType::kI32);
  Tensor all_targets = Tensor::empty({S, A, B, T}, DType::kI32);
  Tensor ids, targets;
  for (int64_t i = 0; i < S * A; ++i) {
    loader.next_batch(B, ids, targets);
    std::copy_n(ids.data<int32_t>(), B * T, all_ids.data<int32_t>() + i * B * T);
    std::copy_n(targets.data<int32_t>(), B * T, all_targets.data<int32_t>() + i * B * T);
  }
  io::save_safetensors(path, {{"ids", all_ids}, {"targets", all_targets}});
}

TEST(Trainer, LossCurveMatchesPyTorchFor200Steps) {
  const std::string root = temp_dir("curve");
  const std::string data = make_data(root);
  // Initial weights both sides start from.
  auto cfg = model::ModelConfig::named_shape("tiny");
  model::Model::random(cfg, DType::kF32, 11).save(root + "/init");
  const std::string text = base_config(root + "/run", data, 200,
                                       "[optimizer]\nlr = 0.003\nweight_decay = 0.1\n"
                                       "[schedule]\nkind = \"cosine\"\nwarmup_steps = 20\n"
                                       "min_lr_ratio = 0.1\n[spike_guard]\nenabled = false\n") +
                           "";
  auto c = parse(text);
  c.model.init_from = root + "/init";
  c.model.shape.clear();
  c.data.grad_accum = 2;
  dump_batches(c, root + "/batches.safetensors");
  nlohmann::json s = {{"lr", c.optimizer.lr},         {"beta1", c.optimizer.beta1},
                      {"beta2", c.optimizer.beta2},   {"eps", c.optimizer.eps},
                      {"weight_decay", c.optimizer.weight_decay},
                      {"warmup_steps", c.schedule.warmup_steps},
                      {"total_steps", c.schedule.total_steps},
                      {"min_lr_ratio", c.schedule.min_lr_ratio},
                      {"max_grad_norm", c.training.max_grad_norm}};
  io::write_file_atomic(root + "/settings.json", s.dump());
  const std::string cmd = std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR +
                          "/tests/parity/train_reference.py --model " + root + "/init --batches " +
                          root + "/batches.safetensors --settings " + root +
                          "/settings.json --out " + root + "/ref.json";
  base::Timer timer;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::printf("pytorch reference: %.1f s\n", timer.seconds());
  timer.reset();
  const auto ref = io::read_json_file(root + "/ref.json")["losses"].get<std::vector<double>>();
  const auto r = run_training(c);
  std::printf("tessera: %.1f s\n", timer.seconds());
  ASSERT_EQ(r.losses.size(), 200u);
  ASSERT_EQ(ref.size(), 200u);
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double rel = std::abs(r.losses[i] - ref[i]) / std::abs(ref[i]);
    worst = std::max(worst, rel);
    EXPECT_LT(rel, 1e-3) << "step " << i << ": tessera " << r.losses[i] << " pytorch " << ref[i];
  }
  std::printf("200-step loss curve: worst relative difference %.2e; loss %.4f -> %.4f\n", worst,
              ref.front(), ref.back());
  EXPECT_LT(ref.back(), ref.front() * 0.8);  // it did learn something
  fs::remove_all(root);
}

void check_resume(const std::string& precision, const std::string& optimizer,
                  const std::string& bf16_mode = "auto") {
  const std::string root = temp_dir("resume_" + precision + optimizer + bf16_mode);
  const std::string data = make_data(root);
  const std::string extra = "[checkpoint]\nevery = 6\n[optimizer]\nname = \"" + optimizer +
                            "\"\n[schedule]\nwarmup_steps = 3\n";
  auto full_cfg = parse(base_config(root + "/full", data, 12, extra));
  full_cfg.training.precision = precision;
  full_cfg.training.bf16_mode = bf16_mode;
  const auto full = run_training(full_cfg);
  auto cfg = parse(base_config(root + "/split", data, 12, extra));
  cfg.training.precision = precision;
  cfg.training.bf16_mode = bf16_mode;
  TrainOptions stop;
  stop.stop_after = 6;
  const auto first = run_training(cfg, stop);
  ASSERT_EQ(first.losses.size(), 6u);
  TrainOptions resume;
  resume.resume = true;
  const auto second = run_training(cfg, resume);
  EXPECT_EQ(second.start_step, 6);
  ASSERT_EQ(second.losses.size(), 6u);
  for (int i = 0; i < 12; ++i) {
    const double got = i < 6 ? first.losses[i] : second.losses[i - 6];
    EXPECT_EQ(got, full.losses[i]) << precision << " step " << i;  // bit-identical
  }
  EXPECT_EQ(second.val_loss, full.val_loss);
  // The metrics log of the resumed run holds each step once.
  const auto records = read_metrics(root + "/split/metrics.jsonl");
  int64_t expect = 1;
  for (const auto& rec : records) {
    if (rec.contains("step") && !rec.contains("event")) {
      EXPECT_EQ(rec["step"].get<int64_t>(), expect++);
    }
  }
  EXPECT_EQ(expect, 13);
  // A finished run's model directory loads for inference.
  EXPECT_NO_THROW(model::Model::load(second.model_dir));
  fs::remove_all(root);
}

TEST(Trainer, ResumeIsBitIdenticalFp32) { check_resume("fp32", "adamw"); }
// Both bf16 modes on every machine (native runs without AMX too, only slower).
TEST(Trainer, ResumeIsBitIdenticalBf16Native) { check_resume("bf16", "adamw", "native"); }
TEST(Trainer, ResumeIsBitIdenticalBf16Emulated) { check_resume("bf16", "adamw", "emulated"); }
TEST(Trainer, ResumeIsBitIdenticalBf16Muon) { check_resume("bf16", "muon"); }

// A checkpoint records its bf16 mode; a resume under bf16_mode = "auto" (and no
// TESSERA_BF16) continues in it even where this CPU's default is the other mode, so the
// curve stays bit-identical; an explicit request wins, with a warning.
TEST(Trainer, ResumeKeepsTheSavedBf16ModeUnderAuto) {
  const char* env = std::getenv("TESSERA_BF16");
  const std::string saved_env = env ? env : "";
  unsetenv("TESSERA_BF16");
  const std::string other =
      model::choose_bf16_mode(DType::kBF16) == model::Bf16Mode::kNative ? "emulated" : "native";
  const std::string root = temp_dir("resume_mode");
  const std::string data = make_data(root);
  const std::string extra = "[checkpoint]\nevery = 3\n";
  auto with_mode = [&](const std::string& out, const std::string& mode) {
    auto c = parse(base_config(root + "/" + out, data, 6, extra));
    c.training.precision = "bf16";
    c.training.bf16_mode = mode;
    return c;
  };
  const auto full = run_training(with_mode("full", other));
  TrainOptions stop;
  stop.stop_after = 3;
  run_training(with_mode("split", other), stop);
  const auto index = io::read_json_file(root + "/split/checkpoints/step_00000003/optimizer_index.json");
  EXPECT_EQ(index.at("bf16_mode").get<std::string>(), other);
  TrainOptions resume;
  resume.resume = true;
  const auto second = run_training(with_mode("split", "auto"), resume);
  ASSERT_EQ(second.losses.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(second.losses[i], full.losses[i + 3]) << "step " << i + 4;
  if (!saved_env.empty()) setenv("TESSERA_BF16", saved_env.c_str(), 1);
  fs::remove_all(root);
}

TEST(Trainer, RefusesToOverwriteAnEarlierRun) {
  const std::string root = temp_dir("overwrite");
  const auto c = parse(base_config(root + "/run", make_data(root), 2));
  run_training(c);
  EXPECT_THROW(run_training(c), Error);
  TrainOptions resume;
  resume.resume = true;
  const auto r = run_training(c, resume);  // already finished: nothing to do
  EXPECT_EQ(r.steps_run, 0);
  fs::remove_all(root);
}

TEST(Trainer, WritesAChromeTraceOnRequest) {
  const std::string root = temp_dir("trace");
  auto c = parse(base_config(root + "/run", make_data(root), 3, "[checkpoint]\nevery = 2\n"));
  c.data.grad_accum = 2;
  c.logging.trace = root + "/trace.json";
  run_training(c);
  const auto trace = io::read_json_file(root + "/trace.json");
  std::map<std::string, int> count, kernel_spans;
  for (const auto& e : trace.at("traceEvents")) {
    EXPECT_EQ(e.at("ph"), "X");
    EXPECT_GE(e.at("dur").get<int64_t>(), 0);
    ++count[e.at("name").get<std::string>()];
    if (e.at("cat") == "kernel") ++kernel_spans[e.at("name").get<std::string>()];
  }
  EXPECT_EQ(count["step"], 3);
  // Every kernel entry point is a span of its own (TESSERA_KERNEL): the 6 backward passes
  // run one attention backward per layer; evaluation adds forwards.
  EXPECT_GT(kernel_spans["matmul"], 0);
  EXPECT_EQ(kernel_spans["attention_backward"] % 6, 0);
  EXPECT_GE(kernel_spans["attention_backward"], 6);
  EXPECT_GE(kernel_spans["attention_forward"], kernel_spans["attention_backward"]);
  EXPECT_EQ(count["forward_backward"], 6);  // 3 steps x 2 micro-batches
  EXPECT_EQ(count["optimizer_step"], 3);
  EXPECT_EQ(count["checkpoint_save"], 2);  // step 2 (async) and the final one
  EXPECT_EQ(count["checkpoint_write"], 2);
  fs::remove_all(root);
}

TEST(Trainer, Fp16OverflowSkipsStepsAndHalvesTheScale) {
  const std::string root = temp_dir("fp16");
  auto c = parse(base_config(root + "/run", make_data(root), 30));
  c.training.precision = "fp16";
  c.fp16_init_scale = 67108864.0;  // 2^26: the first steps overflow fp16 (here up to 2^21)
  c.optimizer.lr = 3e-3;
  c.fp16_growth_interval = 10;
  const auto r = run_training(c);
  EXPECT_GT(r.skipped_steps, 0);
  const auto recs = read_metrics(root + "/run/metrics.jsonl");
  ASSERT_EQ(recs.size(), 30u);
  EXPECT_TRUE(recs[0].value("skipped", false));
  EXPECT_EQ(recs[0]["loss_scale"].get<double>(), 67108864.0);
  EXPECT_EQ(recs[1]["loss_scale"].get<double>(), 33554432.0);  // halved after the overflow
  bool grew = false;
  for (size_t i = 1; i < recs.size(); ++i)
    grew |= recs[i]["loss_scale"].get<double>() == 2 * recs[i - 1]["loss_scale"].get<double>();
  EXPECT_TRUE(grew);  // doubled after growth_interval good steps
  int late_skips = 0;  // once in range, only the periodic growth attempts overflow
  for (size_t i = 10; i < recs.size(); ++i) late_skips += recs[i].value("skipped", false);
  EXPECT_LE(late_skips, 3);
  EXPECT_LT(r.losses.back(), r.losses[r.skipped_steps] - 0.3);  // and it trains once in range
  if (!HasFailure()) fs::remove_all(root);
}

TEST(Trainer, SpikeGuardRollsBackAndSkipsTheBatch) {
  const std::string root = temp_dir("spike");
  // A tiny sigma turns ordinary noise into "spikes", exercising the rollback path.
  auto c = parse(base_config(root + "/run", make_data(root), 16,
                             "[checkpoint]\nevery = 4\n[spike_guard]\npolicy = \"rollback\"\n"
                             "sigma = 0.01\nwindow = 4\nmin_history = 2\nmax_rollbacks = 2\n"));
  c.optimizer.lr = 1e-4;
  const auto r = run_training(c);
  EXPECT_EQ(r.rollbacks, 2);
  int events = 0;
  for (const auto& rec : read_metrics(root + "/run/metrics.jsonl"))
    events += rec.contains("event") && rec["event"] == "rollback";
  EXPECT_EQ(events, 2);
  const auto state = io::read_json_file(root + "/run/checkpoints/step_00000016/trainer_state.json");
  EXPECT_EQ(state["skip_ranges"].size(), 2u);
  EXPECT_EQ(state["rollbacks"].get<int64_t>(), 2);
  fs::remove_all(root);
}

TEST(Trainer, BadInputIsAClearError) {
  const std::string root = temp_dir("bad");
  const std::string data = make_data(root);
  auto c = parse(base_config(root + "/run", root + "/nodata", 2));
  EXPECT_THROW(run_training(c), Error);
  c = parse(base_config(root + "/run2", data, 2));
  c.data.seq_len = 100000;  // longer than the corpus (the model's context allows it)
  c.model.max_position_embeddings = 100000;
  try {
    run_training(c);
    ADD_FAILURE() << "a sequence longer than the corpus trained";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find("max_position_embeddings"), std::string::npos) << e.what();
  }
  // A run whose only checkpoint is corrupt: resume is an error, nothing is overwritten.
  c = parse(base_config(root + "/run3", data, 2));
  run_training(c);
  const std::string model = root + "/run3/checkpoints/step_00000002/model.safetensors";
  { std::fstream f(model, std::ios::in | std::ios::out | std::ios::binary); f.seekp(200); f.put('x'); }
  TrainOptions resume;
  resume.resume = true;
  try {
    run_training(c, resume);
    ADD_FAILURE() << "resumed from a corrupt checkpoint";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("step_00000002"), std::string::npos) << e.what();
  }
  fs::remove_all(root);
}

}  // namespace
}  // namespace tessera::train
