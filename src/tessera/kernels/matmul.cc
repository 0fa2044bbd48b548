// matmul: checks shapes and dtypes, unifies mixed dtypes, picks a backend.
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/dispatch.h"

#include <cpuid.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tessera/base/cpu_features.h"
#include "tessera/kernels/bf16_speed.h"
#include "tessera/kernels/cpu/matmul_cpu.h"
#include "tessera/kernels/cpu/stream_copy.h"
#include "tessera/kernels/packed_b.h"
#include "tessera/kernels/reference/matmul_ref.h"

namespace tessera::kernels {
namespace {

// Row stride of a 2-D operand whose last dim is contiguous. A single row may carry
// any stride (e.g. a select()ed view), so it is normalised to the row length.
int64_t row_stride(const Tensor& t, const char* name) {
  TESSERA_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "matmul: ", name, " ", t.describe(),
                " must have a contiguous last dim (strides ", shape_str(t.strides()),
                "); pass trans_", name, " or call .contiguous()");
  if (t.size(0) <= 1) return std::max<int64_t>(1, t.size(1));
  TESSERA_CHECK(t.stride(0) >= t.size(1), "matmul: ", name, " ", t.describe(),
                " has overlapping rows (strides ", shape_str(t.strides()), ")");
  return t.stride(0);
}

void check_operand(const Tensor& t, const char* name) {
  TESSERA_CHECK(t.defined(), "matmul: ", name, " is an undefined tensor");
  TESSERA_CHECK(t.device() == Device::kCPU, "matmul: ", name, " ", t.describe(),
                " is not on the CPU");
  TESSERA_CHECK(t.dim() == 2, "matmul: ", name, " must be 2-D, got ", t.describe());
}

// Byte range [first, last) a 2-D row-strided tensor touches.
std::pair<const char*, const char*> byte_range(const Tensor& t, int64_t ld) {
  const char* p = static_cast<const char*>(t.raw_data());
  const int64_t elems = (t.size(0) - 1) * ld + t.size(1);
  return {p, p + elems * static_cast<int64_t>(dtype_size(t.dtype()))};
}

// Whether two row-strided views share a byte. Views into the same wide buffer with
// the same row pitch (e.g. column blocks of a fused QKV output) interleave without
// touching, so for equal pitch the column windows are compared modulo the pitch.
bool overlaps(const Tensor& x, int64_t ldx, const Tensor& y, int64_t ldy) {
  if (x.numel() == 0 || y.numel() == 0) return false;
  const auto [x0, x1] = byte_range(x, ldx);
  const auto [y0, y1] = byte_range(y, ldy);
  if (!(x0 < y1 && y0 < x1)) return false;
  const int64_t pitch = ldx * static_cast<int64_t>(dtype_size(x.dtype()));
  const int64_t wx = x.size(1) * static_cast<int64_t>(dtype_size(x.dtype()));
  const int64_t wy = y.size(1) * static_cast<int64_t>(dtype_size(y.dtype()));
  if (x.size(0) <= 1 || y.size(0) <= 1 ||
      pitch != ldy * static_cast<int64_t>(dtype_size(y.dtype())))
    return true;
  const int64_t d = ((y0 - x0) % pitch + pitch) % pitch;  // y's window start within x's row
  return d < wx || d + wy > pitch;
}

// Rounds the f32 operand of a mixed-dtype product to bf16 into a per-thread buffer
// that only grows, so a steady stream of same-sized calls does not allocate.
const void* round_to_bf16(const Tensor& t, int64_t& ld) {
  thread_local std::vector<uint16_t> scratch;
  const int64_t rows = t.size(0), cols = t.size(1);
  if (scratch.size() < static_cast<size_t>(rows * cols)) scratch.resize(rows * cols);
  const float* src = static_cast<const float*>(t.raw_data());
  if (ld == cols) {
    convert_elements(src, DType::kF32, scratch.data(), DType::kBF16, rows * cols);
  } else {
    for (int64_t r = 0; r < rows; ++r)
      convert_elements(src + r * ld, DType::kF32, scratch.data() + r * cols, DType::kBF16, cols);
  }
  ld = cols;
  return scratch.data();
}

// Without AMX, some CPUs' vdpbf16ps retires half the flops of f32 FMA (Intel's: ~60 vs
// ~120 GFLOP/s a core), so once M is large enough for the GEMM to be compute-bound,
// widening bf16 operands to f32 and running the f32 GEMM is faster, with identical
// products (a bf16 x bf16 product is exact in f32). Measured crossover there on 2048x2048
// weights: native wins at M = 32 (146 vs 137 GFLOP/s), widening from M = 48 (164 vs 152;
// 240 vs 164 at 128). AMD's runs it at twice the f32 rate: there it stays native
// (bf16_native_gemm_faster()).
constexpr int64_t kWidenMinM = 48;
// oneDNN needs AVX512-BF16 or AMX for bf16 products; elsewhere bf16 is widened.
bool native_bf16() {
  const auto& f = base::cpu_features();
  return f.avx512_bf16 || f.amx_bf16;
}

bool widen_bf16(const cpu::GemmArgs& g) {
  if (g.a_dtype != DType::kBF16 || g.b_dtype != DType::kBF16) return false;
  if (!native_bf16()) return true;
  return g.m >= kWidenMinM && g.n >= kWidenMinM && !bf16_native_gemm_faster();
}

// Whether this is an AMD CPU (cpuid leaf 0 vendor "AuthenticAMD").
bool is_amd() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  char vendor[13];
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  vendor[12] = 0;
  return std::strcmp(vendor, "AuthenticAMD") == 0;
}

// Decided from the CPU, not timed: a timed decision flipped between two processes of one
// machine under load (widened and native products sum in different orders, so two runs
// of one config would differ). AMD's AVX512-BF16 (Zen 4/5) runs bf16 dot products at
// twice the f32 FMA rate (measured 960-1004 against 480-509 GFLOP/s on 2 cores); Intel's
// without AMX at half of it (146-152 against 164-240).
bool native_faster_on_this_cpu() {
  const auto& f = base::cpu_features();
  if (f.amx_bf16) return true;
  if (!f.avx512_bf16) return false;
  if (const char* v = std::getenv("TESSERA_BF16_GEMM")) {
    const std::string s = v;
    if (s == "native") return true;
    if (s == "widened") return false;
    TESSERA_CHECK(s.empty(), "TESSERA_BF16_GEMM = '", s, "' is not one of native, widened");
  }
  return is_amd();
}

const char* backend_name(MatmulBackend b) {
  switch (b) {
    case MatmulBackend::kAuto: return "auto";
    case MatmulBackend::kOneDnn: return "onednn";
    case MatmulBackend::kSkinny: return "skinny";
    case MatmulBackend::kReference: return "reference";
  }
  return "?";
}

// Every entry point's checks and dispatch; bias (N) f32 or null.
void run_matmul(MatmulBackend backend, const Tensor& a, const Tensor& b, const Tensor* bias, Tensor& c,
                bool trans_a, bool trans_b, float alpha, float beta);

}  // namespace

bool bf16_native_gemm_faster() {
  static const bool faster = native_faster_on_this_cpu();
  return faster;
}

void matmul(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a, bool trans_b, float alpha,
            float beta) {
  matmul_with(MatmulBackend::kAuto, a, b, c, trans_a, trans_b, alpha, beta);
}

void matmul_with(MatmulBackend backend, const Tensor& a, const Tensor& b, Tensor& c, bool trans_a,
                 bool trans_b, float alpha, float beta) {
  run_matmul(backend, a, b, nullptr, c, trans_a, trans_b, alpha, beta);
}

void matmul_bias(const Tensor& a, const Tensor& b, const Tensor& bias, Tensor& c, bool trans_b) {
  matmul_bias_with(MatmulBackend::kAuto, a, b, bias, c, trans_b);
}

void matmul_bias_with(MatmulBackend backend, const Tensor& a, const Tensor& b, const Tensor& bias,
                      Tensor& c, bool trans_b) {
  run_matmul(backend, a, b, &bias, c, false, trans_b, 1.f, 0.f);
}

namespace {

void run_matmul(MatmulBackend backend, const Tensor& a, const Tensor& b, const Tensor* bias, Tensor& c,
                bool trans_a, bool trans_b, float alpha, float beta) {
  check_operand(a, "a");
  check_operand(b, "b");
  check_operand(c, "c");
  for (const Tensor* t : {&a, &b})
    TESSERA_CHECK(t->dtype() == DType::kF32 || t->dtype() == DType::kBF16, "matmul: ",
                  t == &a ? "a" : "b", " must be f32 or bf16, got ", t->describe());
  // A bf16 c (bf16 a and b, beta 0, no bias): the product rounded once as oneDNN writes it.
  const bool c_bf16 = c.dtype() == DType::kBF16;
  TESSERA_CHECK(c.dtype() == DType::kF32 || (c_bf16 && a.dtype() == DType::kBF16 &&
                                             b.dtype() == DType::kBF16 && beta == 0.f && !bias),
                "matmul: c must be f32 (or bf16 for a bf16 product with beta 0 and no bias), got ",
                c.describe());
  TESSERA_CHECK(std::isfinite(alpha) && std::isfinite(beta), "matmul: alpha (", alpha,
                ") and beta (", beta, ") must be finite");

  const int64_t m = trans_a ? a.size(1) : a.size(0);
  const int64_t k = trans_a ? a.size(0) : a.size(1);
  const int64_t kb = trans_b ? b.size(1) : b.size(0);
  const int64_t n = trans_b ? b.size(0) : b.size(1);
  TESSERA_CHECK(k == kb, "matmul: inner dims differ: op(a) is (", m, ", ", k, ") from a ",
                a.describe(), (trans_a ? " transposed" : ""), ", op(b) is (", kb, ", ", n,
                ") from b ", b.describe(), (trans_b ? " transposed" : ""));
  TESSERA_CHECK(c.size(0) == m && c.size(1) == n, "matmul: c is ", c.describe(),
                " but op(a) @ op(b) is (", m, ", ", n, ")");

  if (bias) {
    TESSERA_CHECK(bias->defined() && bias->device() == Device::kCPU && bias->dtype() == DType::kF32 &&
                      bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(),
                  "matmul: bias must be a contiguous f32 (", n, ") on the CPU, got ",
                  bias->defined() ? bias->describe() : std::string("an undefined tensor"));
  }

  cpu::GemmArgs g;
  g.bias = bias ? bias->data<float>() : nullptr;
  // oneDNN writes a bf16 c itself where it multiplies bf16 natively; elsewhere (another
  // backend, a CPU without AVX512-BF16, an empty sum) the f32 product is rounded once.
  const bool direct_bf16_c = c_bf16 && k > 0 && native_bf16() &&
                             (backend == MatmulBackend::kAuto || backend == MatmulBackend::kOneDnn);
  if (direct_bf16_c) backend = MatmulBackend::kOneDnn;
  if (c_bf16 && !direct_bf16_c) {  // through f32, rounded once
    Tensor wide = Tensor::empty(c.shape(), DType::kF32);
    run_matmul(backend, a, b, nullptr, wide, trans_a, trans_b, alpha, 0.f);
    c.copy_from(wide);
    return;
  }
  if (backend == MatmulBackend::kReference) {
    reference::matmul(a, b, c, trans_a, trans_b, alpha, beta);
    if (bias) {
      g.m = m, g.n = n, g.c = static_cast<float*>(c.raw_data()), g.ldc = row_stride(c, "c");
      cpu::add_bias_rows(g);
    }
    return;
  }

  g.m = m, g.n = n, g.k = k;
  g.a = a.raw_data(), g.a_dtype = a.dtype(), g.lda = row_stride(a, "a"), g.trans_a = trans_a;
  g.b = b.raw_data(), g.b_dtype = b.dtype(), g.ldb = row_stride(b, "b"), g.trans_b = trans_b;
  g.c = static_cast<float*>(c.raw_data()), g.ldc = row_stride(c, "c"), g.c_dtype = c.dtype();
  g.alpha = alpha, g.beta = beta;
  g.any_shape = VaryingShapes::active();
  TESSERA_CHECK(!overlaps(c, g.ldc, a, g.lda) && !overlaps(c, g.ldc, b, g.ldb),
                "matmul: c ", c.describe(), " overlaps an input (a ", a.describe(), ", b ",
                b.describe(), "); write to a separate tensor");
  if (m == 0 || n == 0) return;
  if (k == 0) {  // empty sum: c = beta * c, without reading c when beta == 0
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        float& v = g.c[i * g.ldc + j];
        v = beta == 0.f ? 0.f : beta * v;
      }
    if (bias) cpu::add_bias_rows(g);
    return;
  }

  const bool auto_backend = backend == MatmulBackend::kAuto;
  if (auto_backend) {
    const bool skinny =
        m <= skinny_max_rows(b.dtype()) && trans_b && cpu::skinny_isa_supported(cpu::SkinnyIsa::kAvx2);
    backend = skinny ? MatmulBackend::kSkinny : MatmulBackend::kOneDnn;
  }
  TESSERA_CHECK(backend != MatmulBackend::kSkinny || trans_b, "matmul: the ",
                backend_name(backend), " backend needs trans_b (b as an (N, K) weight), got b ",
                b.describe());

  if (a.dtype() != b.dtype()) {  // autocast: the f32 side is rounded to bf16
    if (a.dtype() == DType::kF32) {
      g.a = round_to_bf16(a, g.lda), g.a_dtype = DType::kBF16;
    } else {
      g.b = round_to_bf16(b, g.ldb), g.b_dtype = DType::kBF16;
    }
  }
  // The CPU backend's three GEMMs: the skinny decode kernel, oneDNN on widened bf16, oneDNN.
  const auto cpu_gemm = [&] {
    if (backend == MatmulBackend::kSkinny) {
      cpu::gemm_skinny(g);
      if (g.bias) cpu::add_bias_rows(g);
    }
    else if ((auto_backend || !native_bf16()) && g.c_dtype == DType::kF32 && widen_bf16(g))
      cpu::gemm_onednn_widened(g);
    else
      cpu::gemm_onednn(g);
  };
  TESSERA_KERNEL("matmul", cpu_gemm(), a, b, c);
}

}  // namespace

// The packed product shares matmul's checks and its autocast rounding of an f32 a; b is
// already in oneDNN's layout, so oneDNN is the only backend.
void matmul_packed(const Tensor& a, const PackedB& b, Tensor& c, const Tensor* bias, float beta) {
  TESSERA_CHECK(b.defined(), "matmul (packed b): b is not packed");
  TESSERA_CHECK(packed_products_supported(), "matmul (packed b): needs AVX512-BF16 or AMX; this CPU runs ",
                isa_level_name(cpu_isa_level()));
  check_operand(a, "a");
  check_operand(c, "c");
  TESSERA_CHECK(a.dtype() == DType::kF32 || a.dtype() == DType::kBF16, "matmul: a must be f32 or bf16, got ",
                a.describe());
  TESSERA_CHECK(a.size(1) == b.k, "matmul (packed b): a is ", a.describe(), " but b is (", b.k, ", ", b.n, ")");
  TESSERA_CHECK(c.size(0) == a.size(0) && c.size(1) == b.n, "matmul: c is ", c.describe(), " but a @ b is (",
                a.size(0), ", ", b.n, ")");
  TESSERA_CHECK(c.dtype() == DType::kF32 || (c.dtype() == DType::kBF16 && beta == 0.f && !bias),
                "matmul (packed b): c must be f32 (or bf16 with beta 0 and no bias), got ", c.describe());
  if (bias)
    TESSERA_CHECK(bias->defined() && bias->dtype() == DType::kF32 && bias->dim() == 1 && bias->size(0) == b.n &&
                      bias->is_contiguous(),
                  "matmul (packed b): bias must be a contiguous f32 (", b.n, ")");
  if (a.size(0) == 0) return;
  cpu::GemmArgs g;
  g.m = a.size(0), g.n = b.n, g.k = b.k;
  g.a = a.raw_data(), g.a_dtype = DType::kBF16, g.lda = row_stride(a, "a");
  if (a.dtype() == DType::kF32) g.a = round_to_bf16(a, g.lda);  // autocast
  g.b = b.data.raw_data(), g.b_dtype = DType::kBF16, g.b_packed = true;
  g.c = static_cast<float*>(c.raw_data()), g.c_dtype = c.dtype(), g.ldc = row_stride(c, "c");
  g.beta = beta;
  g.bias = bias ? bias->data<float>() : nullptr;
  TESSERA_KERNEL("matmul", cpu::gemm_onednn(g), a, c);
}

bool takes_packed(const PackedB& p, int64_t rows) { return p.defined() && rows > skinny_max_rows(DType::kBF16); }

void matmul_streamed_rows(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a, bool trans_b, int64_t block_rows) {
  TESSERA_CHECK(block_rows >= 1, "matmul_streamed_rows: block_rows must be >= 1, got ", block_rows);
  TESSERA_CHECK(a.defined() && a.dim() == 2 && c.defined() && c.dim() == 2 && c.dtype() == DType::kF32 &&
                    c.size(0) == a.size(trans_a ? 1 : 0),
                "matmul_streamed_rows: op(a) of ", a.describe(), " and c ", c.describe(),
                " must be 2-D with the same rows, c f32");
  const int64_t M = c.size(0);
  if (M <= block_rows) return matmul(a, b, c, trans_a, trans_b);
  const int64_t N = c.size(1);
  thread_local Tensor scratch;  // reused: its lines stay in cache from block to block
  if (!scratch.defined() || scratch.numel() < block_rows * N) scratch = Tensor::empty({block_rows * N}, DType::kF32);
  for (int64_t r0 = 0; r0 < M; r0 += block_rows) {
    const int64_t rn = std::min(block_rows, M - r0);
    Tensor block = scratch.slice(0, 0, rn * N).view({rn, N});
    matmul(a.slice(trans_a ? 1 : 0, r0, r0 + rn), b, block, trans_a, trans_b);
    cpu::stream_copy_rows(block.data<float>(), N, static_cast<float*>(c.raw_data()) + r0 * c.stride(0), c.stride(0),
                          rn, N);
  }
}

namespace {
thread_local int varying_shapes_depth = 0;
thread_local int decode_rows_depth = 0;
}  // namespace

VaryingShapes::VaryingShapes() { ++varying_shapes_depth; }
VaryingShapes::~VaryingShapes() { --varying_shapes_depth; }
bool VaryingShapes::active() { return varying_shapes_depth > 0; }

DecodeRows::DecodeRows() { ++decode_rows_depth; }
DecodeRows::~DecodeRows() { --decode_rows_depth; }
bool DecodeRows::active() { return decode_rows_depth > 0; }

int64_t skinny_max_rows(DType weight_dtype) {
  if (decode_rows_depth == 0) return kSkinnyMaxRows;
  if (weight_dtype == DType::kF32 || (weight_dtype == DType::kBF16 && !cpu_has(IsaLevel::kAmx)))
    return kSkinnyDecodeRows;
  return kSkinnyMaxRows;
}

}  // namespace tessera::kernels
