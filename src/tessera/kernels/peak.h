// Machine peaks to quote kernel speed against: STREAM triad bandwidth and the GEMM
// throughput our own matmul reaches. Used by `tessera bench` and bench/gemm_backends.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/base/aligned_alloc.h"
#include "tessera/kernels/matmul.h"
#include "tessera/tensor/dtype.h"

namespace tessera::kernels {

// STREAM triad a[i] = b[i] + s * c[i] over three f32 arrays of n elements each, on all
// base::num_threads() workers. Counts 3 * 4 bytes per element (STREAM's convention:
// the write-allocate read of a is not counted) and returns the best of `reps` runs in
// GB/s (1e9 bytes), as STREAM does. n = 0: stream_array_elements().
// `huge_pages`: the arrays advised as Tessera's own large tensors are (StreamProbe below).
double measure_stream_triad_gbps(int64_t n_elements_per_array = 0, int reps = 10, bool huge_pages = false);
// Read-only bandwidth: the sum of one f32 array of 3 n elements (the triad's footprint) on
// all workers, each streaming its contiguous part; 4 bytes per element, best of `reps`
// runs, in GB/s. Decode only reads its weights: where a core's outstanding reads, not the
// memory, are the limit (AMD's Zen 4 in a 2-vCPU guest: 28-32 GB/s read against a 35-55
// GB/s triad, whose stores do not wait), this is what a read stream can reach.
double measure_stream_read_gbps(int64_t n_elements_per_array = 0, int reps = 10, bool huge_pages = false);
// A triad's three arrays, allocated and first-touched once, for trials taken between other
// work: `bench decode` pairs each window of tokens with a trial just before and after it,
// since a shared host's bandwidth can change within a run (see docs/performance.md).
// The arrays sit on the pages a plain allocation gets, as in STREAM's own binary; with
// `huge_pages` they are advised as Tessera's large tensors are (base::aligned_malloc), the
// pages decode's weights stream from.
class StreamProbe {
 public:
  explicit StreamProbe(int64_t n_elements_per_array = 0, bool huge_pages = false);  // 0: stream_array_elements()
  double triad_gbps();  // one trial, 3 * 4 bytes per element, GB/s
  double best_triad_gbps(int reps);  // the best of `reps` trials (measure_stream_triad_gbps)
  int64_t elements() const { return n_; }

 private:
  int64_t n_;
  base::AlignedArray<float> a_, b_, c_;
};

// Elements per array for a triad that measures memory, not cache: STREAM's rule, each
// array at least 4x the last-level cache (sysconf), and at least 32 Mi floats; at most
// 1/16 of physical memory each. (A 300 MiB L3 served a triad of 3 x 128 MiB at 28-60
// GB/s, depending on the neighbours' use of it, against 25-27 GB/s from memory.)
int64_t stream_array_elements();

struct GemmMeasurement {
  int64_t m = 0, n = 0, k = 0;
  DType dtype = DType::kF32;
  double gflops = 0;   // 2 * m * n * k / seconds
  double seconds = 0;  // median time of one call
  double best_gflops = 0;  // from the fastest call (what a machine can reach: a shared
                           // machine's neighbours only ever slow a call down)
  double gbps = 0;     // compulsory traffic (read a and b, write c once) / seconds
};

// Times matmul_with(backend) on c(m, n) f32 = a(m, k) @ b(n, k)^T with a and b of
// `dtype` (b laid out as a Linear weight, trans_b). One untimed warm-up call (creates
// the oneDNN primitive), then calls are timed one by one until min_seconds have passed
// (at least 5 calls); reports the MEDIAN call, which is robust on shared machines.
// cold_weights cycles through enough copies of b to exceed 1 GiB, so b streams from
// DRAM as it does in decode of a model larger than the L3 cache.
GemmMeasurement measure_matmul_gflops(int64_t m, int64_t n, int64_t k, DType dtype,
                                      MatmulBackend backend, double min_seconds = 1.0,
                                      bool cold_weights = false);

// The shapes `tessera bench gemm` tables and the peak probe tries: square 256..2048, the
// 1B model's MLP pair and GPT-2's 4 x 64-token step (m x n x k).
struct GemmShape {
  int64_t m, n, k;
};
const std::vector<GemmShape>& gemm_bench_shapes();

// The GEMM peak this machine reaches through matmul() for `dtype` operands (bf16 or f32),
// the one probe `bench gemm`, `bench train`, `bench prefill`, the trainer's MFU and `plan
// calibrate` share: an untimed warm-up of at least 0.1 s (oneDNN JIT, AMX tile state,
// clocks), then every gemm_bench_shapes() shape timed call by call for seconds_per_shape
// with the operands hot; the peak is the fastest call's rate over all shapes.
struct GemmPeak {
  DType dtype = DType::kF32;
  double gflops = 0;
  int64_t m = 0, n = 0, k = 0;  // the shape that reached it
};
GemmPeak measure_gemm_peak(DType dtype, double seconds_per_shape = 0.15);

// The datasheet-style peak from the clock and the core count: cores x GHz x flop/cycle of
// the widest unit (AMX-BF16 1024 bf16 flop/cycle; AVX-512 2 FMA units x 16 lanes x 2;
// AVX512-BF16 twice the f32 rate; AVX2 32). `how` says what it assumed; CPUs with one
// AVX-512 FMA unit, or 256-bit halves, reach half of it. Cores: base::num_threads(); clock: the highest "cpu MHz" in
// /proc/cpuinfo (or the model name's "@ x.xxGHz").
struct NominalPeak {
  double gflops = 0;
  double ghz = 0;
  int cores = 0;
  double flops_per_cycle = 0;
  std::string how;  // e.g. "2 cores x 2.60 GHz x 64 flop/cycle (AVX-512 FMA, 2 units x 16 lanes x 2; ...)"
};
NominalPeak nominal_gemm_peak(DType dtype);

}  // namespace tessera::kernels
