// The one place a kernel entry point chooses its implementation (as CTranslate2's
// DEVICE_AND_FLOAT_DISPATCH and ggml's per-backend supports_op do): the device its tensors
// live on picks the backend, and on the CPU one ISA level, detected once (and capped by
// TESSERA_ISA), tells every kernel family (pointwise, attention, skinny GEMM) what it may
// use. A CUDA backend adds its files and its case in TESSERA_KERNEL; no entry point
// changes. Entry points (kernels/*.cc) check shapes, then dispatch:
//   TESSERA_KERNEL("add_inplace", cpu::add_inplace(a, b), a, b);
#pragma once
#include <initializer_list>

#include "tessera/base/trace.h"
#include "tessera/tensor/tensor.h"

namespace tessera::kernels {

// What the CPU offers, best last; each level includes the ones before it.
enum class IsaLevel { kScalar, kAvx2, kAvx512, kAvx512Bf16, kAmx };
IsaLevel cpu_isa_level();                // from base::cpu_features (TESSERA_ISA caps it)
const char* isa_level_name(IsaLevel l);  // "scalar" | "avx2" | "avx512" | "avx512_bf16" | "amx"
inline bool cpu_has(IsaLevel l) { return cpu_isa_level() >= l; }

// The device the call runs on: every defined tensor's. A one-line error naming the op when
// they differ, or when no backend implements the op on that device (CUDA: none yet).
Device kernel_device_of(const char* op, std::initializer_list<const Tensor*> tensors);
template <typename... T>
Device kernel_device(const char* op, const T&... tensors) {
  return kernel_device_of(op, {&tensors...});
}
[[noreturn]] void no_backend(const char* op, Device d);

}  // namespace tessera::kernels

// Runs `cpu_call` when the tensors (the remaining arguments) live on the CPU; the other
// devices' backends go here as they are added. Each call is a span of category "kernel"
// in a Chrome trace when one is recording (`op` must be a string literal).
#define TESSERA_KERNEL(op, cpu_call, ...)                                      \
  do {                                                                        \
    const ::tessera::base::TraceScope tessera_kernel_trace_(op, "kernel");    \
    const ::tessera::Device tessera_kernel_device_ =                          \
        ::tessera::kernels::kernel_device(op, __VA_ARGS__);                   \
    switch (tessera_kernel_device_) {                                         \
      case ::tessera::Device::kCPU:                                           \
        cpu_call;                                                             \
        break;                                                                \
      default:                                                                \
        ::tessera::kernels::no_backend(op, tessera_kernel_device_);          \
    }                                                                         \
  } while (0)
