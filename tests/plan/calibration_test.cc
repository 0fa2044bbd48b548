// The planner against this project's own runs: (1) its memory model against the bytes
// per rank the trainer reports in metrics.jsonl for DP / ZeRO-1/2/3 runs (within 10%);
// (2) its time model, calibrated with this machine's bench gemm / STREAM / bench comm
// (`tessera plan calibrate`), against the measured step time of a 2-rank run (within 25%).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sys/resource.h>
#include <unistd.h>

#include "tessera/comm/communicator.h"
#include "tessera/kernels/peak.h"
#include "tessera/model/precision.h"
#include "tessera/plan/calibrate.h"
#include "tessera/plan/search.h"
#include "tessera/train/metrics.h"
#include "tessera/train/trainer.h"
#include "tessera/train/trainer_setup.h"
#include "test_util/run_command.h"
#include "train/trainer_test_util.h"

namespace tessera::plan {
namespace {

// The trainer's own model config, read back through the planner's config.json reader.
ModelSpec spec_of(const std::string& cfg_text) {
  const auto c = train::build_model(train::TrainConfig::parse(cfg_text, "run.toml"), 256, 0).config();
  return model_from_hf_json(c.to_json(), "run/config.json");
}

// Tessera's CPU build: 16-bit values kept in f32 (the matmul-only activations as bf16
// where the trainer runs native bf16), no allocator allowances.
Hardware tessera_cpu() {
  const bool native = model::choose_bf16_mode(DType::kBF16) == model::Bf16Mode::kNative;
  return hardware_from_toml(std::string(native ? "native_bf16_activations = true\n" : "") +
      "name = \"tessera-cpu\"\nmemory_gib = 16\nmemory_bandwidth_gbps = 10\n"
      "peak_tflops_bf16 = 0.1\npeak_tflops_fp32 = 0.1\ndevices_per_node = 2\n"
      "intra_node_bandwidth_gbps = 5\nintra_node_latency_us = 5\ninter_node_bandwidth_gbps = 5\n"
      "inter_node_latency_us = 5\nreserved_gib = 0\nfragmentation = 0\nstore_16bit_as_f32 = true\n",
      "tessera-cpu.toml");
}

TEST(Calibration, MemoryModelMatchesPerRankBytesOfDataParallelRuns) {
  const std::string root = train::temp_dir("plan_memory");
  const std::string data = train::make_data(root);
  struct Case {
    int zero;
    const char* precision;
    const char* recompute;
  };
  const Case cases[] = {{0, "bf16", "none"},     {1, "bf16", "none"}, {2, "bf16", "none"},
                        {3, "bf16", "none"},     {1, "bf16", "selective"},
                        {2, "bf16", "full"},     {0, "fp32", "none"}};
  std::printf("%-22s %12s %12s %12s %12s %12s  (predicted / reported by the trainer)\n", "run",
              "weights", "grads", "optimizer", "activations", "total");
  for (const Case& k : cases) {
    const std::string name = "z" + std::to_string(k.zero) + k.precision + k.recompute;
    std::string cfg = train::base_config(root + "/" + name, data, 1,
                                         "[parallel]\nzero_stage = " + std::to_string(k.zero) + "\n");
    cfg.replace(cfg.find("shape = \"tiny\""), 14,
                "shape = \"tiny\"\nhidden_size = 128\nnum_layers = 3\nintermediate_size = 352");
    cfg.replace(cfg.find("seq_len = 32"), 12, "seq_len = 64");
    cfg.replace(cfg.find("\"fp32\""), 6, std::string("\"") + k.precision + "\"\n" +
                                             "activation_checkpointing = \"" + k.recompute + "\"");
    const train::TrainConfig c = train::TrainConfig::parse(cfg, name + ".toml");
    comm::run_local(2, [&](comm::Communicator& comm) {
      train::TrainOptions o;
      o.comm = &comm;
      train::run_training(c, o);
    });
    nlohmann::json rec;
    for (const auto& r : train::read_metrics(c.out_dir + "/metrics.jsonl"))
      if (r.contains("mem_params")) rec = r;
    ASSERT_FALSE(rec.is_null()) << name;

    TrainSetup s;
    s.devices = 2, s.seq = 64, s.global_batch = 4;
    s.precision = parse_precision(k.precision);
    s.selective_keeps_attention_output = false;  // Tessera recomputes the attention output
    Layout l;
    l.dp = 2, l.zero = k.zero, l.micro_batch = 2;
    l.recompute = k.recompute == std::string("none")        ? Recompute::kNone
                  : k.recompute == std::string("selective") ? Recompute::kSelective
                                                           : Recompute::kFull;
    const StageMemory p = estimate_memory(spec_of(cfg), tessera_cpu(), s, l).peak();
    const double got[] = {rec.at("mem_params").get<double>(), rec.at("mem_grads").get<double>(),
                          rec.at("mem_optimizer").get<double>(),
                          rec.at("mem_activations").get<double>()};
    const double want[] = {p.weights, p.grads, p.optimizer(), p.activations};
    double got_total = 0, want_total = 0;
    std::printf("%-22s", name.c_str());
    for (int i = 0; i < 4; ++i) {
      got_total += got[i], want_total += want[i];
      std::printf(" %5.3f=%.0f/%.0f", want[i] / got[i], want[i], got[i]);
      EXPECT_NEAR(want[i] / got[i], 1.0, 0.10) << name << " part " << i;
    }
    std::printf("  total %.4f\n", want_total / got_total);
    EXPECT_NEAR(want_total / got_total, 1.0, 0.10) << name;
  }
}

TEST(Calibration, MemoryModelMatchesPerRankBytesOfModelParallelRuns) {
  // Rank 0's bytes (pipeline stage 0, tp rank 0) against the planner's stage 0, for the
  // model-parallel layouts the trainer runs: tp (+ SP), pp under GPipe and 1F1B (the
  // activations of the micro-batches in flight), and their products with dp / ZeRO-1 and 3.
  const std::string root = train::temp_dir("plan_memory_mp");
  const std::string data = train::make_data(root);
  struct Case {
    const char* name;
    int dp, tp, pp, zero;
    bool sp;
    const char* schedule;
  };
  const Case cases[] = {{"tp2", 1, 2, 1, 0, false, "1f1b"},     {"tp2_sp", 1, 2, 1, 0, true, "1f1b"},
                        {"pp2_1f1b", 1, 1, 2, 0, false, "1f1b"}, {"pp2_gpipe", 1, 1, 2, 0, false, "gpipe"},
                        {"dp2pp2_z1", 2, 1, 2, 1, false, "1f1b"}, {"tp2pp2", 1, 2, 2, 0, false, "1f1b"},
                        {"dp2tp2_z1", 2, 2, 1, 1, false, "1f1b"}, {"dp2tp2_z3", 2, 2, 1, 3, false, "1f1b"},
                        {"dp2pp2_z3", 2, 1, 2, 3, false, "1f1b"}};
  std::printf("%-12s %12s %12s %12s %12s  (predicted / reported by the trainer)\n", "run", "weights",
              "grads", "optimizer", "activations");
  for (const Case& k : cases) {
    const std::string par = "dp = " + std::to_string(k.dp) + "\ntp = " + std::to_string(k.tp) +
                            "\npp = " + std::to_string(k.pp) + "\nzero_stage = " + std::to_string(k.zero) +
                            "\nsequence_parallel = " + (k.sp ? "true" : "false") + "\npp_schedule = \"" +
                            k.schedule + "\"\n";
    std::string cfg = train::base_config(root + "/" + k.name, data, 1, "[parallel]\n" + par);
    cfg.replace(cfg.find("shape = \"tiny\""), 14,
                "shape = \"tiny\"\nhidden_size = 128\nnum_layers = 4\nintermediate_size = 352");
    cfg.replace(cfg.find("seq_len = 32"), 12, "seq_len = 64");
    cfg.replace(cfg.find("batch_size = 4\n"), 15, "batch_size = 4\ngrad_accum = 4\n");
    cfg.replace(cfg.find("\"fp32\""), 6, "\"bf16\"");
    const train::TrainConfig c = train::TrainConfig::parse(cfg, std::string(k.name) + ".toml");
    comm::run_local(k.dp * k.tp * k.pp, [&](comm::Communicator& comm) {
      train::TrainOptions o;
      o.comm = &comm;
      train::run_training(c, o);
    });
    nlohmann::json rec;
    for (const auto& r : train::read_metrics(c.out_dir + "/metrics.jsonl"))
      if (r.contains("mem_params")) rec = r;
    ASSERT_FALSE(rec.is_null()) << k.name;
    TrainSetup s;
    s.devices = k.dp * k.tp * k.pp, s.seq = 64, s.global_batch = 16;
    s.precision = Precision::kBf16;
    s.selective_keeps_attention_output = false;
    Layout l;
    l.dp = k.dp, l.tp = k.tp, l.pp = k.pp, l.zero = k.zero, l.sp = k.sp;
    l.micro_batch = 4 / k.dp;
    l.schedule = k.schedule == std::string("gpipe") ? Schedule::kGPipe : Schedule::k1F1B;
    const StageMemory p = estimate_memory(spec_of(cfg), tessera_cpu(), s, l).stages[0];
    const double got[] = {rec.at("mem_params").get<double>(), rec.at("mem_grads").get<double>(),
                          rec.at("mem_optimizer").get<double>(), rec.at("mem_activations").get<double>()};
    const double want[] = {p.weights, p.grads, p.optimizer(), p.activations};
    std::printf("%-12s", k.name);
    for (int i = 0; i < 4; ++i) {
      std::printf(" %5.3f=%.0f/%.0f", want[i] / got[i], want[i], got[i]);
      EXPECT_NEAR(want[i] / got[i], 1.0, 0.10) << k.name << " part " << i;
    }
    std::printf("\n");
  }
}

TEST(Calibration, MemoryModelIsWithinAQuarterOfEachRanksPeakRss) {
  // Each rank a process (mpirun -np 2): its peak RSS (VmHWM, metrics.jsonl peak_rss_mb at
  // the last step, before the final save) less the baseline of the same launch training a
  // 1-layer, 64-wide model (binary, libraries, MPI, the data loader), against the
  // planner's whole stage-0 estimate (weights, gradients, optimizer state, activations and
  // temporaries), for a 33M-parameter model laid out as dp2, tp2 and pp2.
  const std::string root = train::temp_dir("plan_rss");
  const std::string data = train::make_data(root);
  const std::string mpirun =
      "OMPI_MCA_plm=isolated OMPI_MCA_btl=self,vader OMP_NUM_THREADS=1 "
      "mpirun --allow-run-as-root --oversubscribe -np 2 ";
  auto run = [&](const std::string& name, const std::string& model, const std::string& parallel) {
    std::string cfg = train::base_config(root + "/" + name, data, 2, "[parallel]\n" + parallel);
    cfg.replace(cfg.find("shape = \"tiny\""), 14, "shape = \"tiny\"\n" + model);
    cfg.replace(cfg.find("seq_len = 32"), 12, "seq_len = 64");
    cfg.replace(cfg.find("batch_size = 4\n"), 15, "batch_size = 4\ngrad_accum = 2\n");
    cfg.replace(cfg.find("eval_batches = 2"), 16, "eval_batches = 0");
    const std::string path = root + "/" + name + ".toml";
    std::ofstream(path) << cfg;
    const auto r = testing::run_command(mpirun + TESSERA_CLI_PATH + " train --config " + path);
    EXPECT_EQ(r.code, 0) << r.out;
    nlohmann::json rec;
    for (const auto& x : train::read_metrics(root + "/" + name + "/metrics.jsonl"))
      if (x.contains("peak_rss_mb")) rec = x;
    return std::pair{cfg, rec};
  };
  const auto [base_cfg, base] = run("baseline", "hidden_size = 64\nnum_layers = 1\nintermediate_size = 128", "dp = 2\n");
  ASSERT_FALSE(base.is_null());
  const double baseline = base.at("peak_rss_mb").get<double>() * (1 << 20);
  const std::string big = "hidden_size = 512\nnum_layers = 8\nnum_heads = 8\nnum_kv_heads = 4\n"
                          "intermediate_size = 1536\nvocab_size = 8192";
  struct Case {
    const char* name;
    int dp, tp, pp;
  };
  std::printf("baseline RSS %.1f MiB\n", baseline / (1 << 20));
  for (const Case& k : {Case{"dp2", 2, 1, 1}, Case{"tp2", 1, 2, 1}, Case{"pp2", 1, 1, 2}}) {
    const auto [cfg, rec] = run(k.name, big, "dp = " + std::to_string(k.dp) + "\ntp = " +
                                                 std::to_string(k.tp) + "\npp = " + std::to_string(k.pp) + "\n");
    ASSERT_FALSE(rec.is_null()) << k.name;
    TrainSetup s;
    s.devices = 2, s.seq = 64, s.global_batch = 8;
    s.precision = Precision::kFp32;
    Layout l;
    l.dp = k.dp, l.tp = k.tp, l.pp = k.pp, l.micro_batch = 4 / k.dp;
    const StageMemory p = estimate_memory(spec_of(cfg), tessera_cpu(), s, l).stages[0];
    const double rss = rec.at("peak_rss_mb").get<double>() * (1 << 20) - baseline;
    std::printf("%-4s predicted %.1f MiB, peak RSS less baseline %.1f MiB (%.3f)\n", k.name,
                p.total() / (1 << 20), rss / (1 << 20), p.total() / rss);
    EXPECT_NEAR(p.total() / rss, 1.0, 0.25) << k.name;
  }
}

// This machine's speed right now: a 512^3 f32 GEMM on both devices at once (GFLOP/s).
double speed_probe() {
  const auto r = on_all_devices(2, [](int) {
    return kernels::measure_matmul_gflops(512, 512, 512, DType::kF32, kernels::MatmulBackend::kAuto, 0.2)
        .gflops;
  });
  return (r[0] + r[1]) / 2;
}

struct Measurement {
  double measured = 0, predicted = 0;  // seconds per step
  double drift = 0;                    // |speed after / speed before - 1| around the run
  double spread = 0;                   // upper / lower quartile of the measured steps
};

// Calibrates this machine, trains the 2-rank run in `dir`, returns the measured median
// step, the planner's prediction and how much the machine's speed moved meanwhile.
Measurement measure_and_predict(const std::string& dir, const std::string& data) {
  CalibrateOptions co;
  co.devices = 2;
  co.min_seconds = 0.03;
  co.gemm_k = {64, 128, 256, 512, 1024};
  co.gemm_mn = {128, 256, 512, 1024};
  co.tessera_exe = TESSERA_CLI_PATH;
  co.max_comm_bytes = int64_t{16} << 20;
  std::string log;
  const Hardware hw = calibrate_cpu(co, &log);
  std::printf("%s", log.c_str());
  std::filesystem::create_directories(dir);
  const int64_t seq = 128, batch = 8;
  std::string cfg = train::base_config(dir + "/run", data, 12, "[parallel]\nzero_stage = 0\n");
  cfg.replace(cfg.find("shape = \"tiny\""), 14,
              "shape = \"tiny\"\nhidden_size = 512\nnum_layers = 4\nnum_heads = 8\nnum_kv_heads = 4\n"
              "intermediate_size = 1408\nmax_position_embeddings = 512");
  cfg.replace(cfg.find("seq_len = 32"), 12, "seq_len = " + std::to_string(seq));
  cfg.replace(cfg.find("batch_size = 4"), 14, "batch_size = " + std::to_string(batch));
  cfg.replace(cfg.find("\"fp32\""), 6, "\"bf16\"");
  cfg.replace(cfg.find("eval_batches = 2"), 16, "eval_batches = 1");
  train::io_write(dir + "/run.toml", cfg + "[checkpoint]\nevery = 0\n");
  const double before = speed_probe();
  const auto r = testing::run_command("OMP_NUM_THREADS=1 " + std::string(TESSERA_CLI_PATH) +
                                      " train --config " + dir + "/run.toml --nproc 2");
  const double after = speed_probe();
  EXPECT_EQ(r.code, 0) << r.out;
  std::vector<double> steps;
  for (const auto& rec : train::read_metrics(dir + "/run/metrics.jsonl"))
    if (rec.contains("tokens_per_s") && rec.at("step").get<int>() > 1)  // step 1 warms up
      steps.push_back(static_cast<double>(batch * seq) / rec.at("tokens_per_s").get<double>());
  EXPECT_GE(steps.size(), 9u);
  if (steps.empty()) return {1, 0, 0};
  std::sort(steps.begin(), steps.end());
  const double measured = steps[steps.size() / 2];
  std::printf("steps: fastest %.1f ms, median %.1f ms, slowest %.1f ms\n", steps.front() * 1e3,
              measured * 1e3, steps.back() * 1e3);

  TrainSetup s;
  s.devices = 2, s.seq = seq, s.global_batch = batch;
  s.selective_keeps_attention_output = false;
  Layout l;
  l.dp = 2, l.micro_batch = batch / 2;
  const StepTime t = estimate_step_time(spec_of(cfg), hw, s, l);
  std::printf("step: measured %.1f ms (median of %zu), predicted %.1f ms (GEMM %.1f, attention %.1f, "
              "memory-bound %.1f, DP all-reduce %.1f, optimizer %.1f); ratio %.3f\n",
              measured * 1e3, steps.size(), t.total * 1e3,
              (t.stages[0].gemm_fwd + t.stages[0].gemm_bwd) * 1e3,
              (t.stages[0].attn_fwd + t.stages[0].attn_bwd) * 1e3, t.stages[0].elementwise * 1e3,
              t.dp_comm * 1e3, t.optimizer * 1e3, t.total / measured);
  std::printf("machine speed (512^3 GEMM on both cores): %.1f GFLOP/s before the run, %.1f after\n",
              before, after);
  return {measured, t.total, std::abs(after / before - 1),
          steps[steps.size() * 3 / 4] / steps[steps.size() / 4]};
}


// CPU seconds the whole machine was busy (steal included) and CPU seconds this process
// and its waited-for descendants used, so a measurement can tell whether others ran too.
struct CpuClock {
  double busy = 0, ours = 0, wall = 0;
  static CpuClock now() {
    CpuClock c;
    std::ifstream f("/proc/stat");
    std::string cpu;
    double user = 0, nice = 0, sys = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
    f >> cpu >> user >> nice >> sys >> idle >> iowait >> irq >> softirq >> steal;
    c.busy = (user + nice + sys + irq + softirq + steal) / static_cast<double>(::sysconf(_SC_CLK_TCK));
    for (int who : {RUSAGE_SELF, RUSAGE_CHILDREN}) {
      rusage u{};
      ::getrusage(who, &u);
      c.ours += u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6 + u.ru_stime.tv_sec + u.ru_stime.tv_usec * 1e-6;
    }
    c.wall = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    return c;
  }
};

// Share of the machine's cores that other processes (or the hypervisor) took in [a, b].
double foreign_share(const CpuClock& a, const CpuClock& b) {
  const double cores = static_cast<double>(::sysconf(_SC_NPROCESSORS_ONLN));
  return std::max(0.0, (b.busy - a.busy) - (b.ours - a.ours)) / ((b.wall - a.wall) * cores);
}

// One 2-rank data-parallel run under mpirun, as `tessera train --nproc 2` starts it, each
// rank on one core; its median step against the planner's prediction from a calibration
// of this machine made just before. The machine is shared (other processes, and a
// virtual machine's neighbours that /proc/stat does not show). An attempt counts only when
// the machine was steady through it: other processes took at most 10% of its cores, its
// GEMM speed moved at most 15% across the run, and the upper quartile of its steps was at
// most 1.25x the lower. Noise only slows a run down, so a steady attempt outside the bar is retried
// (within a time budget); the test fails when steady attempts were made and none was
// within 25%, and is skipped when the machine never held still.
TEST(Calibration, TimeModelPredictsTheStepOfATwoRankRun) {
  // Timing needs the machine to itself: ctest runs this as `plan_time_model` with RUN_SERIAL
  // (and this variable); the copy discovered among the parallel tests stands aside.
  if (!std::getenv("TESSERA_PLAN_TIME_TEST"))
    GTEST_SKIP() << "runs alone as the ctest test plan_time_model (set TESSERA_PLAN_TIME_TEST=1 to run it here)";
  if (testing::run_command("command -v mpirun >/dev/null").code != 0)
    GTEST_SKIP() << "mpirun is not installed: no multi-rank run to compare with";
  const std::string root = train::temp_dir("plan_time");
  const std::string data = train::make_data(root, 60000);
  std::string busy, outside;
  const auto t0 = std::chrono::steady_clock::now();
  // Each attempt takes ~13 s on a quiet machine and 25 s+ on a busy one.
  for (int attempt = 1; attempt <= 4 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(75);
       ++attempt) {
    const CpuClock start = CpuClock::now();
    const Measurement m = measure_and_predict(root + "/a" + std::to_string(attempt), data);
    const double foreign = foreign_share(start, CpuClock::now());
    const double ratio = m.predicted / m.measured;
    std::printf("attempt %d: measured %.1f ms, predicted %.1f ms, ratio %.3f; other processes "
                "used %.0f%% of the cores meanwhile, machine speed moved %.0f%%, step quartiles %.2fx "
                "apart\n",
                attempt, m.measured * 1e3, m.predicted * 1e3, ratio, 100 * foreign, 100 * m.drift, m.spread);
    std::fflush(stdout);
    if (foreign > 0.10 || m.drift > 0.15 || m.spread > 1.25) {
      busy += " attempt " + std::to_string(attempt) + ": others " + std::to_string(std::lround(100 * foreign)) +
              "%, speed moved " + std::to_string(std::lround(100 * m.drift)) + "%, step quartiles " +
              std::to_string(m.spread).substr(0, 4) + "x;";
      continue;
    }
    if (std::abs(ratio - 1.0) <= 0.25) return;  // within the bar
    outside += " attempt " + std::to_string(attempt) + ": ratio " + std::to_string(ratio).substr(0, 5) + ";";
  }
  if (!outside.empty())
    FAIL() << "the time model missed the measured step by more than 25% on a steady machine:" << outside
           << " (unsteady:" << busy << ")";
  GTEST_SKIP() << "the machine was not steady enough to time a step (" << busy
               << " bars: others 10%, speed 15%, step quartiles 1.25x); nothing compared";
}

}  // namespace
}  // namespace tessera::plan
