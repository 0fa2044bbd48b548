// dtype names, sizes and half-precision conversions.
#include "tessera/tensor/dtype.h"

#include <cmath>

#include "tessera/base/error.h"

namespace tessera {

size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kI8: return 1;
    case DType::kU8: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kF8E4M3: return 1;
  }
  return 0;
}

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kI8: return "i8";
    case DType::kU8: return "u8";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kF8E4M3: return "f8e4m3";
  }
  return "?";
}

DType parse_dtype(const std::string& s) {
  if (s == "f32" || s == "float32" || s == "fp32") return DType::kF32;
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  if (s == "f16" || s == "float16" || s == "fp16") return DType::kF16;
  if (s == "i8" || s == "int8") return DType::kI8;
  if (s == "u8" || s == "uint8") return DType::kU8;
  if (s == "i32" || s == "int32") return DType::kI32;
  if (s == "i64" || s == "int64") return DType::kI64;
  if (s == "f8e4m3" || s == "float8_e4m3fn") return DType::kF8E4M3;
  fail("unknown dtype '", s, "' (expected f32, bf16, f16, i8, u8, i32, i64 or f8e4m3)");
}

float fp8_e4m3_to_f32(uint8_t v) {
  const int e = (v >> 3) & 0xF, m = v & 7;
  const float sign = (v & 0x80) ? -1.f : 1.f;
  if (e == 15 && m == 7) return std::nanf("");
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -9);
  return sign * std::ldexp(1.f + m / 8.f, e - 7);
}

uint8_t f32_to_fp8_e4m3(float f) {
  if (std::isnan(f)) return 0x7F;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::fabs(f);
  if (a >= 448.f) return sign | 0x7E;
  if (a < std::ldexp(1.f, -6)) {  // subnormal: units of 2^-9 (8 of them make the min normal)
    return sign | static_cast<uint8_t>(std::nearbyint(std::ldexp(a, 9)));
  }
  int ex = 0;
  const float fr = std::frexp(a, &ex);  // a = fr 2^ex, fr in [0.5, 1)
  int e = ex - 1;
  int m = static_cast<int>(std::nearbyint((fr * 2.f - 1.f) * 8.f));
  if (m == 8) m = 0, ++e;
  const int code = ((e + 7) << 3) | m;
  return sign | static_cast<uint8_t>(std::min(code, 0x7E));
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t man = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal
      float f = std::ldexp(static_cast<float>(man), -24);
      std::memcpy(&u, &f, 4);
      u |= sign;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t absu = u & 0x7fffffffu;
  if (absu > 0x7f800000u) return sign | 0x7e00;   // NaN
  if (absu >= 0x477ff000u) return sign | 0x7c00;  // overflow -> inf
  if (absu < 0x38800000u) {                       // subnormal or zero
    float a;
    std::memcpy(&a, &absu, 4);
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f));
  }
  uint32_t mant = absu & 0x7fffffu;
  uint32_t exp = (absu >> 23) - 112;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return sign | static_cast<uint16_t>(h);
}

}  // namespace tessera
