// GEMM backends side by side on this machine: oneDNN vs OpenBLAS vs the skinny decode
// kernel, f32 and bf16, with STREAM triad as the bandwidth peer for decode shapes.
// Usage: gemm_backends [min_seconds_per_measurement=0.5] [rounds=3]
// Every figure is the median over `rounds` interleaved runs of each run's median call.
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tessera/base/cpu_features.h"
#include "tessera/base/thread_pool.h"
#include "tessera/base/timer.h"
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/peak.h"
#include "tessera/tensor/tensor.h"

#ifdef TESSERA_HAVE_OPENBLAS
#include <cblas.h>
#endif

namespace {

using tessera::DType;
using tessera::Tensor;
using tessera::kernels::MatmulBackend;

struct Problem {
  int64_t m, n, k;
  bool cold;  // weights streamed from DRAM (cycled through > 1 GiB of copies)
};

using tessera::base::median;

// Lets the other runtime's spinning workers (OpenMP's or OpenBLAS's) go to sleep, so
// one backend's measurement does not pay for the previous backend's threads.
void settle() { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }

Tensor random_tensor(int64_t rows, int64_t cols, DType dt, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(rows * cols);
  for (float& x : v) x = dist(rng);
  return Tensor::from_vector(v, {rows, cols}).to(dt);
}

#ifdef TESSERA_HAVE_OPENBLAS
// Debian's OpenBLAS 0.3.21 declares cblas_sbgemm but is built without BUILD_BFLOAT16,
// so the symbol is looked up at run time instead of linked.
using SbgemmFn = void (*)(CBLAS_ORDER, CBLAS_TRANSPOSE, CBLAS_TRANSPOSE, blasint, blasint,
                          blasint, float, const uint16_t*, blasint, const uint16_t*, blasint,
                          float, float*, blasint);
extern "C" char* openblas_get_corename(void);
SbgemmFn find_sbgemm() { return reinterpret_cast<SbgemmFn>(dlsym(RTLD_DEFAULT, "cblas_sbgemm")); }

// Median seconds per call of c(m, n) = a(m, k) @ b(n, k)^T through OpenBLAS; same
// layout and warm-up/median rule as measure_matmul_gflops. Returns <0 if unsupported.
double time_openblas(const Problem& p, DType dt, double min_seconds) {
  SbgemmFn sbgemm = find_sbgemm();
  if (dt == DType::kBF16 && !sbgemm) return -1;
  const Tensor a = random_tensor(p.m, p.k, dt, 1);  // (m, k)
  std::vector<Tensor> w{random_tensor(p.n, p.k, dt, 2)};  // each (n, k)
  if (p.cold) {
    const double bytes = static_cast<double>(p.n) * p.k * dtype_size(dt);
    for (int i = 1; i < static_cast<int>((1u << 30) / bytes) + 1; ++i) w.push_back(w[0].clone());
  }
  Tensor c = Tensor::empty({p.m, p.n}, DType::kF32);  // (m, n)
  auto call = [&](const Tensor& b) {
    if (dt == DType::kF32)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, p.m, p.n, p.k, 1.f,
                  a.data<float>(), p.k, b.data<float>(), p.k, 0.f, c.data<float>(), p.n);
    else
      sbgemm(CblasRowMajor, CblasNoTrans, CblasTrans, p.m, p.n, p.k, 1.f,
             static_cast<const uint16_t*>(a.raw_data()), p.k,
             static_cast<const uint16_t*>(b.raw_data()), p.k, 0.f, c.data<float>(), p.n);
  };
  return tessera::base::median_call_seconds([&](int64_t i) { call(w[i % w.size()]); },
                                           min_seconds);
}
#endif

std::string fmt(double v, const char* f = "%.1f") {
  if (v < 0) return "n/a";
  char buf[32];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  const double min_seconds = argc > 1 ? std::atof(argv[1]) : 0.5;
  const int rounds = argc > 2 ? std::max(1, std::atoi(argv[2])) : 3;
  namespace tk = tessera::kernels;
  std::printf("cpu: %s, threads: %d\n", tessera::base::describe_cpu_features().c_str(),
              tessera::base::num_threads());

  std::vector<double> triads;
  for (int r = 0; r < rounds; ++r) triads.push_back(tk::measure_stream_triad_gbps());
  const double triad = median(triads);
  std::printf("STREAM triad (3 x 128 MiB, best of 10, median of %d): %.1f GB/s\n", rounds,
              triad);
  std::vector<double> reads;
  for (int r = 0; r < rounds; ++r) reads.push_back(tk::measure_stream_read_gbps());
  std::printf("read-only sum (384 MiB, best of 10, median of %d): %.1f GB/s\n", rounds, median(reads));
  std::printf("\n");

  const std::vector<Problem> problems = {
      {512, 512, 512, false},    {1024, 1024, 1024, false}, {2048, 2048, 2048, false},
      {512, 2048, 2048, false},  {512, 5632, 2048, false},  {1, 2048, 2048, false},
      {1, 5632, 2048, false},    {1, 2048, 2048, true},     {1, 5632, 2048, true},
      {4, 5632, 2048, true}};

  // Backends: 0 oneDNN native dtype, 1 OpenBLAS, 2 skinny, 3 matmul()'s own choice.
  constexpr int kNumBackends = 4;
  std::printf("%-22s %-5s | %-20s | %-20s | %-20s | %-20s\n", "M x N x K (b = weight)",
              "dtype", "oneDNN GFLOP/s GB/s", "OpenBLAS GFLOP/s GB/s", "skinny GFLOP/s GB/s",
              "auto GFLOP/s GB/s");
  for (const Problem& p : problems) {
    for (DType dt : {DType::kF32, DType::kBF16}) {
      std::vector<double> gf[kNumBackends], bw[kNumBackends];
      for (int r = 0; r < rounds; ++r) {
        for (int bi = 0; bi < kNumBackends; ++bi) {
          if (bi == 2 && p.m > 4) continue;  // skinny is for decode only
          double secs = -1;
          settle();
          if (bi != 1) {
            const MatmulBackend be = bi == 0   ? MatmulBackend::kOneDnn
                                     : bi == 2 ? MatmulBackend::kSkinny
                                               : MatmulBackend::kAuto;
            const auto meas = tk::measure_matmul_gflops(p.m, p.n, p.k, dt, be, min_seconds, p.cold);
            secs = meas.seconds;
          } else {
#ifdef TESSERA_HAVE_OPENBLAS
            secs = time_openblas(p, dt, min_seconds);
#endif
          }
          if (secs <= 0) continue;
          const double bytes = (double(p.m) * p.k + double(p.n) * p.k) * dtype_size(dt) +
                               4.0 * p.m * p.n;
          gf[bi].push_back(2.0 * p.m * p.n * p.k / secs / 1e9);
          bw[bi].push_back(bytes / secs / 1e9);
        }
      }
      std::string name = std::to_string(p.m) + "x" + std::to_string(p.n) + "x" +
                         std::to_string(p.k) + (p.cold ? " cold" : "");
      std::printf("%-22s %-5s", name.c_str(), tessera::dtype_name(dt));
      for (int bi = 0; bi < kNumBackends; ++bi) {
        const bool any = !gf[bi].empty();
        std::printf(" | %9s %10s", any ? fmt(median(gf[bi])).c_str() : "-",
                    any ? fmt(median(bw[bi])).c_str() : "-");
      }
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  std::printf("\nGB/s = compulsory bytes (read a and b once, write c once) / median time.\n"
              "cold = b cycled through > 1 GiB of copies, so it streams from DRAM.\n"
              "STREAM triad for comparison: %.1f GB/s.\n", triad);
#ifdef TESSERA_HAVE_OPENBLAS
  std::printf("OpenBLAS kernel set picked at run time: %s\n", openblas_get_corename());
  if (!find_sbgemm()) std::printf("OpenBLAS bf16: n/a (this OpenBLAS exports no cblas_sbgemm)\n");
#else
  std::printf("OpenBLAS: not linked\n");
#endif
  return 0;
}
