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

#include "tessera/base/aligned_alloc.h"
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

// Buffers of T elements, 64-byte aligned.
template <typename T>
struct Buf {
  explicit Buf(int64_t n) : p(static_cast<T*>(base::aligned_malloc(sizeof(T) * std::max<int64_t>(n, 1)))) {}
  ~Buf() { base::aligned_free(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  T* p;
};

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

// 16 lanes of a row pair as VNNI words: the first row's bf16 in the low half, the second's high.
TESSERA_AVX512 inline __m512i pair_words(__m512 a, __m512 b) {
  return _mm512_or_si512(_mm512_srli_epi32(bf16_round_bits(a), 16), bf16_round_bits(b));
}

// Backward, one key tile of 64: P = exp(S - lse) in place in s for rows [0, R), and P as
// VNNI pairs over its rows (pv: B of dV^T += dO^T P; rows past R zero).
TESSERA_AVX512 void probs_with_pairs(float* s, int64_t R, const float* lse, uint16_t* pv) {
  for (int64_t p = 0; p < kRowsPad / 2; ++p) {
    const int64_t r0 = 2 * p, r1 = r0 + 1;
    for (int64_t j = 0; j < kKeyTile; j += 16) {
      __m512 e0 = _mm512_setzero_ps(), e1 = _mm512_setzero_ps();
      if (r0 < R) {
        e0 = avx512::exp_or_zero(_mm512_sub_ps(_mm512_loadu_ps(s + r0 * kKeyTile + j), _mm512_set1_ps(lse[r0])));
        _mm512_storeu_ps(s + r0 * kKeyTile + j, e0);
      }
      if (r1 < R) {
        e1 = avx512::exp_or_zero(_mm512_sub_ps(_mm512_loadu_ps(s + r1 * kKeyTile + j), _mm512_set1_ps(lse[r1])));
        _mm512_storeu_ps(s + r1 * kKeyTile + j, e1);
      }
      _mm512_storeu_si512(pv + p * 2 * kKeyTile + 2 * j, pair_words(e0, e1));
    }
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
      _mm512_storeu_si512(dsv + p * 2 * kKeyTile + 2 * j, pair_words(ds[0], ds[1]));
    }
  }
}

}  // namespace

namespace {
int64_t amx_min_keys = kAmxMinKeys;
}  // namespace

void set_amx_attention_min_keys_for_testing(int64_t keys) { amx_min_keys = keys > 0 ? keys : kAmxMinKeys; }

bool amx_attention_supports(const AttnDims& d) {
  // A row block (one position's query heads at least) must fit the kRowsPad tile rows.
  return d.D % 32 == 0 && d.D <= 256 && d.Tk >= amx_min_keys && d.Hkv > 0 && d.Hq / d.Hkv <= kRowsPad;
}

void attention_forward_amx(const AttnDims& d, const AttnView& q, const AttnView& k, const AttnView& v,
                           const AttnView& out, const LseView& lse, const AttentionParams& p) {
  if (d.B == 0 || d.Tq == 0 || d.Hq == 0) return;
  const Blocking bl = make_blocking(d);
  const int64_t D = d.D, G = bl.G;
  const int64_t nkeys = visible_key_end(d, p, d.Tq - 1, 1);
  const int64_t ntiles = (nkeys + kKeyTile - 1) / kKeyTile, per_head = ntiles * D * kKeyTile;
  Buf<uint16_t> kt(d.B * d.Hkv * per_head), vv(d.B * d.Hkv * per_head);
  base::parallel_for(d.B * d.Hkv, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t w = b0; w < b1; ++w) {
      const int64_t b = w / d.Hkv, h = w % d.Hkv;
      pack_key_tiles(k.row(b, 0, h, D), k.token_stride, nkeys, D, true, kt.p + w * per_head);
      pack_key_tiles(v.row(b, 0, h, D), v.token_stride, nkeys, D, false, vv.p + w * per_head);
    }
  });
  const AttnTileOps& ops = row_ops();
  base::parallel_for(d.B * d.Hkv * bl.nblocks, 1, [&](int64_t w0, int64_t w1) {
    Buf<float> qs(kRowsPad * D), o(kRowsPad * D), s(kRowsPad * kKeyTile), m(kRowsPad), l(kRowsPad);
    Buf<uint16_t> qa(kRowsPad * D), pa(kRowsPad * kKeyTile);
    const AmxTileScope tiles;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t blk = w % bl.nblocks, bh = w / bl.nblocks, b = bh / d.Hkv, kvh = bh % d.Hkv;
      const int64_t i0 = blk * bl.qb, qn = std::min(bl.qb, d.Tq - i0), R = qn * G;
      const BlockKeys bk = visible_keys(d, p, b, i0, qn);
      gather_rows(q, b, kvh, i0, qn, G, D, p.scale, qs.p);
      amx_pack_rows(qs.p, D, R, D, qa.p, kRowsPad, D);
      std::fill_n(o.p, kRowsPad * D, 0.f);
      std::fill_n(m.p, kRowsPad, kNegInf);
      std::fill_n(l.p, kRowsPad, 0.f);
      const uint16_t* ktb = kt.p + bh * per_head;
      const uint16_t* vb = vv.p + bh * per_head;
      for (int64_t kt0 = bk.begin(); kt0 < bk.end(); kt0 += kKeyTile) {
        const int64_t n = std::min(kKeyTile, bk.end() - kt0), t = kt0 / kKeyTile;
        score_tile(p, bk, G, R, D, qa.p, ktb + t * D * kKeyTile, kt0, n, s.p, nullptr);
        ops.softmax_update(s.p, kKeyTile, R, kKeyTile, m.p, l.p, o.p, D, D);
        amx_pack_rows(s.p, kKeyTile, R, kKeyTile, pa.p, kRowsPad, kKeyTile);
        amx_gemm_bf16(kRowsPad, D, kKeyTile, pa.p, kKeyTile, vb + t * D * kKeyTile, 2 * D, o.p, D, true);  // O += P V
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t i = i0 + r / G, h = kvh * G + r % G;
        float* dst = out.row(b, i, h, D);
        const float inv = l.p[r] > 0.f ? 1.f / l.p[r] : 0.f;
        for (int64_t e = 0; e < D; ++e) dst[e] = o.p[r * D + e] * inv;
        if (lse.data) lse.at(b, h, i) = l.p[r] > 0.f ? m.p[r] + std::log(l.p[r]) : kNegInf;
      }
    }
  });
}

void attention_backward_amx(const AttnDims& d, const AttnView& q, const AttnView& k, const AttnView& v,
                            const AttnView& out, const LseView& lse, const AttnView& dout, const AttnView& dq,
                            const AttnView& dk, const AttnView& dv, const AttentionParams& p) {
  if (d.B == 0 || d.Hq == 0) return;
  const Blocking bl = make_blocking(d);
  const int64_t D = d.D, G = bl.G;
  const float scale = p.scale;
  const int64_t nkeys = d.Tq == 0 ? 0 : visible_key_end(d, p, 0, d.Tq);
  const int64_t ntiles = (nkeys + kKeyTile - 1) / kKeyTile, per_head = ntiles * D * kKeyTile;
  // dK^T and dV^T rows: the keys, and 16 floats more so their rows (a C tile's) do not
  // fall 4 KiB apart, on the same L1 sets.
  const int64_t Tp = std::max<int64_t>(ntiles * kKeyTile, kKeyTile) + 16;
  const AttnTileOps& ops = row_ops();
  base::parallel_for(d.B * d.Hkv, 1, [&](int64_t w0, int64_t w1) {
    Buf<uint16_t> kt(per_head), vt(per_head), kv(per_head);
    Buf<float> dkt(D * Tp), dvt(D * Tp);
    Buf<float> qs(kRowsPad * D), dos(kRowsPad * D), dqa(kRowsPad * D), s(kRowsPad * kKeyTile),
        dp(kRowsPad * kKeyTile), th(kRowsPad * kKeyTile), lse_r(kRowsPad), delta(kRowsPad);
    Buf<uint16_t> qa(kRowsPad * D), qat(D * kRowsPad), doa(kRowsPad * D), doat(D * kRowsPad),
        pv(kRowsPad * kKeyTile), dsa(kRowsPad * kKeyTile), dsv(kRowsPad * kKeyTile);
    const AmxTileScope tiles;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / d.Hkv, kvh = w % d.Hkv;
      const float* kbase = k.row(b, 0, kvh, D);
      const float* vbase = v.row(b, 0, kvh, D);
      pack_key_tiles(kbase, k.token_stride, nkeys, D, true, kt.p);   // B = K^T (S)
      pack_key_tiles(vbase, v.token_stride, nkeys, D, true, vt.p);   // B = V^T (dP)
      pack_key_tiles(kbase, k.token_stride, nkeys, D, false, kv.p);  // B = K (dQ)
      std::fill_n(dkt.p, D * Tp, 0.f);
      std::fill_n(dvt.p, D * Tp, 0.f);
      for (int64_t blk = 0; blk < bl.nblocks && d.Tq > 0; ++blk) {
        const int64_t i0 = blk * bl.qb, qn = std::min(bl.qb, d.Tq - i0), R = qn * G;
        gather_rows(q, b, kvh, i0, qn, G, D, scale, qs.p);
        gather_rows(dout, b, kvh, i0, qn, G, D, 1.f, dos.p);
        amx_pack_rows(qs.p, D, R, D, qa.p, kRowsPad, D);
        amx_pack_rows_transposed(qs.p, D, R, D, qat.p, D, kRowsPad);
        amx_pack_rows(dos.p, D, R, D, doa.p, kRowsPad, D);
        amx_pack_rows_transposed(dos.p, D, R, D, doat.p, D, kRowsPad);
        for (int64_t r = 0; r < R; ++r) {
          const int64_t i = i0 + r / G, h = kvh * G + r % G;
          lse_r.p[r] = lse.at(b, h, i);
          delta.p[r] = ops.dot(dout.row(b, i, h, D), out.row(b, i, h, D), D);
        }
        std::fill_n(dqa.p, kRowsPad * D, 0.f);
        const BlockKeys bk = visible_keys(d, p, b, i0, qn);
        for (int64_t kt0 = bk.begin(); kt0 < bk.end(); kt0 += kKeyTile) {
          const int64_t n = std::min(kKeyTile, bk.end() - kt0), t = kt0 / kKeyTile;
          const int64_t tile = t * D * kKeyTile;
          score_tile(p, bk, G, R, D, qa.p, kt.p + tile, kt0, n, s.p, th.p);
          probs_with_pairs(s.p, R, lse_r.p, pv.p);                                                // P
          amx_gemm_bf16(kRowsPad, kKeyTile, D, doa.p, D, vt.p + tile, 2 * kKeyTile, dp.p, kKeyTile, false);  // dP = dO V^T
          dscores_with_packs(s.p, dp.p, R, n, delta.p, p.softcap > 0.f ? th.p : nullptr, dsa.p, dsv.p);  // dS
          amx_gemm_bf16(D, kKeyTile, kRowsPad, doat.p, kRowsPad, pv.p, 2 * kKeyTile, dvt.p + kt0, Tp, true);  // dV^T += dO^T P
          amx_gemm_bf16(kRowsPad, D, kKeyTile, dsa.p, kKeyTile, kv.p + tile, 2 * D, dqa.p, D, true);  // dQ += dS K
          amx_gemm_bf16(D, kKeyTile, kRowsPad, qat.p, kRowsPad, dsv.p, 2 * kKeyTile, dkt.p + kt0, Tp, true);  // dK^T += Qs^T dS
        }
        for (int64_t r = 0; r < R; ++r) {
          float* dst = dq.row(b, i0 + r / G, kvh * G + r % G, D);
          for (int64_t e = 0; e < D; ++e) dst[e] = dqa.p[r * D + e] * scale;
        }
      }
      for (int64_t t = 0; t < d.Tk; ++t) {
        float* dkr = dk.row(b, t, kvh, D);
        float* dvr = dv.row(b, t, kvh, D);
        for (int64_t e = 0; e < D; ++e) {
          dkr[e] = t < Tp ? dkt.p[e * Tp + t] : 0.f;
          dvr[e] = t < Tp ? dvt.p[e * Tp + t] : 0.f;
        }
      }
    }
  });
}

}  // namespace tessera::kernels::cpu
