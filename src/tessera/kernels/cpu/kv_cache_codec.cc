// A KV cache row's stored form <-> f32 (paged_attention.h lists the forms). Writes happen
// once per token, reads once per key tile per query row block, so the widening loops are
// the ones that matter: AVX-512 and AVX2 for every form (a 256-entry table for fp8 on
// scalar CPUs). Writes round in scalar code, but for int8 (quantize_row_s8_fast).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "tessera/kernels/cpu/avx512_math.h"
#include "tessera/kernels/cpu/paged_attention_cpu.h"
#include "tessera/kernels/cpu/quant_rows.h"
#include "tessera/kernels/quant.h"
#include "tessera/kernels/reference/quant_ref.h"

namespace tessera::kernels::cpu {
namespace {

float row_scale(const uint8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof(float));
  return s;
}

struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) v[i] = fp8_e4m3_to_f32(static_cast<uint8_t>(i));
  }
};
const Fp8Table& fp8_table() {
  static const Fp8Table t;
  return t;
}

TESSERA_AVX512 void bf16_to_f32_avx512(const uint16_t* src, int64_t D, float* dst) {
  int64_t e = 0;
  for (; e + 16 <= D; e += 16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + e)));
    _mm512_storeu_ps(dst + e, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
  for (; e < D; ++e) dst[e] = bf16_to_f32(src[e]);
}

TESSERA_AVX512 void int8_to_f32_avx512(const int8_t* src, int64_t D, float scale, float* dst) {
  const __m512 vs = _mm512_set1_ps(scale);
  int64_t e = 0;
  for (; e + 16 <= D; e += 16) {
    const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + e)));
    _mm512_storeu_ps(dst + e, _mm512_mul_ps(_mm512_cvtepi32_ps(w), vs));
  }
  for (; e < D; ++e) dst[e] = scale * src[e];
}

// Values / 256 (avx512::e4m3_over_256) times scale x 256: the same single rounding of
// scale x value as the table's. Code 0x7F (and 0xFF) is NaN, as the table has it.
TESSERA_AVX512 void fp8_to_f32_avx512(const uint8_t* src, int64_t D, float scale, float* dst) {
  const __m512 vs = _mm512_set1_ps(scale * 256.f);
  const __m128i m7f = _mm_set1_epi8(0x7F);
  const __m512 nan = _mm512_set1_ps(std::nanf(""));
  int64_t e = 0;
  for (; e + 16 <= D; e += 16) {
    const __m512 v = _mm512_mul_ps(avx512::e4m3_over_256(src + e), vs);
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + e));
    const __mmask16 is_nan = _mm_cmpeq_epi8_mask(_mm_and_si128(b, m7f), m7f);
    _mm512_storeu_ps(dst + e, _mm512_mask_mov_ps(v, is_nan, nan));
  }
  const float* t = fp8_table().v;
  for (; e < D; ++e) dst[e] = scale * t[src[e]];
}

// The same three at eight values a time for AVX2 CPUs (fp8 through F16C's vcvtph2ps).
#define TESSERA_KV_AVX2 __attribute__((target("avx2,fma,f16c")))

TESSERA_KV_AVX2 void bf16_to_f32_avx2(const uint16_t* src, int64_t D, float* dst) {
  int64_t e = 0;
  for (; e + 8 <= D; e += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + e)));
    _mm256_storeu_ps(dst + e, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  for (; e < D; ++e) dst[e] = bf16_to_f32(src[e]);
}

TESSERA_KV_AVX2 void int8_to_f32_avx2(const int8_t* src, int64_t D, float scale, float* dst) {
  const __m256 vs = _mm256_set1_ps(scale);
  int64_t e = 0;
  for (; e + 8 <= D; e += 8) {
    const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + e)));
    _mm256_storeu_ps(dst + e, _mm256_mul_ps(_mm256_cvtepi32_ps(w), vs));
  }
  for (; e < D; ++e) dst[e] = scale * src[e];
}

// e4m3 s.eeee.mmm placed in an f16 as s.0eeee.mmm0000000 (value / 256, exact), times scale
// x 256: the table's single rounding. Codes 0x7F and 0xFF are NaN.
TESSERA_KV_AVX2 void fp8_to_f32_avx2(const uint8_t* src, int64_t D, float scale, float* dst) {
  const __m256 vs = _mm256_set1_ps(scale * 256.f);
  const __m128i m7f = _mm_set1_epi16(0x7F), m80 = _mm_set1_epi16(0x80);
  const __m256 nan = _mm256_set1_ps(std::nanf(""));
  int64_t e = 0;
  for (; e + 8 <= D; e += 8) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + e)));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, m7f), 7), _mm_slli_epi16(_mm_and_si128(b, m80), 8));
    const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(h), vs);
    const __m256i is_nan = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(_mm_and_si128(b, m7f), m7f));
    _mm256_storeu_ps(dst + e, _mm256_blendv_ps(v, nan, _mm256_castsi256_ps(is_nan)));
  }
  const float* t = fp8_table().v;
  for (; e < D; ++e) dst[e] = scale * t[src[e]];
}

}  // namespace

KvCacheView kv_cache_view(const Tensor& cache) {
  KvCacheView v;
  v.dtype = kv_cache_dtype(cache);
  v.data = static_cast<uint8_t*>(cache.raw_data());
  const int64_t es = static_cast<int64_t>(dtype_size(cache.dtype()));
  v.row_bytes = cache.size(3) * es;
  v.token_bytes = cache.size(2) * v.row_bytes;
  v.block_bytes = cache.size(1) * v.token_bytes;
  return v;
}

void kv_row_to_f32(KvCacheDtype d, const uint8_t* src, int64_t D, float* dst, AttnIsa isa) {
  const bool avx512 = isa == AttnIsa::kAvx512, avx2 = isa == AttnIsa::kAvx2;
  switch (d) {
    case KvCacheDtype::kF32:
      std::memcpy(dst, src, sizeof(float) * D);
      return;
    case KvCacheDtype::kBF16: {
      const auto* b = reinterpret_cast<const uint16_t*>(src);
      if (avx512) return bf16_to_f32_avx512(b, D, dst);
      if (avx2) return bf16_to_f32_avx2(b, D, dst);
      for (int64_t e = 0; e < D; ++e) dst[e] = bf16_to_f32(b[e]);
      return;
    }
    case KvCacheDtype::kInt8: {
      const float s = row_scale(src, D);
      const auto* q = reinterpret_cast<const int8_t*>(src);
      if (avx512) return int8_to_f32_avx512(q, D, s, dst);
      if (avx2) return int8_to_f32_avx2(q, D, s, dst);
      for (int64_t e = 0; e < D; ++e) dst[e] = s * q[e];
      return;
    }
    case KvCacheDtype::kFp8: {
      const float s = row_scale(src, D);
      if (avx512) return fp8_to_f32_avx512(src, D, s, dst);
      if (avx2) return fp8_to_f32_avx2(src, D, s, dst);
      const float* t = fp8_table().v;
      for (int64_t e = 0; e < D; ++e) dst[e] = s * t[src[e]];
      return;
    }
  }
}

void kv_row_from_f32(KvCacheDtype d, const float* src, int64_t D, uint8_t* dst, AttnIsa /*isa*/) {
  switch (d) {
    case KvCacheDtype::kF32:
      std::memcpy(dst, src, sizeof(float) * D);
      return;
    case KvCacheDtype::kBF16: {
      auto* b = reinterpret_cast<uint16_t*>(dst);
      for (int64_t e = 0; e < D; ++e) b[e] = f32_to_bf16(src[e]);
      return;
    }
    case KvCacheDtype::kInt8: {  // W8A8's per-row activation quantizer: absmax / 127
      auto* q = reinterpret_cast<int8_t*>(dst);
      const float s = quantize_row_s8_fast(src, D, q);  // (the same bits as the reference on every path)
      std::memcpy(dst + D, &s, sizeof(float));
      return;
    }
    case KvCacheDtype::kFp8: {
      float amax = 0.f;
      for (int64_t e = 0; e < D; ++e) amax = std::max(amax, std::fabs(src[e]));
      const float s = amax > 0.f ? amax / 448.f : 1.f;
      for (int64_t e = 0; e < D; ++e) dst[e] = f32_to_fp8_e4m3(src[e] / s);
      std::memcpy(dst + D, &s, sizeof(float));
      return;
    }
  }
}

}  // namespace tessera::kernels::cpu
