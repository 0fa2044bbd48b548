// `tessera bench gemm|decode|prefill|train|tokenizer`: speed figures with the machine peak
// measured in the same run, printed as ratios.
#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "tessera/base/cpu_features.h"
#include "tessera/base/thread_pool.h"
#include "tessera/cli/commands.h"
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/peak.h"
#include "tessera/model/benchmark.h"
#include "tessera/train/benchmark.h"

namespace tessera::cli {
namespace {

void print_machine() {
  std::printf("machine: %d threads, cpu features: %s\n", base::num_threads(),
              base::describe_cpu_features().c_str());
}

int run_gemm(double min_seconds) {
  print_machine();
  struct Size {
    int64_t m, n, k;
  };
  const Size sizes[] = {{256, 256, 256},    {512, 512, 512},    {1024, 1024, 1024},
                        {2048, 2048, 2048}, {512, 5632, 2048},  {512, 2048, 5632},
                        {256, 768, 3072}};
  double peak[2] = {0, 0};
  std::printf("%-22s %8s %12s\n", "shape (m x n x k)", "dtype", "GFLOP/s");
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (const auto& s : sizes) {
      const auto r = kernels::measure_matmul_gflops(s.m, s.n, s.k, dt, kernels::MatmulBackend::kAuto,
                                                    min_seconds);
      char shape[64];
      std::snprintf(shape, sizeof shape, "%lldx%lldx%lld", (long long)s.m, (long long)s.n,
                    (long long)s.k);
      std::printf("%-22s %8s %12.1f\n", shape, dtype_name(dt), r.gflops);
      double& p = peak[dt == DType::kBF16];
      p = std::max(p, r.gflops);
    }
  }
  std::printf("peak seen: f32 %.1f GFLOP/s, bf16 %.1f GFLOP/s\n", peak[0], peak[1]);
  return 0;
}

int run_decode(const model::BenchOptions& o) {
  print_machine();
  const auto m = model::bench_model(o);
  std::printf("model: %s, %lld layers, hidden %lld, weights %s\n",
              o.model_dir.empty() ? o.shape.c_str() : o.model_dir.c_str(),
              (long long)m.config().num_layers, (long long)m.config().hidden_size,
              dtype_name(m.compute_dtype()));
  const auto r = model::bench_decode(m, o);
  std::printf("decode: %.2f tokens/s, %.1f MB weights/token, %.2f GB/s achieved\n",
              r.tokens_per_second, r.weight_bytes / 1e6, r.achieved_gbps);
  std::printf("stream triad: %.2f GB/s\nratio achieved/stream: %.3f\n", r.stream_triad_gbps, r.ratio);
  return 0;
}

int run_prefill(const model::BenchOptions& o) {
  print_machine();
  const auto m = model::bench_model(o);
  const auto r = model::bench_prefill(m, o);
  std::printf("prefill %lld tokens: %.1f tokens/s, %.1f GFLOP/s achieved\n",
              (long long)o.prompt_tokens, r.tokens_per_second, r.gflops);
  std::printf("bf16 matmul peak (same run): %.1f GFLOP/s\nratio achieved/peak: %.3f\n",
              r.peak_gflops, r.ratio);
  return 0;
}

struct TrainFlags {
  std::string compute = "bf16";
  std::string recompute = "none";
  bool no_optimizer = false;
  bool checkpoint = false;
};

int run_train(model::BenchOptions o, const TrainFlags& f) {
  print_machine();
  o.dtype = DType::kF32;  // f32 master weights; matmuls in the compute dtype
  auto m = model::bench_model(o);
  m.set_compute_dtype(parse_dtype(f.compute));
  m.set_recompute(model::parse_recompute(f.recompute));
  train::StepBenchOptions so;
  so.batch = o.batch;
  so.seq = o.seq;
  so.repeats = o.repeats;
  so.optimizer = !f.no_optimizer;
  so.checkpoint = f.checkpoint;
  so.checkpoint_dir = std::filesystem::temp_directory_path() /
                      ("tessera_bench_ckpt_" + std::to_string(::getpid()));
  const auto r = train::bench_train_step(m, so);
  std::printf("train step (%s) %s, batch %lld x %lld, compute %s, recompute %s: %.3f s, "
              "%.1f tokens/s, %.1f model GFLOP/s\n",
              so.optimizer ? "forward + backward + clip + AdamW" : "forward + backward",
              o.model_dir.empty() ? o.shape.c_str() : o.model_dir.c_str(), (long long)o.batch,
              (long long)o.seq, f.compute.c_str(), f.recompute.c_str(), r.step_seconds,
              r.tokens_per_second, r.model_gflops);
  std::printf("matmul peak (%s, 2048^3, same run): %.1f GFLOP/s; MFU %.3f\n", f.compute.c_str(),
              r.peak_gflops, r.mfu);
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
  std::printf("{\"tessera_tokens_per_s\": %.3f, \"mfu\": %.4f, \"peak_rss_mb\": %.1f, "
              "\"ckpt_stall_fraction\": %.4f}\n",
              r.tokens_per_second, r.mfu, r.peak_rss_mb, stall);
  return 0;
}

}  // namespace

void add_bench_tokenizer(CLI::App* bench, Action& action);  // cmd_tokenizer.cc
void add_bench_comm(CLI::App* bench, Action& action);       // cmd_bench_comm.cc
void add_bench_serve(CLI::App* bench, Action& action);      // cmd_bench_serve.cc

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
    c->add_option("--model", o->model_dir, "Model directory (instead of --shape)");
    c->add_option("--shape", o->shape, "Random model shape: small, 1b, gpt2-124m")->capture_default_str();
    c->add_option("--repeats", o->repeats, "Runs; the median is reported")->capture_default_str();
  };
  auto* decode = bench->add_subcommand("decode", "Decode tokens/s vs STREAM triad bandwidth");
  model_flags(decode);
  decode->add_option("--tokens", o->decode_tokens, "Tokens decoded per run")->capture_default_str();
  decode->add_option("--dtype", *dtype, "Weight dtype")->capture_default_str();
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
  prefill->callback([&action, o, dtype] {
    action = [o, dtype] {
      o->dtype = parse_dtype(*dtype);
      return run_prefill(*o);
    };
  });
  auto* train = bench->add_subcommand("train", "Full training step (forward, backward, clip, AdamW) tokens/s, MFU, peak memory");
  model_flags(train);
  train->add_option("--batch", o->batch, "Sequences per step")->capture_default_str();
  train->add_option("--seq", o->seq, "Tokens per sequence")->capture_default_str();
  auto tf = std::make_shared<TrainFlags>();
  train->add_option("--compute", tf->compute, "Matmul dtype: f32, bf16 or f16")->capture_default_str();
  train->add_option("--recompute", tf->recompute, "Activation checkpointing: none, selective, full")
      ->capture_default_str();
  train->add_flag("--no-optimizer", tf->no_optimizer, "Time forward + backward only");
  train->add_flag("--checkpoint", tf->checkpoint, "Also measure the stall of an async checkpoint");
  train->callback([&action, o, tf] { action = [o, tf] { return run_train(*o, *tf); }; });
  add_bench_tokenizer(bench, action);
  add_bench_comm(bench, action);
  add_bench_serve(bench, action);
}

}  // namespace tessera::cli
