// Runtime CPU feature detection: kernels dispatch on these, so one binary runs
// on CPUs with or without AVX-512 and AMX.
#pragma once
#include <string>

namespace tessera::base {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512_bf16 = false;
  bool avx512_vnni = false;  // vpdpbusd: u8 x s8 dot products into int32
  bool amx_tile = false;
  bool amx_bf16 = false;
  bool amx_int8 = false;
  bool amx_os_enabled = false;  // the OS granted AMX tile state to this process
};

// Detected once (cpuid + xgetbv + Linux arch_prctl for AMX), then cached.
// TESSERA_ISA=scalar|avx2|avx512 caps what kernels may use (for testing the fallbacks);
// amx or native (or unset) caps nothing.
const CpuFeatures& cpu_features();
std::string describe_cpu_features();
// A one-line error when TESSERA_ISA is set to anything else: a mistyped cap would run
// the uncapped kernels while the user believes the fallback was tested. The CLI calls
// it before any command runs.
void check_isa_cap();

}  // namespace tessera::base
