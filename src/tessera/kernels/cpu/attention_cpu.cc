// FlashAttention-style forward and backward on the CPU: query blocks against key tiles
// of kKeyTile keys with an online softmax. The (Tq, Tk) score matrix is never stored:
// scratch is one score tile per thread plus, when it is reused, a transposed copy of K.
//
// A "row block" is a few consecutive query positions of all the query heads that share
// one kv head, so each K / V tile is loaded once for the whole GQA group. Row r of a
// block is query i0 + r / G of head kvh * G + r % G (G = Hq / Hkv).
#include "tessera/kernels/dispatch.h"
#include "tessera/kernels/cpu/attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "tessera/base/aligned_alloc.h"
#include "tessera/base/cpu_features.h"
#include "tessera/base/thread_pool.h"
#include "tessera/kernels/cpu/attention_blocks.h"
#include "tessera/kernels/cpu/attention_tile_ops.h"

namespace tessera::kernels::cpu {

const AttnTileOps& tile_ops(AttnIsa isa) {
  switch (isa) {
    case AttnIsa::kAvx512: return avx512_tile_ops();
    case AttnIsa::kAvx2: return avx2_tile_ops();
    default: return scalar_tile_ops();
  }
}

namespace {

using namespace attn;

// Packs keys [0, n) of one (b, kv head) as consecutive (D, kKeyTile) tiles of K^T. Tiles
// are kept apart (not one (D, n) matrix) so a tile's rows do not collide in L1 sets.
void pack_key_tiles(const AttnTileOps& ops, const float* k, int64_t token_stride, int64_t n,
                    int64_t D, float* dst) {
  for (int64_t t0 = 0; t0 < n; t0 += kKeyTile)
    ops.pack_transposed(k + t0 * token_stride, token_stride, std::min(kKeyTile, n - t0), D,
                        dst + t0 / kKeyTile * D * kKeyTile, kKeyTile);
}

// ---------------------------------------------------------------------------------------
// Forward.

struct ForwardJob {
  AttnDims d;
  AttnView q, k, v, out;
  LseView lse;
  AttentionParams p;
  Blocking bl;
  int64_t nsplit = 1;  // key ranges per row block, merged afterwards when > 1
  const AttnTileOps* ops = nullptr;
  float* partial = nullptr;  // nsplit > 1: per (block, split) o (R, D), m (R), l (R)
  // When several row blocks share a kv head, K is transposed once up front: per (b, kv
  // head) `packed_stride` floats of key tiles (D, kKeyTile). Null: each block packs its own.
  const float* kt_packed = nullptr;
  int64_t packed_stride = 0;

  int64_t partial_stride() const { return bl.rows() * (d.D + 2); }
};

// Online softmax over keys [kbeg, kend) for one row block; leaves o (R, D) unnormalised
// with its running max m and sum l.
void forward_range(const ForwardJob& job, int64_t b, int64_t kvh, int64_t i0, int64_t qn,
                   const BlockKeys& bk, int64_t kbeg, int64_t kend, float* qs, float* kt, float* s,
                   float* o, float* m, float* l) {
  const AttnDims& d = job.d;
  const AttnTileOps& ops = *job.ops;
  const int64_t G = job.bl.G, R = qn * G, D = d.D;
  gather_rows(job.q, b, kvh, i0, qn, G, D, job.p.scale, qs);
  std::fill_n(o, R * D, 0.f);
  std::fill_n(m, R, kNegInf);
  std::fill_n(l, R, 0.f);
  const float* kbase = job.k.row(b, 0, kvh, D);
  const float* vbase = job.v.row(b, 0, kvh, D);
  const float* packed =
      job.kt_packed ? job.kt_packed + (b * d.Hkv + kvh) * job.packed_stride : nullptr;
  for (int64_t kt0 = kbeg; kt0 < kend; kt0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, kend - kt0);
    const float* ktile = packed ? packed + kt0 / kKeyTile * D * kKeyTile : kt;
    if (!packed)
      ops.pack_transposed(kbase + kt0 * job.k.token_stride, job.k.token_stride, n, D, kt, kKeyTile);
    ops.gemm(R, n, D, qs, D, 1, ktile, kKeyTile, s, kKeyTile, false);  // S = (scale Q) K^T
    if (job.p.softcap > 0.f) softcap_tile(s, kKeyTile, R, n, job.p.softcap);
    if (bk.needs_mask(kt0, n)) mask_tile(s, kKeyTile, R, n, G, kt0, bk);
    ops.softmax_update(s, kKeyTile, R, n, m, l, o, D, D);
    ops.gemm(R, D, n, s, kKeyTile, 1, vbase + kt0 * job.v.token_stride, job.v.token_stride, o, D,
             true);  // O += P V
  }
}


// Work item w -> (b, kv head, block, split). Blocks are visited in the order 0, n-1, 1,
// n-2, ... so the contiguous chunks parallel_for hands out mix cheap early (causal) blocks
// with expensive late ones.
struct Item {
  int64_t b, kvh, block, split;
};

Item decode_item(int64_t w, int64_t Hkv, int64_t nblocks, int64_t nsplit) {
  Item it;
  it.split = w % nsplit;
  w /= nsplit;
  const int64_t z = w % nblocks;
  w /= nblocks;
  it.kvh = w % Hkv;
  it.b = w / Hkv;
  it.block = (z % 2 == 0) ? z / 2 : nblocks - 1 - z / 2;
  return it;
}

void run_forward(const ForwardJob& job) {
  const AttnDims& d = job.d;
  const int64_t R = job.bl.rows(), D = d.D;
  const int64_t nitems = d.B * d.Hkv * job.bl.nblocks * job.nsplit;
  base::parallel_for(nitems, 1, [&](int64_t begin, int64_t end) {
    Scratch buf(R * D * 2 + D * kKeyTile + R * kKeyTile + 2 * R);
    float* qs = buf.get();
    float* o = qs + R * D;
    float* kt = o + R * D;
    float* s = kt + D * kKeyTile;
    float* m = s + R * kKeyTile;
    float* l = m + R;
    for (int64_t w = begin; w < end; ++w) {
      const Item it = decode_item(w, d.Hkv, job.bl.nblocks, job.nsplit);
      const int64_t i0 = it.block * job.bl.qb;
      const int64_t qn = std::min(job.bl.qb, d.Tq - i0);
      const BlockKeys bk = visible_keys(d, job.p, it.b, i0, qn);
      const int64_t kbeg = bk.begin(), kend = bk.end();
      if (job.nsplit == 1) {
        forward_range(job, it.b, it.kvh, i0, qn, bk, kbeg, kend, qs, kt, s, o, m, l);
        store_rows(job.out, job.lse, it.b, it.kvh, i0, qn, job.bl.G, D, o, m, l);
        continue;
      }
      // Split-K: tile-aligned key ranges; an empty range leaves l = 0 (weight 0 in the merge).
      const int64_t ntiles = (kend - kbeg + kKeyTile - 1) / kKeyTile;
      const int64_t t0 = ntiles * it.split / job.nsplit, t1 = ntiles * (it.split + 1) / job.nsplit;
      float* part = job.partial + w * job.partial_stride();
      forward_range(job, it.b, it.kvh, i0, qn, bk, kbeg + t0 * kKeyTile, std::min(kend, kbeg + t1 * kKeyTile), qs, kt,
                    s, part, part + R * D, part + R * D + R);
    }
  });
  if (job.nsplit == 1) return;
  // Merge the splits of each row block: weights exp(m_s - max_s m_s).
  const int64_t nblocks_total = d.B * d.Hkv * job.bl.nblocks;
  base::parallel_for(nblocks_total, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(R * D), m(R), l(R);
    for (int64_t w = begin; w < end; ++w) {
      const Item it = decode_item(w * job.nsplit, d.Hkv, job.bl.nblocks, job.nsplit);
      const int64_t i0 = it.block * job.bl.qb;
      const int64_t qn = std::min(job.bl.qb, d.Tq - i0);
      const float* parts = job.partial + w * job.nsplit * job.partial_stride();
      for (int64_t r = 0; r < qn * job.bl.G; ++r) {
        float mx = kNegInf;
        for (int64_t sp = 0; sp < job.nsplit; ++sp)
          mx = std::max(mx, parts[sp * job.partial_stride() + R * D + r]);
        m[r] = mx;
        l[r] = 0.f;
        std::fill_n(&o[r * D], D, 0.f);
        if (mx == kNegInf) continue;
        for (int64_t sp = 0; sp < job.nsplit; ++sp) {
          const float* part = parts + sp * job.partial_stride();
          const float wgt = std::exp(part[R * D + r] - mx);
          if (wgt == 0.f) continue;
          l[r] += part[R * D + R + r] * wgt;
          for (int64_t e = 0; e < D; ++e) o[r * D + e] += part[r * D + e] * wgt;
        }
      }
      store_rows(job.out, job.lse, it.b, it.kvh, i0, qn, job.bl.G, D, o.data(), m.data(), l.data());
    }
  });
}

// ---------------------------------------------------------------------------------------
// Backward (FlashAttention-2). One work item per (b, kv head): it owns dk / dv of that kv
// head and dq of the group's query heads, so threads never write the same row.

struct BackwardJob {
  AttnDims d;
  AttnView q, k, v, out, dout, dq, dk, dv;
  LseView lse;
  AttentionParams p;
  Blocking bl;
  const AttnTileOps* ops = nullptr;
};

void backward_item(const BackwardJob& job, int64_t b, int64_t kvh, float* kt, float* vt, float* qs,
                   float* dos, float* dqa, float* s, float* dp, float* lse_r, float* delta, float* th) {
  const AttnDims& d = job.d;
  const AttnTileOps& ops = *job.ops;
  const int64_t G = job.bl.G, D = d.D;
  const float scale = job.p.scale;
  const float* kbase = job.k.row(b, 0, kvh, D);
  const float* vbase = job.v.row(b, 0, kvh, D);
  float* dkbase = job.dk.row(b, 0, kvh, D);
  float* dvbase = job.dv.row(b, 0, kvh, D);
  for (int64_t t = 0; t < d.Tk; ++t) {
    std::fill_n(dkbase + t * job.dk.token_stride, D, 0.f);
    std::fill_n(dvbase + t * job.dv.token_stride, D, 0.f);
  }
  const int64_t kall = visible_key_end(d, job.p, 0, d.Tq);
  pack_key_tiles(ops, kbase, job.k.token_stride, kall, D, kt);
  pack_key_tiles(ops, vbase, job.v.token_stride, kall, D, vt);

  for (int64_t blk = 0; blk < job.bl.nblocks; ++blk) {
    const int64_t i0 = blk * job.bl.qb;
    const int64_t qn = std::min(job.bl.qb, d.Tq - i0);
    const int64_t R = qn * G;
    gather_rows(job.q, b, kvh, i0, qn, G, D, scale, qs);
    gather_rows(job.dout, b, kvh, i0, qn, G, D, 1.f, dos);
    block_lse_and_delta(job.lse, job.dout, job.out, b, kvh, i0, qn, G, D, ops.dot, lse_r, delta);
    std::fill_n(dqa, R * D, 0.f);
    const BlockKeys bk = visible_keys(d, job.p, b, i0, qn);
    const int64_t kend = bk.end();
    for (int64_t kt0 = bk.begin(); kt0 < kend; kt0 += kKeyTile) {
      const int64_t n = std::min(kKeyTile, kend - kt0);
      const float* ktile = kt + kt0 * D;  // tile kt0 / kKeyTile of the packed K^T and V^T
      const float* vtile = vt + kt0 * D;
      ops.gemm(R, n, D, qs, D, 1, ktile, kKeyTile, s, kKeyTile, false);  // S = (scale Q) K^T
      if (job.p.softcap > 0.f) softcap_tile(s, kKeyTile, R, n, job.p.softcap, th);
      if (bk.needs_mask(kt0, n)) mask_tile(s, kKeyTile, R, n, G, kt0, bk);
      ops.probs_from_scores(s, kKeyTile, R, n, lse_r);                     // P
      ops.gemm(R, n, D, dos, D, 1, vtile, kKeyTile, dp, kKeyTile, false);  // dP = dO V^T
      ops.dscores_from_dprobs(s, dp, kKeyTile, R, n, delta);               // dS = P (dP - delta)
      if (job.p.softcap > 0.f)  // through the cap: dS (1 - tanh^2)
        for (int64_t r = 0; r < R; ++r)
          for (int64_t j = 0; j < n; ++j) dp[r * kKeyTile + j] *= 1.f - th[r * kKeyTile + j] * th[r * kKeyTile + j];
      // dV += P^T dO
      ops.gemm(n, D, R, s, 1, kKeyTile, dos, D, dvbase + kt0 * job.dv.token_stride,
               job.dv.token_stride, true);
      // dQ += dS K (scaled once at the end)
      ops.gemm(R, D, n, dp, kKeyTile, 1, kbase + kt0 * job.k.token_stride, job.k.token_stride, dqa,
               D, true);
      // dK += dS^T (scale Q)
      ops.gemm(n, D, R, dp, 1, kKeyTile, qs, D, dkbase + kt0 * job.dk.token_stride,
               job.dk.token_stride, true);
    }
    scatter_rows(dqa, b, kvh, i0, qn, G, D, scale, job.dq);
  }
}

}  // namespace

AttnIsa best_attention_isa() {
  if (cpu_has(IsaLevel::kAvx512)) return AttnIsa::kAvx512;  // dispatch.h
  return cpu_has(IsaLevel::kAvx2) ? AttnIsa::kAvx2 : AttnIsa::kScalar;
}

void attention_forward_cpu(const AttnDims& dims, const AttnView& q, const AttnView& k,
                           const AttnView& v, const AttnView& out, const LseView& lse,
                           const AttentionParams& params, AttnIsa isa) {
  if (dims.B == 0 || dims.Tq == 0 || dims.Hq == 0 || dims.D == 0) return;
  ForwardJob job;
  job.d = dims;
  job.q = q, job.k = k, job.v = v, job.out = out, job.lse = lse;
  job.p = params;
  job.bl = make_blocking(dims);
  job.ops = &tile_ops(isa);
  // Decode-like calls have few row blocks: split the keys so every thread gets work.
  const int64_t nt = base::num_threads();
  const int64_t nblocks_total = dims.B * dims.Hkv * job.bl.nblocks;
  const int64_t max_keys = visible_key_end(dims, params, dims.Tq - 1, 1);
  if (nblocks_total < 2 * nt && max_keys >= kMinSplitKeys) {
    job.nsplit = std::min<int64_t>((2 * nt + nblocks_total - 1) / nblocks_total,
                                   max_keys / (kMinSplitKeys / 2));
  }
  std::unique_ptr<Scratch> partial;
  if (job.nsplit > 1) {
    partial = std::make_unique<Scratch>(nblocks_total * job.nsplit * job.partial_stride());
    job.partial = partial->get();
  }
  std::unique_ptr<Scratch> packed;
  if (job.bl.nblocks > 1) {
    const int64_t ntiles = (max_keys + kKeyTile - 1) / kKeyTile;
    job.packed_stride = ntiles * dims.D * kKeyTile;
    packed = std::make_unique<Scratch>(dims.B * dims.Hkv * job.packed_stride);
    float* dst = packed->get();
    base::parallel_for(dims.B * dims.Hkv * ntiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t w = begin; w < end; ++w) {
        const int64_t bh = w / ntiles, t0 = w % ntiles * kKeyTile;
        const float* src = k.row(bh / dims.Hkv, t0, bh % dims.Hkv, dims.D);
        job.ops->pack_transposed(src, k.token_stride, std::min(kKeyTile, max_keys - t0), dims.D,
                                 dst + bh * job.packed_stride + t0 * dims.D, kKeyTile);
      }
    });
    job.kt_packed = dst;
  }
  run_forward(job);
}

void attention_backward_cpu(const AttnDims& dims, const AttnView& q, const AttnView& k,
                            const AttnView& v, const AttnView& out, const LseView& lse,
                            const AttnView& dout, const AttnView& dq, const AttnView& dk,
                            const AttnView& dv, const AttentionParams& params, AttnIsa isa) {
  if (dims.B == 0 || dims.Hq == 0 || dims.D == 0) return;
  BackwardJob job;
  job.d = dims;
  job.q = q, job.k = k, job.v = v, job.out = out, job.dout = dout;
  job.dq = dq, job.dk = dk, job.dv = dv, job.lse = lse;
  job.p = params;
  job.ops = &tile_ops(isa);
  const int64_t D = dims.D;
  if (dims.Tq == 0) {  // no queries: every key gradient is zero
    for (int64_t b = 0; b < dims.B; ++b)
      for (int64_t t = 0; t < dims.Tk; ++t)
        for (int64_t h = 0; h < dims.Hkv; ++h) {
          std::fill_n(dk.row(b, t, h, D), D, 0.f);
          std::fill_n(dv.row(b, t, h, D), D, 0.f);
        }
    return;
  }
  job.bl = make_blocking(dims);
  const int64_t R = job.bl.rows();
  // K^T and V^T of one (b, kv head) are packed once, as (D, kKeyTile) tiles, and reused by
  // every row block.
  const int64_t packed = (dims.Tk + kKeyTile - 1) / kKeyTile * kKeyTile * D;
  base::parallel_for(dims.B * dims.Hkv, 1, [&](int64_t begin, int64_t end) {
    Scratch buf(2 * packed + 3 * R * D + 3 * R * kKeyTile + 2 * R);
    float* kt = buf.get();
    float* vt = kt + packed;
    float* qs = vt + packed;
    float* dos = qs + R * D;
    float* dqa = dos + R * D;
    float* s = dqa + R * D;
    float* dp = s + R * kKeyTile;
    float* lse_r = dp + R * kKeyTile;
    float* delta = lse_r + R;
    float* th = delta + R;  // soft-capping: the tile's tanh values
    for (int64_t w = begin; w < end; ++w)
      backward_item(job, w / dims.Hkv, w % dims.Hkv, kt, vt, qs, dos, dqa, s, dp, lse_r, delta, th);
  });
}

}  // namespace tessera::kernels::cpu
