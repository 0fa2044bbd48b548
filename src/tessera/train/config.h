// A training run's configuration, read from one TOML file (configs/*.toml). Every
// table and key is listed in docs/training.md; unknown keys, wrong types, integers out
// of range (never truncated to the field's type), nan / inf and out-of-range values are
// errors that name the file and "table.key".
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/train/loss_scaler.h"
#include "tessera/train/optimizer.h"
#include "tessera/train/schedule.h"

namespace tessera::train {

struct ModelSection {
  std::string shape = "tiny";  // a named shape (model::ModelConfig::named_shape) ...
  std::string config;          // ... or a Hugging Face config.json path ...
  std::string init_from;       // ... or a model directory to fine-tune (weights loaded)
  std::string arch;            // overrides of the shape, 0 / "" = keep
  int64_t vocab_size = 0;      // 0 = the data's vocabulary size
  int64_t hidden_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0;
  int64_t intermediate_size = 0, max_position_embeddings = 0;
  int tie_word_embeddings = -1;  // -1 keep, 0 / 1
  uint64_t seed = 1234;          // weight initialisation
};

struct DataSection {
  // "tokens" (token shards) or "chat" (conversations, train/chat_data.h); "" = what dir holds.
  std::string format;
  // format = "chat": a JSONL file of {"messages": [...]} rendered with the chat template of
  // data.tokenizer (else model.init_from) into `dir` (default out_dir/chat_data) by the CLI.
  std::string path;
  double val_fraction = 0.05;  // chat: the last conversations of `path` held out for validation
  std::string dir;        // token shards from `tessera data prepare` (or a chat data directory)
  std::string tokenizer;  // copied next to saved models ("" = the data's meta.json tokenizer)
  int64_t seq_len = 128;
  int64_t batch_size = 8;  // sequences per micro-batch
  int64_t grad_accum = 1;  // micro-batches per optimizer step
  uint64_t seed = 1;       // shuffle
};

struct TrainingSection {
  int64_t steps = 100;
  std::string precision = "bf16";                // bf16 | fp16 | fp32
  std::string bf16_mode = "auto";                 // auto | native | emulated (model::choose_bf16_mode)
  std::string activation_checkpointing = "none";  // none | selective | full
  double max_grad_norm = 1.0;                     // <= 0: no clipping
  int64_t eval_every = 0;                         // steps; 0 = only at the end
  int64_t eval_batches = 8;
  // Mixture-of-experts models. Capacity: each expert takes at most this times its even
  // share of a layer's routed slots per micro-batch (the rest dropped, counted in
  // metrics.jsonl); 0 = no limit. Auxiliary-loss-free balancing (DeepSeek-V3): after each
  // step every expert's selection bias moves by this rate towards the mean load
  // (b_e += rate x sign(mean load - load_e), the loads of the whole global batch); > 0
  // gives a model without one a bias (saved as gate.e_score_correction_bias).
  double moe_capacity_factor = 0.0;
  double moe_bias_update_rate = 0.0;
  // DeepSeek-V3's multi-token prediction module (num_nextn_predict_layers): the weight of
  // its cross-entropy in the objective (its loss in metrics.jsonl as mtp_loss); unset (-1):
  // 0.1 for a model with the module (Megatron-LM's default), 0 turns it off.
  double mtp_loss_weight = -1.0;
  // Per-rank memory budget in MiB (0 = none): after the first step, a rank whose
  // parameters, gradients, optimizer state and saved activations (the metrics' mem_*)
  // exceed it stops the run with a one-line error naming the parts, before any checkpoint.
  double memory_limit_mb = 0.0;
};

struct CheckpointSection {
  int64_t every = 0;  // steps; 0 = only at the end
  int keep = 3;
  bool async = true;
};

struct SpikeGuardSection {
  bool enabled = true;
  double sigma = 3.0;       // a loss above mean + sigma * std of the window is a spike
  int64_t window = 50;      // losses the mean and deviation are taken over
  int64_t min_history = 20;  // no verdicts before this many losses were seen
  std::string policy = "skip";  // skip | rollback
  int64_t max_rollbacks = 5;
};

struct LoggingSection {
  bool progress = true;  // progress bar on stderr
  double peak_gflops = 0;  // MFU denominator; 0 = measure the bf16/f32 matmul peak at start
  bool plot = true;        // loss_curve.svg at the end
  std::string trace;       // Chrome trace-event JSON of the run ("" = off)
};

// Data parallelism ([parallel]); the world size comes from the launcher (mpirun, --nproc).
struct ParallelSection {
  int zero_stage = 0;          // 0 DDP, 1 optimizer state, 2 + gradients, 3 + parameters sharded
  double bucket_mb = 25;       // gradient bucket size in MiB (stages 0-2)
  bool offload = false;        // fp32 master weights + optimizer state in host memory (CPU Adam)
  bool prefetch = true;        // stage 3: gather the next layer's weights ahead of use
  std::string algorithm = "auto";  // collectives: auto | backend | ring | hd | hierarchical
  double timeout_s = 300;      // watchdog: a collective slower than this aborts the job
  // The device mesh (parallel/device_mesh.h): dp 0 = the ranks left after pp x tp.
  int64_t dp = 0, tp = 1, pp = 1, cp = 1, ep = 1;
  // Context parallelism (cp > 1): "ring" (ring attention, causal load balancing) or
  // "ulysses" (all-to-all to a head split); model/context_parallel.h.
  std::string cp_method = "ring";
  // Megatron sequence parallelism inside the tp groups (needs tp > 1).
  bool sequence_parallel = false;
  // With sequence parallelism: overlap each forward all-gather with the GEMM of this
  // rank's own rows (model::Model::set_sp_overlap).
  bool sp_overlap = false;
  // Pipeline parallelism (pp > 1): the schedule (gpipe | 1f1b | interleaved), chunks per
  // rank for interleaved, and optionally the layers of each (virtual) stage, in order
  // (empty: balanced by parameter count). The micro-batches of a step are data.grad_accum.
  std::string pp_schedule = "1f1b";
  int64_t pp_virtual_stages = 1;
  std::vector<int64_t> pp_layers;
};

// LoRA fine-tuning ([lora]; docs/fine-tuning.md): adapters on the base model's block
// linears (Hugging Face module names), the base frozen; only the adapters train.
struct LoraSection {
  bool enabled = false;  // the table is present
  int64_t rank = 8;
  double alpha = 16;
  double dropout = 0.0;
  bool rslora = false;  // scale alpha / sqrt(rank)
  std::vector<std::string> target_modules = {"q_proj", "v_proj"};  // PEFT's default for llama
  std::string init_from;  // a PEFT adapter directory to start from ("" = fresh: B = 0)
  // QLoRA: the frozen base quantized on load, round-to-nearest ("" none | int8 | int4 | fp8).
  std::string quantize_base;
  uint64_t seed = 1234;   // adapter initialisation and dropout
};

struct TrainConfig {
  std::string out_dir = "runs/train";  // [run] out_dir
  // [run] save_dtype: the final model's weights in f32 (the master weights, exact) or bf16
  // (half the bytes, what training in bf16 computes with; config.json says torch_dtype).
  std::string save_dtype = "f32";
  ModelSection model;
  DataSection data;
  OptimizerConfig optimizer;
  ScheduleConfig schedule;
  TrainingSection training;
  CheckpointSection checkpoint;
  SpikeGuardSection spike_guard;
  LoggingSection logging;
  ParallelSection parallel;
  LoraSection lora;
  double fp16_init_scale = 65536.0;  // [training] fp16_init_scale
  int64_t fp16_growth_interval = 2000;
  std::string source_text;  // the TOML as read (saved into checkpoints)
  std::string source;       // the file it was read from, for errors found later (build_model)
  // `source`, or "training config" for a config built in code: the prefix of later errors.
  std::string source_name() const { return source.empty() ? "training config" : source; }

  // Relative paths in the file are taken relative to the current directory.
  static TrainConfig load(const std::string& path);
  static TrainConfig parse(const std::string& toml_text, const std::string& source);
};

}  // namespace tessera::train
