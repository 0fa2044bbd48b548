// Paged attention on the CPU: FlashAttention-style tiles whose keys and values are read
// through each sequence's block table, with split-K (flash-decoding) partitions.
//
// Work is cut into row blocks: up to kTargetRows query rows of one sequence, the G query
// heads of one kv head times a few positions, so every K / V tile is loaded once for the
// whole GQA group (row r is position i0 + r / G, head kvh * G + r % G). A row block's keys
// are cut into partitions of `split` keys from key 0; each partition is an online softmax
// over 64-key tiles starting at the partition's first key, and the partitions' partial
// (max, sum, unnormalised output) are merged in partition order by one function.
//
// Bit-reproducibility rests on three facts: (1) a row's arithmetic never depends on which
// other rows share its block (every score and output element is its own FMA chain, softmax
// is per row, and extra fully masked columns or tiles add exact zeros); (2) partition and
// tile boundaries depend only on the sequence's context_len (and params); (3) a row block
// runs its partitions either in one work item or as separate items whose partials are
// merged afterwards, and both do the same merge_partial calls in the same order. So the
// thread count and the other sequences only decide scheduling, never the bits.
#include "tessera/kernels/cpu/paged_attention_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include "tessera/base/aligned_alloc.h"
#include "tessera/base/thread_pool.h"
#include "tessera/kernels/cpu/attention_tile_ops.h"
#include "tessera/kernels/cpu/avx2_math.h"
#include "tessera/kernels/cpu/avx512_math.h"

namespace tessera::kernels::cpu {
namespace {

constexpr int64_t kKeyTile = 64;         // keys per score tile
constexpr int64_t kTargetRows = 32;      // rows per block: G heads x a few positions
constexpr int64_t kInvariantSplit = 256; // partition size under batch_invariant
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct SeqPlan {
  int64_t q_offset = 0;        // absolute position of query row 0
  int64_t split = 0;           // keys per partition
  int64_t tiles_per_part = 0;  // ceil(split / kKeyTile)
  const float* packed = nullptr;  // K^T tiles, packed once when several row blocks share them
  int64_t packed_stride = 0;      // floats per kv head in `packed`
};

// Query rows [i0, i0 + qn) of sequence `seq` for the G query heads of kv head `kvh`.
struct RowBlock {
  int64_t seq = 0, kvh = 0, i0 = 0, qn = 0;
  int64_t kend = 0;            // keys [kbeg, kend) are visible to some row of the block
  int64_t kbeg = 0;            // (sliding window: keys before it are never read)
  int64_t nparts = 0;
  float* partials = nullptr;   // when split: nparts x (o (R, D), m (R), l (R))
};

struct Item {
  int64_t block = 0;
  int64_t part = -1;  // -1: every partition of the block, in one item
  int64_t cost = 0;   // rows x keys, for scheduling only
};

// dst[e] = dst[e] * a + src[e] * b for e < D: the rescale-and-add of a partition merge.
using ScaleAddFn = void (*)(float* dst, const float* src, float a, float b, int64_t D);

void scale_add_scalar(float* dst, const float* src, float a, float b, int64_t D) {
  for (int64_t e = 0; e < D; ++e) dst[e] = dst[e] * a + src[e] * b;
}

TESSERA_AVX512 void scale_add_avx512(float* dst, const float* src, float a, float b, int64_t D) {
  const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
  for (int64_t e = 0; e < D; e += 16) {
    const __mmask16 mk = avx512::tail_mask(D - e);
    const __m512 d = _mm512_mul_ps(avx512::load(dst + e, mk), va);
    _mm512_mask_storeu_ps(dst + e, mk, _mm512_fmadd_ps(avx512::load(src + e, mk), vb, d));
  }
}

// o (R, D) += P V where P is (R, n) with row stride lds and row k of V starts at v_rows[k]
// (values sit wherever their cache block is). Each o element is one FMA chain over k in
// order, whatever R is, so a row's bits do not depend on the rows it is computed with.
using AccumulatePvFn = void (*)(int64_t R, int64_t n, const float* p, int64_t lds,
                                const float* const* v_rows, int64_t D, float* o);

void accumulate_pv_scalar(int64_t R, int64_t n, const float* p, int64_t lds,
                          const float* const* v_rows, int64_t D, float* o) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < n; ++k) {
      const float a = p[r * lds + k];
      const float* v = v_rows[k];
      for (int64_t e = 0; e < D; ++e) o[r * D + e] += a * v[e];
    }
}

// MR rows x NV vectors of o in registers; the last vector is masked.
template <int MR, int NV>
TESSERA_AVX512 void pv_micro(int64_t n, const float* p, int64_t lds, const float* const* v_rows,
                             int64_t col, float* o, int64_t D, __mmask16 last) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      acc[m][v] = avx512::load(o + m * D + col + v * 16, v == NV - 1 ? last : __mmask16(0xFFFF));
  for (int64_t k = 0; k < n; ++k) {
    const float* vk = v_rows[k] + col;
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV - 1; ++v) bv[v] = _mm512_loadu_ps(vk + v * 16);
    bv[NV - 1] = avx512::load(vk + (NV - 1) * 16, last);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512 a = _mm512_set1_ps(p[m * lds + k]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_fmadd_ps(a, bv[v], acc[m][v]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int v = 0; v < NV - 1; ++v) _mm512_storeu_ps(o + m * D + col + v * 16, acc[m][v]);
    _mm512_mask_storeu_ps(o + m * D + col + (NV - 1) * 16, last, acc[m][NV - 1]);
  }
}

using PvMicroFn = void (*)(int64_t, const float*, int64_t, const float* const*, int64_t, float*,
                           int64_t, __mmask16);
constexpr int kPvMaxRows = 6, kPvMaxVecs = 4;

template <int MR>
constexpr PvMicroFn pv_micro_row(int nv) {
  return nv == 1 ? &pv_micro<MR, 1> : nv == 2 ? &pv_micro<MR, 2> : nv == 3 ? &pv_micro<MR, 3>
                                                                           : &pv_micro<MR, 4>;
}

TESSERA_AVX512 void accumulate_pv_avx512(int64_t R, int64_t n, const float* p, int64_t lds,
                                         const float* const* v_rows, int64_t D, float* o) {
  static const PvMicroFn table[kPvMaxRows][kPvMaxVecs] = {
      {pv_micro_row<1>(1), pv_micro_row<1>(2), pv_micro_row<1>(3), pv_micro_row<1>(4)},
      {pv_micro_row<2>(1), pv_micro_row<2>(2), pv_micro_row<2>(3), pv_micro_row<2>(4)},
      {pv_micro_row<3>(1), pv_micro_row<3>(2), pv_micro_row<3>(3), pv_micro_row<3>(4)},
      {pv_micro_row<4>(1), pv_micro_row<4>(2), pv_micro_row<4>(3), pv_micro_row<4>(4)},
      {pv_micro_row<5>(1), pv_micro_row<5>(2), pv_micro_row<5>(3), pv_micro_row<5>(4)},
      {pv_micro_row<6>(1), pv_micro_row<6>(2), pv_micro_row<6>(3), pv_micro_row<6>(4)},
  };
  // Even row chunks (8 rows -> 4 + 4, not 6 + 2) keep the V loads per FMA low.
  const int64_t chunks = (R + kPvMaxRows - 1) / kPvMaxRows;
  const int64_t mr = (R + chunks - 1) / chunks;
  for (int64_t col = 0; col < D; col += 16 * kPvMaxVecs) {
    const int64_t nn = std::min<int64_t>(16 * kPvMaxVecs, D - col);
    const int nv = static_cast<int>((nn + 15) / 16);
    const __mmask16 last = avx512::tail_mask(nn - (nv - 1) * 16);
    for (int64_t r0 = 0; r0 < R; r0 += mr) {
      const int rows = static_cast<int>(std::min(mr, R - r0));
      table[rows - 1][nv - 1](n, p + r0 * lds, lds, v_rows, col, o + r0 * D, D, last);
    }
  }
}

// The same two for AVX2 + FMA CPUs: 8-lane vectors, the last one through vmaskmovps.
TESSERA_AVX2_FMA void scale_add_avx2(float* dst, const float* src, float a, float b, int64_t D) {
  const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
  for (int64_t e = 0; e < D; e += 8) {
    const __m256i mk = avx2::tail_mask(D - e);
    const __m256 d = _mm256_mul_ps(_mm256_maskload_ps(dst + e, mk), va);
    _mm256_maskstore_ps(dst + e, mk, _mm256_fmadd_ps(_mm256_maskload_ps(src + e, mk), vb, d));
  }
}

template <int MR, int NV>
TESSERA_AVX2_FMA void pv_micro_avx2(int64_t n, const float* p, int64_t lds, const float* const* v_rows,
                                    int64_t col, float* o, int64_t D, __m256i last) {
  const __m256i all = _mm256_set1_epi32(-1);
  __m256 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_maskload_ps(o + m * D + col + v * 8, v == NV - 1 ? last : all);
  for (int64_t k = 0; k < n; ++k) {
    const float* vk = v_rows[k] + col;
    __m256 bv[NV];
    for (int v = 0; v < NV - 1; ++v) bv[v] = _mm256_loadu_ps(vk + v * 8);
    bv[NV - 1] = _mm256_maskload_ps(vk + (NV - 1) * 8, last);
    for (int m = 0; m < MR; ++m) {
      const __m256 a = _mm256_broadcast_ss(p + m * lds + k);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_fmadd_ps(a, bv[v], acc[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < NV - 1; ++v) _mm256_storeu_ps(o + m * D + col + v * 8, acc[m][v]);
    _mm256_maskstore_ps(o + m * D + col + (NV - 1) * 8, last, acc[m][NV - 1]);
  }
}

TESSERA_AVX2_FMA void accumulate_pv_avx2(int64_t R, int64_t n, const float* p, int64_t lds,
                                         const float* const* v_rows, int64_t D, float* o) {
  using Fn = void (*)(int64_t, const float*, int64_t, const float* const*, int64_t, float*, int64_t, __m256i);
  static const Fn table[kPvMaxRows][2] = {
      {pv_micro_avx2<1, 1>, pv_micro_avx2<1, 2>}, {pv_micro_avx2<2, 1>, pv_micro_avx2<2, 2>},
      {pv_micro_avx2<3, 1>, pv_micro_avx2<3, 2>}, {pv_micro_avx2<4, 1>, pv_micro_avx2<4, 2>},
      {pv_micro_avx2<5, 1>, pv_micro_avx2<5, 2>}, {pv_micro_avx2<6, 1>, pv_micro_avx2<6, 2>},
  };
  const int64_t chunks = (R + kPvMaxRows - 1) / kPvMaxRows;
  const int64_t mr = (R + chunks - 1) / chunks;
  for (int64_t col = 0; col < D; col += 16) {
    const int64_t nn = std::min<int64_t>(16, D - col);
    const int nv = static_cast<int>((nn + 7) / 8);
    const __m256i last = avx2::tail_mask(nn - (nv - 1) * 8);
    for (int64_t r0 = 0; r0 < R; r0 += mr) {
      const int rows = static_cast<int>(std::min(mr, R - r0));
      table[rows - 1][nv - 1](n, p + r0 * lds, lds, v_rows, col, o + r0 * D, D, last);
    }
  }
}

struct Job {
  PagedDims d;
  int64_t G = 1;
  AttnView q, out;
  KvCacheView k, v;
  AttnIsa isa = AttnIsa::kScalar;
  const std::vector<PagedSequence>* seqs = nullptr;
  float scale = 1.f;
  int64_t window = 0;  // sliding window (0: none)
  float softcap = 0.f;  // logit soft-capping (0: none)
  const AttnTileOps* ops = nullptr;
  ScaleAddFn scale_add = nullptr;
  AccumulatePvFn accumulate_pv = nullptr;
  std::vector<SeqPlan> plans;  // indexed like seqs
  std::vector<RowBlock> blocks;
};

int64_t partial_floats(int64_t R, int64_t D) { return R * (D + 2); }

// Calls fn(physical block, first slot, column in the range, length) for each run of keys in
// [t0, t0 + n) that sit in one physical block.
template <typename Fn>
void for_each_run(const PagedSequence& s, int64_t bs, int64_t t0, int64_t n, Fn&& fn) {
  for (int64_t t = t0; t < t0 + n;) {
    const int64_t slot = t % bs;
    const int64_t len = std::min(bs - slot, t0 + n - t);
    fn(static_cast<int64_t>(s.block_table[t / bs]), slot, t - t0, len);
    t += len;
  }
}

// Keys [t0, t0 + n) of (sequence, kv head) as f32 rows into gather (n, D).
void gather_key_rows(const Job& job, const PagedSequence& s, int64_t kvh, int64_t t0, int64_t n, float* gather) {
  const int64_t D = job.d.D;
  const bool f32 = job.k.dtype == KvCacheDtype::kF32;
  for_each_run(s, job.d.block_size, t0, n, [&](int64_t blk, int64_t slot, int64_t col, int64_t len) {
    for (int64_t j = 0; j < len; ++j) {
      const uint8_t* src = job.k.row(blk, slot + j, kvh);
      if (f32)
        std::memcpy(gather + (col + j) * D, src, sizeof(float) * D);
      else
        kv_row_to_f32(job.k.dtype, src, D, gather + (col + j) * D, job.isa);
    }
  });
}

// K^T of keys [t0, t0 + n) of (sequence, kv head) into dst (D, kKeyTile). An f32 cache
// whose runs all start on a 16-column boundary is transposed straight from the cache (a
// pack zero-fills only past its own last column); otherwise the keys are gathered (and
// widened to f32) into `gather` (n, D) first.
void pack_key_tile(const Job& job, const PagedSequence& s, int64_t kvh, int64_t t0, int64_t n,
                   float* dst, float* gather) {
  const int64_t D = job.d.D, bs = job.d.block_size;
  const AttnTileOps& ops = *job.ops;
  const bool f32 = job.k.dtype == KvCacheDtype::kF32;
  if (f32 && bs % 16 == 0 && t0 % 16 == 0) {
    for_each_run(s, bs, t0, n, [&](int64_t blk, int64_t slot, int64_t col, int64_t len) {
      ops.pack_transposed(reinterpret_cast<const float*>(job.k.row(blk, slot, kvh)),
                          job.k.token_bytes / 4, len, D, dst + col, kKeyTile);
    });
    return;
  }
  gather_key_rows(job, s, kvh, t0, n, gather);
  ops.pack_transposed(gather, D, n, D, dst, kKeyTile);
}

// Sets scores of keys after each row's position (and, under a sliding window, before its
// window) to -inf. s (R, n) holds keys [kt0, kt0 + n); row r is at position pos0 + r / G.
void mask_tile(float* s, int64_t lds, int64_t R, int64_t n, int64_t G, int64_t pos0, int64_t kt0,
               int64_t window) {
  for (int64_t r = 0; r < R; ++r) {
    const int64_t first_hidden = pos0 + r / G + 1 - kt0;
    for (int64_t j = std::max<int64_t>(first_hidden, 0); j < n; ++j) s[r * lds + j] = kNegInf;
    if (window > 0)
      for (int64_t j = 0; j < std::min(first_hidden - window, n); ++j) s[r * lds + j] = kNegInf;
  }
}

// Per-thread buffers, sized for the largest row block.
struct Buffers {
  explicit Buffers(int64_t R, int64_t D)
      : mem(3 * R * D + 4 * R + D * kKeyTile + R * kKeyTile + 2 * kKeyTile * D + D) {
    qs = mem.get();
    o = qs + R * D;
    ao = o + R * D;
    kt = ao + R * D;
    s = kt + D * kKeyTile;
    gather = s + R * kKeyTile;
    vt = gather + kKeyTile * D;
    m = vt + kKeyTile * D;
    l = m + R;
    am = l + R;
    al = am + R;
    zero = al + R;  // a value row of zeros for keys outside a sliding window
    std::fill_n(zero, D, 0.f);
  }
  Scratch mem;
  float *qs, *o, *ao, *kt, *s, *gather, *vt, *m, *l, *am, *al, *zero;
};

// Online softmax of the block's rows over the keys of partition `part`; leaves o (R, D)
// unnormalised with the row max m and row sum l. qs (R, D) holds the scaled queries.
void run_partition(const Job& job, const RowBlock& rb, int64_t part, Buffers& buf, float* o,
                   float* m, float* l) {
  const SeqPlan& sp = job.plans[rb.seq];
  const PagedSequence& s = (*job.seqs)[rb.seq];
  const AttnTileOps& ops = *job.ops;
  const int64_t G = job.G, R = rb.qn * G, D = job.d.D;
  std::fill_n(o, R * D, 0.f);
  std::fill_n(m, R, kNegInf);
  std::fill_n(l, R, 0.f);
  const int64_t pbeg = part * sp.split, pend = std::min(pbeg + sp.split, rb.kend);
  const int64_t pos0 = sp.q_offset + rb.i0;  // position of the block's first row
  for (int64_t kt0 = pbeg, tile = 0; kt0 < pend; kt0 += kKeyTile, ++tile) {
    const int64_t n = std::min(kKeyTile, pend - kt0);
    if (kt0 + n <= rb.kbeg) continue;  // before every row's window
    // Keys [kt0, lead) precede the block's window: their cache blocks may be freed, so they
    // are packed as zeros (and masked) and their value rows are zeros. (Prepacked tiles
    // start at the sequence's first window, at or before this block's.)
    const int64_t lead = std::max(rb.kbeg, kt0);
    const float* ktile = buf.kt;
    if (sp.packed) {
      ktile = sp.packed + rb.kvh * sp.packed_stride +
              (part * sp.tiles_per_part + tile) * D * kKeyTile;
    } else if (lead > kt0) {
      gather_key_rows(job, s, rb.kvh, lead, kt0 + n - lead, buf.gather + (lead - kt0) * D);
      std::fill_n(buf.gather, (lead - kt0) * D, 0.f);
      ops.pack_transposed(buf.gather, D, n, D, buf.kt, kKeyTile);
    } else {
      pack_key_tile(job, s, rb.kvh, kt0, n, buf.kt, buf.gather);
    }
    ops.gemm(R, n, D, buf.qs, D, 1, ktile, kKeyTile, buf.s, kKeyTile, false);  // S = (scale Q) K^T
    if (job.softcap > 0.f) {  // cap tanh(s / cap), per element: a row's bits stay its own
      const float inv = 1.f / job.softcap;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < n; ++j) buf.s[r * kKeyTile + j] = job.softcap * std::tanh(buf.s[r * kKeyTile + j] * inv);
    }
    if (kt0 + n - 1 > pos0 || (job.window > 0 && kt0 <= pos0 + rb.qn - 1 - job.window))
      mask_tile(buf.s, kKeyTile, R, n, G, pos0, kt0, job.window);
    ops.softmax_update(buf.s, kKeyTile, R, n, m, l, o, D, D);
    // Value rows are read in place from an f32 cache, else widened into vt first.
    const float* v_rows[kKeyTile];
    for (int64_t j = 0; j < lead - kt0; ++j) v_rows[j] = buf.zero;
    const bool f32 = job.v.dtype == KvCacheDtype::kF32;
    for_each_run(s, job.d.block_size, lead, kt0 + n - lead,
                 [&](int64_t blk, int64_t slot, int64_t col0, int64_t len) {
                   const int64_t col = col0 + (lead - kt0);
                   for (int64_t j = 0; j < len; ++j) {
                     const uint8_t* src = job.v.row(blk, slot + j, rb.kvh);
                     if (f32) {
                       v_rows[col + j] = reinterpret_cast<const float*>(src);
                     } else {
                       float* row = buf.vt + (col + j) * D;
                       kv_row_to_f32(job.v.dtype, src, D, row, job.isa);
                       v_rows[col + j] = row;
                     }
                   }
                 });
    job.accumulate_pv(R, n, buf.s, kKeyTile, v_rows, D, o);  // O += P V
  }
}

// Folds one partition's (po, pm, pl) into the running (ao, am, al), row by row. Every path
// merges through this one out-of-line function, so the rounding is the same everywhere.
[[gnu::noinline]] void merge_partial(ScaleAddFn scale_add, int64_t R, int64_t D, const float* po,
                                     const float* pm, const float* pl, float* ao, float* am,
                                     float* al) {
  for (int64_t r = 0; r < R; ++r) {
    if (pm[r] == kNegInf) continue;  // the row sees no key of this partition
    const float* src = po + r * D;
    float* dst = ao + r * D;
    if (am[r] == kNegInf) {
      std::memcpy(dst, src, sizeof(float) * D);
      am[r] = pm[r];
      al[r] = pl[r];
      continue;
    }
    const float mx = std::max(am[r], pm[r]);
    // One factor is exactly exp(0) = 1; skipping that call changes no bit.
    const float a = am[r] == mx ? 1.f : std::exp(am[r] - mx);
    const float b = pm[r] == mx ? 1.f : std::exp(pm[r] - mx);
    scale_add(dst, src, a, b, D);
    al[r] = al[r] * a + pl[r] * b;
    am[r] = mx;
  }
}

void gather_queries(const Job& job, const RowBlock& rb, float* qs) {
  const int64_t G = job.G, D = job.d.D;
  const int64_t t0 = (*job.seqs)[rb.seq].q_begin + rb.i0;
  for (int64_t ii = 0; ii < rb.qn; ++ii) {
    const float* src = job.q.row(0, t0 + ii, rb.kvh * G, D);  // G heads, adjacent
    float* dst = qs + ii * G * D;
    for (int64_t e = 0; e < G * D; ++e) dst[e] = src[e] * job.scale;
  }
}

[[gnu::noinline]] void store_rows(const Job& job, const RowBlock& rb, const float* ao,
                                  const float* al) {
  const int64_t G = job.G, D = job.d.D;
  const int64_t t0 = (*job.seqs)[rb.seq].q_begin + rb.i0;
  for (int64_t r = 0; r < rb.qn * G; ++r) {
    float* dst = job.out.row(0, t0 + r / G, rb.kvh * G + r % G, D);
    const float inv = al[r] > 0.f ? 1.f / al[r] : 0.f;
    for (int64_t e = 0; e < D; ++e) dst[e] = ao[r * D + e] * inv;
  }
}

void reset_running(int64_t R, int64_t D, float* ao, float* am, float* al) {
  std::fill_n(ao, R * D, 0.f);
  std::fill_n(am, R, kNegInf);
  std::fill_n(al, R, 0.f);
}

void run_item(const Job& job, const Item& it, Buffers& buf, std::atomic<int64_t>* done) {
  const RowBlock& rb = job.blocks[it.block];
  const int64_t R = rb.qn * job.G, D = job.d.D;
  gather_queries(job, rb, buf.qs);
  if (it.part >= 0) {
    // One partition of a split block; whoever finishes the block's last one merges them all.
    float* part = rb.partials + it.part * partial_floats(R, D);
    run_partition(job, rb, it.part, buf, part, part + R * D, part + R * D + R);
    if (done[it.block].fetch_add(1, std::memory_order_acq_rel) + 1 < rb.nparts) return;
    reset_running(R, D, buf.ao, buf.am, buf.al);
    for (int64_t p = 0; p < rb.nparts; ++p) {
      const float* pp = rb.partials + p * partial_floats(R, D);
      merge_partial(job.scale_add, R, D, pp, pp + R * D, pp + R * D + R, buf.ao, buf.am, buf.al);
    }
    store_rows(job, rb, buf.ao, buf.al);
    return;
  }
  reset_running(R, D, buf.ao, buf.am, buf.al);
  for (int64_t p = 0; p < rb.nparts; ++p) {
    run_partition(job, rb, p, buf, buf.o, buf.m, buf.l);
    merge_partial(job.scale_add, R, D, buf.o, buf.m, buf.l, buf.ao, buf.am, buf.al);
  }
  store_rows(job, rb, buf.ao, buf.al);
}

// Packs K^T once for sequences with several query row blocks per kv head, so their row
// blocks share it instead of each transposing every key tile again.
std::unique_ptr<Scratch> prepack_keys(Job& job, int64_t qb_max) {
  struct PackTask {
    int64_t seq, kvh, t0, n;
    float* dst;
    int64_t first;  // keys before it (a sliding window's start) are packed as zeros
  };
  const int64_t D = job.d.D, tile_floats = D * kKeyTile;
  int64_t total = 0;
  std::vector<int64_t> offset(job.seqs->size(), -1);
  for (size_t i = 0; i < job.seqs->size(); ++i) {
    const PagedSequence& s = (*job.seqs)[i];
    if (s.q_len <= qb_max) continue;  // one row block per kv head: packs each tile once anyway
    SeqPlan& sp = job.plans[i];
    sp.packed_stride = ceil_div(s.context_len, sp.split) * sp.tiles_per_part * tile_floats;
    offset[i] = total;
    total += sp.packed_stride * job.d.Hkv;
  }
  if (total == 0) return nullptr;
  auto mem = std::make_unique<Scratch>(total);
  std::vector<PackTask> tasks;
  for (size_t i = 0; i < job.seqs->size(); ++i) {
    if (offset[i] < 0) continue;
    const PagedSequence& s = (*job.seqs)[i];
    SeqPlan& sp = job.plans[i];
    sp.packed = mem->get() + offset[i];
    // Under a sliding window no row sees a key before its first row's window: tiles wholly
    // before it are never used (left unpacked), the tile holding it is packed from it on.
    const int64_t first = job.window > 0 ? std::max<int64_t>(sp.q_offset - job.window + 1, 0) : 0;
    for (int64_t kvh = 0; kvh < job.d.Hkv; ++kvh)
      for (int64_t p = 0; p * sp.split < s.context_len; ++p) {
        const int64_t pend = std::min((p + 1) * sp.split, s.context_len);
        for (int64_t t0 = p * sp.split, tile = 0; t0 < pend; t0 += kKeyTile, ++tile)
          if (t0 + std::min(kKeyTile, pend - t0) > first)
            tasks.push_back({static_cast<int64_t>(i), kvh, t0, std::min(kKeyTile, pend - t0),
                             mem->get() + offset[i] + kvh * sp.packed_stride +
                                 (p * sp.tiles_per_part + tile) * tile_floats, first});
      }
  }
  base::parallel_for(static_cast<int64_t>(tasks.size()), 4, [&](int64_t begin, int64_t end) {
    Scratch gather(kKeyTile * D);
    for (int64_t w = begin; w < end; ++w) {
      const PackTask& t = tasks[w];
      if (t.first <= t.t0) {
        pack_key_tile(job, (*job.seqs)[t.seq], t.kvh, t.t0, t.n, t.dst, gather.get());
        continue;
      }
      const int64_t lead = t.first - t.t0;
      gather_key_rows(job, (*job.seqs)[t.seq], t.kvh, t.first, t.n - lead, gather.get() + lead * D);
      std::fill_n(gather.get(), lead * D, 0.f);
      job.ops->pack_transposed(gather.get(), D, t.n, D, t.dst, kKeyTile);
    }
  });
  return mem;
}

}  // namespace

int64_t paged_partition_keys(int64_t context_len, const PagedAttentionParams& p) {
  if (p.decode_split > 0) return p.decode_split;
  if (p.batch_invariant) return kInvariantSplit;
  // About 16 partitions for long contexts, so one long decode spreads over the threads;
  // at least 256 keys, because each partition costs a merge (measured on batch-16 decodes
  // over 512 keys: 128-key partitions ~5% slower than one pass, 64-key ones ~10%).
  // Depends on context_len only.
  return std::clamp<int64_t>(ceil_div(ceil_div(context_len, 16), kKeyTile) * kKeyTile, 256, 1024);
}

void paged_attention_cpu(const PagedDims& dims, const AttnView& q, const KvCacheView& k_cache,
                         const KvCacheView& v_cache, const std::vector<PagedSequence>& seqs,
                         const AttnView& out, const PagedAttentionParams& p, AttnIsa isa) {
  if (dims.Hq == 0 || dims.D == 0) return;
  Job job;
  job.d = dims;
  job.G = dims.Hq / dims.Hkv;
  job.q = q, job.k = k_cache, job.v = v_cache, job.out = out;
  job.isa = isa;
  job.seqs = &seqs;
  job.scale = p.scale;
  job.window = p.window;
  job.softcap = p.softcap;
  job.ops = &tile_ops(isa);
  job.scale_add = isa == AttnIsa::kAvx512 ? scale_add_avx512 : isa == AttnIsa::kAvx2 ? scale_add_avx2 : scale_add_scalar;
  job.accumulate_pv = isa == AttnIsa::kAvx512 ? accumulate_pv_avx512
                      : isa == AttnIsa::kAvx2 ? accumulate_pv_avx2
                                              : accumulate_pv_scalar;
  const int64_t G = job.G, D = dims.D;
  const int64_t qb_max = std::max<int64_t>(kTargetRows / G, 1);

  job.plans.resize(seqs.size());
  int64_t total_cost = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const PagedSequence& s = seqs[i];
    if (s.q_len <= 0) continue;
    SeqPlan& sp = job.plans[i];
    sp.q_offset = s.context_len - s.q_len;
    sp.split = paged_partition_keys(s.context_len, p);
    sp.tiles_per_part = ceil_div(sp.split, kKeyTile);
    const int64_t qb = std::min(qb_max, s.q_len);
    for (int64_t kvh = 0; kvh < dims.Hkv; ++kvh)
      for (int64_t i0 = 0; i0 < s.q_len; i0 += qb) {
        RowBlock rb;
        rb.seq = static_cast<int64_t>(i), rb.kvh = kvh, rb.i0 = i0;
        rb.qn = std::min(qb, s.q_len - i0);
        rb.kend = std::min(s.context_len, sp.q_offset + i0 + rb.qn);
        rb.kbeg = p.window > 0 ? std::max<int64_t>(sp.q_offset + i0 - p.window + 1, 0) : 0;
        rb.nparts = ceil_div(rb.kend, sp.split);
        total_cost += rb.qn * G * (rb.kend - rb.kbeg);
        job.blocks.push_back(rb);
      }
  }
  if (job.blocks.empty()) return;

  // Scheduling (never the bits): a block much bigger than a fair share of the work is
  // split into one item per partition so a lone long sequence still uses every thread.
  const int64_t nt = base::num_threads();
  const int64_t share = total_cost / (4 * nt);
  std::vector<Item> items;
  int64_t partial_total = 0;
  for (size_t b = 0; b < job.blocks.size(); ++b) {
    const RowBlock& rb = job.blocks[b];
    const int64_t R = rb.qn * G, cost = R * rb.kend;
    if (rb.nparts > 1 && cost > share) {
      const int64_t split = job.plans[rb.seq].split;
      for (int64_t part = 0; part < rb.nparts; ++part)
        items.push_back({static_cast<int64_t>(b), part,
                         R * (std::min((part + 1) * split, rb.kend) - part * split)});
      partial_total += rb.nparts * partial_floats(R, D);
    } else {
      items.push_back({static_cast<int64_t>(b), -1, cost});
    }
  }
  std::unique_ptr<Scratch> partials;
  if (partial_total > 0) {
    partials = std::make_unique<Scratch>(partial_total);
    float* next = partials->get();
    for (const Item& it : items) {
      RowBlock& rb = job.blocks[it.block];
      if (it.part != 0) continue;  // first partition item of a split block
      rb.partials = next;
      next += rb.nparts * partial_floats(rb.qn * G, D);
    }
  }
  const std::unique_ptr<Scratch> packed = prepack_keys(job, qb_max);

  // Biggest items first, handed out dynamically: decodes and prefill chunks differ in cost
  // by orders of magnitude.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::unique_ptr<std::atomic<int64_t>[]> done(new std::atomic<int64_t>[job.blocks.size()]());
  std::atomic<int64_t> next_item{0};
  const int64_t nitems = static_cast<int64_t>(items.size());
  const int64_t rows_max = G * std::max<int64_t>(qb_max, 1);
  base::parallel_for(std::min(nt, nitems), 1, [&](int64_t, int64_t) {
    Buffers buf(rows_max, D);
    for (int64_t w; (w = next_item.fetch_add(1, std::memory_order_relaxed)) < nitems;)
      run_item(job, items[w], buf, done.get());
  });
}

void write_kv_cache_cpu(const PagedDims& dims, const AttnView& k, const AttnView& v,
                        const std::vector<KvSlotWrite>& writes, const KvCacheView& k_cache,
                        const KvCacheView& v_cache, AttnIsa isa) {
  const int64_t D = dims.D;
  base::parallel_for(static_cast<int64_t>(writes.size()), 64, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const KvSlotWrite& x = writes[w];
      const bool has_v = v_cache.data != nullptr;  // (a cache of one tensor: latent rows)
      if (k_cache.dtype == KvCacheDtype::kF32) {  // head stride D: a token's heads are one run
        std::memcpy(k_cache.row(x.block, x.slot, 0), k.row(0, x.token, 0, D), sizeof(float) * dims.Hkv * D);
        if (has_v)
          std::memcpy(v_cache.row(x.block, x.slot, 0), v.row(0, x.token, 0, D), sizeof(float) * dims.Hkv * D);
        continue;
      }
      for (int64_t h = 0; h < dims.Hkv; ++h) {
        kv_row_from_f32(k_cache.dtype, k.row(0, x.token, h, D), D, k_cache.row(x.block, x.slot, h), isa);
        if (has_v)
          kv_row_from_f32(v_cache.dtype, v.row(0, x.token, h, D), D, v_cache.row(x.block, x.slot, h), isa);
      }
    }
  });
}

void copy_kv_blocks_cpu(const KvCacheView& k_cache, const KvCacheView& v_cache,
                        const std::vector<std::pair<int32_t, int32_t>>& copies) {
  // In list order: a block may be copied after it was itself a destination.
  for (const auto& [src, dst] : copies) {
    if (src == dst) continue;
    std::memcpy(k_cache.row(dst, 0, 0), k_cache.row(src, 0, 0), k_cache.block_bytes);
    if (v_cache.data) std::memcpy(v_cache.row(dst, 0, 0), v_cache.row(src, 0, 0), v_cache.block_bytes);
  }
}

void read_kv_rows_cpu(const PagedDims& dims, const KvCacheView& cache, const PagedSequence& s, float* out,
                      AttnIsa isa) {
  const int64_t D = dims.D, bs = dims.block_size;
  base::parallel_for(s.context_len, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < dims.Hkv; ++h)
        kv_row_to_f32(cache.dtype, cache.row(s.block_table[t / bs], t % bs, h), D, out + (t * dims.Hkv + h) * D,
                      isa);
  });
}

}  // namespace tessera::kernels::cpu
