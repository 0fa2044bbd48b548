// `tessera plan` through the binary: JSON for tools, --explain, --svg, and a table of bad
// inputs that must each give one clear line and a non-zero exit.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "tessera/train/config.h"
#include "test_util/run_command.h"
#include "test_util/scratch_dir.h"

namespace tessera::plan {
namespace {

using testing::run_cli;
namespace fs = std::filesystem;

std::string temp_dir(const std::string& name) { return testing::scratch_dir("tessera_plan_" + name + "_"); }

TEST(PlanCli, TrainJsonHasEveryPartPerLayout) {
  const auto r = run_cli("plan train --model llama2-7b --gpu h100-80g --gpus 16 --seq 4096 "
                         "--global-batch 256 --tokens 1T --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j.at("layouts").size(), 10u);
  for (const auto& l : j.at("layouts")) {
    for (const char* k : {"weights", "gradients", "master_weights", "optimizer", "activations",
                          "temporary", "reserved", "fragmentation", "total"})
      EXPECT_TRUE(l.at("memory_bytes").contains(k)) << k;
    double parts = 0;
    for (const char* k : {"compute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "dp_comm",
                          "bubble", "optimizer"})
      parts += l.at("time_s").at(k).get<double>();
    EXPECT_NEAR(parts, l.at("time_s").at("total").get<double>(), 1e-9 * parts);
    EXPECT_GT(l.at("tokens_per_s").get<double>(), 0);
    EXPECT_GT(l.at("mfu").get<double>(), 0);
    EXPECT_LT(l.at("mfu").get<double>(), 1);
    EXPECT_TRUE(l.at("fits").get<bool>());
    EXPECT_GT(l.at("time_to_train_s").get<double>(), 0);
  }
  EXPECT_GT(j.at("search").at("valid").get<int>(), 10);
}

TEST(PlanCli, OneLayoutWithExplainAndSvg) {
  const std::string dir = temp_dir("svg");
  const auto r = run_cli("plan train --model llama2-70b --gpu h100-80g --gpus 64 --seq 4096 "
                         "--global-batch 512 --layout dp=2,tp=8,pp=4,zero=1,mb=1,recompute=selective,sp=on "
                         "--explain --svg " + dir + "/plan.svg");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* want : {"layout dp=2,tp=8,pp=4", "bubble = (pp - 1) x t_mb", "MFU =",
                           "Korthikanti", "TP: 4 x (reduce-scatter + all-gather)", "wrote "})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
  // A well-formed SVG with the schedule's boxes and one memory bar per stage.
  const auto x = testing::run_command(std::string(TESSERA_PYTHON) +
                                      " -c \"import sys, xml.etree.ElementTree as E; r = E.parse(sys.argv[1]).getroot(); "
                                      "print(sum(1 for e in r.iter() if e.tag.endswith('rect')))\" " +
                                      dir + "/plan.svg");
  ASSERT_EQ(x.code, 0) << x.out;
  EXPECT_GT(std::stoi(x.out), 4 * 32 * 2);  // 4 stages x 32 drawn micro-batches x F/B
}

TEST(PlanCli, EmitConfigWritesTheParallelTableTheTrainerReads) {
  // The planner's layout spelling and the trainer's [parallel] table agree: the emitted
  // table, appended to a run config, parses into exactly the layout's axes and stage.
  const std::string dir = temp_dir("emit");
  const std::string out = dir + "/parallel.toml";
  const auto r = run_cli("plan train --model llama2-7b --gpu h100-80g --gpus 16 --seq 4096 "
                         "--global-batch 256 --layout dp=2,tp=4,pp=2,zero=1,mb=2,recompute=selective,sp=on "
                         "--emit-config " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("wrote " + out), std::string::npos) << r.out;
  std::ifstream in(out);
  const std::string table((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(table.find("batch_size = 4 (dp x micro-batch), grad_accum = 64, seq_len = 4096"),
            std::string::npos) << table;
  EXPECT_NE(table.find("activation_checkpointing = \"selective\""), std::string::npos) << table;
  const std::string cfg = "[run]\nout_dir = \"" + dir + "/run\"\n[data]\ndir = \"" + dir + "\"\n" + table;
  const auto c = train::TrainConfig::parse(cfg, "emitted.toml");
  EXPECT_EQ(c.parallel.dp, 2);
  EXPECT_EQ(c.parallel.tp, 4);
  EXPECT_EQ(c.parallel.pp, 2);
  EXPECT_EQ(c.parallel.cp, 1);
  EXPECT_EQ(c.parallel.ep, 1);
  EXPECT_EQ(c.parallel.zero_stage, 1);
  EXPECT_TRUE(c.parallel.sequence_parallel);
  EXPECT_FALSE(c.parallel.offload);
  fs::remove_all(dir);
}

TEST(PlanCli, TrainTakesThePlannersLayoutSpelling) {
  // `tessera train --layout` reads what `plan train --layout` reads: the axes, the stage,
  // the schedule and the micro-batch regrouping of the config's global batch.
  const std::string dir = temp_dir("train_layout");
  const std::string cfg = dir + "/run.toml";
  std::ofstream(cfg) << "[run]\nout_dir = \"" << dir << "/run\"\n[model]\nnum_layers = 4\n"
                     << "[data]\ndir = \"" << dir << "\"\nbatch_size = 8\ngrad_accum = 2\n";
  const auto r = run_cli("train --config " + cfg + " --layout dp=1,pp=2,mb=2,sched=gpipe --print-schedule");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("pipeline: gpipe, pp 2, 8 micro-batches"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 1: F0 F1 F2 F3 F4 F5 F6 F7 B0"), std::string::npos) << r.out;
  const auto i = run_cli("train --config " + cfg + " --layout pp=2,sched=interleaved,vpp=2,mb=4 --print-schedule");
  ASSERT_EQ(i.code, 0) << i.out;
  EXPECT_NE(i.out.find("pipeline: interleaved, pp 2, 4 micro-batches, 2 chunks per rank"), std::string::npos)
      << i.out;
  const auto bad = run_cli("train --config " + cfg + " --layout pp=2,mb=3 --print-schedule");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("does not split into micro-batches of dp x mb = 3"), std::string::npos) << bad.out;
  fs::remove_all(dir);
}

TEST(PlanCli, InferAnswersTheSeventyBOnOneCardQuestion) {
  const auto r = run_cli("plan infer --model llama2-70b --gpu h100-80g --context 4096 --tp 1 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_FALSE(j.at("configs").empty());
  for (const auto& c : j.at("configs")) {
    EXPECT_NE(c.at("weights"), "bf16");  // 138 GB of bf16 weights never fit 80 GB
    EXPECT_GE(c.at("max_concurrent_requests").get<int>(), 1);
    for (const char* k : {"kv_bytes_per_token", "decode_tokens_per_s_single", "ttft_s"})
      EXPECT_GT(c.at(k).get<double>(), 0) << k;
  }
  const auto e = run_cli("plan infer --model llama2-70b --gpu h100-80g --context 4096 --tp 1 "
                         "--weights int4 --kv bf16 --explain");
  ASSERT_EQ(e.code, 0) << e.out;
  EXPECT_NE(e.out.find("2 x 80 x 8 x 128 x 2 = 327680"), std::string::npos) << e.out;
  // --svg: one stacked bar (weights, workspace, KV, free) per listed configuration.
  const std::string dir = temp_dir("infer_svg");
  const auto s = run_cli("plan infer --model llama2-70b --gpu h100-80g --context 4096 --top 3 --svg " + dir +
                         "/infer.svg");
  ASSERT_EQ(s.code, 0) << s.out;
  const auto x = testing::run_command(std::string(TESSERA_PYTHON) +
                                      " -c \"import sys, xml.etree.ElementTree as E; r = E.parse(sys.argv[1]).getroot(); "
                                      "print(sum(1 for e in r.iter() if e.tag.endswith('rect')))\" " +
                                      dir + "/infer.svg");
  ASSERT_EQ(x.code, 0) << x.out;
  EXPECT_EQ(std::stoi(x.out), 1 + 3 * 4 + 4);  // background, 3 bars x 4 parts, legend
}

TEST(PlanCli, BadInputGivesOneLineAndNonZeroExit) {
  const std::string dir = temp_dir("bad");
  {
    std::ofstream(dir + "/partial.toml") << "name = \"x\"\nmemory_gib = 80\n";
    std::ofstream(dir + "/unknown.toml") << "base = \"h100-80g\"\nmemroy_gib = 80\n";
    std::ofstream(dir + "/config.json") << R"({"model_type": "llama", "hidden_size": 64})";
    std::ofstream(dir + "/small.json") << R"({"model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 1000})";
  }
  const std::string train = "plan train --gpu h100-80g --gpus 16 --seq 4096 --global-batch 256 ";
  const std::pair<std::string, std::string> cases[] = {
      {train + "--model llama2-7b --layout dp=3,tp=8", "= 24 devices, but --gpus is 16"},
      {train + "--model llama2-70b --layout tp=16", "tp=16 does not divide the 8 key/value heads"},
      {train + "--model llama2-7b --layout tp=8,pp=2,zero=3", "zero=3 with pp=2 is not supported"},
      {train + "--model llama2-7b --layout dp=16,ep=2", "is dense"},
      {train + "--model llama2-7b --layout dp=16,mb=3", "not divisible by dp=16 x mb=3"},
      {train + "--model llama2-7b --layout wat=2", "unknown key 'wat'"},
      {train + "--model llama9-1t", "unknown model 'llama9-1t'"},
      {train + "--model " + dir + "/config.json", "missing key 'num_hidden_layers'"},
      {train + "--params 12x", "--params: '12x' is not a positive count"},
      {"plan train --model llama3-405b --gpu a100-40g --gpus 8 --seq 4096 --global-batch 64",
       "fits on no layout of 8 x a100-40g"},
      {"plan train --model llama2-70b --gpu h100-80g --gpus 8 --seq 4096 --global-batch 64 "
       "--layout dp=8,zero=0",
       "does not fit: it needs"},
      {"plan train --model llama2-7b --gpu " + dir + "/partial.toml --gpus 8 --seq 4096 --global-batch 64",
       "missing hardware field 'memory_bandwidth_gbps'"},
      {"plan train --model llama2-7b --gpu " + dir + "/unknown.toml --gpus 8 --seq 4096 --global-batch 64",
       "unknown hardware field 'memroy_gib'"},
      {"plan train --model llama2-7b --gpu x100 --gpus 8 --seq 4096 --global-batch 64", "unknown --gpu 'x100'"},
      {"plan train --model llama2-7b --gpu a100-80g --gpus 8 --seq 4096 --global-batch 64 --precision fp8",
       "has no peak FLOP/s for fp8"},
      {"plan train --model " + dir + "/small.json --gpu h100-80g --gpus 7 --seq 4096 --global-batch 64",
       "no layout of 7 devices divides the model and the batch"},
      {"plan infer --model llama2-70b --gpu h100-80g --context 4096 --tp 3", "--tp 3 does not divide"},
      {"plan infer --model deepseek-v3 --gpu a100-40g --context 4096",
       "leaves no room for one 4096-token request"},
      {"plan infer --model llama2-7b --gpu h100-80g --context 4096 --kv fp4", "--kv: 'fp4'"},
  };
  for (const auto& [args, want] : cases) {
    // stderr only: the error line.
    const auto r = testing::run_command(std::string(TESSERA_CLI_PATH) + " " + args + " 2>&1 >/dev/null", false);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_NE(r.out.find(want), std::string::npos) << args << "\n" << r.out;
    EXPECT_EQ(r.out.find("tessera: error: "), 0u) << args << "\n" << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << args << "\n" << r.out;
  }
}

// `--gpu cpu` reads this machine's calibration (tessera plan calibrate writes it).
TEST(PlanCli, CpuPresetReadsTheCalibrationFile) {
  const std::string dir = temp_dir("cpu");
  std::ofstream(dir + "/cpu.toml")
      << "name = \"cpu\"\nmemory_gib = 8\nmemory_bandwidth_gbps = 12\npeak_tflops_bf16 = 0.15\n"
         "devices_per_node = 2\nintra_node_bandwidth_gbps = 6\nintra_node_latency_us = 5\n"
         "inter_node_bandwidth_gbps = 6\ninter_node_latency_us = 5\nstore_16bit_as_f32 = true\n"
         "comm_overlap = 0\nreserved_gib = 0\nfragmentation = 0\n";
  const std::string cli = std::string(TESSERA_CLI_PATH);
  const std::string args = " plan train --model " + dir + "/small.json --gpu cpu --gpus 2 --seq 128 --global-batch 8 --json";
  std::ofstream(dir + "/small.json") << R"({"model_type": "llama", "hidden_size": 256,
      "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 300})";
  const auto ok = testing::run_command("TESSERA_CPU_CALIBRATION=" + dir + "/cpu.toml " + cli + args, false);
  ASSERT_EQ(ok.code, 0) << ok.out;
  const auto j = nlohmann::json::parse(ok.out);
  EXPECT_EQ(j.at("hardware").at("name"), "cpu");
  EXPECT_DOUBLE_EQ(j.at("hardware").at("memory_bytes").get<double>(), 8.0 * (1 << 30));
  const auto missing = testing::run_command("TESSERA_CPU_CALIBRATION=" + dir + "/none.toml " + cli + args);
  EXPECT_NE(missing.code, 0);
  EXPECT_NE(missing.out.find("run `tessera plan calibrate` first"), std::string::npos) << missing.out;
}

TEST(PlanCli, HardwareFileWithBaseAndFlagOverrides) {
  const std::string dir = temp_dir("hw");
  std::ofstream(dir + "/h.toml") << "base = \"h100-80g\"\nname = \"h100-64g\"\nmemory_gib = 64\n";
  const auto r = run_cli("plan train --model llama2-7b --gpu " + dir +
                         "/h.toml --gpus 8 --seq 4096 --global-batch 64 --layout dp=8,zero=1 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("hardware").at("name"), "h100-64g");
  EXPECT_DOUBLE_EQ(j.at("layouts")[0].at("memory_bytes").at("capacity").get<double>(), 64.0 * (1 << 30));
  const auto o = run_cli("plan train --model llama2-7b --gpu h100-80g --gpu-memory-gib 40 --gpus 8 "
                         "--seq 4096 --global-batch 64 --layout dp=8,zero=3 --json");
  ASSERT_EQ(o.code, 0) << o.out;
  EXPECT_DOUBLE_EQ(nlohmann::json::parse(o.out).at("layouts")[0].at("memory_bytes").at("capacity").get<double>(),
                   40.0 * (1 << 30));
}

}  // namespace
}  // namespace tessera::plan
