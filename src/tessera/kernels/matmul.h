// Matrix multiply, the op that dominates every model. Backed by oneDNN (AMX /
// AVX-512 BF16 / AVX-512 / AVX2 picked at run time) with a hand-written
// bandwidth-bound kernel for skinny products (decode: M <= 4, or <= 8 in decode steps).
#pragma once
#include "tessera/tensor/tensor.h"

namespace tessera::kernels {

// Products of at most this many rows with an (N, K) weight go to the skinny decode kernel.
// A row's result from the skinny kernel does not depend on the rows beside it; oneDNN's
// differs from it in the last bits, so a prompt's rows (an embedding, a prompt's logits)
// keep one kernel whether the prompt runs alone or batched past this limit: from 5 tokens,
// always oneDNN.
constexpr int64_t kSkinnyMaxRows = 4;

// Inside a DecodeRows scope (a step made only of decode rows, one token per sequence), up to
// this many rows go to the skinny kernel: for f32 weights, and for bf16 ones where the CPU
// has no AMX (with AMX, oneDNN's bf16 kernels win from 8 rows). Measured on Zen 4, 2 cores
// (`build/bin/skinny_rows`): f32 4096 x 768 at 5-8 rows 0.54-0.58 ms against oneDNN's
// 0.69-0.85. A decode row then takes the same kernel alone and in steps of up to 8.
constexpr int64_t kSkinnyDecodeRows = 8;

// While one is alive on this thread, matmul's automatic choice (and takes_packed) use the
// decode limit above. Deterministic: the same rows and weights always take the same kernel
// inside a scope.
class DecodeRows {
 public:
  DecodeRows();
  ~DecodeRows();
  DecodeRows(const DecodeRows&) = delete;
  DecodeRows& operator=(const DecodeRows&) = delete;
  static bool active();  // on this thread
};

// The most rows a product with a weight of this dtype sends to the skinny kernel on this
// thread now: kSkinnyMaxRows, or kSkinnyDecodeRows inside a DecodeRows scope (see above).
int64_t skinny_max_rows(DType weight_dtype);

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
