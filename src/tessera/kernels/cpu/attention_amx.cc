// The attention kernels with their products on AMX-BF16 tiles (AttentionParams::
// bf16_products on a CPU with AMX): the same row blocks, key tiles, masks and online
// softmax as the f32 kernels (attention_cpu.cc), with every product's operands rounded to
// bf16 and accumulated in f32 (as autocast multiplies attention). Per key tile of 64:
//   forward   S = (scale Q) K^T, softmax step, O += P V
//   backward  S, P = exp(S - lse), dP = dO V^T, dS = P (dP - delta),
//             dV^T += dO^T P, dQ += dS K, dK^T += (scale Q)^T dS
// K^T, V (and in the backward V^T, K) are packed once per (batch, kv head) in the tiles'
// VNNI pairs; a block's rows are padded to 32, its last key tile to 64 (zeros, masked).
#include "tessera/kernels/cpu/attention_amx.h"

#include <algorithm>

#include "tessera/base/thread_pool.h"
#include "tessera/kernels/cpu/amx_tiles.h"
#include "tessera/kernels/cpu/attention_blocks.h"
#include "tessera/kernels/cpu/attention_tile_ops.h"
#include "tessera/kernels/cpu/avx512_math.h"
#include "tessera/tensor/bf16_avx512.h"

namespace tessera::kernels::cpu {
namespace {

using namespace attn;

constexpr int64_t kRowsPad = 32;  // a block's rows (<= kTargetRows), padded: the K of dV^T and dK^T

// Packs keys [0, nkeys) of x (token stride ld) tile by tile: `transposed` as B = x^T (for
// S = Q K^T, dP = dO V^T), else as B = x (for O += P V, dQ += dS K).
void pack_key_tiles(const float* x, int64_t ld, int64_t nkeys, int64_t D, bool transposed, uint16_t* dst) {
  for (int64_t t0 = 0; t0 < nkeys; t0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, nkeys - t0);
    uint16_t* d = dst + t0 / kKeyTile * D * kKeyTile;
    if (transposed)
      amx_pack_vnni_transposed(x + t0 * ld, ld, n, D, d, D, kKeyTile);
    else
      amx_pack_vnni(x + t0 * ld, ld, n, D, d, kKeyTile, D);
  }
}

// S (kRowsPad x 64) of rows qa against key tile kt0 (n keys): scale Q K^T, the tile's
// padding columns and hidden keys at -inf, soft-capped (th: the tanh values) when asked.
void score_tile(const AttentionParams& p, const BlockKeys& bk, int64_t G, int64_t R, int64_t D, const uint16_t* qa,
                const uint16_t* ktile, int64_t kt0, int64_t n, float* s, float* th) {
  amx_gemm_bf16(kRowsPad, kKeyTile, D, qa, D, ktile, 2 * kKeyTile, s, kKeyTile, false);
  if (p.softcap > 0.f) softcap_tile(s, kKeyTile, R, n, p.softcap, th);
  if (n < kKeyTile)
    for (int64_t r = 0; r < R; ++r) std::fill(s + r * kKeyTile + n, s + (r + 1) * kKeyTile, kNegInf);
  if (bk.needs_mask(kt0, n)) mask_tile(s, kKeyTile, R, n, G, kt0, bk);
}

const AttnTileOps& row_ops() { return avx512_tile_ops(); }  // AMX CPUs have AVX-512

// Backward, one key tile of 64: P = exp(S - lse) in place in s for rows [0, R), and P as
// VNNI pairs over its rows (pv: B of dV^T += dO^T P; rows past R zero).
TESSERA_AVX512 void probs_with_pairs(float* s, int64_t R, const float* lse, uint16_t* pv) {
  for (int64_t p = 0; p < kRowsPad / 2; ++p)
    for (int64_t j = 0; j < kKeyTile; j += 16) {
      __m512 e[2];
      for (int h = 0; h < 2; ++h) {
        const int64_t r = 2 * p + h;
        e[h] = _mm512_setzero_ps();
        if (r >= R) continue;
        e[h] = avx512::exp_or_zero(_mm512_sub_ps(_mm512_loadu_ps(s + r * kKeyTile + j), _mm512_set1_ps(lse[r])));
        _mm512_storeu_ps(s + r * kKeyTile + j, e[h]);
      }
      _mm512_storeu_si512(pv + p * 2 * kKeyTile + 2 * j, bf16_pair_words(e[0], e[1]));
    }
}

// dS = P (dP - delta) for rows [0, R) (times 1 - tanh^2 for keys [0, n) when soft-capped:
// th), as bf16 rows (dsa: A of dQ += dS K) and as VNNI pairs over rows (dsv: B of
// dK^T += Qs^T dS); rows past R zero.
TESSERA_AVX512 void dscores_with_packs(const float* p_, const float* dp, int64_t R, int64_t n, const float* delta,
                                       const float* th, uint16_t* dsa, uint16_t* dsv) {
  for (int64_t p = 0; p < kRowsPad / 2; ++p) {
    const int64_t r[2] = {2 * p, 2 * p + 1};
    for (int64_t j = 0; j < kKeyTile; j += 16) {
      __m512 ds[2];
      for (int e = 0; e < 2; ++e) {
        ds[e] = _mm512_setzero_ps();
        if (r[e] >= R) continue;
        const int64_t o = r[e] * kKeyTile + j;
        ds[e] = _mm512_mul_ps(_mm512_loadu_ps(p_ + o), _mm512_sub_ps(_mm512_loadu_ps(dp + o), _mm512_set1_ps(delta[r[e]])));
        if (th) {
          const __mmask16 live = avx512::tail_mask(std::max<int64_t>(0, n - j));
          const __m512 t = _mm512_maskz_loadu_ps(live, th + o);
          ds[e] = _mm512_mask_mul_ps(ds[e], live, ds[e], _mm512_fnmadd_ps(t, t, _mm512_set1_ps(1.f)));
        }
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dsa + r[0] * kKeyTile + j), bf16_pack(ds[0]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dsa + r[1] * kKeyTile + j), bf16_pack(ds[1]));
      _mm512_storeu_si512(dsv + p * 2 * kKeyTile + 2 * j, bf16_pair_words(ds[0], ds[1]));
    }
  }
}

}  // namespace

namespace {
int64_t amx_min_keys = kAmxMinKeys;
}  // namespace

void set_amx_attention_min_keys_for_testing(int64_t keys) { amx_min_keys = keys > 0 ? keys : kAmxMinKeys; }

bool amx_attention_supports(const AttnDims& d) {
  // Queries to run (no queries: the f32 backward zeroes dk, dv), and a row block (one
  // position's query heads at least) that fits the kRowsPad tile rows.
  return d.Tq > 0 && d.D % 32 == 0 && d.D <= 256 && d.Tk >= amx_min_keys && d.Hkv > 0 && d.Hq / d.Hkv <= kRowsPad;
}

void attention_forward_amx(const AttnDims& d, const AttnView& q, const AttnView& k, const AttnView& v,
                           const AttnView& out, const LseView& lse, const AttentionParams& p) {
  const Blocking bl = make_blocking(d);
  const int64_t D = d.D, G = bl.G;
  const int64_t nkeys = visible_key_end(d, p, d.Tq - 1, 1);
  const int64_t ntiles = (nkeys + kKeyTile - 1) / kKeyTile, per_head = ntiles * D * kKeyTile;
  ScratchOf<uint16_t> kt(d.B * d.Hkv * per_head), vv(d.B * d.Hkv * per_head);
  base::parallel_for(d.B * d.Hkv, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t w = b0; w < b1; ++w) {
      const int64_t b = w / d.Hkv, h = w % d.Hkv;
      pack_key_tiles(k.row(b, 0, h, D), k.token_stride, nkeys, D, true, kt.get() + w * per_head);
      pack_key_tiles(v.row(b, 0, h, D), v.token_stride, nkeys, D, false, vv.get() + w * per_head);
    }
  });
  const AttnTileOps& ops = row_ops();
  base::parallel_for(d.B * d.Hkv * bl.nblocks, 1, [&](int64_t w0, int64_t w1) {
    ScratchOf<float> qs(kRowsPad * D), o(kRowsPad * D), s(kRowsPad * kKeyTile), m(kRowsPad), l(kRowsPad);
    ScratchOf<uint16_t> qa(kRowsPad * D), pa(kRowsPad * kKeyTile);
    const AmxTileScope tiles;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t blk = w % bl.nblocks, bh = w / bl.nblocks, b = bh / d.Hkv, kvh = bh % d.Hkv;
      const int64_t i0 = blk * bl.qb, qn = std::min(bl.qb, d.Tq - i0), R = qn * G;
      const BlockKeys bk = visible_keys(d, p, b, i0, qn);
      gather_rows(q, b, kvh, i0, qn, G, D, p.scale, qs.get());
      amx_pack_rows(qs.get(), D, R, D, qa.get(), kRowsPad, D);
      std::fill_n(o.get(), kRowsPad * D, 0.f);
      std::fill_n(m.get(), kRowsPad, kNegInf);
      std::fill_n(l.get(), kRowsPad, 0.f);
      const uint16_t* ktb = kt.get() + bh * per_head;
      const uint16_t* vb = vv.get() + bh * per_head;
      for (int64_t kt0 = bk.begin(); kt0 < bk.end(); kt0 += kKeyTile) {
        const int64_t n = std::min(kKeyTile, bk.end() - kt0), t = kt0 / kKeyTile;
        score_tile(p, bk, G, R, D, qa.get(), ktb + t * D * kKeyTile, kt0, n, s.get(), nullptr);
        ops.softmax_update(s.get(), kKeyTile, R, kKeyTile, m.get(), l.get(), o.get(), D, D);
        amx_pack_rows(s.get(), kKeyTile, R, kKeyTile, pa.get(), kRowsPad, kKeyTile);
        amx_gemm_bf16(kRowsPad, D, kKeyTile, pa.get(), kKeyTile, vb + t * D * kKeyTile, 2 * D, o.get(), D, true);  // O += P V
      }
      store_rows(out, lse, b, kvh, i0, qn, G, D, o.get(), m.get(), l.get());
    }
  });
}

void attention_backward_amx(const AttnDims& d, const AttnView& q, const AttnView& k, const AttnView& v,
                            const AttnView& out, const LseView& lse, const AttnView& dout, const AttnView& dq,
                            const AttnView& dk, const AttnView& dv, const AttentionParams& p) {
  const Blocking bl = make_blocking(d);
  const int64_t D = d.D, G = bl.G;
  const float scale = p.scale;
  const int64_t nkeys = visible_key_end(d, p, 0, d.Tq);
  const int64_t ntiles = (nkeys + kKeyTile - 1) / kKeyTile, per_head = ntiles * D * kKeyTile;
  // dK^T and dV^T rows: the keys, and 16 floats more so their rows (a C tile's) do not
  // fall 4 KiB apart, on the same L1 sets.
  const int64_t Tp = ntiles * kKeyTile + 16;
  const AttnTileOps& ops = row_ops();
  base::parallel_for(d.B * d.Hkv, 1, [&](int64_t w0, int64_t w1) {
    ScratchOf<uint16_t> kt(per_head), vt(per_head), kv(per_head);
    ScratchOf<float> dkt(D * Tp), dvt(D * Tp);
    ScratchOf<float> qs(kRowsPad * D), dos(kRowsPad * D), dqa(kRowsPad * D), s(kRowsPad * kKeyTile),
        dp(kRowsPad * kKeyTile), th(kRowsPad * kKeyTile), lse_r(kRowsPad), delta(kRowsPad);
    ScratchOf<uint16_t> qa(kRowsPad * D), qat(D * kRowsPad), doa(kRowsPad * D), doat(D * kRowsPad),
        pv(kRowsPad * kKeyTile), dsa(kRowsPad * kKeyTile), dsv(kRowsPad * kKeyTile);
    const AmxTileScope tiles;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / d.Hkv, kvh = w % d.Hkv;
      const float* kbase = k.row(b, 0, kvh, D);
      const float* vbase = v.row(b, 0, kvh, D);
      pack_key_tiles(kbase, k.token_stride, nkeys, D, true, kt.get());   // B = K^T (S)
      pack_key_tiles(vbase, v.token_stride, nkeys, D, true, vt.get());   // B = V^T (dP)
      pack_key_tiles(kbase, k.token_stride, nkeys, D, false, kv.get());  // B = K (dQ)
      std::fill_n(dkt.get(), D * Tp, 0.f);
      std::fill_n(dvt.get(), D * Tp, 0.f);
      for (int64_t blk = 0; blk < bl.nblocks; ++blk) {
        const int64_t i0 = blk * bl.qb, qn = std::min(bl.qb, d.Tq - i0), R = qn * G;
        gather_rows(q, b, kvh, i0, qn, G, D, scale, qs.get());
        gather_rows(dout, b, kvh, i0, qn, G, D, 1.f, dos.get());
        amx_pack_rows(qs.get(), D, R, D, qa.get(), kRowsPad, D);
        amx_pack_rows_transposed(qs.get(), D, R, D, qat.get(), D, kRowsPad);
        amx_pack_rows(dos.get(), D, R, D, doa.get(), kRowsPad, D);
        amx_pack_rows_transposed(dos.get(), D, R, D, doat.get(), D, kRowsPad);
        block_lse_and_delta(lse, dout, out, b, kvh, i0, qn, G, D, ops.dot, lse_r.get(), delta.get());
        std::fill_n(dqa.get(), kRowsPad * D, 0.f);
        const BlockKeys bk = visible_keys(d, p, b, i0, qn);
        for (int64_t kt0 = bk.begin(); kt0 < bk.end(); kt0 += kKeyTile) {
          const int64_t n = std::min(kKeyTile, bk.end() - kt0), t = kt0 / kKeyTile;
          const int64_t tile = t * D * kKeyTile;
          score_tile(p, bk, G, R, D, qa.get(), kt.get() + tile, kt0, n, s.get(), th.get());
          probs_with_pairs(s.get(), R, lse_r.get(), pv.get());                                                // P
          amx_gemm_bf16(kRowsPad, kKeyTile, D, doa.get(), D, vt.get() + tile, 2 * kKeyTile, dp.get(), kKeyTile, false);  // dP = dO V^T
          dscores_with_packs(s.get(), dp.get(), R, n, delta.get(), p.softcap > 0.f ? th.get() : nullptr, dsa.get(), dsv.get());  // dS
          amx_gemm_bf16(D, kKeyTile, kRowsPad, doat.get(), kRowsPad, pv.get(), 2 * kKeyTile, dvt.get() + kt0, Tp, true);  // dV^T += dO^T P
          amx_gemm_bf16(kRowsPad, D, kKeyTile, dsa.get(), kKeyTile, kv.get() + tile, 2 * D, dqa.get(), D, true);  // dQ += dS K
          amx_gemm_bf16(D, kKeyTile, kRowsPad, qat.get(), kRowsPad, dsv.get(), 2 * kKeyTile, dkt.get() + kt0, Tp, true);  // dK^T += Qs^T dS
        }
        scatter_rows(dqa.get(), b, kvh, i0, qn, G, D, scale, dq);
      }
      for (int64_t t = 0; t < d.Tk; ++t) {
        float* dkr = dk.row(b, t, kvh, D);
        float* dvr = dv.row(b, t, kvh, D);
        for (int64_t e = 0; e < D; ++e) {
          dkr[e] = t < Tp ? dkt.get()[e * Tp + t] : 0.f;
          dvr[e] = t < Tp ? dvt.get()[e * Tp + t] : 0.f;
        }
      }
    }
  });
}

}  // namespace tessera::kernels::cpu
