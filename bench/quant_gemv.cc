// The quantized decode GEMV alone: one token (M = 1) against the 1b shape's MLP weights
// (5632 x 2048 and 2048 x 5632), for each scheme and each row kernel this CPU can run,
// cycling through enough weights (~1.5 GB of codes) that none is cached: GB/s of weight
// bytes streamed, beside the STREAM triad of the same run. Where decode is not at the
// triad, this says whether the GEMV or the rest of the token is why. The triad is printed
// on plain pages (STREAM's) and on huge pages (the weights'); ratios are to the first.
// With `hot`, two 512 x 2048 weights (1 MB of int8 codes) cycle instead, staying in L2:
// the kernel's own ceiling, which says whether a CPU's GEMV is bound by memory or by its
// instructions (AMD's Zen 4 runs 512-bit instructions in two halves).
// Usage: quant_gemv [SECONDS_PER_CASE=1] [SCHEME=all] [hot]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "tessera/base/cpu_features.h"
#include "tessera/base/timer.h"
#include "tessera/kernels/cpu/quant_cpu.h"
#include "tessera/kernels/dispatch.h"
#include "tessera/kernels/peak.h"
#include "tessera/kernels/quant.h"

using namespace tessera;
using kernels::QuantScheme;
using kernels::cpu::QuantIsa;

int main(int argc, char** argv) {
  const double min_s = argc > 1 ? std::atof(argv[1]) : 1.0;
  std::vector<QuantIsa> isas = {QuantIsa::kScalar};
  if (kernels::cpu_has(kernels::IsaLevel::kAvx2)) isas.push_back(QuantIsa::kAvx2);
  if (kernels::cpu_has(kernels::IsaLevel::kAvx512)) isas.push_back(QuantIsa::kAvx512);
  if (kernels::cpu_has(kernels::IsaLevel::kAvx512) && base::cpu_features().avx512_vnni)
    isas.push_back(QuantIsa::kAvx512Vnni);
  const char* isa_names[] = {"scalar", "avx2", "avx512", "avx512_vnni"};
  const std::string only = argc > 2 ? argv[2] : "all";
  const bool hot = argc > 3 && std::string(argv[3]) == "hot";
  const double triad = kernels::measure_stream_triad_gbps(), read = kernels::measure_stream_read_gbps();
  // The weights below are tensors, on huge pages where the kernel grants them
  // (base/aligned_alloc.h); STREAM's arrays are not, so both triads are printed.
  const double huge_triad = kernels::measure_stream_triad_gbps(0, 10, /*huge_pages=*/true);
  std::printf("STREAM triad: %.2f GB/s (on huge pages: %.2f), read-only: %.2f GB/s; cpu: %s\n", triad, huge_triad, read,
              base::describe_cpu_features().c_str());
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 0.02f);
  for (QuantScheme s : {QuantScheme::kInt8, QuantScheme::kInt4, QuantScheme::kFp8, QuantScheme::kW8A8}) {
    if (only != "all" && only != kernels::quant_scheme_name(s)) continue;
    // Weights totalling ~1.5 GB of codes for int8 (half for int4), alternating shapes.
    std::vector<kernels::QuantWeight> ws;
    int64_t bytes = 0;
    while (bytes < (int64_t{3} << 29) && !(hot && ws.size() == 2)) {
      const bool up = ws.size() % 2 == 0;
      const int64_t out = hot ? 512 : up ? 5632 : 2048, in = up || hot ? 2048 : 5632;
      std::vector<float> v(out * in);
      for (float& f : v) f = nd(rng);
      ws.push_back(kernels::quantize_rtn(Tensor::from_vector(v, {out, in}), s,
                                         s == QuantScheme::kInt4 ? 128 : 0));
      bytes += ws.back().nbytes();
      if (s == QuantScheme::kInt4 && bytes >= (int64_t{3} << 28)) break;
    }
    Tensor x1 = Tensor::empty({1, 5632}, DType::kF32), x2 = Tensor::empty({1, 2048}, DType::kF32);
    for (Tensor* x : {&x1, &x2})
      for (int64_t i = 0; i < x->numel(); ++i) x->data<float>()[i] = nd(rng) * 50;
    Tensor y1 = Tensor::empty({1, hot ? 512 : 5632}, DType::kF32), y2 = Tensor::empty({1, 2048}, DType::kF32);
    for (QuantIsa isa : isas) {
      if (isa == QuantIsa::kScalar) continue;  // minutes per case; the reference is for tests
      kernels::cpu::force_quant_isa_for_testing(isa);
      std::vector<double> rates;
      for (int round = 0; round < 3; ++round) {
        base::Timer t;
        int64_t streamed = 0;
        size_t i = 0;
        while (t.seconds() < min_s / 3) {
          const kernels::QuantWeight& w = ws[i++ % ws.size()];
          const bool up = w.in == 2048;
          Tensor& y = up ? y1 : y2;
          kernels::quant_matmul_with(kernels::QuantPath::kGemv, up ? x2 : x1, w, y);
          streamed += w.nbytes();
        }
        rates.push_back(static_cast<double>(streamed) / t.seconds() / 1e9);
      }
      const double gbps = base::median(rates);
      std::printf("%-5s %-12s %7.2f GB/s  %.3f of the triad, %.3f of the read\n", kernels::quant_scheme_name(s),
                  isa_names[static_cast<int>(isa)], gbps, gbps / triad, gbps / read);
    }
  }
  kernels::cpu::force_quant_isa_for_testing(std::nullopt);
  return 0;
}
