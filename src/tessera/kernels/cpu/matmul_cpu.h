// Internal interface between matmul.cc (checks, dtype unification) and the CPU GEMM
// backends (oneDNN, the skinny decode kernel). Not part of the public API.
#pragma once
#include <cstdint>

#include "tessera/tensor/dtype.h"

namespace tessera::kernels::cpu {

// One GEMM on raw row-major buffers, already validated by matmul.cc:
//   c(M, N) = alpha * op(a)(M, K) @ op(b)(K, N) + beta * c; beta == 0 never reads c.
// a is (M, K) with row stride lda, or (K, M) when trans_a; b is (K, N) with row
// stride ldb, or (N, K) when trans_b; c is f32 (M, N) with row stride ldc.
// a and b have the same dtype (f32 or bf16; i8 through oneDNN: the exact int32 sums,
// converted to f32) except in the skinny kernel, which accepts any combination.
struct GemmArgs {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  DType a_dtype = DType::kF32;
  int64_t lda = 0;
  bool trans_a = false;
  const void* b = nullptr;
  DType b_dtype = DType::kF32;
  int64_t ldb = 0;
  bool trans_b = false;
  float* c = nullptr;
  int64_t ldc = 0;
  // kBF16: c points at bf16 values (oneDNN only: beta 0, no bias; kernels::matmul routes it).
  DType c_dtype = DType::kF32;
  float alpha = 1.f;
  float beta = 0.f;
  // c[i, :] += bias after alpha * op(a) @ op(b) + beta * c; null: none. f32, N values.
  // oneDNN's matmul primitive adds it in its epilogue (a post-op of the same pass); the
  // other GEMMs with add_bias_rows.
  const float* bias = nullptr;
  // b is bf16 in oneDNN's blocked BA16a64b2a layout of (K, N) (kernels/packed_b.h); ldb
  // and trans_b are unused. oneDNN only.
  bool b_packed = false;
  // One oneDNN primitive for every M, N, K and row stride of this layout (runtime
  // dimensions; kernels::VaryingShapes). Not with b_packed (matmul_packed never sets it:
  // the blocked layout's descriptor needs K and N).
  bool any_shape = false;
};

// c[i, :] += g.bias for each of the M rows (the GEMMs without a bias epilogue).
void add_bias_rows(const GemmArgs& g);

// oneDNN matmul primitive, cached per problem (matmul_onednn.cc). Needs a_dtype == b_dtype.
void gemm_onednn(const GemmArgs& g);
// bf16 x bf16 computed as f32 x f32 through oneDNN after widening both operands (exact:
// bf16 products are representable in f32). Faster than native bf16 on CPUs whose
// vdpbf16ps retires fewer flops than f32 FMA (measured: half) and that lack AMX.
// b is widened in blocks of N holding at most max_b_floats (at least 64 rows) so a huge
// weight (an LM head) needs bounded scratch.
void gemm_onednn_widened(const GemmArgs& g, int64_t max_b_floats = int64_t{16} << 20);
// The blocked layout of a packed b (packed_b_cpu.cc): op(b)[kk, nn]'s position for K
// rounded up to 32 (kp), the elements of a (K, N), the packer of stored rows [r0, r1) of a
// weight ((K, N), or (N, K) when trans; row stride ld; w points at row r0) into dst, and
// of its row-major elements [e0, e1) (w at element e0; rows of `cols`), one at a time.
int64_t packed_index(int64_t kk, int64_t nn, int64_t kp);
int64_t packed_elements(int64_t k, int64_t n);
void pack_rows(const uint16_t* w, int64_t ld, int64_t r0, int64_t r1, int64_t k, int64_t n, bool trans,
               uint16_t* dst);
void pack_elements(const uint16_t* w, int64_t e0, int64_t e1, int64_t cols, int64_t k, bool trans, uint16_t* dst);

// Number of cached oneDNN primitives (for tests of the cache).
int64_t onednn_cache_size();

// Instruction set the skinny kernel runs with; kBest picks from base::cpu_features().
enum class SkinnyIsa { kBest, kScalar, kAvx2, kAvx512 };
// True when this CPU can run `isa` (kScalar always).
bool skinny_isa_supported(SkinnyIsa isa);
// Bandwidth-bound kernel for small M with a weight b (N, K) (matmul_skinny.cc).
// Needs trans_b; any M works, but it re-reads b once per 4 rows of op(a).
void gemm_skinny(const GemmArgs& g, SkinnyIsa isa = SkinnyIsa::kBest);

}  // namespace tessera::kernels::cpu
