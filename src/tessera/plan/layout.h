// A training run to plan (sequence, batch, precision, optimizer) and one parallel layout
// of it (dp, tp, pp, cp, ep, ZeRO stage, micro-batch, recomputation, SP, schedule), with
// the checks that say whether a layout divides the model and the cluster.
#pragma once
#include <cstdint>
#include <string>

#include "tessera/plan/hardware.h"
#include "tessera/plan/model_spec.h"

namespace tessera::plan {

enum class Recompute { kNone, kSelective, kFull };
enum class Schedule { k1F1B, kGPipe, kInterleaved };
enum class Precision { kBf16, kFp16, kFp8, kFp32 };
enum class Optimizer { kAdamW, kSgdMomentum, kMuon };

const char* recompute_name(Recompute r);
const char* schedule_name(Schedule s);
const char* precision_name(Precision p);
const char* optimizer_name(Optimizer o);
Precision parse_precision(const std::string& s);  // bf16 | fp16 | fp8 | fp32
Optimizer parse_optimizer(const std::string& s);  // adamw | sgd | muon

struct TrainSetup {
  int64_t devices = 0;
  int64_t seq = 0;           // tokens per sequence
  int64_t global_batch = 0;  // sequences per optimizer step
  double tokens = 0;         // D, tokens to train on (0: no time-to-train)
  Precision precision = Precision::kBf16;
  Optimizer optimizer = Optimizer::kAdamW;
  bool flash_attention = true;  // no s^2 score tensors are stored (Dao et al. 2022)
  bool dropout = false;         // Llama-family models train without dropout
  // Megatron's selective recomputation keeps the attention output (the input of the
  // output projection); Tessera's recomputes it with the attention kernel.
  bool selective_keeps_attention_output = true;
  // Failures and restarts (docs/planner.md): per-device mean time between failures,
  // checkpoint interval (0 = Young's optimum), stall per checkpoint, time to restart.
  double device_mtbf_hours = 50000;
  double checkpoint_interval_s = 0;
  double checkpoint_stall_s = 30;
  double restart_s = 600;
  double zero_bucket_bytes = 25e6;  // ZeRO-2 gradient bucket (two in flight)

  void validate() const;
};

struct Layout {
  int dp = 1, tp = 1, pp = 1, cp = 1, ep = 1;
  int zero = 0;  // ZeRO stage 0-3
  int64_t micro_batch = 1;  // sequences per micro-batch per data-parallel replica
  Recompute recompute = Recompute::kNone;
  bool sp = false;  // sequence parallelism (Korthikanti et al. 2022), needs tp > 1
  Schedule schedule = Schedule::k1F1B;
  int vpp = 1;  // virtual stages per device (interleaved schedule)
  bool offload = false;  // fp32 master weights + optimizer state in host memory

  int64_t devices() const { return int64_t{dp} * tp * pp * cp; }
  // Micro-batches per optimizer step on each pipeline: global batch / (dp x micro_batch).
  int64_t micro_batches(const TrainSetup& s) const { return s.global_batch / (dp * micro_batch); }
  std::string str() const;  // "dp=2,tp=8,pp=4,cp=1,ep=1,zero=1,mb=1,recompute=selective,sp=on"
};

// "dp=2,tp=8,pp=4,zero=1,mb=1,recompute=selective,sp=on[,cp=2,ep=4,sched=interleaved,vpp=2,
// offload=on]". Keys left out take defaults; dp defaults to devices / (tp pp cp). Errors
// name the key and value.
Layout parse_layout(const std::string& text, int64_t devices);

// The `[parallel]` table `tessera train` reads for this layout (dp, tp, pp, cp, ep,
// zero_stage, sequence_parallel, offload), after a comment naming the layout and the
// [data] / [training] keys it implies (batch_size = dp x micro-batch, grad_accum,
// activation_checkpointing).
std::string parallel_table_toml(const Layout& l, const TrainSetup& s);

// Empty when `layout` divides the model and the cluster; otherwise one line saying why
// (e.g. "tp=3 does not divide the 32 attention heads of llama2-7b").
std::string layout_problem(const ModelSpec& m, const Hardware& hw, const TrainSetup& s,
                           const Layout& l);

// Bytes per element of weights, gradients, fp32 master copy and optimizer moments.
struct StateBytes {
  double weight = 2, grad = 2, master = 4;
  double moments = 8;         // per parameter under AdamW (m and v in fp32)
  double muon_moments = 4;    // per 2-D hidden matrix element under Muon (momentum only)
  double activation = 2;      // bytes per stored activation element
  double matmul_activation = 2;  // ... of one that feeds only matmuls (norm outputs, the
                                 // MLP product): 2 under native bf16 on the CPU build too
};
StateBytes state_bytes(const TrainSetup& s, const Hardware& hw);
const char* compute_dtype(Precision p);  // the peak_flops key its matmuls run at

}  // namespace tessera::plan
