// `tessera plan calibrate`: this machine's `cpu` hardware description from its own
// `bench gemm` measurements (GEMM rate curve per dtype), STREAM triad bandwidth and
// `bench comm` all-reduce times (fitted to the alpha-beta ring model).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/plan/hardware.h"
#include "tessera/tensor/dtype.h"

namespace tessera::plan {

struct CalibrateOptions {
  int devices = 0;           // ranks the machine is split into (0: one per core)
  double min_seconds = 0.05; // per GEMM shape
  std::vector<double> gemm_k = {64, 128, 256, 512, 1024, 2048};  // inner sizes of the grid
  std::vector<double> gemm_mn = {128, 256, 512, 1024, 2048};     // outer sizes (m = n)
  bool comm = true;          // measure collectives (needs mpirun unless devices == 1)
  std::string mpirun = "mpirun";
  std::string tessera_exe;   // the binary whose `bench comm` to run ("" = this process's)
  int64_t max_comm_bytes = int64_t{64} << 20;
};

// Measures and returns the description; appends what it did, one line per step, to `log`.
Hardware calibrate_cpu(const CalibrateOptions& o, std::string* log = nullptr);

// --- the measurements, public for tests ---

// Runs fn(device) on `devices` threads at once (the ranks of a run share the machine) and
// returns what each returned.
std::vector<double> on_all_devices(int devices, const std::function<double(int)>& fn);
// Achieved FLOP/s of (mn x k) @ (k x mn) on every grid point, `bench gemm`'s measurement
// (median call), all devices measuring at once; the mean over devices.
GemmTable measure_gemm_table(DType dtype, const CalibrateOptions& o, int devices,
                             std::string* log);
// Tessera's memory-bound layer kernels (norms, RoPE, SwiGLU, residual adds, operand
// rounding) on a Llama-shaped layer, and its optimizer step (AdamW, clipping, weight
// rounding, zeroing), timed on all devices at once and expressed in bytes/s of the time
// model's byte counts (layer_elementwise_bytes, optimizer_bytes_per_param).
double measure_elementwise_bandwidth(int devices, std::string* log);
double measure_optimizer_bandwidth(int devices, std::string* log);
// Tessera's causal flash attention forward + backward (512 tokens, 8 heads of 64, 4 KV
// heads) in FLOP/s of the time model's count: 3.5 x T s heads (d_qk + d_v) / 2 x 2.
double measure_attention_flops(int devices, std::string* log);

// Least-squares fit of t = 2 (p-1) alpha + 2 (p-1)/p n / beta to (bytes, seconds) points,
// minimising relative error. Returns {alpha seconds, beta bytes/s}.
std::pair<double, double> fit_ring_all_reduce(const std::vector<std::pair<double, double>>& pts,
                                              int p);

// (bytes, seconds) of `op` rows in `bench comm --json` output (other lines ignored).
std::vector<std::pair<double, double>> parse_bench_comm_json(const std::string& text,
                                                             const std::string& op, int* ranks);

}  // namespace tessera::plan
