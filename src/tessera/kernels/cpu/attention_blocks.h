// The row blocks and key masks the CPU attention kernels share (f32 tiles in
// attention_cpu.cc, AMX tiles in attention_amx.cc). Internal to kernels/cpu.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "tessera/kernels/cpu/attention_cpu.h"

namespace tessera::kernels::cpu::attn {

inline constexpr int64_t kKeyTile = 64;        // keys per tile (columns of the score tile)
inline constexpr int64_t kTargetRows = 32;     // rows per block: G heads x a few query positions
inline constexpr int64_t kMinSplitKeys = 256;  // split the keys across threads only above this
inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// How the rows of the problem are cut into blocks of query positions.
struct Blocking {
  int64_t G = 1;        // query heads per kv head
  int64_t qb = 1;       // query positions per block
  int64_t nblocks = 1;  // per (b, kv head)
  int64_t rows() const { return G * qb; }
};

inline Blocking make_blocking(const AttnDims& d) {
  Blocking bl;
  bl.G = d.Hq / d.Hkv;
  bl.qb = std::clamp<int64_t>(kTargetRows / bl.G, 1, d.Tq);
  bl.nblocks = (d.Tq + bl.qb - 1) / bl.qb;
  return bl;
}

// Keys [0, end) that any query in [i0, i0 + n) may see.
inline int64_t visible_key_end(const AttnDims& d, const AttentionParams& p, int64_t i0, int64_t n) {
  return p.causal ? std::min(d.Tk, p.q_offset + i0 + n) : d.Tk;
}

// Soft-capping of a score tile (R, n) with stride lds: s = cap tanh(s / cap); with t, the
// tanh values are kept (stride lds) for the backward's derivative 1 - t^2.
inline void softcap_tile(float* s, int64_t lds, int64_t R, int64_t n, float cap, float* t = nullptr) {
  const float inv = 1.f / cap;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < n; ++j) {
      const float th = std::tanh(s[r * lds + j] * inv);
      s[r * lds + j] = cap * th;
      if (t) t[r * lds + j] = th;
    }
}

// The keys each query position of a row block may see: query i0 + ii sees [lo[ii], hi[ii]).
// hi is the causal limit; lo is the latest of the window's first key and the start of the
// query's packed document. Never empty: a query always sees itself.
struct BlockKeys {
  int64_t lo[kTargetRows], hi[kTargetRows];  // (qn)
  int64_t lo_min = 0, lo_max = 0, hi_min = 0, hi_max = 0;
  // Key tiles [begin(), end()) are visited: the tiles before lo_min hold no key any row of
  // the block sees (the window's or the documents' skipping), so they are never computed.
  int64_t begin() const { return lo_min / kKeyTile * kKeyTile; }
  int64_t end() const { return hi_max; }
  // Whether the tile of keys [kt0, kt0 + n) holds a key hidden from some row.
  bool needs_mask(int64_t kt0, int64_t n) const { return kt0 < lo_max || kt0 + n > hi_min; }
};

// qn <= kTargetRows: make_blocking gives qb <= kTargetRows.
inline BlockKeys visible_keys(const AttnDims& d, const AttentionParams& p, int64_t b, int64_t i0,
                       int64_t qn) {
  BlockKeys bk;
  const int32_t* doc_pos =
      p.doc_positions ? p.doc_positions + b * p.doc_positions_stride : nullptr;
  for (int64_t ii = 0; ii < qn; ++ii) {
    const int64_t i = i0 + ii, pos = p.q_offset + i;
    int64_t lo = 0, hi = d.Tk;
    if (p.causal) {
      hi = std::min(d.Tk, pos + 1);
      if (p.window > 0) lo = std::max<int64_t>(pos - p.window + 1, 0);
      if (doc_pos) lo = std::max<int64_t>(lo, i - doc_pos[i]);  // q_offset is 0 here
    }
    bk.lo[ii] = lo, bk.hi[ii] = hi;
    bk.lo_min = ii == 0 ? lo : std::min(bk.lo_min, lo);
    bk.lo_max = ii == 0 ? lo : std::max(bk.lo_max, lo);
    bk.hi_min = ii == 0 ? hi : std::min(bk.hi_min, hi);
    bk.hi_max = ii == 0 ? hi : std::max(bk.hi_max, hi);
  }
  return bk;
}

// Sets the scores of keys outside each row's visible range to -inf. s (R, n) with stride
// lds holds keys [kt0, kt0 + n); row r is the block's query position r / G.
inline void mask_tile(float* s, int64_t lds, int64_t R, int64_t n, int64_t G, int64_t kt0,
               const BlockKeys& bk) {
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * lds;
    const int64_t first = std::clamp<int64_t>(bk.lo[r / G] - kt0, 0, n);
    const int64_t last = std::clamp<int64_t>(bk.hi[r / G] - kt0, 0, n);
    std::fill(sr, sr + first, kNegInf);
    std::fill(sr + last, sr + n, kNegInf);
  }
}

// Copies the block's rows (G heads of positions i0 .. i0 + qn) of x into dst (R, D),
// multiplied by `mul`. The G heads of one position are adjacent (head stride D).
inline void gather_rows(const AttnView& x, int64_t b, int64_t kvh, int64_t i0, int64_t qn, int64_t G,
                 int64_t D, float mul, float* dst) {
  for (int64_t ii = 0; ii < qn; ++ii) {
    const float* src = x.row(b, i0 + ii, kvh * G, D);
    float* out = dst + ii * G * D;
    if (mul == 1.f)
      std::memcpy(out, src, sizeof(float) * G * D);
    else
      for (int64_t e = 0; e < G * D; ++e) out[e] = src[e] * mul;
  }
}

// The inverse of gather_rows: x's rows of the block = mul * src (R = qn G rows of D).
inline void scatter_rows(const float* src, int64_t b, int64_t kvh, int64_t i0, int64_t qn, int64_t G, int64_t D,
                         float mul, const AttnView& x) {
  for (int64_t r = 0; r < qn * G; ++r) {
    float* dst = x.row(b, i0 + r / G, kvh * G + r % G, D);
    for (int64_t e = 0; e < D; ++e) dst[e] = src[r * D + e] * mul;
  }
}

// Writes out = o / l and lse = m + log l for the block's rows (lse.data null: no lse).
inline void store_rows(const AttnView& out, const LseView& lse, int64_t b, int64_t kvh, int64_t i0, int64_t qn,
                       int64_t G, int64_t D, const float* o, const float* m, const float* l) {
  for (int64_t r = 0; r < qn * G; ++r) {
    const int64_t i = i0 + r / G, h = kvh * G + r % G;
    float* dst = out.row(b, i, h, D);
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int64_t e = 0; e < D; ++e) dst[e] = o[r * D + e] * inv;
    if (lse.data) lse.at(b, h, i) = l[r] > 0.f ? m[r] + std::log(l[r]) : kNegInf;
  }
}

// The backward's per-row inputs of a block: the saved log-sum-exp and delta = dout . out.
template <typename Dot>
void block_lse_and_delta(const LseView& lse, const AttnView& dout, const AttnView& out, int64_t b, int64_t kvh,
                         int64_t i0, int64_t qn, int64_t G, int64_t D, Dot dot, float* lse_r, float* delta) {
  for (int64_t r = 0; r < qn * G; ++r) {
    const int64_t i = i0 + r / G, h = kvh * G + r % G;
    lse_r[r] = lse.at(b, h, i);
    delta[r] = dot(dout.row(b, i, h, D), out.row(b, i, h, D), D);
  }
}

}  // namespace tessera::kernels::cpu::attn
