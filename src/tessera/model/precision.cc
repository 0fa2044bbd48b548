// choose_bf16_mode: the CPU features, TESSERA_BF16 and the request, in that order of weight.
#include "tessera/model/precision.h"

#include <cstdlib>

#include "tessera/base/cpu_features.h"
#include "tessera/base/error.h"
#include "tessera/kernels/bf16_speed.h"

namespace tessera::model {

Bf16Request parse_bf16_request(const std::string& text, const std::string& what) {
  if (text == "auto") return Bf16Request::kAuto;
  if (text == "native") return Bf16Request::kNative;
  if (text == "emulated") return Bf16Request::kEmulated;
  fail(what, " = '", text, "' is not one of auto, native, emulated");
}

const char* bf16_request_name(Bf16Request r) {
  switch (r) {
    case Bf16Request::kNative: return "native";
    case Bf16Request::kEmulated: return "emulated";
    default: return "auto";
  }
}

namespace {

Bf16Request env_request() {
  const char* v = std::getenv("TESSERA_BF16");
  if (!v || !*v) return Bf16Request::kAuto;
  return parse_bf16_request(v, "TESSERA_BF16");
}

}  // namespace

Bf16Request effective_bf16_request(Bf16Request request) {
  return request == Bf16Request::kAuto ? env_request() : request;
}

Bf16Mode choose_bf16_mode(DType compute, Bf16Request request) {
  if (compute == DType::kF32) return Bf16Mode::kOff;
  if (compute == DType::kF16) return Bf16Mode::kEmulatedF16;
  TESSERA_CHECK(compute == DType::kBF16, "compute dtype must be f32, bf16 or f16, not ",
                dtype_name(compute));
  request = effective_bf16_request(request);
  if (request == Bf16Request::kNative) return Bf16Mode::kNative;
  if (request == Bf16Request::kEmulated) return Bf16Mode::kEmulated;
  // The faster of the two: native wherever bf16 products beat f32 ones (AMX; AVX512-BF16
  // at twice the f32 rate), emulated where widening to f32 wins.
  return kernels::bf16_native_gemm_faster() ? Bf16Mode::kNative : Bf16Mode::kEmulated;
}

const char* bf16_mode_name(Bf16Mode mode) {
  switch (mode) {
    case Bf16Mode::kOff: return "off";
    case Bf16Mode::kNative: return "native";
    case Bf16Mode::kEmulated: return "emulated";
    default: return "emulated-f16";
  }
}

DType matmul_peak_dtype(Bf16Mode mode) {
  return mode == Bf16Mode::kNative ? DType::kBF16 : DType::kF32;
}

std::string describe_compute(DType compute, Bf16Mode mode) {
  const auto& f = base::cpu_features();
  const std::string f32_isa = f.avx512f ? "AVX-512" : f.avx2 ? "AVX2" : "SSE";
  switch (mode) {
    case Bf16Mode::kOff:
      return "f32 (f32 operands; oneDNN " + f32_isa + ")";
    case Bf16Mode::kNative:
      return std::string(dtype_name(compute)) + " native (bf16 operands, f32 accumulation; oneDNN " +
             (f.amx_bf16                          ? "AMX-BF16"
              : f.avx512_bf16 && kernels::bf16_native_gemm_faster() ? "AVX512-BF16"
              : f.avx512_bf16 ? "AVX512-BF16, large products widened to f32"
                              : "widened to f32") +
             ")";
    case Bf16Mode::kEmulated:
      return "bf16 emulated (bf16-rounded values multiplied in f32; oneDNN " + f32_isa + ")";
    default:
      return "fp16 emulated (fp16-rounded values multiplied in f32; oneDNN " + f32_isa + ")";
  }
}

}  // namespace tessera::model
