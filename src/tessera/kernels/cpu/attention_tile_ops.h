// The per-tile building blocks of the CPU attention kernels (small GEMM, transpose-pack,
// softmax pieces), one table per ISA so the tiling code in attention_cpu.cc is shared.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>

#include "tessera/base/aligned_alloc.h"

namespace tessera::kernels::cpu {

// A 64-byte aligned buffer of T for an attention kernel's per-thread tiles.
template <typename T>
class ScratchOf {
 public:
  explicit ScratchOf(int64_t n) : data_(base::aligned_array<T>(n)) {}
  T* get() const { return data_.get(); }

 private:
  base::AlignedArray<T> data_;
};
using Scratch = ScratchOf<float>;

struct AttnTileOps {
  // C (M, N) = (accumulate ? C : 0) + sum_k A(i, k) * B(k, :), where A(i, k) = a[i*a_si + k*a_sk]
  // (so A may be read transposed) and row k of B starts at b + k*ldb. Every attention
  // product is this shape: scores Q Kt, P V, P^T dO, dS K, dS^T Q.
  void (*gemm)(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_si, int64_t a_sk,
               const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate);

  // dst (D, ld): dst[d*ld + j] = src[j*src_ld + d] for j < n; columns n .. round_up(n, 16)
  // are zero-filled. ld must be >= round_up(n, 16).
  void (*pack_transposed)(const float* src, int64_t src_ld, int64_t n, int64_t D, float* dst,
                          int64_t ld);

  // Online-softmax step for R rows of a score tile s (R, n) with row stride lds:
  // m_new = max(m, rowmax s); s := exp(s - m_new) (masked -inf scores give 0);
  // l := l * exp(m - m_new) + rowsum; o rows (R, D), stride ldo, are rescaled by the same factor.
  void (*softmax_update)(float* s, int64_t lds, int64_t R, int64_t n, float* m, float* l, float* o,
                         int64_t ldo, int64_t D);

  // s (R, n) := exp(s - lse[r]); -inf gives 0.
  void (*probs_from_scores)(float* s, int64_t lds, int64_t R, int64_t n, const float* lse);

  // dp (R, n) := p * (dp - delta[r]).
  void (*dscores_from_dprobs)(const float* p, float* dp, int64_t lds, int64_t R, int64_t n,
                              const float* delta);

  float (*dot)(const float* a, const float* b, int64_t n);
};

const AttnTileOps& scalar_tile_ops();
const AttnTileOps& avx2_tile_ops();    // only call when the CPU has AVX2 and FMA
const AttnTileOps& avx512_tile_ops();  // only call when the CPU has AVX-512F

}  // namespace tessera::kernels::cpu
