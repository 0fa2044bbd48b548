// Scalar paged-attention reference (see paged_attention_ref.h).
#include "tessera/kernels/reference/paged_attention_ref.h"

#include <cstring>

#include "tessera/kernels/quant.h"
#include "tessera/kernels/reference/attention_ref.h"

namespace tessera::kernels::reference {

// Cached (token, head) rows of any KV cache dtype, decoded from the format's definition
// (paged_attention.h) one value at a time.
std::vector<double> gather_paged(const Tensor& cache, const PagedSequence& s) {
  const int64_t bs = cache.size(1), H = cache.size(2);
  const bool scaled = cache.dtype() == DType::kI8 || cache.dtype() == DType::kU8;
  const int64_t D = scaled ? cache.size(3) - 4 : cache.size(3);
  const int64_t es = static_cast<int64_t>(dtype_size(cache.dtype()));
  const auto* base = static_cast<const uint8_t*>(cache.raw_data());
  std::vector<double> out(s.context_len * H * D);
  for (int64_t t = 0; t < s.context_len; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const uint8_t* row = base + ((s.block_table[t / bs] * bs + t % bs) * H + h) * cache.size(3) * es;
      float scale = 1.f;
      if (scaled) std::memcpy(&scale, row + D, sizeof(float));
      for (int64_t e = 0; e < D; ++e) {
        double x;
        switch (cache.dtype()) {
          case DType::kF32: { float f; std::memcpy(&f, row + 4 * e, 4); x = f; break; }
          case DType::kBF16: { uint16_t b; std::memcpy(&b, row + 2 * e, 2); x = bf16_to_f32(b); break; }
          case DType::kI8: x = static_cast<double>(scale) * static_cast<int8_t>(row[e]); break;
          default: x = static_cast<double>(scale) * fp8_e4m3_to_f32(row[e]); break;
        }
        out[(t * H + h) * D + e] = x;
      }
    }
  return out;
}

void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                     const std::vector<PagedSequence>& seqs, Tensor& out,
                     const PagedAttentionParams& p) {
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2);  // D from q: caches may hold scales
  for (const PagedSequence& s : seqs) {
    if (s.q_len == 0) continue;
    const std::vector<double> k = gather_paged(k_cache, s), v = gather_paged(v_cache, s);
    std::vector<double> qd(s.q_len * Hq * D), od(qd.size());
    for (int64_t i = 0; i < s.q_len; ++i)
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t e = 0; e < D; ++e)
          qd[(i * Hq + h) * D + e] =
              q.data<float>()[(s.q_begin + i) * q.stride(0) + h * q.stride(1) + e * q.stride(2)];
    AttentionParams ap;
    ap.scale = p.scale;
    ap.causal = true;
    ap.q_offset = s.context_len - s.q_len;
    ap.window = p.window;
    ap.softcap = p.softcap;
    const AttnShape shape{1, s.q_len, s.context_len, Hq, Hkv, D};
    attention_forward_f64(shape, qd.data(), k.data(), v.data(), od.data(), nullptr, ap);
    for (int64_t i = 0; i < s.q_len; ++i)
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t e = 0; e < D; ++e)
          out.data<float>()[(s.q_begin + i) * out.stride(0) + h * out.stride(1) +
                            e * out.stride(2)] = static_cast<float>(od[(i * Hq + h) * D + e]);
  }
}

}  // namespace tessera::kernels::reference
