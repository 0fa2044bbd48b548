// The kernels' dispatch point (dispatch.h).
#include "tessera/kernels/dispatch.h"

#include "tessera/base/cpu_features.h"
#include "tessera/base/error.h"

namespace tessera::kernels {

IsaLevel cpu_isa_level() {
  static const IsaLevel level = [] {
    const auto& f = base::cpu_features();  // already capped by TESSERA_ISA
    if (!(f.avx2 && f.fma)) return IsaLevel::kScalar;
    if (!(f.avx512f && f.avx512bw && f.avx512vl)) return IsaLevel::kAvx2;
    if (!f.avx512_bf16) return IsaLevel::kAvx512;
    if (!(f.amx_tile && f.amx_bf16 && f.amx_os_enabled)) return IsaLevel::kAvx512Bf16;
    return IsaLevel::kAmx;
  }();
  return level;
}

const char* isa_level_name(IsaLevel l) {
  switch (l) {
    case IsaLevel::kScalar: return "scalar";
    case IsaLevel::kAvx2: return "avx2";
    case IsaLevel::kAvx512: return "avx512";
    case IsaLevel::kAvx512Bf16: return "avx512_bf16";
    default: return "amx";
  }
}

Device kernel_device_of(const char* op, std::initializer_list<const Tensor*> tensors) {
  bool any = false;
  Device d = Device::kCPU;
  for (const Tensor* t : tensors) {
    if (!t->defined()) continue;
    if (any && t->device() != d)
      fail(op, ": tensors on different devices (", t->describe(), " is not on the others' device)");
    d = t->device();
    any = true;
  }
  if (d != Device::kCPU) no_backend(op, d);
  return d;
}

void no_backend(const char* op, Device d) {
  fail(op, ": no kernel for device ", d == Device::kCUDA ? "cuda" : "?",
       " in this build (the CPU backend is the one built)");
}

}  // namespace tessera::kernels
