// A matmul weight kept in the layout the GEMM itself computes from.
//
// oneDNN's bf16 matmul (AMX and AVX512-BF16 brgemm kernels) multiplies its b operand in a
// blocked layout, BA16a64b2a: (K, N) cut into 32 x 64 blocks, N blocks outermost; inside a
// block, for each pair of K rows (16 pairs), 64 columns of two interleaved bf16 values (the
// VNNI pair the tile instructions read). Given b in any other layout, every call first
// copies the b it needs into that layout. A weight that outlives many products (between
// optimizer steps, or for a whole serving run) can be kept packed instead, and the copy
// leaves the product: 10-30% of a 256-row product's time with AMX (docs/performance.md).
//
// PackedB is that copy. It is filled from the weight as stored (row-major bf16, either
// orientation) by our own packer, by any partition of the stored rows, so an optimizer can
// pack each chunk it updates while the chunk is in cache. The padding (K rounded up to 32,
// N to 64) is zero from allocation and never written.
#pragma once
#include <cstdint>
#include <vector>

#include "tessera/tensor/tensor.h"

namespace tessera::kernels {

struct PackedB {
  Tensor data;         // bf16, packed_b_elements(k, n) elements
  int64_t k = 0, n = 0;  // op(b) is (K, N)
  bool trans = false;  // the source weight is stored (N, K) (a Linear's (out, in) for x W^T)
  bool defined() const { return data.defined(); }
};

// Elements of a packed (K, N): K rounded up to 32 times N rounded up to 64.
int64_t packed_b_elements(int64_t k, int64_t n);
// Position of op(b)[kk, nn] in the packed layout of a (K, N) matrix.
int64_t packed_b_index(int64_t kk, int64_t nn, int64_t k);

// A zeroed PackedB for op(b) of a weight stored row-major as (K, N), or (N, K) when trans.
PackedB packed_b_like(int64_t k, int64_t n, bool trans);
// Copies stored rows [r0, r1) of w (bf16, row-major, row stride ld; (K, N) or, when
// p.trans, (N, K)) into p. Rows may come in any order and partition; a call writes only
// its own rows' elements. Single-threaded (callers run it per chunk).
void pack_b_rows(const uint16_t* w, int64_t ld, int64_t r0, int64_t r1, PackedB& p);
// The whole weight (2-D bf16, contiguous last dim), packed in parallel into p, which is
// (re)allocated unless it already has the shape.
void pack_b(const Tensor& w, bool trans, PackedB& p);

// The packed copies a weight's new values go to as an optimizer publishes them: `count`
// stacked row-major (rows, cols) weights (a Linear's one, or a mixture-of-experts layer's
// experts), weight i packed for the forward product into fwd[i] and for the input
// gradient's into dx[i] (null: not kept).
struct PackTargets {
  int64_t rows = 0, cols = 0;
  std::vector<PackedB*> fwd, dx;
};
// Writes n bf16 values, the stacked weights' row-major elements [first, first + n), into
// every packed copy. Whole rows go through the row packer (streamed, 16 rows at a time
// where the rows allow); the partial rows at either end one element at a time.
void publish_packed(const PackTargets& t, int64_t first, const uint16_t* values, int64_t n);

// Whether training keeps its native bf16 weights packed (the optimizer writes them so):
// TESSERA_PACKED_WEIGHTS=on (needs AVX512-BF16 or AMX); off by default. Measured on a
// 2-core AMX Xeon (docs/performance.md): a GPT-2 124M step's GEMMs 1.6% faster, its
// optimizer pass 10 ms slower (two more copies to write), the step 3.5% slower, and
// still 2% slower with 4 micro-batches per step.
bool packed_weights_enabled();
// Whether this CPU multiplies packed weights: oneDNN's bf16 brgemm (AVX512-BF16 or AMX,
// as capped by TESSERA_ISA).
bool packed_products_supported();

// c = op(a) @ op(b) (+ bias per row) (+ beta c) with b packed: a (M, K) f32 or bf16
// (f32 is rounded to bf16, autocast semantics), c (M, N) f32, or bf16 with beta 0 and no
// bias. The product equals matmul's on the plain weight bit for bit.
void matmul_packed(const Tensor& a, const PackedB& b, Tensor& c, const Tensor* bias = nullptr,
                   float beta = 0.f);
// Whether a product of `rows` rows takes p rather than the plain weight: p is kept, and
// the rows are more than the skinny decode kernel takes (which reads the plain weight).
bool takes_packed(const PackedB& p, int64_t rows);

}  // namespace tessera::kernels
