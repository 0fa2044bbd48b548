// cpuid-based feature detection with an optional cap from TESSERA_ISA.
#include "tessera/base/cpu_features.h"

#include <cpuid.h>
#include <cstdlib>
#include <string>
#include <sys/syscall.h>
#include <unistd.h>

#include "tessera/base/error.h"

namespace tessera::base {
namespace {

unsigned long long xgetbv0() {
  unsigned eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}

bool request_amx_permission() {
  // Linux >= 5.16 requires a request for the AMX tile data state (XFEATURE 18).
  constexpr int kArchGetXcompPerm = 0x1022;
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  unsigned long bitmask = 0;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &bitmask) != 0) return false;
  return (bitmask & (1UL << kXfeatureXtiledata)) != 0;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27);
  f.fma = c & (1u << 12);
  if (!osxsave) return f;
  const unsigned long long xcr0 = xgetbv0();
  const bool ymm_ok = (xcr0 & 0x6) == 0x6;
  const bool zmm_ok = (xcr0 & 0xe6) == 0xe6;
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = ymm_ok && (b & (1u << 5));
  f.fma = f.fma && ymm_ok;
  f.avx512f = zmm_ok && (b & (1u << 16));
  f.avx512bw = zmm_ok && (b & (1u << 30));
  f.avx512vl = zmm_ok && (b & (1u << 31));
  f.avx512_vnni = zmm_ok && f.avx512f && (c & (1u << 11));
  f.amx_bf16 = d & (1u << 22);
  f.amx_tile = d & (1u << 24);
  f.amx_int8 = d & (1u << 25);
  __cpuid_count(7, 1, a, b, c, d);
  f.avx512_bf16 = f.avx512f && (a & (1u << 5));
  if (f.amx_tile) f.amx_os_enabled = request_amx_permission();
  if (!f.amx_os_enabled) f.amx_tile = f.amx_bf16 = f.amx_int8 = false;

  const IsaCap cap = isa_cap();
  if (cap != IsaCap::kNone) f.amx_tile = f.amx_bf16 = f.amx_int8 = false;
  if (cap == IsaCap::kAvx2 || cap == IsaCap::kScalar)
    f.avx512f = f.avx512bw = f.avx512vl = f.avx512_bf16 = f.avx512_vnni = false;
  if (cap == IsaCap::kScalar) f.avx2 = f.fma = false;
  return f;
}

IsaCap parse_isa_cap() {
  const char* cap = std::getenv("TESSERA_ISA");
  if (cap == nullptr) return IsaCap::kNone;
  const std::string c = cap;
  if (c == "scalar") return IsaCap::kScalar;
  if (c == "avx2") return IsaCap::kAvx2;
  if (c == "avx512") return IsaCap::kAvx512;
  if (c == "amx" || c == "native" || c.empty()) return IsaCap::kNone;
  fail("TESSERA_ISA='", c, "' is not one of scalar, avx2, avx512, amx, native");
}

}  // namespace

IsaCap isa_cap() {
  static const IsaCap cap = parse_isa_cap();
  return cap;
}

void check_isa_cap() { (void)isa_cap(); }

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

std::string describe_cpu_features() {
  const auto& f = cpu_features();
  std::string s;
  auto add = [&](bool on, const char* name) {
    if (!on) return;
    if (!s.empty()) s += ' ';
    s += name;
  };
  add(f.avx2, "avx2");
  add(f.fma, "fma");
  add(f.avx512f, "avx512f");
  add(f.avx512_bf16, "avx512_bf16");
  add(f.avx512_vnni, "avx512_vnni");
  add(f.amx_tile, "amx_tile");
  add(f.amx_bf16, "amx_bf16");
  return s.empty() ? "scalar" : s;
}

}  // namespace tessera::base
