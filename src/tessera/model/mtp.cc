// DeepSeek-V3's multi-token prediction module in the training forward (activations.h).
// The backward is in backward.cc, where the block's backward lives.
#include "tessera/kernels/elementwise.h"
#include "tessera/kernels/embedding.h"
#include "tessera/kernels/matmul.h"
#include "tessera/model/activations.h"
#include "tessera/model/block.h"
#include "tessera/model/layer_ops.h"

namespace tessera::model {

void mtp_embed(const Model& m, const Activations& acts, MtpActivations& t) {
  const int64_t B = acts.B, T = acts.T, N = B * T;
  t.ids = Tensor::empty({N}, DType::kI32);
  const int32_t* id = acts.ids.data<int32_t>();
  int32_t* nx = t.ids.data<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < T; ++i) nx[b * T + i] = i + 1 < T ? id[b * T + i + 1] : 0;
  t.emb = embed_tokens(m, t.ids, acts.positions);  // (vocab-parallel under tp)
}

void mtp_forward(const Model& m, const Activations& acts, const Tensor& hf, MtpActivations& t) {
  const auto& c = m.config();
  const MtpParams& P = m.weights().mtp;
  const int64_t N = acts.B * acts.T, H = c.hidden_size;
  // x = eh_proj [enorm(embedding of the next token) | hnorm(h)] (the embedding half first,
  // as vLLM's and Megatron-LM's DeepSeek-V3 modules concatenate).
  t.cat = Tensor::empty({N, 2 * H}, DType::kF32);
  t.e_rstd = Tensor::empty({N}, DType::kF32);
  t.h_rstd = Tensor::empty({N}, DType::kF32);
  Tensor en = t.cat.slice(1, 0, H), hn = t.cat.slice(1, H, 2 * H);
  norm_forward(c, P.enorm, Tensor(), t.emb, en, nullptr, &t.e_rstd);
  t.h_in = hf.clone();  // (the caller rounds hf in place for the head's matmuls)
  norm_forward(c, P.hnorm, Tensor(), t.h_in, hn, nullptr, &t.h_rstd);
  BlockState s;
  s.x = Tensor::empty({N, H}, DType::kF32);
  kernels::matmul(t.cat, P.eh_proj, s.x, false, true);
  layer_forward_train(m, c.num_layers, acts, s, t.layer, true);
  kernels::add_inplace(s.x, s.delta);
  t.x_out = s.x;
  t.rstd = Tensor::empty({N}, DType::kF32);
  t.hm = Tensor::empty({N, H}, DType::kF32);
  norm_forward(c, P.head_norm, Tensor(), t.x_out, t.hm, nullptr, &t.rstd);
  round_matmul_input_in_place(t.hm, m.bf16_mode());  // feeds only the head's matmuls
}

}  // namespace tessera::model
