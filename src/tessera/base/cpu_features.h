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

// The most a run may use, from TESSERA_ISA=scalar|avx2|avx512|amx|native (for testing the
// fallbacks on a CPU that has more); amx, native, empty or unset cap nothing.
enum class IsaCap { kScalar, kAvx2, kAvx512, kNone };
// Parsed once and cached. Any other value is a one-line error: a mistyped cap would run
// the uncapped kernels while the user believes the fallback was tested.
IsaCap isa_cap();

// Detected once (cpuid + xgetbv + Linux arch_prctl for AMX), then cached, with isa_cap()
// applied.
const CpuFeatures& cpu_features();
std::string describe_cpu_features();
// isa_cap()'s error, raised early: the CLI calls it before any command runs.
void check_isa_cap();

}  // namespace tessera::base
