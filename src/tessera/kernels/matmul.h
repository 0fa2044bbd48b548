// Matrix multiply, the op that dominates every model. Backed by oneDNN (AMX /
// AVX-512 BF16 / AVX-512 / AVX2 picked at run time) with a hand-written
// bandwidth-bound kernel for skinny products (decode: M <= 4).
#pragma once
#include "tessera/tensor/tensor.h"

namespace tessera::kernels {

// Products of at most this many rows with an (N, K) weight go to the skinny decode kernel.
// (For f32 weights it is 1.05-1.5x faster than oneDNN's at 5-8 rows too, but a row's
// result must not depend on the rows batched with it: a sequence's embedding or logits
// are the same bits alone or in any batch, and the boundary moves with this limit.)
constexpr int64_t kSkinnyMaxRows = 4;

// c = alpha * op(a) @ op(b) + beta * c, accumulated in f32.
//   op(a): (M, K); a is (M, K), or (K, M) when trans_a.
//   op(b): (K, N); b is (K, N), or (N, K) when trans_b (a Linear weight (out, in)).
//   c: (M, N), f32.
// a and b are 2-D, f32 or bf16; their last dim is contiguous and rows may be strided
// (views of wider buffers). When a and b differ in dtype, the f32 operand is rounded
// to bf16 (autocast semantics). c may be a strided view too.
void matmul(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a = false,
            bool trans_b = false, float alpha = 1.f, float beta = 0.f);

// c = op(a) @ op(b) + bias (each row): a Linear layer's forward with its bias in the
// GEMM's epilogue (oneDNN adds it in the same pass) instead of a second pass over c.
// bias: (N) f32, contiguous.
void matmul_bias(const Tensor& a, const Tensor& b, const Tensor& bias, Tensor& c,
                 bool trans_b = false);

// Same contract, forced through one backend; for tests and `tessera bench gemm`.
enum class MatmulBackend { kAuto, kOneDnn, kSkinny, kReference };
void matmul_with(MatmulBackend backend, const Tensor& a, const Tensor& b, Tensor& c,
                 bool trans_a, bool trans_b, float alpha, float beta);
void matmul_bias_with(MatmulBackend backend, const Tensor& a, const Tensor& b, const Tensor& bias,
                      Tensor& c, bool trans_b);

// c = op(a) @ op(b) (beta 0) for a product whose f32 c is far larger than the cache and is
// read long after (the training head's (vocabulary, hidden) weight gradient): c is computed
// `block_rows` rows at a time into a scratch that stays in cache, and each block is written
// to c with streaming stores, so c's lines are not first read from memory (with the plain
// product that read is a third of the traffic). Arguments as matmul's.
void matmul_streamed_rows(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a = false, bool trans_b = false,
                          int64_t block_rows = 768);

// While one is alive on a thread, that thread's oneDNN products run primitives whose M, N
// and K are given at each call (oneDNN's runtime dimensions): one primitive per operand
// layout and dtype instead of one per shape. For callers whose shapes change every call,
// where creating a primitive (0.2-4 ms, a JIT compile) costs as much as the product: a
// mixture-of-experts layer, whose router sends each expert a different number of rows every
// step. Deterministic: the same shape always takes the same kernel inside a scope.
class VaryingShapes {
 public:
  VaryingShapes();
  ~VaryingShapes();
  VaryingShapes(const VaryingShapes&) = delete;
  VaryingShapes& operator=(const VaryingShapes&) = delete;
  static bool active();  // on this thread
};

}  // namespace tessera::kernels
