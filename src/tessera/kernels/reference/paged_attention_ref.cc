// Scalar paged-attention reference (see paged_attention_ref.h).
#include "tessera/kernels/reference/paged_attention_ref.h"

#include "tessera/kernels/reference/attention_ref.h"

namespace tessera::kernels::reference {

std::vector<double> gather_paged(const Tensor& cache, const PagedSequence& s) {
  const int64_t bs = cache.size(1), row = cache.size(2) * cache.size(3);
  const float* base = cache.data<float>();
  std::vector<double> out(s.context_len * row);
  for (int64_t t = 0; t < s.context_len; ++t) {
    const float* src = base + s.block_table[t / bs] * cache.stride(0) + (t % bs) * cache.stride(1);
    for (int64_t e = 0; e < row; ++e) out[t * row + e] = src[e];
  }
  return out;
}

void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                     const std::vector<PagedSequence>& seqs, Tensor& out,
                     const PagedAttentionParams& p) {
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
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
