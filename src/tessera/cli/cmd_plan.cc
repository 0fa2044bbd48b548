// `tessera plan train|infer|calibrate`: parallel layout, memory and time estimates before
// renting a cluster (docs/planner.md). Flags here; the models live in src/tessera/plan.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <sstream>

#include "tessera/base/error.h"
#include "tessera/cli/commands.h"
#include "tessera/io/json_file.h"
#include "tessera/plan/calibrate.h"
#include "tessera/plan/report.h"
#include "tessera/plan/svg.h"

namespace tessera::cli {
namespace {

struct ModelFlags {
  std::string model, params;
  plan::ParametricOptions p;
};

struct HardwareFlags {
  std::string gpu;
  int gpus_per_node = 0;
  double memory_gib = 0, memory_bw = 0, peak_tflops = 0, efficiency = 0;
  double intra_bw = 0, intra_lat = -1, inter_bw = 0, inter_lat = -1;
};

struct TrainFlags {
  ModelFlags model;
  HardwareFlags hw;
  int64_t gpus = 0, seq = 0, global_batch = 0;
  std::string global_batch_tokens, tokens, precision = "bf16", optimizer = "adamw", layout, svg,
      emit_config;
  bool json = false, explain = false, no_flash = false, dropout = false;
  int top = 10;
  double mtbf_hours = 50000, ckpt_interval_min = 0, ckpt_stall_s = 30, restart_min = 10;
};

struct InferFlags {
  ModelFlags model;
  HardwareFlags hw;
  plan::InferSetup s;
  bool json = false, explain = false;
  std::string svg;
  int top = 10;
};

void add_model_flags(CLI::App* c, ModelFlags& f) {
  c->add_option("--model", f.model,
                "Preset (llama2-7b llama2-13b llama2-70b llama3-8b llama3-70b llama3-405b gpt3-175b "
                "mixtral-8x7b deepseek-v3) or a Hugging Face config.json / model directory");
  c->add_option("--params", f.params, "Instead of --model: a dense model of this many parameters (200b, 7e9)");
  c->add_option("--layers", f.p.layers, "With --params: layers (default: derived)");
  c->add_option("--hidden", f.p.hidden, "With --params: hidden size (default: derived)");
  c->add_option("--heads", f.p.heads, "With --params: attention heads (default: hidden / 128)");
  c->add_option("--kv-heads", f.p.kv_heads, "With --params: key/value heads (default: 8)");
  c->add_option("--ffn", f.p.ffn, "With --params: MLP width (default: 8/3 hidden rounded to 256)");
  c->add_option("--vocab", f.p.vocab, "With --params: vocabulary size")->capture_default_str();
}

void add_hardware_flags(CLI::App* c, HardwareFlags& f) {
  c->add_option("--gpu", f.gpu, "Preset (a100-40g a100-80g h100-80g h200-141g cpu) or a hardware .toml file")
      ->required();
  c->add_option("--gpus-per-node", f.gpus_per_node, "Override: devices per node");
  c->add_option("--gpu-memory-gib", f.memory_gib, "Override: device memory (GiB)");
  c->add_option("--memory-bandwidth-gbps", f.memory_bw, "Override: device memory bandwidth (GB/s)");
  c->add_option("--peak-tflops", f.peak_tflops, "Override: peak TFLOP/s of the run's dtype");
  c->add_option("--efficiency", f.efficiency, "Override: achievable fraction of peak for GEMMs");
  c->add_option("--intra-bandwidth-gbps", f.intra_bw, "Override: intra-node link GB/s per device per direction");
  c->add_option("--intra-latency-us", f.intra_lat, "Override: intra-node latency (us)");
  c->add_option("--inter-bandwidth-gbps", f.inter_bw, "Override: inter-node link GB/s per device per direction");
  c->add_option("--inter-latency-us", f.inter_lat, "Override: inter-node latency (us)");
}

plan::ModelSpec load_model_spec(const ModelFlags& f) {
  TESSERA_CHECK(f.model.empty() != f.params.empty(),
                "give exactly one of --model NAME|CONFIG and --params COUNT");
  if (!f.model.empty()) return plan::load_model(f.model);
  plan::ParametricOptions p = f.p;
  p.params = plan::parse_count(f.params, "--params");
  return plan::parametric_model(p);
}

plan::Hardware load_hardware_spec(const HardwareFlags& f, const std::string& dtype) {
  plan::Hardware hw = plan::load_hardware(f.gpu);
  if (f.gpus_per_node > 0) hw.devices_per_node = f.gpus_per_node;
  if (f.memory_gib > 0) hw.memory_bytes = f.memory_gib * 1024.0 * 1024 * 1024;
  if (f.memory_bw > 0) hw.memory_bandwidth = f.memory_bw * 1e9;
  if (f.peak_tflops > 0) hw.peak_flops[dtype] = f.peak_tflops * 1e12, hw.gemm.erase(dtype);
  if (f.efficiency > 0) hw.compute_efficiency = f.efficiency;
  if (f.intra_bw > 0) hw.intra_bandwidth = f.intra_bw * 1e9;
  if (f.intra_lat >= 0) hw.intra_latency = f.intra_lat * 1e-6;
  if (f.inter_bw > 0) hw.inter_bandwidth = f.inter_bw * 1e9;
  if (f.inter_lat >= 0) hw.inter_latency = f.inter_lat * 1e-6;
  hw.validate("--gpu " + f.gpu);
  return hw;
}

int run_plan_train(const TrainFlags& f) {
  const plan::ModelSpec m = load_model_spec(f.model);
  plan::TrainSetup s;
  s.devices = f.gpus;
  s.seq = f.seq;
  s.precision = plan::parse_precision(f.precision);
  s.optimizer = plan::parse_optimizer(f.optimizer);
  TESSERA_CHECK((f.global_batch > 0) != !f.global_batch_tokens.empty(),
                "give exactly one of --global-batch SEQUENCES and --global-batch-tokens COUNT");
  TESSERA_CHECK(f.seq >= 1, "--seq must be at least 1, got ", f.seq);
  if (!f.global_batch_tokens.empty()) {
    const double tok = plan::parse_count(f.global_batch_tokens, "--global-batch-tokens");
    s.global_batch = std::max<int64_t>(1, std::llround(tok / static_cast<double>(f.seq)));
  } else {
    s.global_batch = f.global_batch;
  }
  if (!f.tokens.empty()) s.tokens = plan::parse_count(f.tokens, "--tokens");
  s.flash_attention = !f.no_flash;
  s.dropout = f.dropout;
  s.device_mtbf_hours = f.mtbf_hours;
  s.checkpoint_interval_s = f.ckpt_interval_min * 60;
  s.checkpoint_stall_s = f.ckpt_stall_s;
  s.restart_s = f.restart_min * 60;
  s.validate();
  const plan::Hardware hw = load_hardware_spec(f.hw, plan::compute_dtype(s.precision));
  hw.peak(plan::compute_dtype(s.precision));  // the run's dtype must have a peak

  std::vector<plan::Evaluation> shown;
  plan::SearchResult sr;
  const bool single = !f.layout.empty();
  if (single) {
    const plan::Layout l = plan::parse_layout(f.layout, s.devices);
    const std::string problem = plan::layout_problem(m, hw, s, l);
    TESSERA_CHECK(problem.empty(), "--layout ", f.layout, ": ", problem);
    shown.push_back(plan::evaluate_layout(m, hw, s, l));
  } else {
    plan::SearchOptions o;
    o.keep = std::max(f.top, 1);
    sr = plan::search_layouts(m, hw, s, o);
    TESSERA_CHECK(sr.valid > 0, m.name, ": no layout of ", s.devices,
                  " devices divides the model and the batch (check --gpus, --global-batch and --seq)");
    if (sr.ranked.empty()) {
      const plan::Evaluation& n = sr.nearest_misses.front();
      fail(m.name, " fits on no layout of ", s.devices, " x ", hw.name, ": the smallest, ",
           n.layout.str(), ", needs ", plan::format_bytes(n.memory.peak().total()),
           " per device of ", plan::format_bytes(n.memory.capacity), " (over by ",
           plan::format_bytes(n.memory.over_bytes()), ")",
           sr.offload_tried ? ", and none fits with ZeRO-Offload either" : "",
           "; add devices or use a larger --gpu");
    }
    shown = sr.ranked;
  }
  const plan::Evaluation& best = shown.front();
  if (f.json) {
    nlohmann::json j = plan::train_setup_json(m, hw, s);
    j["layouts"] = nlohmann::json::array();
    for (const auto& ev : shown) j["layouts"].push_back(plan::evaluation_json(ev));
    if (!single) {
      j["search"] = {{"valid", sr.valid}, {"fit", sr.fitting}, {"too_big", sr.too_big}};
      j["nearest_misses"] = nlohmann::json::array();
      for (const auto& ev : sr.nearest_misses) {
        nlohmann::json n = plan::evaluation_json(ev);
        n["over_bytes"] = ev.memory.over_bytes();
        j["nearest_misses"].push_back(n);
      }
    }
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("%s", plan::describe_train_setup(m, hw, s).c_str());
    if (!single) {
      std::printf("%s\n", plan::format_search_summary(sr).c_str());
      std::printf("top %zu layouts by predicted throughput (memory in GiB on the fullest device; "
                  "time in s per step; comm = exposed TP + CP + EP + PP + DP):\n",
                  shown.size());
    }
    std::printf("%s\n", plan::format_train_table(shown).c_str());
    std::printf("%s", plan::format_train_summary(best, s).c_str());
    if (f.explain) std::printf("\n%s", plan::explain_train(m, hw, s, best).c_str());
  }
  if (!f.svg.empty()) {
    plan::write_plan_svg(f.svg, m, hw, s, best);
    if (!f.json) std::printf("wrote %s\n", f.svg.c_str());
  }
  if (!f.emit_config.empty()) {
    io::write_file_atomic(f.emit_config, plan::parallel_table_toml(best.layout, s));
    if (!f.json) std::printf("wrote %s\n", f.emit_config.c_str());
  }
  TESSERA_CHECK(best.fits(), "layout ", best.layout.str(), " does not fit: it needs ",
                plan::format_bytes(best.memory.peak().total()), " per device of ",
                plan::format_bytes(best.memory.capacity), " (over by ",
                plan::format_bytes(best.memory.over_bytes()), ")");
  return 0;
}

int run_plan_infer(InferFlags f) {
  const plan::ModelSpec m = load_model_spec(f.model);
  f.s.validate();
  const plan::Hardware hw = load_hardware_spec(f.hw, "bf16");
  const plan::InferSearchResult r = plan::search_inference(m, hw, f.s);
  if (r.ranked.empty()) {
    const plan::InferEvaluation& n = r.rejected.front();
    fail(m.name, " leaves no room for one ", f.s.context, "-token request on ", hw.name,
         " at any of the tried TP degrees and quantizations; the closest (tp=", n.tp, ", ",
         n.weights, " weights, ", n.kv, " KV) has ", plan::format_bytes(n.kv_budget_bytes),
         " for KV against ", plan::format_bytes(n.kv_bytes_per_request), " per request");
  }
  std::vector<plan::InferEvaluation> shown(
      r.ranked.begin(), r.ranked.begin() + std::min<size_t>(r.ranked.size(), std::max(f.top, 1)));
  if (f.json) {
    nlohmann::json j;
    j["model"] = {{"name", m.name}, {"params", m.total_params()}, {"active_params", m.active_params()}};
    j["hardware"] = {{"name", hw.name}, {"memory_bytes", hw.memory_bytes}};
    j["context"] = f.s.context;
    j["configs"] = nlohmann::json::array();
    for (const auto& ev : shown) j["configs"].push_back(plan::infer_evaluation_json(ev));
    j["rejected"] = r.rejected.size();
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("%s", plan::describe_infer_setup(m, hw, f.s).c_str());
  std::printf("%zu configurations fit, %zu do not; ranked by decode tokens/s per device at "
              "full concurrency (accuracy of quantization is not modelled):\n",
              r.ranked.size(), r.rejected.size());
  std::printf("%s\n", plan::format_infer_table(shown).c_str());
  if (f.explain) std::printf("%s", plan::explain_infer(m, hw, f.s, shown.front()).c_str());
  if (!f.svg.empty()) {
    io::write_file_atomic(f.svg, plan::render_infer_svg(m, hw, f.s, shown));
    std::printf("wrote %s\n", f.svg.c_str());
  }
  return 0;
}

}  // namespace

void add_plan(CLI::App& app, Action& action) {
  auto* plan_cmd = app.add_subcommand(
      "plan", "Memory, time and communication estimates and the best parallel layout (docs/planner.md)");
  plan_cmd->require_subcommand(1);

  auto tf = std::make_shared<TrainFlags>();
  auto* train = plan_cmd->add_subcommand(
      "train", "Rank parallel layouts of a training run, or evaluate one with --layout");
  add_model_flags(train, tf->model);
  add_hardware_flags(train, tf->hw);
  train->add_option("--gpus", tf->gpus, "Devices in the cluster")->required();
  train->add_option("--seq", tf->seq, "Tokens per sequence")->required();
  train->add_option("--global-batch", tf->global_batch, "Sequences per optimizer step");
  train->add_option("--global-batch-tokens", tf->global_batch_tokens, "Or tokens per step (4M)");
  train->add_option("--tokens", tf->tokens, "Tokens to train on, D (2T): prints the time to train");
  train->add_option("--precision", tf->precision, "bf16, fp16, fp8 or fp32")->capture_default_str();
  train->add_option("--optimizer", tf->optimizer, "adamw, sgd (momentum) or muon")->capture_default_str();
  train->add_option("--layout", tf->layout,
                    "Evaluate one layout: dp=2,tp=8,pp=4,cp=1,ep=1,zero=1,mb=1,recompute=selective,"
                    "sp=on[,sched=1f1b|gpipe|interleaved,vpp=2,offload=on]");
  train->add_flag("--json", tf->json, "Print JSON for tools");
  train->add_flag("--explain", tf->explain, "Print the arithmetic for the chosen layout");
  train->add_option("--svg", tf->svg, "Draw the chosen pipeline schedule and memory per stage");
  train->add_option("--emit-config", tf->emit_config,
                    "Write the [parallel] table of the chosen layout (for tessera train) to FILE");
  train->add_option("--top", tf->top, "Layouts to list")->capture_default_str();
  train->add_flag("--no-flash-attention", tf->no_flash, "Store attention scores (s^2 per head)");
  train->add_flag("--dropout", tf->dropout, "The model trains with dropout (masks are stored)");
  train->add_option("--mtbf-hours", tf->mtbf_hours, "Mean time between failures of one device")
      ->capture_default_str();
  train->add_option("--checkpoint-interval-min", tf->ckpt_interval_min,
                    "Minutes between checkpoints (default: Young's optimum)");
  train->add_option("--checkpoint-stall-s", tf->ckpt_stall_s, "Seconds training stalls per checkpoint")
      ->capture_default_str();
  train->add_option("--restart-min", tf->restart_min, "Minutes to restart after a failure")
      ->capture_default_str();
  train->callback([&action, tf] { action = [tf] { return run_plan_train(*tf); }; });

  auto inf = std::make_shared<InferFlags>();
  auto* infer = plan_cmd->add_subcommand(
      "infer", "Serving: KV cache, requests that fit, decode tokens/s and TTFT by TP and quantization");
  add_model_flags(infer, inf->model);
  add_hardware_flags(infer, inf->hw);
  infer->add_option("--context", inf->s.context, "Tokens per request (prompt + output)")->required();
  infer->add_option("--prompt", inf->s.prompt, "Prompt tokens for TTFT (default: the context)");
  infer->add_option("--tp", inf->s.tp, "Tensor-parallel degree (default: try 1, 2, 4, 8)");
  infer->add_option("--weights", inf->s.weights, "bf16, int8 or int4 (default: try all)");
  infer->add_option("--kv", inf->s.kv, "KV cache: bf16, fp8 or int8 (default: try all)");
  infer->add_option("--memory-utilization", inf->s.memory_utilization, "Usable fraction of memory")
      ->capture_default_str();
  infer->add_option("--max-batched-tokens", inf->s.max_batched_tokens,
                    "Prefill chunk the activation workspace is sized for")->capture_default_str();
  infer->add_flag("--json", inf->json, "Print JSON for tools");
  infer->add_flag("--explain", inf->explain, "Print the arithmetic for the best configuration");
  infer->add_option("--svg", inf->svg, "Write a memory bar chart of the listed configurations (SVG)");
  infer->add_option("--top", inf->top, "Configurations to list")->capture_default_str();
  infer->callback([&action, inf] { action = [inf] { return run_plan_infer(*inf); }; });

  auto co = std::make_shared<plan::CalibrateOptions>();
  auto out = std::make_shared<std::string>();
  auto* cal = plan_cmd->add_subcommand(
      "calibrate", "Measure this machine (bench gemm, STREAM, bench comm) into the `cpu` hardware file");
  cal->add_option("--out", *out, "File to write (default: " + plan::cpu_calibration_path() + ")");
  cal->add_option("--devices", co->devices, "Ranks the machine is split into (default: one per core)");
  cal->add_option("--min-seconds", co->min_seconds, "Time per GEMM size")->capture_default_str();
  cal->add_flag_function("--no-comm", [co](int64_t) { co->comm = false; }, "Skip the collectives (no mpirun)");
  cal->add_option("--mpirun", co->mpirun, "mpirun to start `bench comm` with")->capture_default_str();
  cal->callback([&action, co, out] {
    action = [co, out] {
      const std::string path = out->empty() ? plan::cpu_calibration_path() : *out;
      std::string log;
      const plan::Hardware hw = plan::calibrate_cpu(*co, &log);
      std::string header = "# Tessera planner: this machine, measured by `tessera plan calibrate`.\n";
      std::istringstream lines(log);
      for (std::string line; std::getline(lines, line);) header += "# " + line + "\n";
      const auto parent = std::filesystem::path(path).parent_path();
      if (!parent.empty()) std::filesystem::create_directories(parent);
      io::write_file_atomic(path, plan::hardware_to_toml(hw, header));
      std::printf("%swrote %s\n", log.c_str(), path.c_str());
      return 0;
    };
  });
}

}  // namespace tessera::cli
