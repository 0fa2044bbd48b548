// The training head with vocabulary-major logits (block.h): under native bf16 the three
// products of the head run with the (V, H) weight as their plain left operand, which is
// the layout AMX's bf16 GEMMs run fastest at the few hundred rows of a training step.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "tessera/base/thread_pool.h"
#include "tessera/kernels/matmul.h"
#include "tessera/model/block.h"

namespace tessera::model {

bool vocab_major_head(const Model& m) {
  static const bool rows = [] {
    const char* e = std::getenv("TESSERA_HEAD_LAYOUT");
    return e && std::strcmp(e, "rows") == 0;
  }();
  return !rows && m.bf16_mode() == Bf16Mode::kNative && !m.tp_comm() && !m.sequence_parallel() &&
         m.config().final_softcap <= 0 && !m.quantized_lm_head() &&
         m.compute_lm_head().dtype() == DType::kBF16;
}

kernels::CrossEntropyResult head_loss_vocab_major(const Model& m, const Tensor& h,
                                                  const Tensor& targets, float grad_scale,
                                                  Tensor& dh, Tensor* dw, bool accumulate) {
  const Tensor& W = m.compute_lm_head();  // (V, H) bf16
  const int64_t N = h.size(0), V = W.size(0), H = W.size(1);
  const Tensor h16 = h.dtype() == DType::kBF16 ? h : h.to(DType::kBF16);
  // dlogits^T = E diag(k) - grad_scale * onehot^T, E (V, N) the exps (kernels::
  // cross_entropy_columns): the per-token scale k and the targets' -grad_scale are
  // applied to the (N, H) sides of the products, not to the (V, N) gradient.
  // The logits in bf16, as autocast's head writes them (rounded once by the GEMM): half
  // the bytes to write and read back, and the exps then go over them in place.
  Tensor exps_t = Tensor::empty({V, N}, DType::kBF16), k = Tensor::empty({N}, DType::kF32);
  kernels::matmul(W, h16, exps_t, false, true);
  const kernels::CrossEntropyResult ce = kernels::cross_entropy_columns(exps_t, targets, grad_scale, &exps_t, &k);
  const float* ks = k.data<float>();
  const int32_t* t = targets.data<int32_t>();
  const bf16* w = W.data<bf16>();
  // dh = diag(k) E^T W - grad_scale W[targets]
  kernels::matmul(exps_t, W, dh, true, false);
  // The (N, H) fix-ups below split H over the threads; each column keeps token order.
  const auto over_columns = [H](auto&& fn) { base::parallel_for(H, 128, fn); };
  over_columns([&](int64_t j0, int64_t j1) {
    for (int64_t n = 0; n < N; ++n) {
      float* row = dh.data<float>() + n * dh.stride(0);
      if (t[n] == kernels::kIgnoreIndex) {
        std::fill(row + j0, row + j1, 0.f);
        continue;
      }
      const bf16* wt = w + t[n] * W.stride(0);
      for (int64_t j = j0; j < j1; ++j) row[j] = ks[n] * row[j] - grad_scale * bf16_to_f32(wt[j].bits);
    }
  });
  if (!dw) return ce;
  // dW (+)= E diag(k) h - grad_scale onehot^T h, with diag(k) h rounded to bf16 as h is.
  Tensor hk = Tensor::empty({N, H}, DType::kBF16);
  const bf16* hs = h16.data<bf16>();
  bf16* hd = hk.data<bf16>();
  over_columns([&](int64_t j0, int64_t j1) {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = j0; j < j1; ++j)
        hd[n * H + j].bits = f32_to_bf16(ks[n] * bf16_to_f32(hs[n * h16.stride(0) + j].bits));
  });
  if (accumulate)
    kernels::matmul(exps_t, hk, *dw, false, false, 1.f, 1.f);
  else  // (V, H) f32, ~150 MB at GPT-2's shape: written around the cache
    kernels::matmul_streamed_rows(exps_t, hk, *dw);
  float* g = dw->data<float>();
  over_columns([&](int64_t j0, int64_t j1) {
    for (int64_t n = 0; n < N; ++n) {  // in token order: the same bits for any thread count
      if (t[n] == kernels::kIgnoreIndex) continue;
      float* row = g + t[n] * dw->stride(0);
      for (int64_t j = j0; j < j1; ++j) row[j] -= grad_scale * bf16_to_f32(hs[n * h16.stride(0) + j].bits);
    }
  });
  return ce;
}

}  // namespace tessera::model
