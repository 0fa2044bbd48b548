// STREAM triad and matmul timing (see peak.h).
// GCC 12 warns about its own _mm512_undefined_* placeholders inside _mm512_reduce_add_ps
// (GCC PR 105593), as in quant_avx512.cc.
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <mutex>
#include <regex>
#include <random>
#include <vector>

#include "tessera/base/aligned_alloc.h"
#include "tessera/base/strings.h"
#include "tessera/base/cpu_features.h"
#include "tessera/base/thread_pool.h"
#include "tessera/base/timer.h"
#include "tessera/kernels/peak.h"
#include "tessera/tensor/tensor.h"

namespace tessera::kernels {
namespace {

// Same loop twice: the build has no -march, so the AVX-512 copy is what lets the
// compiler use full-width loads and stores where the CPU has them.
__attribute__((target("avx512f"))) void triad_avx512(float* a, const float* b, const float* c,
                                                     float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}
void triad_portable(float* a, const float* b, const float* c, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

__attribute__((target("avx512f"))) double sum_avx512(const float* p, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 48));
  }
  double s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  for (; i < n; ++i) s += p[i];
  return s;
}
double sum_portable(const float* p, int64_t n) {
  float a[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) a[k] += p[i + k];
  double s = 0;
  for (float v : a) s += v;
  for (; i < n; ++i) s += p[i];
  return s;
}

constexpr int64_t kStreamGrain = 1 << 16;  // (a multiple of 64: every chunk stays 64-byte aligned)

}  // namespace

int64_t stream_array_elements() {
  int64_t llc = 0;
  for (int name : {_SC_LEVEL3_CACHE_SIZE, _SC_LEVEL2_CACHE_SIZE}) {
    const long v = sysconf(name);
    if (v > 0) {
      llc = v;
      break;
    }
  }
  int64_t n = std::max<int64_t>(int64_t{32} << 20, 4 * llc / static_cast<int64_t>(sizeof(float)));
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0)
    n = std::min<int64_t>(n, static_cast<int64_t>(pages) * page / 16 / static_cast<int64_t>(sizeof(float)));
  return n;
}

StreamProbe::StreamProbe(int64_t n, bool huge_pages) : n_(n == 0 ? stream_array_elements() : n) {
  TESSERA_CHECK(n_ > 0, "StreamProbe: the array length (", n_, ") must be positive");
  for (auto* arr : {&a_, &b_, &c_}) *arr = base::aligned_array<float>(n_, huge_pages);
  // First touch from the workers that will stream each chunk (parallel_for's split is
  // deterministic), so pages land on their NUMA node.
  float *a = a_.get(), *b = b_.get(), *c = c_.get();
  base::parallel_for(n_, kStreamGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) a[i] = 0.f, b[i] = 1.f, c[i] = 2.f;
  });
}

double StreamProbe::triad_gbps() {
  const bool avx512 = base::cpu_features().avx512f;
  float *a = a_.get(), *b = b_.get(), *c = c_.get();
  base::Timer t;
  base::parallel_for(n_, kStreamGrain, [&](int64_t i0, int64_t i1) {
    if (avx512)
      triad_avx512(a + i0, b + i0, c + i0, 3.f, i1 - i0);
    else
      triad_portable(a + i0, b + i0, c + i0, 3.f, i1 - i0);
  });
  const double s = t.seconds();
  TESSERA_CHECK(a[n_ / 2] == 7.f, "StreamProbe: wrong triad result");
  return 3.0 * sizeof(float) * static_cast<double>(n_) / s / 1e9;
}

double StreamProbe::best_triad_gbps(int reps) {
  TESSERA_CHECK(reps > 0, "StreamProbe: reps (", reps, ") must be positive");
  double best = 0;
  for (int r = 0; r < reps; ++r) best = std::max(best, triad_gbps());
  return best;
}

double measure_stream_triad_gbps(int64_t n, int reps, bool huge_pages) {
  TESSERA_CHECK(n >= 0 && reps > 0, "measure_stream_triad_gbps: n (", n, ") must not be negative and reps (",
                reps, ") must be positive");
  return StreamProbe(n, huge_pages).best_triad_gbps(reps);
}

double measure_stream_read_gbps(int64_t n, int reps, bool huge_pages) {
  if (n == 0) n = stream_array_elements();
  TESSERA_CHECK(n > 0 && reps > 0, "measure_stream_read_gbps: n (", n, ") and reps (", reps,
                ") must be positive");
  const int64_t total = 3 * n;
  const auto buf = base::aligned_array<float>(total, huge_pages);
  float* p = buf.get();
  const int64_t grain = kStreamGrain;
  base::parallel_for(total, grain, [&](int64_t i0, int64_t i1) { std::fill(p + i0, p + i1, 1.f); });
  const bool avx512 = base::cpu_features().avx512f;
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    std::mutex mu;
    double sum = 0;
    base::Timer t;
    base::parallel_for(total, grain, [&](int64_t i0, int64_t i1) {
      double s = 0;  // (float sums of at most `grain` ones at a time: exact)
      for (int64_t b = i0; b < i1; b += grain) {
        const int64_t e = std::min(i1, b + grain);
        s += avx512 ? sum_avx512(p + b, e - b) : sum_portable(p + b, e - b);
      }
      std::lock_guard<std::mutex> lock(mu);
      sum += s;
    });
    best = std::min(best, t.seconds());
    TESSERA_CHECK(sum == static_cast<double>(total), "measure_stream_read_gbps: wrong sum ", sum);
  }
  return sizeof(float) * static_cast<double>(total) / best / 1e9;
}

GemmMeasurement measure_matmul_gflops(int64_t m, int64_t n, int64_t k, DType dtype,
                                      MatmulBackend backend, double min_seconds,
                                      bool cold_weights) {
  TESSERA_CHECK(m > 0 && n > 0 && k > 0, "measure_matmul_gflops: sizes must be positive, got m=",
                m, " n=", n, " k=", k);
  auto random_tensor = [](int64_t rows, int64_t cols, DType dt, uint32_t seed) {
    Tensor t = Tensor::empty({rows, cols}, DType::kF32);
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(-1.f, 1.f);
    float* p = t.data<float>();
    for (int64_t i = 0; i < rows * cols; ++i) p[i] = dist(rng);
    return t.to(dt);
  };
  const Tensor a = random_tensor(m, k, dtype, 1);  // (m, k)
  std::vector<Tensor> weights{random_tensor(n, k, dtype, 2)};  // each (n, k)
  const double b_bytes = static_cast<double>(n) * k * dtype_size(dtype);
  if (cold_weights) {
    const int copies = static_cast<int>(std::clamp((1u << 30) / b_bytes, 1.0, 4096.0)) + 1;
    for (int i = 1; i < copies; ++i) weights.push_back(weights[0].clone());
  }
  Tensor c = Tensor::empty({m, n}, DType::kF32);  // (m, n)
  GemmMeasurement r;
  r.m = m, r.n = n, r.k = k, r.dtype = dtype;
  double fastest = 1e30;
  r.seconds = base::median_call_seconds(
      [&](int64_t i) {
        base::Timer t;
        matmul_with(backend, a, weights[i % weights.size()], c, false, true, 1.f, 0.f);
        if (i > 0) fastest = std::min(fastest, t.seconds());  // call 0 is the warm-up
      },
      min_seconds);
  r.gflops = 2.0 * m * n * k / r.seconds / 1e9;
  r.best_gflops = 2.0 * m * n * k / fastest / 1e9;
  const double bytes = (static_cast<double>(m) * k + static_cast<double>(n) * k) *
                           dtype_size(dtype) + 4.0 * m * n;
  r.gbps = bytes / r.seconds / 1e9;
  return r;
}

const std::vector<GemmShape>& gemm_bench_shapes() {
  static const std::vector<GemmShape> shapes = {{256, 256, 256},    {512, 512, 512},
                                                {1024, 1024, 1024}, {2048, 2048, 2048},
                                                {512, 5632, 2048},  {512, 2048, 5632},
                                                {256, 768, 3072}};
  return shapes;
}

GemmPeak measure_gemm_peak(DType dtype, double seconds_per_shape) {
  TESSERA_CHECK(dtype == DType::kF32 || dtype == DType::kBF16,
                "measure_gemm_peak: dtype must be f32 or bf16, got ", dtype_name(dtype));
  // Warm-up: the first calls JIT the kernels, request AMX tile state and wait out the
  // clock change of wide vector units; a short probe would time all of that.
  measure_matmul_gflops(1024, 1024, 1024, dtype, MatmulBackend::kAuto, 0.1);
  GemmPeak best;
  best.dtype = dtype;
  for (const GemmShape& s : gemm_bench_shapes()) {
    const auto r = measure_matmul_gflops(s.m, s.n, s.k, dtype, MatmulBackend::kAuto, seconds_per_shape);
    if (r.best_gflops > best.gflops) best.gflops = r.best_gflops, best.m = s.m, best.n = s.n, best.k = s.k;
  }
  return best;
}

namespace {

// Highest clock in /proc/cpuinfo (GHz): the model name's "@ x.xxGHz" (Intel's nominal
// clock) or else the highest "cpu MHz"; 0 when unreadable.
double cpu_clock_ghz() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  double mhz = 0, model_ghz = 0;
  static const std::regex at_ghz(R"(@\s*([0-9.]+)\s*GHz)");
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string key = line.substr(0, line.find_last_not_of(" \t", colon - 1) + 1);
    const std::string value = line.substr(colon + 1);
    try {
      std::smatch m;
      if (key == "cpu MHz")
        mhz = std::max(mhz, std::stod(value));
      else if (key == "model name" && std::regex_search(value, m, at_ghz))
        model_ghz = std::max(model_ghz, std::stod(m[1].str()));
    } catch (const std::exception&) {  // an unparsable line: the other lines still count
    }
  }
  return model_ghz > 0 ? model_ghz : mhz / 1000.0;
}

}  // namespace

NominalPeak nominal_gemm_peak(DType dtype) {
  const auto& f = base::cpu_features();
  const double ghz = cpu_clock_ghz();
  NominalPeak p;
  p.ghz = ghz;
  p.cores = base::num_threads();
  std::string unit;
  double f32 = 0;
  if (f.avx512f) {
    f32 = 64, unit = "AVX-512 FMA, 2 units x 16 lanes x 2";
  } else if (f.avx2 && f.fma) {
    f32 = 32, unit = "AVX2 FMA, 2 units x 8 lanes x 2";
  } else {
    f32 = 8, unit = "SSE";
  }
  p.flops_per_cycle = f32;
  if (dtype == DType::kBF16 && f.amx_bf16) {
    p.flops_per_cycle = 1024, unit = "AMX-BF16, 16x16x32 tile product per 16 cycles";
  } else if (dtype == DType::kBF16 && f.avx512_bf16) {
    p.flops_per_cycle = 2 * f32, unit = "AVX512-BF16 dot product, twice " + unit;
  }
  p.gflops = p.cores * p.ghz * p.flops_per_cycle;
  p.how = base::strprintf("%d cores x %.2f GHz x %.0f flop/cycle (%s; the clock /proc/cpuinfo "
                          "reports, which turbo can exceed)",
                          p.cores, p.ghz, p.flops_per_cycle, unit.c_str());
  return p;
}

}  // namespace tessera::kernels
