// `tessera bench gemm|decode|prefill|train|moe|tokenizer`: speed figures with the machine peak
// measured in the same run, printed as ratios.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "tessera/base/aligned_alloc.h"
#include "tessera/base/cpu_features.h"
#include "tessera/base/thread_pool.h"
#include "tessera/cli/commands.h"
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/peak.h"
#include "tessera/comm/communicator.h"
#include "tessera/model/benchmark.h"
#include "tessera/parallel/context_parallel.h"
#include "tessera/train/benchmark.h"
#include "tessera/train/token_shard.h"
#include "tessera/train/trainer_setup.h"

namespace tessera::cli {
namespace {

void print_machine() {
  std::printf("machine: %d threads, cpu features: %s\n", base::num_threads(),
              base::describe_cpu_features().c_str());
}

int run_gemm(double min_seconds) {
  print_machine();
  double peak[2] = {0, 0};
  std::printf("%-22s %8s %14s %14s\n", "shape (m x n x k)", "dtype", "median GFLOP/s", "best GFLOP/s");
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (const auto& s : kernels::gemm_bench_shapes()) {
      const auto r = kernels::measure_matmul_gflops(s.m, s.n, s.k, dt, kernels::MatmulBackend::kAuto,
                                                    min_seconds);
      char shape[64];
      std::snprintf(shape, sizeof shape, "%lldx%lldx%lld", (long long)s.m, (long long)s.n,
                    (long long)s.k);
      std::printf("%-22s %8s %14.1f %14.1f\n", shape, dtype_name(dt), r.gflops, r.best_gflops);
      double& p = peak[dt == DType::kBF16];
      p = std::max(p, r.best_gflops);
    }
  }
  std::printf("peak seen (best call): f32 %.1f GFLOP/s, bf16 %.1f GFLOP/s\n", peak[0], peak[1]);
  // The probe `bench train`, `bench prefill`, the trainer and `plan calibrate` divide by,
  // measured here too so that the two can be compared in one run.
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const auto p = kernels::measure_gemm_peak(dt);
    const auto nominal = kernels::nominal_gemm_peak(dt);
    std::printf("peak probe %s: %.1f GFLOP/s at %lldx%lldx%lld, %.3f of the table's best; "
                "nominal %.1f GFLOP/s = %s\n",
                dtype_name(dt), p.gflops, (long long)p.m, (long long)p.n, (long long)p.k,
                p.gflops / peak[dt == DType::kBF16], nominal.gflops, nominal.how.c_str());
  }
  return 0;
}

int run_decode(const model::BenchOptions& o) {
  print_machine();
  const auto m = model::bench_model(o);
  std::printf("model: %s, %lld layers, hidden %lld, weights %s\n",
              o.model_dir.empty() ? o.shape.c_str() : o.model_dir.c_str(),
              (long long)m.config().num_layers, (long long)m.config().hidden_size,
              m.weights_description().c_str());
  const auto r = model::bench_decode(m, o);
  std::printf("decode: %.2f tokens/s (median token time), %.1f MB weights/token, %.2f GB/s achieved\n",
              r.tokens_per_second, r.weight_bytes / 1e6, r.achieved_gbps);
  std::printf("decode over whole runs: %.2f tokens/s (median run, neighbours' bursts included)\n",
              r.run_tokens_per_second);
  std::printf("stream triad: %.2f GB/s (best of 10 trials)\nratio achieved/stream: %.3f (whole runs: %.3f)\n",
              r.stream_triad_gbps, r.ratio, r.run_ratio);
  std::printf("stream read: %.2f GB/s (read-only, best of 10 trials)\nratio achieved/read: %.3f\n",
              r.stream_read_gbps, r.read_ratio);
  std::printf("paired ratio achieved/stream: %.3f (median of %lld windows of 8 tokens, each against a triad "
              "trial just before and after it; those trials' median %.2f GB/s)\n",
              r.paired_ratio, static_cast<long long>(r.paired_windows), r.paired_triad_gbps);
  std::printf("memory on transparent huge pages before the probes: %.0f MB (the model's large tensors ask for "
              "them; TESSERA_HUGEPAGES=0 does not)\n", r.huge_page_bytes / 1e6);
  std::printf("stream triad on huge pages%s: %.2f GB/s (best of 10 trials); paired ratio achieved/that: %.3f "
              "(trials' median %.2f GB/s)\n",
              base::huge_pages_enabled() ? "" : " (not asked for: TESSERA_HUGEPAGES=0)", r.stream_triad_huge_gbps,
              r.paired_huge_ratio, r.paired_huge_triad_gbps);
  return 0;
}

int run_prefill(const model::BenchOptions& o) {
  print_machine();
  const auto m = model::bench_model(o);
  const auto r = model::bench_prefill(m, o);
  std::printf("weights %s\n", m.weights_description().c_str());
  std::printf("prefill %lld tokens: %.1f tokens/s, %.1f GFLOP/s achieved\n",
              (long long)o.prompt_tokens, r.tokens_per_second, r.gflops);
  std::printf("%s GEMM peak (same run, shared probe): %.1f GFLOP/s\nratio achieved/peak: %.3f\n",
              dtype_name(r.peak_dtype), r.peak_gflops, r.ratio);
  const auto nominal = kernels::nominal_gemm_peak(r.peak_dtype);
  std::printf("nominal %s peak: %.1f GFLOP/s = %s; ratio achieved/nominal: %.3f\n",
              dtype_name(r.peak_dtype), nominal.gflops, nominal.how.c_str(),
              nominal.gflops > 0 ? r.gflops / nominal.gflops : 0.0);
  return 0;
}

struct TrainFlags {
  std::string config;  // a run config: the step `tessera train --config` would run
  std::string compute = "bf16";
  std::string bf16_mode = "auto";
  std::string recompute = "none";
  bool no_optimizer = false;
  bool checkpoint = false;
  std::string trace;  // Chrome trace of the timed steps
};

// The run config the benchmark's step is built from: --config FILE, or the defaults of
// one with the precision and recompute flags.
train::TrainConfig bench_train_config(const TrainFlags& f) {
  if (!f.config.empty()) return train::TrainConfig::load(f.config);
  train::TrainConfig c;
  const DType dt = parse_dtype(f.compute);
  c.training.precision = dt == DType::kF32 ? "fp32" : dt == DType::kF16 ? "fp16" : "bf16";
  TESSERA_CHECK(dt == DType::kF32 || dt == DType::kBF16 || dt == DType::kF16,
                "--compute '", f.compute, "' is not f32, bf16 or f16");
  model::parse_bf16_request(f.bf16_mode, "--bf16-mode");
  c.training.bf16_mode = f.bf16_mode;
  model::parse_recompute(f.recompute);
  c.training.activation_checkpointing = f.recompute;
  return c;
}

int run_train(model::BenchOptions o, const TrainFlags& f) {
  print_machine();
  const train::TrainConfig cfg = bench_train_config(f);
  std::string what = o.model_dir.empty() ? o.shape : o.model_dir;
  model::Model m;
  if (!f.config.empty()) {
    // The model `tessera train` would start from (its vocabulary: the data's, when known).
    const std::string meta = cfg.data.dir + "/meta.json";
    const auto data = std::filesystem::exists(meta) ? train::read_data_meta(cfg.data.dir) : train::DataMeta{};
    TESSERA_CHECK(cfg.model.vocab_size > 0 || data.vocab_size > 0, "bench train --config ", f.config,
                  ": set [model] vocab_size or point [data] dir at prepared data (", meta, " is missing)");
    m = train::build_model(cfg, data.vocab_size, data.eos_id);
    o.batch = cfg.data.batch_size;
    o.seq = cfg.data.seq_len;
    what = f.config;
  } else {
    o.dtype = DType::kF32;  // f32 master weights; matmuls in the compute dtype
    m = model::bench_model(o);
  }
  train::StepBenchOptions so;
  so.batch = o.batch;
  so.seq = o.seq;
  so.repeats = o.repeats;
  so.optimizer = !f.no_optimizer;
  so.checkpoint = f.checkpoint;
  so.trace = f.trace;
  so.checkpoint_dir = std::filesystem::temp_directory_path() /
                      ("tessera_bench_ckpt_" + std::to_string(::getpid()));
  const auto r = train::bench_train_step(m, cfg, so);
  std::printf("compute %s\n", r.compute.c_str());
  std::printf("%strain step (%s) %s, batch %lld x %lld x %lld, precision %s, recompute %s: %.3f s, "
              "%.1f tokens/s, %.1f model GFLOP/s\n",
              cfg.lora.enabled ? "LoRA " : "", so.optimizer ? "forward + backward + clip + optimizer" : "forward + backward",
              what.c_str(), (long long)cfg.data.grad_accum, (long long)o.batch, (long long)o.seq,
              cfg.training.precision.c_str(), cfg.training.activation_checkpointing.c_str(),
              r.step_seconds, r.tokens_per_second, r.model_gflops);
  std::printf("measured %s GEMM peak (same run, shared probe): %.1f GFLOP/s; MFU %.3f\n",
              dtype_name(r.peak_dtype), r.peak_gflops, r.mfu);
  std::printf("nominal %s peak: %.1f GFLOP/s = %s; MFU %.3f\n", dtype_name(r.peak_dtype),
              r.nominal_gflops, r.nominal_how.c_str(), r.nominal_mfu);
  std::printf("peak RSS: %.0f MiB\n", r.peak_rss_mb);
  double stall = 0;
  if (!r.ckpt.empty())
    std::printf("checkpoint snapshot memory (%.0f MB) reserved before the first step in %.3f s\n",
                r.ckpt_bytes / 1e6, r.ckpt_reserve_seconds);
  for (size_t i = 0; i < r.ckpt.size(); ++i) {
    const train::CheckpointStall& s = r.ckpt[i];
    const char* which = i == 0 ? "first save" : "next save";
    std::printf("%s: steps while the checkpoint was in flight (s):", which);
    for (double t : s.step_seconds) std::printf(" %.3f", t);
    std::printf("\n");
    std::printf("  async checkpoint of %.0f MB: blocked the loop %.3f s, background write %.2f s "
                "over %d steps, total stall %.1f%% of a step (bar 10%%)\n",
                r.ckpt_bytes / 1e6, s.blocking_seconds, s.write_seconds,
                static_cast<int>(s.step_seconds.size()), 100.0 * s.stall_fraction);
    stall = s.stall_fraction;  // the JSON reports the steady state: the last save
  }
  double full_step = 0;
  if (cfg.lora.enabled) {
    // The peer: full fine-tuning of the same model, batch and precision (the config without [lora]).
    train::TrainConfig full = cfg;
    full.lora.enabled = false;
    const auto data = train::read_data_meta(cfg.data.dir);
    model::Model fm = train::build_model(full, data.vocab_size, data.eos_id);
    train::StepBenchOptions fo = so;
    fo.measure_peak = false;
    full_step = train::bench_train_step(fm, full, fo).step_seconds;
    std::printf("full fine-tuning step of the same model and batch: %.3f s; LoRA step / full step = %.2f (bar 0.8)\n",
                full_step, r.step_seconds / full_step);
  }
  std::printf("{\"tessera_tokens_per_s\": %.3f, \"mfu\": %.4f, \"nominal_mfu\": %.4f, "
              "\"peak_gflops\": %.1f, \"bf16_mode\": \"%s\", \"peak_rss_mb\": %.1f, "
              "\"ckpt_stall_fraction\": %.4f%s}\n",
              r.tokens_per_second, r.mfu, r.nominal_mfu, r.peak_gflops,
              model::bf16_mode_name(m.bf16_mode()), r.peak_rss_mb, stall,
              full_step > 0 ? (", \"lora_over_full_step\": " + std::to_string(r.step_seconds / full_step)).c_str() : "");
  return 0;
}

}  // namespace

void add_bench_tokenizer(CLI::App* bench, Action& action);  // cmd_tokenizer.cc
void add_bench_comm(CLI::App* bench, Action& action);       // cmd_bench_comm.cc
void add_bench_serve(CLI::App* bench, Action& action);      // cmd_bench_serve.cc
void add_bench_stream_ppl(CLI::App* bench, Action& action);  // cmd_bench_stream.cc
void add_bench_structured(CLI::App* bench, Action& action); // cmd_bench_structured.cc

void add_bench(CLI::App& app, Action& action) {
  auto* bench = app.add_subcommand("bench", "Benchmarks (figures as ratios to peaks measured in the same run)");
  bench->require_subcommand(1);
  auto o = std::make_shared<model::BenchOptions>();
  auto dtype = std::make_shared<std::string>("bf16");
  auto min_seconds = std::make_shared<double>(0.5);
  auto compute = std::make_shared<std::string>("bf16");

  auto* gemm = bench->add_subcommand("gemm", "Matmul GFLOP/s for f32 and bf16 at several sizes");
  gemm->add_option("--min-seconds", *min_seconds, "Time per size")->capture_default_str();
  gemm->callback([&action, min_seconds] { action = [min_seconds] { return run_gemm(*min_seconds); }; });

  auto model_flags = [&](CLI::App* c) {
    c->add_option("--model", o->model_dir, "Model directory or GGUF file (instead of --shape)");
    c->add_option("--shape", o->shape, "Random model shape: small, 1b, gpt2-124m")->capture_default_str();
    c->add_option("--repeats", o->repeats, "Runs; the median is reported")->capture_default_str();
  };
  auto weights_flag = [&](CLI::App* c) {
    c->add_option("--weights", o->weights,
                  "Quantize the block linears (round-to-nearest): int8, int4 (g128), fp8, w8a8")
        ->check(quant_scheme_validator());
    c->add_flag("--quantize-lm-head", o->quantize_lm_head,
                "With --weights int8 or int4: the head too, int8 per output channel");
  };
  auto* decode = bench->add_subcommand("decode", "Decode tokens/s vs STREAM triad bandwidth");
  model_flags(decode);
  decode->add_option("--tokens", o->decode_tokens, "Tokens decoded per run")->capture_default_str();
  decode->add_option("--dtype", *dtype, "Weight dtype")->capture_default_str();
  decode->add_option("--trace", o->trace, "Write a Chrome trace of the first run's tokens (chrome://tracing, Perfetto)");
  weights_flag(decode);
  decode->callback([&action, o, dtype] {
    action = [o, dtype] {
      o->dtype = parse_dtype(*dtype);
      return run_decode(*o);
    };
  });
  auto* prefill = bench->add_subcommand("prefill", "Prefill FLOP/s vs bf16 matmul peak");
  model_flags(prefill);
  prefill->add_option("--prompt", o->prompt_tokens, "Prompt tokens")->capture_default_str();
  prefill->add_option("--dtype", *dtype, "Weight dtype")->capture_default_str();
  weights_flag(prefill);
  prefill->callback([&action, o, dtype] {
    action = [o, dtype] {
      o->dtype = parse_dtype(*dtype);
      return run_prefill(*o);
    };
  });
  auto* train = bench->add_subcommand("train", "Full training step (forward, backward, clip, AdamW) tokens/s, MFU, peak memory");
  model_flags(train);
  auto* batch = train->add_option("--batch", o->batch, "Sequences per step")->capture_default_str();
  auto* seq = train->add_option("--seq", o->seq, "Tokens per sequence")->capture_default_str();
  auto tf = std::make_shared<TrainFlags>();
  auto* compute_opt = train->add_option("--compute", tf->compute, "Matmul dtype: f32, bf16 or f16")
                      ->capture_default_str();
  auto* bf16 = train->add_option("--bf16-mode", tf->bf16_mode,
                                 "bf16 compute: auto (native on AMX, emulated elsewhere), native or emulated")
                   ->capture_default_str();
  auto* recompute = train->add_option("--recompute", tf->recompute,
                                      "Activation checkpointing: none, selective, full")
                        ->capture_default_str();
  train->add_option("--config", tf->config,
                    "Run config (TOML): bench the step `tessera train --config` runs (model, batch, "
                    "precision, optimizer, ZeRO stage; TESSERA_BF16 applies to both)")
      ->excludes(batch)
      ->excludes(seq)
      ->excludes(compute_opt)
      ->excludes(bf16)
      ->excludes(recompute)
      ->excludes("--model")
      ->excludes("--shape");
  train->add_flag("--no-optimizer", tf->no_optimizer, "Time forward + backward only");
  train->add_flag("--checkpoint", tf->checkpoint, "Also measure the stall of an async checkpoint");
  train->add_option("--trace", tf->trace,
                    "Write a Chrome trace (Perfetto) of the timed steps, one span per kernel call");
  train->callback([&action, o, tf] { action = [o, tf] { return run_train(*o, *tf); }; });
  auto mo = std::make_shared<model::MoeBenchOptions>();
  auto* moe = bench->add_subcommand("moe", "Mixture-of-experts layer (grouped expert GEMMs) vs dense GEMMs of the same FLOPs");
  moe->add_option("--experts", mo->experts, "Experts")->capture_default_str();
  moe->add_option("--top-k", mo->top_k, "Experts per token")->capture_default_str();
  moe->add_option("--hidden", mo->hidden, "Hidden size")->capture_default_str();
  moe->add_option("--ffn", mo->ffn, "Each expert's intermediate size")->capture_default_str();
  moe->add_option("--tokens", mo->tokens, "Tokens per step")->capture_default_str();
  moe->add_option("--dtype", *dtype, "Weight dtype (bf16 or f32)")->capture_default_str();
  moe->add_option("--repeats", mo->repeats, "Runs; the median is reported")->capture_default_str();
  moe->add_option("--trace", mo->trace, "Write a Chrome trace of the timed repeats (chrome://tracing, Perfetto)");
  moe->add_flag("--packed", mo->packed,
                "Both sides' weights kept in oneDNN's packed layout (bf16; TESSERA_PACKED_WEIGHTS)");
  moe->callback([&action, mo, dtype] {
    action = [mo, dtype] {
      mo->dtype = parse_dtype(*dtype);
      TESSERA_CHECK(mo->dtype == DType::kF32 || mo->dtype == DType::kBF16, "--dtype ", *dtype,
                    ": the experts' weights are f32 or bf16");
      TESSERA_CHECK(!mo->packed || mo->dtype == DType::kBF16, "--packed: packed weights are bf16, not --dtype ",
                    *dtype);
      const auto r = model::bench_moe(*mo);
      std::printf("moe: %lld experts, top-%lld, hidden %lld, ffn %lld, %lld tokens, %s weights; %.2f GFLOP of "
                  "expert GEMMs per forward, routed load max/mean %.2f%s\n",
                  static_cast<long long>(mo->experts), static_cast<long long>(mo->top_k),
                  static_cast<long long>(mo->hidden), static_cast<long long>(mo->ffn),
                  static_cast<long long>(mo->tokens), dtype_name(mo->dtype), r.expert_gflop, r.max_over_mean_load,
                  mo->packed ? "; weights packed" : "");
      std::printf("forward:  moe %.2f ms, dense %.2f ms: moe at %.2f of dense (%.1f GFLOP/s)\n", r.moe_forward_s * 1e3,
                  r.dense_forward_s * 1e3, r.forward_ratio, r.expert_gflop / r.moe_forward_s);
      std::printf("backward: moe %.2f ms, dense %.2f ms: moe at %.2f of dense\n", r.moe_backward_s * 1e3,
                  r.dense_backward_s * 1e3, r.backward_ratio);
      return 0;
    };
  });
  auto co = std::make_shared<parallel::CpBenchOptions>();
  auto* cpb = bench->add_subcommand("cp", "Context-parallel attention (ring or Ulysses) over --cp ranks: exposed "
                                          "and hidden communication, vs one rank's whole sequence");
  cpb->add_option("--cp", co->cp, "Ranks (threads, or mpirun's -np)")->capture_default_str();
  cpb->add_option("--method", co->method, "ring or ulysses")->capture_default_str();
  cpb->add_option("--tokens", co->tokens, "Tokens per sequence")->capture_default_str();
  cpb->add_option("--heads", co->heads, "Query heads")->capture_default_str();
  cpb->add_option("--kv-heads", co->kv_heads, "Key/value heads")->capture_default_str();
  cpb->add_option("--head-dim", co->head_dim, "Head dimension")->capture_default_str();
  cpb->add_option("--batch", co->batch, "Sequences")->capture_default_str();
  cpb->add_option("--repeats", co->repeats, "Runs; the median is reported")->capture_default_str();
  cpb->callback([&action, co] {
    action = [co] {
      const auto r = parallel::bench_context_parallel(*co);
      if (comm::running_under_mpi() && comm::mpi_world().rank() != 0) return 0;
      std::printf("cp: %s attention, cp %d, %lld x %lld tokens, %lld/%lld heads of %lld\n", co->method.c_str(),
                  co->cp, static_cast<long long>(co->batch), static_cast<long long>(co->tokens),
                  static_cast<long long>(co->heads), static_cast<long long>(co->kv_heads),
                  static_cast<long long>(co->head_dim));
      std::printf("forward+backward: %.1f ms per rank (one rank, whole sequence: %.1f ms; %.2fx)\n", r.step_s * 1e3,
                  r.single_s * 1e3, r.single_s / r.step_s);
      std::printf("attention %.1f ms, waiting on transfers %.1f ms: exposed communication %.1f%% of attention\n",
                  r.attention_s * 1e3, r.wait_s * 1e3, 100 * r.exposed_fraction());
      std::printf("the transfers alone: %.1f ms (%.1f%% of attention), %.1f MB sent per rank\n", r.transfer_s * 1e3,
                  100 * r.transfer_s / std::max(1e-12, r.attention_s), r.bytes / 1e6);
      if (r.wait_s < r.transfer_s)
        std::printf("hidden behind attention: at least %.0f%% of the transfer time\n", 100 * r.hidden_fraction());
      else
        std::printf("the waits exceed the transfers alone: they are the ranks' compute skew as much as transfer\n");
      return 0;
    };
  });
  add_bench_tokenizer(bench, action);
  add_bench_comm(bench, action);
  add_bench_serve(bench, action);
  add_bench_stream_ppl(bench, action);
  add_bench_structured(bench, action);
}

}  // namespace tessera::cli
