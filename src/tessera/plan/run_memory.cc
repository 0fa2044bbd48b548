// The planner's memory model for a `tessera train` run (run_memory.h).
#include "tessera/plan/run_memory.h"

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/model/precision.h"

namespace tessera::plan {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

Recompute recompute_of(const std::string& s) {
  return s == "full" ? Recompute::kFull : s == "selective" ? Recompute::kSelective : Recompute::kNone;
}

Schedule schedule_of(const std::string& s) {
  return s == "gpipe" ? Schedule::kGPipe : s == "interleaved" ? Schedule::kInterleaved : Schedule::k1F1B;
}

}  // namespace

RunMemory estimate_run_memory(const train::TrainConfig& c, const model::ModelConfig& m, int64_t world,
                              int64_t local_ranks, double available_bytes) {
  const ModelSpec spec = model_from_hf_json(m.to_json(), c.source_name());
  // Tessera's CPU build, as the calibration tests describe it (tests/plan/calibration_test.cc):
  // 16-bit values kept in f32, the matmul-only activations as bf16 under native bf16; the
  // process's own baseline (binary, libraries, data loader) and allocator slack on top.
  Hardware hw;
  hw.name = "this machine";
  hw.memory_bytes = available_bytes / static_cast<double>(std::max<int64_t>(1, local_ranks));
  hw.peak_flops["fp32"] = hw.peak_flops["bf16"] = hw.peak_flops["fp16"] = 1e11;
  hw.memory_bandwidth = 1e10;
  hw.devices_per_node = static_cast<int>(std::max<int64_t>(1, local_ranks));
  hw.intra_bandwidth = hw.inter_bandwidth = 5e9;
  hw.host_memory_bytes = hw.memory_bytes;
  hw.reserved_bytes = 0.25 * kGiB;
  hw.fragmentation = 0.05;
  hw.store_16bit_as_f32 = true;
  hw.native_bf16_activations =
      c.training.precision == "bf16" &&
      model::choose_bf16_mode(DType::kBF16, model::parse_bf16_request(c.training.bf16_mode, "bf16_mode")) ==
          model::Bf16Mode::kNative;
  TrainSetup s;
  s.devices = world;
  s.seq = c.data.seq_len;
  s.global_batch = c.data.batch_size * c.data.grad_accum;
  s.precision = parse_precision(c.training.precision);
  s.optimizer = parse_optimizer(c.optimizer.name);
  s.selective_keeps_attention_output = false;  // Tessera recomputes the attention output
  Layout l;
  const auto& p = c.parallel;
  l.tp = static_cast<int>(p.tp), l.pp = static_cast<int>(p.pp), l.cp = static_cast<int>(p.cp), l.ep = static_cast<int>(p.ep);
  l.dp = static_cast<int>(world / std::max<int64_t>(1, p.tp * p.pp * p.cp));
  l.zero = p.zero_stage;
  l.micro_batch = std::max<int64_t>(1, c.data.batch_size / std::max(1, l.dp));
  l.recompute = recompute_of(c.training.activation_checkpointing);
  l.sp = p.sequence_parallel;
  l.schedule = schedule_of(p.pp_schedule);
  l.vpp = static_cast<int>(p.pp_virtual_stages);
  l.offload = p.offload;
  RunMemory r;
  r.peak = estimate_memory(spec, hw, s, l).peak();
  r.available = hw.memory_bytes;
  r.local_ranks = std::max<int64_t>(1, local_ranks);
  return r;
}

std::optional<std::string> run_memory_error(const train::TrainConfig& c, const RunMemory& r) {
  if (r.fits()) return std::nullopt;
  const StageMemory& p = r.peak;
  const double states = p.weights + p.grads + p.optimizer();
  std::string advice;
  if (p.activations + p.temporary >= states) {
    advice = detail::concat("lower [data] batch_size (now ", c.data.batch_size, ") or seq_len (now ", c.data.seq_len,
                            ")", c.training.activation_checkpointing == "full"
                                     ? ""
                                     : ", or set [training] activation_checkpointing = \"full\"");
  } else {
    advice = c.parallel.zero_stage < 3 && r.local_ranks > 1
                 ? detail::concat("shard the model states: [parallel] zero_stage = 3 (now ", c.parallel.zero_stage, ")")
                 : std::string("keep the optimizer state in host memory ([parallel] offload = true) or train a smaller model");
  }
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "%s: the run needs about %.2f GiB per rank (weights %.2f, gradients %.2f, optimizer %.2f, "
                "activations %.2f, temporaries %.2f GiB: the planner's memory model) but this machine has "
                "%.2f GiB available for each of its %lld rank%s; %s (or pass --no-memory-check)",
                c.source_name().c_str(), p.total() / kGiB, p.weights / kGiB, p.grads / kGiB, p.optimizer() / kGiB,
                p.activations / kGiB, p.temporary / kGiB, r.available / kGiB,
                static_cast<long long>(r.local_ranks), r.local_ranks == 1 ? "" : "s", advice.c_str());
  return std::string(buf);
}

}  // namespace tessera::plan
