// GGUF block formats: scalar transcriptions of ggml's dequantize_row_* and
// quantize_row_*_ref (same operations in the same order, so the bytes agree), and their
// exact forms in kernels::QuantWeight.
#include "tessera/io/gguf_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/base/thread_pool.h"
#include "tessera/kernels/quant_params.h"
#include "tessera/tensor/dtype.h"
#include "tessera/tensor/tensor.h"

namespace tessera::io {

namespace {

constexpr int kQK = 32;    // Q8_0 / Q4_0 block
constexpr int kQKK = 256;  // K-quant super-block

uint16_t load_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
void store_u16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
float load_f16(const uint8_t* p) { return f16_to_f32(load_u16(p)); }

// ggml's nearest_int: round to nearest even through the float adder (exact for
// |v| <= 2^22, which is all the quantizers ask of it).
int nearest_int(float v) {
  const float f = v + 12582912.f;
  int32_t i;
  std::memcpy(&i, &f, 4);
  return (i & 0x007fffff) - 0x00400000;
}

// Sub-block j's 6-bit scale and min from a Q4_K super-block's 12 packed bytes.
void scale_min_k4(int j, const uint8_t* q, uint8_t& d, uint8_t& m) {
  if (j < 4) {
    d = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    d = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
  }
}

// ---- dequantization --------------------------------------------------------------------

void dequant_q8_0(const uint8_t* b, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i, b += 34) {
    const float d = load_f16(b);
    const auto* qs = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < kQK; ++j) *y++ = qs[j] * d;
  }
}

void dequant_q4_0(const uint8_t* b, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i, b += 18, y += kQK) {
    const float d = load_f16(b);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = ((b[2 + j] & 0x0F) - 8) * d;
      y[j + kQK / 2] = ((b[2 + j] >> 4) - 8) * d;
    }
  }
}

void dequant_q4_k(const uint8_t* b, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i, b += 144) {
    const float d = load_f16(b), min = load_f16(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* q = b + 16;
    for (int j = 0, is = 0; j < kQKK; j += 64, q += 32, is += 2) {
      uint8_t sc, m;
      scale_min_k4(is, scales, sc, m);
      const float d1 = d * sc, m1 = min * m;
      scale_min_k4(is + 1, scales, sc, m);
      const float d2 = d * sc, m2 = min * m;
      for (int l = 0; l < 32; ++l) *y++ = d1 * (q[l] & 0xF) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * (q[l] >> 4) - m2;
    }
  }
}

void dequant_q6_k(const uint8_t* b, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i, b += 210) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = load_f16(b + 208);
    for (int n = 0; n < kQKK; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * sc[is] * q1;
        y[l + 32] = d * sc[is + 2] * q2;
        y[l + 64] = d * sc[is + 4] * q3;
        y[l + 96] = d * sc[is + 6] * q4;
      }
    }
  }
}

// ---- quantization ----------------------------------------------------------------------

void quant_q8_0(const float* x, int64_t nb, uint8_t* b) {
  for (int64_t i = 0; i < nb; ++i, x += kQK, b += 34) {
    float amax = 0.f;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127;
    const float id = d != 0.f ? 1.f / d : 0.f;
    store_u16(b, f32_to_f16(d));
    for (int j = 0; j < kQK; ++j) b[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::round(x[j] * id)));
  }
}

void quant_q4_0(const float* x, int64_t nb, uint8_t* b) {
  for (int64_t i = 0; i < nb; ++i, x += kQK, b += 18) {
    float amax = 0.f, max = 0.f;
    for (int j = 0; j < kQK; ++j)
      if (amax < std::fabs(x[j])) amax = std::fabs(x[j]), max = x[j];
    const float d = max / -8;
    const float id = d != 0.f ? 1.f / d : 0.f;
    store_u16(b, f32_to_f16(d));
    for (int j = 0; j < kQK / 2; ++j) {
      const uint8_t q0 = static_cast<uint8_t>(std::min(15, static_cast<int>(static_cast<int8_t>(x[j] * id + 8.5f))));
      const uint8_t q1 =
          static_cast<uint8_t>(std::min(15, static_cast<int>(static_cast<int8_t>(x[j + kQK / 2] * id + 8.5f))));
      b[2 + j] = static_cast<uint8_t>(q0 | (q1 << 4));
    }
  }
}

// ggml's make_qkx2_quants for n values with weights w: the scale and (returned through
// the_min, negated) the min of x ~ scale L + min, L in [0, nmax], searched over nstep + 1
// candidate scales around nmax / (max - min) by weighted least squares.
float make_qkx2_quants(int n, int nmax, const float* x, const float* w, uint8_t* L, float* the_min,
                       uint8_t* Laux, float rmin, float rdelta, int nstep) {
  float min = x[0], max = x[0];
  float sum_w = w[0], sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    *the_min = -min;
    return 0.f;
  }
  float iscale = nmax / (max - min);
  float scale = 1 / iscale;
  float best_error = 0;
  for (int i = 0; i < n; ++i) {
    const int l = nearest_int(iscale * (x[i] - min));
    L[i] = static_cast<uint8_t>(std::max(0, std::min(nmax, l)));
    const float diff = scale * L[i] + min - x[i];
    best_error += w[i] * (diff * diff);
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * is + nmax) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      const int l = std::max(0, std::min(nmax, nearest_int(iscale * (x[i] - min))));
      Laux[i] = static_cast<uint8_t>(l);
      sum_l += w[i] * l;
      sum_l2 += w[i] * l * l;
      sum_xl += w[i] * l * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float cur_error = 0;
      for (int i = 0; i < n; ++i) {
        const float diff = this_scale * Laux[i] + this_min - x[i];
        cur_error += w[i] * (diff * diff);
      }
      if (cur_error < best_error) {
        std::copy(Laux, Laux + n, L);
        best_error = cur_error;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  *the_min = -min;
  return scale;
}

void quant_q4_k(const float* x, int64_t nb, uint8_t* b) {
  uint8_t L[kQKK], Laux[32];
  float weights[32], mins[kQKK / 32], scales[kQKK / 32];
  for (int64_t i = 0; i < nb; ++i, x += kQKK, b += 144) {
    uint8_t* sc6 = b + 4;
    std::memset(sc6, 0, 12);
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < kQKK / 32; ++j) {
      float sum_x2 = 0;
      for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
      const float av_x = std::sqrt(sum_x2 / 32);
      for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(x[32 * j + l]);
      scales[j] = make_qkx2_quants(32, 15, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, -1.f, 0.1f, 20);
      if (scales[j] > max_scale) max_scale = scales[j];
      if (mins[j] > max_min) max_min = mins[j];
    }
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    for (int j = 0; j < kQKK / 32; ++j) {
      // uint8_t as ggml stores them (a negative scale wraps and is then capped at 63).
      const uint8_t ls = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_scale * scales[j])));
      const uint8_t lm = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_min * mins[j])));
      if (j < 4) {
        sc6[j] = ls;
        sc6[j + 4] = lm;
      } else {
        sc6[j + 4] = static_cast<uint8_t>((ls & 0xF) | ((lm & 0xF) << 4));
        sc6[j - 4] |= static_cast<uint8_t>((ls >> 4) << 6);
        sc6[j] |= static_cast<uint8_t>((lm >> 4) << 6);
      }
    }
    const uint16_t dh = f32_to_f16(max_scale / 63.f), mh = f32_to_f16(max_min / 63.f);
    store_u16(b, dh);
    store_u16(b + 2, mh);
    for (int j = 0; j < kQKK / 32; ++j) {
      uint8_t sc, m;
      scale_min_k4(j, sc6, sc, m);
      const float d = f16_to_f32(dh) * sc;
      if (d == 0.f) continue;  // the sub-block keeps make_qkx2_quants' codes
      const float dm = f16_to_f32(mh) * m;
      for (int ii = 0; ii < 32; ++ii)
        L[32 * j + ii] = static_cast<uint8_t>(std::max(0, std::min(15, nearest_int((x[32 * j + ii] + dm) / d))));
    }
    uint8_t* q = b + 16;
    for (int j = 0; j < kQKK; j += 64, q += 32)
      for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 4));
  }
}

}  // namespace

bool ggml_can_dequantize(GgmlType t) {
  switch (t) {
    case GgmlType::kF32: case GgmlType::kF16: case GgmlType::kBF16: case GgmlType::kQ8_0:
    case GgmlType::kQ4_0: case GgmlType::kQ4_K: case GgmlType::kQ6_K: return true;
    default: return false;
  }
}

bool ggml_can_quantize(GgmlType t) {
  return ggml_can_dequantize(t) && t != GgmlType::kQ6_K;
}

void dequantize_row(GgmlType t, const uint8_t* src, int64_t n, float* dst) {
  const int64_t nb = n / ggml_type_traits(static_cast<uint32_t>(t))->block;
  switch (t) {
    case GgmlType::kF32: std::memcpy(dst, src, n * 4); return;
    case GgmlType::kF16: return convert_elements(src, DType::kF16, dst, DType::kF32, n);
    case GgmlType::kBF16: return convert_elements(src, DType::kBF16, dst, DType::kF32, n);
    case GgmlType::kQ8_0: return dequant_q8_0(src, nb, dst);
    case GgmlType::kQ4_0: return dequant_q4_0(src, nb, dst);
    case GgmlType::kQ4_K: return dequant_q4_k(src, nb, dst);
    case GgmlType::kQ6_K: return dequant_q6_k(src, nb, dst);
    default: fail("dequantize: ggml type ", ggml_type_name(t), " is not supported");
  }
}

void quantize_row(GgmlType t, const float* src, int64_t n, uint8_t* dst) {
  const int64_t nb = n / ggml_type_traits(static_cast<uint32_t>(t))->block;
  switch (t) {
    case GgmlType::kF32: std::memcpy(dst, src, n * 4); return;
    case GgmlType::kF16: return convert_elements(src, DType::kF32, dst, DType::kF16, n);
    case GgmlType::kBF16: return convert_elements(src, DType::kF32, dst, DType::kBF16, n);
    case GgmlType::kQ8_0: return quant_q8_0(src, nb, dst);
    case GgmlType::kQ4_0: return quant_q4_0(src, nb, dst);
    case GgmlType::kQ4_K: return quant_q4_k(src, nb, dst);
    default: fail("quantize: ggml type ", ggml_type_name(t), " is not supported");
  }
}

void dequantize_rows(GgmlType t, const uint8_t* src, int64_t rows, int64_t cols, float* dst,
                     const std::string& what) {
  TESSERA_CHECK(ggml_can_dequantize(t), what, ": ggml type ", ggml_type_name(t),
                " cannot be read (Tessera reads F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K)");
  const int64_t rb = ggml_row_bytes(t, cols, what);
  base::parallel_for(rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) dequantize_row(t, src + r * rb, cols, dst + r * cols);
  });
}

std::string quantize_rows(GgmlType t, const float* src, int64_t rows, int64_t cols,
                          const std::string& what) {
  TESSERA_CHECK(ggml_can_quantize(t), what, ": ggml type ", ggml_type_name(t),
                " cannot be written (Tessera writes F32, F16, BF16, Q8_0, Q4_0, Q4_K)");
  const int64_t rb = ggml_row_bytes(t, cols, what);
  if (t != GgmlType::kF32 && t != GgmlType::kF16 && t != GgmlType::kBF16)
    for (int64_t i = 0; i < rows * cols; ++i)
      TESSERA_CHECK(std::isfinite(src[i]), what, ": value ", i, " is ", src[i], ", which ",
                    ggml_type_name(t), " cannot hold");
  std::string out(static_cast<size_t>(rows * rb), '\0');
  auto* dst = reinterpret_cast<uint8_t*>(out.data());
  base::parallel_for(rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row(t, src + r * cols, cols, dst + r * rb);
  });
  return out;
}

// ---- kernel forms ----------------------------------------------------------------------

std::optional<kernels::QuantWeight> gguf_quant_weight(GgmlType t, const uint8_t* src, int64_t rows,
                                                      int64_t cols) {
  using kernels::QuantScheme;
  if (t != GgmlType::kQ8_0 && t != GgmlType::kQ4_0 && t != GgmlType::kQ4_K && t != GgmlType::kQ6_K)
    return std::nullopt;
  kernels::QuantWeight w;
  w.out = rows;
  w.in = cols;
  const bool int4 = t == GgmlType::kQ4_0 || t == GgmlType::kQ4_K;
  w.scheme = int4 ? QuantScheme::kInt4 : QuantScheme::kInt8;
  w.group = t == GgmlType::kQ6_K ? 16 : 32;
  TESSERA_CHECK(cols % ggml_type_traits(static_cast<uint32_t>(t))->block == 0, "gguf_quant_weight: ", cols,
                " columns are not a whole number of ", ggml_type_name(t), " blocks");
  const int64_t G = cols / w.group, rb = ggml_row_bytes(t, cols, "gguf_quant_weight");
  w.q = Tensor::empty(int4 ? Shape{rows, cols / 2} : Shape{rows, cols}, DType::kU8);
  w.scales = Tensor::empty({rows, G}, DType::kF32);
  w.zeros = Tensor::empty({rows, G}, DType::kF32);
  base::parallel_for(rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<int32_t> codes(32);
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = src + r * rb;
      uint8_t* q = w.q.data<uint8_t>() + r * (int4 ? cols / 2 : cols);
      float* s = w.scales.data<float>() + r * G;
      float* z = w.zeros.data<float>() + r * G;
      if (t == GgmlType::kQ8_0) {
        for (int64_t g = 0; g < G; ++g, row += 34) {
          s[g] = load_f16(row);
          z[g] = 128.f;
          for (int j = 0; j < kQK; ++j) q[g * kQK + j] = static_cast<uint8_t>(static_cast<int8_t>(row[2 + j]) + 128);
        }
      } else if (t == GgmlType::kQ4_0) {
        for (int64_t g = 0; g < G; ++g, row += 18) {
          s[g] = load_f16(row);
          z[g] = 8.f;
          std::memcpy(q + g * 16, row + 2, 16);
        }
      } else if (t == GgmlType::kQ4_K) {
        for (int64_t sb = 0; sb < cols / kQKK; ++sb, row += 144) {
          const float d = load_f16(row), dmin = load_f16(row + 2);
          for (int j = 0; j < 8; ++j) {
            uint8_t sc, m;
            scale_min_k4(j, row + 4, sc, m);
            const float d1 = d * sc, m1 = dmin * m;
            const int64_t g = sb * 8 + j;
            // Sub-block j's codes: nibbles of bytes 32 (j / 2) .. +32, low for even j.
            const uint8_t* nib = row + 16 + 32 * (j / 2);
            for (int l = 0; l < 32; ++l) codes[l] = j % 2 == 0 ? nib[l] & 0xF : nib[l] >> 4;
            if (d1 == 0.f) {
              std::fill(codes.begin(), codes.end(), 0);
              s[g] = m1;
              z[g] = 1.f;
            } else {
              s[g] = d1;
              z[g] = m1 / d1;
            }
            kernels::pack_int4(codes.data(), 32, q + g * 16);
          }
        }
      } else {  // Q6_K: 16 groups of 16 per super-block
        for (int64_t sb = 0; sb < cols / kQKK; ++sb, row += 210) {
          const uint8_t* ql = row;
          const uint8_t* qh = row + 128;
          const auto* sc = reinterpret_cast<const int8_t*>(row + 192);
          const float d = load_f16(row + 208);
          uint8_t* qq = q + sb * kQKK;
          for (int n = 0; n < kQKK; n += 128, ql += 64, qh += 32) {
            for (int l = 0; l < 32; ++l) {
              qq[n + l] = static_cast<uint8_t>((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4));
              qq[n + l + 32] = static_cast<uint8_t>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
              qq[n + l + 64] = static_cast<uint8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
              qq[n + l + 96] = static_cast<uint8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
          }
          for (int j = 0; j < 16; ++j) {
            s[sb * 16 + j] = d * sc[j];
            z[sb * 16 + j] = 32.f;
          }
        }
      }
    }
  });
  return w;
}


}  // namespace tessera::io
