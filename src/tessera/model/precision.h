// The one precision decision of the program: how a 16-bit compute dtype multiplies on
// this CPU. The trainer, every DP/ZeRO stage, `bench train`, inference and the planner's
// calibration all ask choose_bf16_mode(), so they cannot disagree (docs/training.md).
#pragma once
#include <string>

#include "tessera/tensor/dtype.h"

namespace tessera::model {

// How matmuls see a 16-bit compute dtype: kNative hands bf16 operands to the kernel
// (f32 accumulation, as PyTorch's autocast); kEmulated keeps bf16-rounded values in f32
// storage and multiplies them in f32 (the same products: a bf16 x bf16 product is exact
// in f32; only the summation order differs); kEmulatedF16 does the same with fp16
// rounding (values past 65504 become inf, which is what the fp16 loss scaler watches for).
enum class Bf16Mode { kOff, kNative, kEmulated, kEmulatedF16 };

// What a user asked for: `[training] bf16_mode`, `--bf16-mode`, or the TESSERA_BF16
// environment variable (auto | native | emulated).
enum class Bf16Request { kAuto, kNative, kEmulated };
// Errors name `what` (the key or flag) and the text.
Bf16Request parse_bf16_request(const std::string& text, const std::string& what);
const char* bf16_request_name(Bf16Request r);
// The request with TESSERA_BF16 applied: kAuto only when neither asked for a mode.
Bf16Request effective_bf16_request(Bf16Request request);

// f32 -> kOff, f16 -> kEmulatedF16; bf16: an explicit request wins, then TESSERA_BF16,
// then the CPU: native where bf16 products beat f32 ones (AMX-BF16, granted by the OS
// and not capped by TESSERA_ISA; or AVX512-BF16 at twice the f32 rate, as on AMD Zen 5:
// kernels::bf16_native_gemm_faster); emulated where AVX512-BF16's dot product retires
// half the f32 FMA rate (Intel without AMX) and widening to f32 is the faster.
Bf16Mode choose_bf16_mode(DType compute, Bf16Request request = Bf16Request::kAuto);
const char* bf16_mode_name(Bf16Mode mode);  // "off" | "native" | "emulated" | "emulated-f16"

// One line naming the compute precision and the matmul path it takes on this CPU, e.g.
// "bf16 native (bf16 operands, f32 accumulation; oneDNN AMX-BF16)". `tessera train` and
// `tessera bench train` both print it; a test checks they agree.
std::string describe_compute(DType compute, Bf16Mode mode);

// The dtype whose GEMM peak the mode runs at: bf16 for kNative, f32 otherwise (emulated
// 16-bit compute multiplies in f32).
DType matmul_peak_dtype(Bf16Mode mode);

}  // namespace tessera::model
