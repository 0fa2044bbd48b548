// Decode and prefill benchmarks on a loaded or randomly built model,
// each reported with the machine peak measured in the same run.
#pragma once
#include <string>

#include "tessera/model/model.h"

namespace tessera::model {

struct BenchOptions {
  std::string model_dir;      // load this, or build `shape` with random weights
  std::string shape = "small";
  DType dtype = DType::kBF16;
  std::string weights;          // quantize the block linears: int8 | int4 | fp8 | w8a8 ("" none)
  bool quantize_lm_head = false;  // ... and the head (int8 per channel; with int8 / int4)
  int64_t prompt_tokens = 512;  // prefill length; decode starts after a prompt of 32
  int64_t decode_tokens = 64;
  int repeats = 3;              // median of this many runs
  int64_t batch = 4, seq = 64;  // training step shape (`bench train`)
  std::string trace;            // decode: a Chrome trace of the timed tokens (base/trace.h)
};

struct DecodeBench {
  // 1 / the median time of one token over every run's tokens (median TPOT): robust, like
  // the triad's best-of-trials, to neighbours that slow a shared machine down in bursts.
  double tokens_per_second = 0;
  double run_tokens_per_second = 0;  // the median run's tokens / its wall time (bursts included)
  double weight_bytes = 0;       // matmul weight bytes read per token
  double achieved_gbps = 0;      // weight_bytes * tokens/s
  double stream_triad_gbps = 0;  // measured in the same run (STREAM: the best of 10 trials)
  double ratio = 0;              // achieved / stream
  double run_ratio = 0;          // weight_bytes * run_tokens_per_second / stream
  // Paired: every window of 8 tokens' weight GB/s over the mean of one triad trial just
  // before and one just after it, the median over all windows (a host whose bandwidth
  // changes within a run moves both sides of each pair together).
  double paired_ratio = 0;
  int64_t paired_windows = 0;
  double paired_triad_gbps = 0;  // the median of those trials
  double stream_read_gbps = 0;   // read-only bandwidth, same run (kernels::measure_stream_read_gbps)
  double read_ratio = 0;         // achieved / read
  // The weights sit on transparent huge pages where the kernel grants them (large tensors
  // ask, base/aligned_alloc.h); STREAM's own binary, and the triad above, do not ask. The
  // same triad on advised arrays, paired with the same windows, compares like with like.
  int64_t huge_page_bytes = 0;   // the process's AnonHugePages before the probes (the model's)
  double paired_huge_ratio = 0;
  double paired_huge_triad_gbps = 0;
  double stream_triad_huge_gbps = 0;  // best of 10 trials on advised arrays
};
DecodeBench bench_decode(const Model& model, const BenchOptions& o);

struct PrefillBench {
  double tokens_per_second = 0;
  double gflops = 0;             // achieved matmul + attention FLOP/s (GFLOP/s)
  DType peak_dtype = DType::kBF16;  // the GEMM precision the forward multiplies in
  double peak_gflops = 0;        // kernels::measure_gemm_peak(peak_dtype), same run
  double ratio = 0;
};
PrefillBench bench_prefill(const Model& model, const BenchOptions& o);

// The mixture-of-experts layer (model/moe.h) forward and backward over `tokens` tokens
// against dense GEMMs of the same FLOPs (the top_k experts' work as one MLP of top_k x ffn
// features over the same tokens): the grouped expert GEMMs' share of dense speed.
struct MoeBenchOptions {
  int64_t experts = 8, top_k = 2, hidden = 1024, ffn = 2816, tokens = 1024;
  DType dtype = DType::kBF16;  // the experts' weights (bf16: multiplied as bf16, as training does)
  int repeats = 5;             // median of this many
  // Both sides' weights kept packed in oneDNN's layout (kernels/packed_b.h; bf16 only).
  bool packed = false;
  std::string trace;  // non-empty: a Chrome trace of the timed repeats (base/trace.h)
};
struct MoeBench {
  double moe_forward_s = 0, moe_backward_s = 0, dense_forward_s = 0, dense_backward_s = 0;
  double expert_gflop = 0;     // the experts' GEMM FLOPs of one forward
  double forward_ratio = 0, backward_ratio = 0;  // dense time / MoE time
  double max_over_mean_load = 0;  // the routing's imbalance (random weights)
};
MoeBench bench_moe(const MoeBenchOptions& o);

// Builds the model a benchmark runs on: loads o.model_dir or a random o.shape.
Model bench_model(const BenchOptions& o);

// FLOPs of one forward over `tokens` new tokens at context `ctx_end` (matmuls + attention).
double forward_flops(const ModelConfig& c, int64_t tokens, int64_t ctx_start);

}  // namespace tessera::model
