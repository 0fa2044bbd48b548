// Machine peaks to quote kernel speed against: STREAM triad bandwidth and the GEMM
// throughput our own matmul reaches. Used by `tessera bench` and bench/gemm_backends.
#pragma once
#include <cstdint>

#include "tessera/kernels/matmul.h"
#include "tessera/tensor/dtype.h"

namespace tessera::kernels {

// STREAM triad a[i] = b[i] + s * c[i] over three f32 arrays of n elements each, on all
// base::num_threads() workers. Counts 3 * 4 bytes per element (STREAM's convention:
// the write-allocate read of a is not counted) and returns the best of `reps` runs in
// GB/s (1e9 bytes), as STREAM does. The default 32M floats (3 x 128 MiB) is larger
// than any L3 we expect; pass more on machines with bigger caches.
double measure_stream_triad_gbps(int64_t n_elements_per_array = int64_t{32} << 20, int reps = 10);

struct GemmMeasurement {
  int64_t m = 0, n = 0, k = 0;
  DType dtype = DType::kF32;
  double gflops = 0;   // 2 * m * n * k / seconds
  double seconds = 0;  // median time of one call
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

}  // namespace tessera::kernels
