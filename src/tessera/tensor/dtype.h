// Element types and scalar conversions between them.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>

namespace tessera {

// kF8E4M3: fp8 e4m3 codes (OCP "e4m3fn"), stored, converted and copied, never computed
// with directly (quantized weights: kernels/quant.h).
enum class DType : uint8_t { kF32, kBF16, kF16, kI8, kU8, kI32, kI64, kF8E4M3 };

size_t dtype_size(DType dt);
const char* dtype_name(DType dt);       // "f32", "bf16", ...
DType parse_dtype(const std::string& s);  // accepts f32/float32, bf16/bfloat16, ...; throws

// bfloat16 / float16 stored as raw bits.
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, NaN kept quiet.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
// fp8 e4m3 (OCP / NVIDIA "e4m3fn": bias 7, no infinities, 0x7f/0xff NaN, max 448).
float fp8_e4m3_to_f32(uint8_t v);
uint8_t f32_to_fp8_e4m3(float f);  // round to nearest even, saturating at +-448

template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::kF32;
};
template <>
struct DTypeOf<bf16> {
  static constexpr DType value = DType::kBF16;
};
template <>
struct DTypeOf<f16> {
  static constexpr DType value = DType::kF16;
};
template <>
struct DTypeOf<int8_t> {
  static constexpr DType value = DType::kI8;
};
template <>
struct DTypeOf<uint8_t> {
  static constexpr DType value = DType::kU8;
};
template <>
struct DTypeOf<int32_t> {
  static constexpr DType value = DType::kI32;
};
template <>
struct DTypeOf<int64_t> {
  static constexpr DType value = DType::kI64;
};

}  // namespace tessera
