// Quantized weights: checks, round-to-nearest quantization, dequantization, and the
// product's dispatch (GEMV in registers, blocked GEMM, int8 W8A8, scalar reference).
#include "tessera/kernels/quant.h"
#include "tessera/kernels/quant_params.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/base/thread_pool.h"
#include "tessera/kernels/cpu/quant_cpu.h"
#include "tessera/kernels/dispatch.h"
#include "tessera/kernels/reference/quant_ref.h"

namespace tessera::kernels {

const char* quant_scheme_name(QuantScheme s) {
  switch (s) {
    case QuantScheme::kInt8: return "int8";
    case QuantScheme::kInt4: return "int4";
    case QuantScheme::kFp8: return "fp8";
    case QuantScheme::kW8A8: return "w8a8";
  }
  return "?";
}

QuantScheme parse_quant_scheme(const std::string& name) {
  if (name == "int8") return QuantScheme::kInt8;
  if (name == "int4") return QuantScheme::kInt4;
  if (name == "fp8") return QuantScheme::kFp8;
  if (name == "w8a8") return QuantScheme::kW8A8;
  fail("quantization '", name, "' is not one of int8, int4, fp8, w8a8");
}

int quant_bits(QuantScheme s) { return s == QuantScheme::kInt4 ? 4 : 8; }

int64_t QuantWeight::nbytes() const {
  int64_t n = static_cast<int64_t>(q.nbytes() + scales.nbytes());
  if (zeros.defined()) n += static_cast<int64_t>(zeros.nbytes());
  return n;
}

void QuantWeight::validate(const std::string& what) const {
  TESSERA_CHECK(out > 0 && in > 0, what, ": quantized weight has shape (", out, ", ", in, ")");
  TESSERA_CHECK(group > 0 && in % group == 0, what, ": group size ", group,
                " does not divide the ", in, " input features");
  const bool int4 = scheme == QuantScheme::kInt4;
  TESSERA_CHECK(!int4 || group % 32 == 0, what, ": int4 group size ", group,
                " is not a multiple of 32");
  TESSERA_CHECK(scheme != QuantScheme::kW8A8 || group == in, what,
                ": w8a8 weights have one scale per output channel (group ", group, " != ", in, ")");
  const Shape qs = int4 ? Shape{out, in / 2} : Shape{out, in};
  const DType qd = scheme == QuantScheme::kW8A8 ? DType::kI8 : DType::kU8;
  TESSERA_CHECK(q.defined() && q.shape() == qs && q.dtype() == qd && q.is_contiguous(), what,
                ": packed weights are ", q.defined() ? q.describe() : "missing", ", expected ",
                dtype_name(qd), shape_str(qs));
  const Shape ss{out, in / group};
  TESSERA_CHECK(scales.defined() && scales.shape() == ss && scales.dtype() == DType::kF32 &&
                    scales.is_contiguous(),
                what, ": scales are ", scales.defined() ? scales.describe() : "missing",
                ", expected f32", shape_str(ss));
  const bool zp = scheme == QuantScheme::kInt8 || scheme == QuantScheme::kInt4;
  if (zp) {
    TESSERA_CHECK(zeros.defined() && zeros.shape() == ss && zeros.dtype() == DType::kF32 &&
                      zeros.is_contiguous(),
                  what, ": zero points are ", zeros.defined() ? zeros.describe() : "missing",
                  ", expected f32", shape_str(ss));
    // Any finite value: the kernels compute s (q - z) in float, and GGUF's K-quants
    // (x = d q - m) have zero points m / d that are not integers. The quantizers here make
    // integers, which is what AutoGPTQ / AutoAWQ checkpoints store.
    const float* z = zeros.data<float>();
    for (int64_t i = 0; i < zeros.numel(); ++i)
      TESSERA_CHECK(std::isfinite(z[i]), what, ": zero point ", i, " is ", z[i]);
  } else {
    TESSERA_CHECK(!zeros.defined(), what, ": ", quant_scheme_name(scheme),
                  " weights have no zero points");
  }
  const float* s = scales.data<float>();
  for (int64_t i = 0; i < scales.numel(); ++i)
    TESSERA_CHECK(std::isfinite(s[i]), what, ": scale ", i, " is ", s[i]);
  if (perm.defined()) {
    TESSERA_CHECK(perm.dtype() == DType::kI32 && perm.shape() == Shape{in} && perm.is_contiguous(),
                  what, ": permutation is ", perm.describe(), ", expected i32(", in, ")");
    std::vector<char> seen(in, 0);
    const int32_t* p = perm.data<int32_t>();
    for (int64_t j = 0; j < in; ++j) {
      TESSERA_CHECK(p[j] >= 0 && p[j] < in && !seen[p[j]], what,
                    ": act-order permutation is not a permutation of 0..", in - 1,
                    " (entry ", j, " = ", p[j], ")");
      seen[p[j]] = 1;
    }
  }
  if (smooth.defined()) {
    TESSERA_CHECK(smooth.dtype() == DType::kF32 && smooth.shape() == Shape{in} &&
                      smooth.is_contiguous(),
                  what, ": smoothing scales are ", smooth.describe(), ", expected f32(", in, ")");
    const float* v = smooth.data<float>();
    for (int64_t k = 0; k < in; ++k)
      TESSERA_CHECK(std::isfinite(v[k]) && v[k] > 0, what, ": smoothing scale ", k, " is ", v[k]);
  }
}

// ---- fp8 e4m3 ------------------------------------------------------------------------

// ---- quantization ---------------------------------------------------------------------

int32_t quantize_value(float w, float scale, float zero, int bits) {
  const float maxq = static_cast<float>((1 << bits) - 1);
  const float q = std::nearbyint(w / scale) + zero;
  return static_cast<int32_t>(std::clamp(q, 0.f, maxq));
}

// GPTQ's Quantizer.find_params for one group of values: the range always includes 0.
void int_params(const float* w, int64_t n, int bits, bool symmetric, bool f16, float& scale,
                float& zero) {
  float lo = 0.f, hi = 0.f;
  for (int64_t i = 0; i < n; ++i) lo = std::min(lo, w[i]), hi = std::max(hi, w[i]);
  const float maxq = static_cast<float>((1 << bits) - 1);
  if (symmetric) {
    hi = std::max(-lo, hi);
    if (lo < 0) lo = -hi;
  }
  if (lo == 0.f && hi == 0.f) lo = -1.f, hi = 1.f;
  const auto round = [&](float v) { return f16 ? f16_to_f32(f32_to_f16(v)) : v; };
  scale = round((hi - lo) / maxq);
  zero = symmetric ? (maxq + 1.f) / 2.f : std::nearbyint(-lo / scale);
  if (zero == 0.f) {  // a group with no negative value: z = 1 (AutoGPTQ's v1 format
    zero = 1.f;       // stores z - 1, which cannot be -1), the range [0, hi] over 2^bits - 2 steps
    scale = round(hi / (maxq - 1.f));
  }
}

void pack_int4(const int32_t* q, int64_t in, uint8_t* dst) {
  for (int64_t b = 0; b < in; b += 32)
    for (int j = 0; j < 16; ++j)
      dst[b / 2 + j] = static_cast<uint8_t>(q[b + j] | (q[b + j + 16] << 4));
}

QuantWeight quantize_rtn(const Tensor& w_in, QuantScheme scheme, int64_t group, bool symmetric,
                         bool f16_scales) {
  TESSERA_CHECK(w_in.dim() == 2, "quantize: weight must be 2-D, got ", w_in.describe());
  const Tensor w = w_in.to(DType::kF32).contiguous();
  QuantWeight r;
  r.scheme = scheme;
  r.out = w.size(0), r.in = w.size(1);
  r.group = scheme == QuantScheme::kW8A8 || group <= 0 ? r.in : group;
  TESSERA_CHECK(r.in % r.group == 0, "quantize: group size ", r.group, " does not divide the ",
                r.in, " input features");
  TESSERA_CHECK(scheme != QuantScheme::kInt4 || r.group % 32 == 0,
                "quantize: int4 group size ", r.group, " is not a multiple of 32");
  const int64_t G = r.in / r.group;
  const bool int4 = scheme == QuantScheme::kInt4;
  r.q = Tensor::empty(int4 ? Shape{r.out, r.in / 2} : Shape{r.out, r.in},
                      scheme == QuantScheme::kW8A8 ? DType::kI8 : DType::kU8);
  r.scales = Tensor::empty({r.out, G}, DType::kF32);
  const bool zp = scheme == QuantScheme::kInt8 || int4;
  if (zp) r.zeros = Tensor::empty({r.out, G}, DType::kF32);
  const float* W = w.data<float>();
  base::parallel_for(r.out, 16, [&](int64_t o0, int64_t o1) {
    std::vector<int32_t> qi(r.in);
    for (int64_t o = o0; o < o1; ++o) {
      const float* row = W + o * r.in;
      for (int64_t g = 0; g < G; ++g) {
        const float* wg = row + g * r.group;
        float& s = r.scales.data<float>()[o * G + g];
        if (zp) {
          float& z = r.zeros.data<float>()[o * G + g];
          int_params(wg, r.group, quant_bits(scheme), symmetric, f16_scales, s, z);
          for (int64_t i = 0; i < r.group; ++i)
            qi[g * r.group + i] = quantize_value(wg[i], s, z, quant_bits(scheme));
          continue;
        }
        float amax = 0.f;
        for (int64_t i = 0; i < r.group; ++i) amax = std::max(amax, std::fabs(wg[i]));
        if (scheme == QuantScheme::kFp8) {
          s = amax > 0 ? amax / 448.f : 1.f;
          uint8_t* dst = r.q.data<uint8_t>() + o * r.in + g * r.group;
          for (int64_t i = 0; i < r.group; ++i) dst[i] = f32_to_fp8_e4m3(wg[i] / s);
        } else {  // kW8A8
          s = amax > 0 ? amax / 127.f : 1.f;
          int8_t* dst = r.q.data<int8_t>() + o * r.in;
          for (int64_t i = 0; i < r.in; ++i)
            dst[i] = static_cast<int8_t>(std::clamp(std::nearbyint(wg[i] / s), -127.f, 127.f));
        }
      }
      if (!zp) continue;
      if (int4)
        pack_int4(qi.data(), r.in, r.q.data<uint8_t>() + o * (r.in / 2));
      else
        for (int64_t i = 0; i < r.in; ++i) r.q.data<uint8_t>()[o * r.in + i] = static_cast<uint8_t>(qi[i]);
    }
  });
  return r;
}

namespace {

Tensor rows_copy(const Tensor& t, int64_t o0, int64_t o1) {
  return t.defined() ? t.slice(0, o0, o1).clone() : Tensor();
}

bool same_values(const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

}  // namespace

QuantWeight quant_rows(const QuantWeight& w, int64_t o0, int64_t o1) {
  TESSERA_CHECK(0 <= o0 && o0 <= o1 && o1 <= w.out, "quant_rows: rows [", o0, ", ", o1,
                ") of a weight with ", w.out);
  QuantWeight r = w;
  r.out = o1 - o0;
  r.q = rows_copy(w.q, o0, o1);
  r.scales = rows_copy(w.scales, o0, o1);
  r.zeros = rows_copy(w.zeros, o0, o1);
  return r;
}

// w (kInt8 or kInt4) as kInt8 with `group` (which divides w.group): the same values.
QuantWeight widen_to_int8(const QuantWeight& w, int64_t group) {
  TESSERA_CHECK((w.scheme == QuantScheme::kInt8 || w.scheme == QuantScheme::kInt4) && !w.perm.defined() &&
                    group > 0 && w.group % group == 0,
                "quant_stack_rows: cannot regroup ", quant_scheme_name(w.scheme), " g", w.group,
                " to int8 g", group);
  QuantWeight r;
  r.scheme = QuantScheme::kInt8;
  r.out = w.out;
  r.in = w.in;
  r.group = group;
  r.smooth = w.smooth;
  const int64_t G = w.groups(), split = w.group / group;
  r.q = Tensor::empty({w.out, w.in}, DType::kU8);
  r.scales = Tensor::empty({w.out, G * split}, DType::kF32);
  r.zeros = Tensor::empty({w.out, G * split}, DType::kF32);
  for (int64_t o = 0; o < w.out; ++o) {
    uint8_t* dst = r.q.data<uint8_t>() + o * w.in;
    if (w.scheme == QuantScheme::kInt4) {
      const uint8_t* src = w.q.data<uint8_t>() + o * (w.in / 2);
      for (int64_t j = 0; j < w.in; ++j) {
        const uint8_t b = src[(j / 32) * 16 + (j % 32) % 16];
        dst[j] = (j % 32) < 16 ? (b & 0xF) : (b >> 4);
      }
    } else {
      std::memcpy(dst, w.q.data<uint8_t>() + o * w.in, w.in);
    }
    for (int64_t g = 0; g < G * split; ++g) {
      r.scales.data<float>()[o * G * split + g] = w.scales.data<float>()[o * G + g / split];
      r.zeros.data<float>()[o * G * split + g] = w.zeros.data<float>()[o * G + g / split];
    }
  }
  return r;
}

QuantWeight quant_stack_rows(const std::vector<QuantWeight>& given, const std::string& what) {
  TESSERA_CHECK(!given.empty(), what, ": nothing to stack");
  // Integer parts in different forms (a GGUF Q4_K q beside a Q6_K v) share the finest:
  // int8 at the smallest group, the same values.
  const bool mixed = std::any_of(given.begin(), given.end(), [&](const QuantWeight& p) {
    return p.scheme != given[0].scheme || p.group != given[0].group;
  });
  const bool widenable = std::all_of(given.begin(), given.end(), [&](const QuantWeight& p) {
    return (p.scheme == QuantScheme::kInt8 || p.scheme == QuantScheme::kInt4) && !p.perm.defined() &&
           p.in == given[0].in;
  });
  std::vector<QuantWeight> widened;
  if (mixed && widenable) {
    int64_t group = given[0].group;
    for (const auto& p : given) group = std::min(group, p.group);
    if (std::all_of(given.begin(), given.end(), [&](const QuantWeight& p) { return p.group % group == 0; }))
      for (const auto& p : given) widened.push_back(widen_to_int8(p, group));
  }
  const std::vector<QuantWeight>& parts = widened.empty() ? given : widened;
  const QuantWeight& a = parts[0];
  QuantWeight r = a;
  int64_t out = 0;
  for (const auto& p : parts) {
    TESSERA_CHECK(p.scheme == a.scheme && p.in == a.in && p.group == a.group, what,
                  ": its parts are quantized differently (", quant_scheme_name(p.scheme), " in ", p.in,
                  " group ", p.group, " vs ", quant_scheme_name(a.scheme), " in ", a.in, " group ",
                  a.group, ")");
    TESSERA_CHECK(same_values(p.perm, a.perm) && same_values(p.smooth, a.smooth), what,
                  ": its parts have different act-order permutations or smoothing scales, so they "
                  "cannot share one product");
    out += p.out;
  }
  r.out = out;
  auto stack = [&](Tensor QuantWeight::*field) {
    if (!(a.*field).defined()) return Tensor();
    Shape s = (a.*field).shape();
    s[0] = out;
    Tensor t = Tensor::empty(s, (a.*field).dtype());
    int64_t at = 0;
    for (const auto& p : parts) {
      Tensor dst = t.slice(0, at, at + p.out);
      dst.copy_from(p.*field);
      at += p.out;
    }
    return t;
  };
  r.q = stack(&QuantWeight::q);
  r.scales = stack(&QuantWeight::scales);
  r.zeros = stack(&QuantWeight::zeros);
  return r;
}

Tensor dequantize(const QuantWeight& w) {
  w.validate("dequantize");
  return reference::dequantize(w);
}

// ---- products -------------------------------------------------------------------------

namespace {

// Above this many rows a product dequantizes blocks of W into a float GEMM: the GEMV
// re-reads W once per 4 rows of x, the GEMM once per block.
constexpr int64_t kGemvMaxRows = 8;

void check_product(const Tensor& x, const QuantWeight& w, const Tensor& y) {
  TESSERA_CHECK(x.defined() && x.dim() == 2 && x.dtype() == DType::kF32, "quant_matmul: x must be f32 2-D, got ",
                x.defined() ? x.describe() : "undefined");
  TESSERA_CHECK(x.size(1) == w.in, "quant_matmul: x ", x.describe(), " has ", x.size(1),
                " features, the weight takes ", w.in);
  TESSERA_CHECK(x.size(0) <= 1 || x.size(1) <= 1 || x.stride(1) == 1,
                "quant_matmul: x ", x.describe(), " must have a contiguous last dim");
  TESSERA_CHECK(y.defined() && y.dtype() == DType::kF32 && y.dim() == 2 && y.size(0) == x.size(0) &&
                    y.size(1) == w.out,
                "quant_matmul: y is ", y.defined() ? y.describe() : "undefined", ", expected f32(",
                x.size(0), ", ", w.out, ")");
  TESSERA_CHECK(y.size(0) <= 1 || y.stride(0) >= w.out, "quant_matmul: y rows overlap");
  TESSERA_CHECK(w.out == 0 || y.size(1) <= 1 || y.stride(1) == 1,
                "quant_matmul: y must have a contiguous last dim");
}

}  // namespace

void quant_matmul(const Tensor& x, const QuantWeight& w, Tensor& y) {
  quant_matmul_with(QuantPath::kAuto, x, w, y);
}

void quant_matmul_with(QuantPath path, const Tensor& x, const QuantWeight& w, Tensor& y) {
  check_product(x, w, y);
  if (x.size(0) == 0) return;
  if (path == QuantPath::kReference) {
    reference::quant_matmul(x, w, y);
    return;
  }
  if (path == QuantPath::kAuto) path = x.size(0) <= kGemvMaxRows ? QuantPath::kGemv : QuantPath::kGemm;
  const cpu::QuantIsa isa = cpu::best_quant_isa();
  TESSERA_KERNEL("quant_matmul",
                 (path == QuantPath::kGemv ? cpu::quant_gemv(x, w, y, isa) : cpu::quant_gemm(x, w, y, isa)),
                 x, w.q, y);
}

}  // namespace tessera::kernels
