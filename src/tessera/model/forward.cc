// Forward passes: inference with a KV cache, and the training forward that saves
// activations.
#include <cmath>

#include "tessera/kernels/activation.h"
#include "tessera/kernels/attention.h"
#include "tessera/kernels/elementwise.h"
#include "tessera/kernels/embedding.h"
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/rope.h"
#include "tessera/model/activations.h"
#include "tessera/model/layer_ops.h"

namespace tessera::model {
namespace {

Tensor make_positions(int64_t B, int64_t T, int64_t start) {
  Tensor p = Tensor::empty({B * T}, DType::kI32);
  int32_t* d = p.data<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) d[b * T + t] = static_cast<int32_t>(start + t);
  return p;
}

// Embedding lookup (+ learned positions for GPT-2): x (N, H).
Tensor embed_tokens(const Model& m, const Tensor& ids, const Tensor& positions) {
  const auto& c = m.config();
  Tensor x = Tensor::empty({ids.numel(), c.hidden_size}, DType::kF32);
  kernels::embedding_forward(m.weights().embed, ids, x);
  if (c.arch == Arch::kGpt2) kernels::embedding_forward(m.weights().pos_embed, positions, x, true);
  return x;
}

void apply_rope(const ModelConfig& c, Tensor& qkv, const Tensor& positions, bool inverse) {
  if (!c.uses_rope()) return;
  Tensor q = qkv.slice(1, 0, c.q_dim());
  Tensor k = qkv.slice(1, c.q_dim(), c.q_dim() + c.kv_dim());
  kernels::rope_apply(q, c.head_dim, positions, c.rope_theta, inverse);
  kernels::rope_apply(k, c.head_dim, positions, c.rope_theta, inverse);
}

// MLP activation: a (N, F) from u (N, 2F | F).
void mlp_activation(const ModelConfig& c, const Tensor& u, Tensor& a) {
  const int64_t F = c.intermediate_size;
  if (c.gated_mlp())
    kernels::swiglu_forward(u.slice(1, 0, F), u.slice(1, F, 2 * F), a);
  else
    kernels::gelu_forward(u, a);
}

kernels::AttentionParams attention_params(const ModelConfig& c, int64_t q_offset) {
  kernels::AttentionParams p;
  p.scale = 1.f / std::sqrt(static_cast<float>(c.head_dim));
  p.causal = true;
  p.q_offset = q_offset;
  return p;
}

}  // namespace

Tensor Model::forward(const std::vector<int32_t>& tokens, KVCache& cache, bool all_logits) const {
  const auto& c = config_;
  const int64_t T = static_cast<int64_t>(tokens.size());
  TESSERA_CHECK(T > 0, "forward: no tokens");
  const int64_t L = cache.length;
  TESSERA_CHECK(L + T <= cache.capacity, "forward: ", L + T, " tokens exceed the KV cache capacity ",
                cache.capacity);
  TESSERA_CHECK(L + T <= c.max_position_embeddings || c.uses_rope(), "forward: position ", L + T - 1,
                " is past max_position_embeddings ", c.max_position_embeddings);
  TESSERA_CHECK(static_cast<int64_t>(cache.k.size()) == c.num_layers,
                "forward: KV cache has ", cache.k.size(), " layers, model has ", c.num_layers);
  const int64_t H = c.hidden_size, Q = c.q_dim(), KV = c.kv_dim(), F = c.intermediate_size;
  const Tensor ids = Tensor::from_vector(tokens, {T});
  const Tensor positions = make_positions(1, T, L);

  Tensor x = embed_tokens(*this, ids, positions);
  Tensor h = Tensor::empty({T, H}, DType::kF32);
  Tensor qkv = Tensor::empty({T, c.qkv_dim()}, DType::kF32);
  Tensor att = Tensor::empty({T, Q}, DType::kF32);
  Tensor delta = Tensor::empty({T, H}, DType::kF32);
  Tensor u = Tensor::empty({T, c.gated_mlp() ? 2 * F : F}, DType::kF32);
  Tensor a = Tensor::empty({T, F}, DType::kF32);
  const auto params = attention_params(c, L);

  for (int64_t l = 0; l < c.num_layers; ++l) {
    const LayerParams& W = weights_.layers[l];
    if (l == 0)
      norm_forward(c, W.norm1_w, W.norm1_b, x, h, nullptr, nullptr);
    else  // x += previous layer's MLP output, then norm
      add_norm_forward(c, W.norm1_w, W.norm1_b, x, delta, h, nullptr, nullptr);
    linear_forward(compute_linear(l, 0), h, qkv, bf16_mode_);
    apply_rope(c, qkv, positions, false);
    Tensor kc = cache.k[l], vc = cache.v[l];
    kc.slice(0, L, L + T).view({T, KV}).copy_from(qkv.slice(1, Q, Q + KV));
    vc.slice(0, L, L + T).view({T, KV}).copy_from(qkv.slice(1, Q + KV, Q + 2 * KV));
    const QkvViews views = qkv_views(c, qkv, 1, T);
    const Tensor k = kc.as_strided({1, L + T, c.num_kv_heads, c.head_dim},
                                   {cache.capacity * KV, KV, c.head_dim, 1});
    const Tensor v = vc.as_strided({1, L + T, c.num_kv_heads, c.head_dim},
                                   {cache.capacity * KV, KV, c.head_dim, 1});
    Tensor att4 = att.view({1, T, c.num_heads, c.head_dim});
    kernels::attention_forward(views.q, k, v, att4, nullptr, params);
    linear_forward(compute_linear(l, 1), att, delta, bf16_mode_);
    add_norm_forward(c, W.norm2_w, W.norm2_b, x, delta, h, nullptr, nullptr);
    linear_forward(compute_linear(l, 2), h, u, bf16_mode_);
    mlp_activation(c, u, a);
    linear_forward(compute_linear(l, 3), a, delta, bf16_mode_);
  }
  cache.length = L + T;
  add_norm_forward(c, weights_.final_norm_w, weights_.final_norm_b, x, delta, h, nullptr, nullptr);
  const Tensor hl = all_logits ? h : h.slice(0, T - 1, T);
  Tensor logits = Tensor::empty({hl.size(0), c.vocab_size}, DType::kF32);
  kernels::matmul(matmul_input(hl, bf16_mode_), compute_lm_head(), logits, false, true);
  return logits;
}

namespace {

// y = x @ W^T (+ b), one row at a time when `rowwise` (the same kernel call for every
// row whatever N is: batch-invariant results).
void linear_rows(const Linear& lin, const Tensor& x, Tensor& y, Bf16Mode mode, bool rowwise) {
  if (!rowwise) {
    linear_forward(lin, x, y, mode);
    return;
  }
  for (int64_t i = 0; i < x.size(0); ++i) {
    Tensor yi = y.slice(0, i, i + 1);
    linear_forward(lin, x.slice(0, i, i + 1), yi, mode);
  }
}

}  // namespace

Tensor Model::forward_tokens(const Tensor& ids, const Tensor& positions, KvAttention& kv,
                             const std::vector<int64_t>& logit_rows, bool batch_invariant) const {
  const auto& c = config_;
  TESSERA_CHECK(ids.dtype() == DType::kI32 && ids.dim() == 1 && positions.dtype() == DType::kI32 &&
                    positions.shape() == ids.shape(),
                "forward_tokens: ids and positions must be i32 (N), got ", ids.describe(), " and ",
                positions.describe());
  const int64_t T = ids.numel();
  TESSERA_CHECK(T > 0, "forward_tokens: no tokens");
  const int64_t H = c.hidden_size, Q = c.q_dim(), F = c.intermediate_size;
  const Tensor pos = positions.contiguous();
  for (int64_t i = 0; i < T; ++i)
    TESSERA_CHECK(pos.data<int32_t>()[i] >= 0 &&
                      (c.uses_rope() || pos.data<int32_t>()[i] < c.max_position_embeddings),
                  "forward_tokens: position ", pos.data<int32_t>()[i], " out of range");
  const bool rows = batch_invariant;
  Tensor x = embed_tokens(*this, ids.contiguous(), pos);
  Tensor h = Tensor::empty({T, H}, DType::kF32);
  Tensor qkv = Tensor::empty({T, c.qkv_dim()}, DType::kF32);
  Tensor att = Tensor::empty({T, Q}, DType::kF32);
  Tensor delta = Tensor::empty({T, H}, DType::kF32);
  Tensor u = Tensor::empty({T, c.gated_mlp() ? 2 * F : F}, DType::kF32);
  Tensor a = Tensor::empty({T, F}, DType::kF32);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const LayerParams& W = weights_.layers[l];
    if (l == 0)
      norm_forward(c, W.norm1_w, W.norm1_b, x, h, nullptr, nullptr);
    else
      add_norm_forward(c, W.norm1_w, W.norm1_b, x, delta, h, nullptr, nullptr);
    linear_rows(compute_linear(l, 0), h, qkv, bf16_mode_, rows);
    apply_rope(c, qkv, pos, false);
    const int64_t Wd = qkv.stride(0), D = c.head_dim, KVd = c.kv_dim();
    Tensor out = att.view({T, c.num_heads, D});
    kv.attend(l, qkv.as_strided({T, c.num_heads, D}, {Wd, D, 1}, 0),
              qkv.as_strided({T, c.num_kv_heads, D}, {Wd, D, 1}, Q),
              qkv.as_strided({T, c.num_kv_heads, D}, {Wd, D, 1}, Q + KVd), out);
    linear_rows(compute_linear(l, 1), att, delta, bf16_mode_, rows);
    add_norm_forward(c, W.norm2_w, W.norm2_b, x, delta, h, nullptr, nullptr);
    linear_rows(compute_linear(l, 2), h, u, bf16_mode_, rows);
    mlp_activation(c, u, a);
    linear_rows(compute_linear(l, 3), a, delta, bf16_mode_, rows);
  }
  add_norm_forward(c, weights_.final_norm_w, weights_.final_norm_b, x, delta, h, nullptr, nullptr);
  const int64_t R = static_cast<int64_t>(logit_rows.size());
  Tensor hl = Tensor::empty({std::max<int64_t>(R, 1), H}, DType::kF32);
  for (int64_t i = 0; i < R; ++i) {
    TESSERA_CHECK(logit_rows[i] >= 0 && logit_rows[i] < T, "forward_tokens: logit row ",
                  logit_rows[i], " out of range [0, ", T, ")");
    hl.slice(0, i, i + 1).copy_from(h.slice(0, logit_rows[i], logit_rows[i] + 1));
  }
  Tensor logits = Tensor::empty({R, c.vocab_size}, DType::kF32);
  if (R == 0) return logits;
  hl = hl.slice(0, 0, R);
  const Tensor lm_in = matmul_input(hl, bf16_mode_);
  if (!rows) {
    kernels::matmul(lm_in, compute_lm_head(), logits, false, true);
  } else {
    for (int64_t i = 0; i < R; ++i) {
      Tensor li = logits.slice(0, i, i + 1);
      kernels::matmul(lm_in.slice(0, i, i + 1), compute_lm_head(), li, false, true);
    }
  }
  return logits;
}

Tensor layer_forward_train(const Model& m, int64_t l, const Activations& acts,
                           LayerActivations& A, bool keep_attention) {
  const auto& c = m.config();
  const int64_t B = acts.B, T = acts.T, N = B * T;
  const int64_t H = c.hidden_size, F = c.intermediate_size;
  const bool ln = c.uses_layernorm();
  const LayerParams& W = m.weights().layers[l];
  const Tensor& x = A.x_in;
  if (ln) A.mean1 = Tensor::empty({N}, DType::kF32);
  A.rstd1 = Tensor::empty({N}, DType::kF32);
  A.h1 = Tensor::empty({N, H}, DType::kF32);
  // h1, h2 and a feed only matmuls (here and for the weight gradients in backward), so
  // they are kept rounded as those want them: one rounding pass each.
  const Bf16Mode mode = m.bf16_mode(), pm = prepared_mode(mode);
  norm_forward(c, W.norm1_w, W.norm1_b, x, A.h1, ln ? &A.mean1 : nullptr, &A.rstd1);
  round_matmul_input_in_place(A.h1, mode);
  A.qkv = Tensor::empty({N, c.qkv_dim()}, DType::kF32);
  linear_forward(m.compute_linear(l, 0), A.h1, A.qkv, pm);
  apply_rope(c, A.qkv, acts.positions, false);
  recompute_attention(m, acts, A);
  Tensor o = Tensor::empty({N, H}, DType::kF32);
  linear_forward(m.compute_linear(l, 1), A.att, o, mode);  // att stays exact for backward
  if (!keep_attention) {  // selective checkpointing: recomputed in the backward pass
    A.att = Tensor();
    A.lse = Tensor();
  }
  A.x_mid = x.clone();
  if (ln) A.mean2 = Tensor::empty({N}, DType::kF32);
  A.rstd2 = Tensor::empty({N}, DType::kF32);
  A.h2 = Tensor::empty({N, H}, DType::kF32);
  add_norm_forward(c, W.norm2_w, W.norm2_b, A.x_mid, o, A.h2, ln ? &A.mean2 : nullptr, &A.rstd2);
  round_matmul_input_in_place(A.h2, mode);
  A.u = Tensor::empty({N, c.gated_mlp() ? 2 * F : F}, DType::kF32);
  linear_forward(m.compute_linear(l, 2), A.h2, A.u, pm);
  A.a = Tensor::empty({N, F}, DType::kF32);
  mlp_activation(c, A.u, A.a);
  round_matmul_input_in_place(A.a, mode);
  Tensor d = o;  // reuse (N, H)
  linear_forward(m.compute_linear(l, 3), A.a, d, pm);
  Tensor out = A.x_mid.clone();
  kernels::add_inplace(out, d);
  return out;
}

void recompute_attention(const Model& m, const Activations& acts, LayerActivations& A) {
  const auto& c = m.config();
  const int64_t B = acts.B, T = acts.T, N = B * T;
  const QkvViews v = qkv_views(c, A.qkv, B, T);
  A.att = Tensor::empty({N, c.q_dim()}, DType::kF32);
  A.lse = Tensor::empty({B, c.num_heads, T}, DType::kF32);
  Tensor att4 = A.att.view({B, T, c.num_heads, c.head_dim});
  kernels::attention_forward(v.q, v.k, v.v, att4, &A.lse, attention_params(c, 0));
}

Tensor forward_train(const Model& m, const Tensor& ids2d, Activations& acts) {
  const auto& c = m.config();
  TESSERA_CHECK(ids2d.dim() == 2 && ids2d.dtype() == DType::kI32,
                "forward: token ids must be an i32 (batch, seq) tensor, got ", ids2d.describe());
  const int64_t B = ids2d.size(0), T = ids2d.size(1), N = B * T;
  TESSERA_CHECK(T <= c.max_position_embeddings || c.uses_rope(), "forward: sequence length ", T,
                " exceeds max_position_embeddings ", c.max_position_embeddings);
  const int64_t H = c.hidden_size;
  acts.B = B;
  acts.T = T;
  acts.ids = ids2d.contiguous().view({N});
  acts.positions = make_positions(B, T, 0);
  acts.layers.assign(c.num_layers, LayerActivations{});
  const bool ln = c.uses_layernorm();
  const Recompute rc = m.recompute();

  TrainHooks* hooks = m.train_hooks();
  if (hooks) hooks->acquire(0);
  Tensor x = embed_tokens(m, acts.ids, acts.positions);
  if (hooks) hooks->release(0);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const int unit = static_cast<int>(l) + 1;
    if (hooks) hooks->acquire(unit);
    LayerActivations& A = acts.layers[l];
    A.x_in = x;
    if (rc == Recompute::kFull) {  // keep only the layer input; the rest is scratch
      LayerActivations scratch;
      scratch.x_in = x;
      x = layer_forward_train(m, l, acts, scratch, false);
    } else {
      x = layer_forward_train(m, l, acts, A, rc == Recompute::kNone);
    }
    if (hooks) hooks->release(unit);
  }
  // The head stays acquired: the caller runs lm_head and releases it (head_units).
  if (hooks) hooks->acquire(m.num_units() - 1);
  acts.x_final = x;
  if (ln) acts.meanf = Tensor::empty({N}, DType::kF32);
  acts.rstdf = Tensor::empty({N}, DType::kF32);
  acts.hf = Tensor::empty({N, H}, DType::kF32);
  norm_forward(c, m.weights().final_norm_w, m.weights().final_norm_b, x, acts.hf,
               ln ? &acts.meanf : nullptr, &acts.rstdf);
  round_matmul_input_in_place(acts.hf, m.bf16_mode());  // feeds only the head's matmuls
  return acts.hf;
}

Tensor Model::forward_batch(const Tensor& ids) const {
  Activations acts;
  const Tensor hf = forward_train(*this, ids, acts);
  Tensor logits = Tensor::empty({acts.B * acts.T, config_.vocab_size}, DType::kF32);
  const bool tied = hooks_ && config_.tie_word_embeddings;
  if (tied) hooks_->acquire(0);
  kernels::matmul(matmul_input(hf, bf16_mode_), compute_lm_head(), logits, false, true);
  if (tied) hooks_->release(0);
  if (hooks_) hooks_->release(num_units() - 1);
  return logits.view({acts.B, acts.T, config_.vocab_size});
}

}  // namespace tessera::model
