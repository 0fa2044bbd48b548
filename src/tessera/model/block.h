// One transformer block: the body that every forward runs (training, inference with a
// dense KV cache, the paged serving forward) and whose description (kBlockLinears) the
// backward pass walks. Internal to model/.
//
//   x += delta                  (the previous block's output; fused into the norm)
//   h = norm1(x)
//   qkv = h @ Wqkv^T (+b); RoPE on q, k          column-parallel
//   att = attention(q, k, v)                     (how: the caller's AttendFn)
//   delta = att @ Wo^T; [tp all-reduce] (+b)     row-parallel
//   x += delta; h = norm2(x)
//   u = h @ Wup^T (+b); a = act(u)               column-parallel
//   delta = a @ Wdown^T; [tp all-reduce] (+b)    row-parallel, added by the next block
//   (mixture-of-experts layers: delta = moe(h), model/moe.h, in place of up and down)
#pragma once
#include <functional>

#include "tessera/kernels/attention.h"
#include "tessera/kernels/cross_entropy.h"
#include "tessera/model/activations.h"
#include "tessera/model/model.h"

namespace tessera::model {

struct LoraGroups;  // lora_ops.h

// The residual stream of a forward over N tokens and the scratch its blocks share.
struct BlockState {
  Tensor x;      // (N, H) residual stream
  Tensor delta;  // (N, H) the last block's output, not yet added to x (undefined before block 0)
  Tensor h, qkv, att, u, a;  // scratch, reused block after block (not under BlockOptions::save)
};

// Attention over this step's tokens: qkv (N, q + 2 kv local) after RoPE; att (N, q local)
// contiguous, to be overwritten.
using AttendFn = std::function<void(int64_t layer, const Tensor& qkv, Tensor& att)>;

struct BlockOptions {
  const Tensor* positions = nullptr;  // (N) i32, for RoPE
  bool rowwise = false;  // every matmul one row at a time (batch-invariant serving)
  // Training: the block writes what backward needs into fresh tensors here (x_in, norms'
  // statistics, h1, qkv, att, x_mid, h2, u, a; lse is the AttendFn's to fill). An x_in
  // already defined is kept (a recompute from the saved input).
  LayerActivations* save = nullptr;
  bool dropout = false;  // LoRA's adapter dropout (the passes that train, not evaluation)
  // Multi-LoRA serving (forward_tokens with row adapters): each group's rows get their
  // adapter of Model::lora_bank() (lora_ops.h); nullptr: Model::lora() for every row.
  const LoraGroups* lora_groups = nullptr;
  // Latent-attention layers (ModelConfig::uses_mla): the attention half, out (N, H) = the
  // o_proj output for h1 (N, H), the normalised input (how: training, cache or pages).
  std::function<void(int64_t layer, const Tensor& h1, Tensor& out)> mla;
};

// The features of layer l's dense MLP on this rank (a MoE layer's shared expert; 0: none).
// (A dense MLP and a shared expert split over tp.)
inline int64_t layer_ffn(const Model& m, int64_t l) {
  const auto& c = m.config();
  if (c.is_deepseek()) return c.mlp_size(l) / m.tp_shard().size;
  if (c.layer_is_moe(l) && !c.shared_expert) return 0;  // mixtral: the experts only
  return m.dims().ffn;
}
// Latent attention's settings from the config (model/mla.h), for this rank's heads (a
// tensor-parallel shard holds heads / tp of them).
MlaSpec mla_spec(const Model& m);

// The mixture-of-experts layer's routing settings from the config.
inline MoeSpec moe_spec(const ModelConfig& c) {
  MoeSpec spec;
  spec.num_experts = c.num_experts;
  spec.top_k = c.experts_per_token;
  // DeepSeek's MoEGate renormalises only when top_k > 1; V2 scales by routed_scaling_factor
  // only when it does not renormalise, V3 always (after it).
  spec.norm_topk_prob = c.norm_topk_prob && (!c.is_deepseek() || c.experts_per_token > 1);
  if (c.is_deepseek()) {
    spec.scoring = c.moe_sigmoid ? MoeScoring::kSigmoid : MoeScoring::kSoftmax;
    spec.n_group = c.n_group;
    spec.topk_group = c.topk_group;
    spec.group_score = c.topk_method == "noaux_tc" ? MoeGroupScore::kTop2Sum : MoeGroupScore::kMax;
    const bool v2_normalised = c.model_type == "deepseek_v2" && spec.norm_topk_prob;
    spec.routed_scaling_factor = v2_normalised ? 1.0 : c.routed_scaling_factor;
  }
  return spec;
}

// Runs block `layer` over s: on return s.x is the residual after attention and s.delta
// the block's output. With opt.save and Model::sequence_parallel, s.x holds this rank's
// rows and the saved x_in, x_mid, h1, h2 and norm statistics too.
void block_forward(const Model& m, int64_t layer, BlockState& s, const BlockOptions& opt,
                   const AttendFn& attend);

// x += delta (when defined); out = final_norm(x), mean/rstd saved when given.
void final_norm_forward(const Model& m, BlockState& s, Tensor& out, Tensor* mean, Tensor* rstd);

// Token embedding (+ GPT-2's learned positions): x (N, H). Vocab-parallel under tp: this
// rank looks up the ids in its rows, the others read 0, and the group sums.
// Under sequence parallelism (sp) x is this rank's rows of the sum (reduce-scattered).
// Gemma's embeddings are then scaled by sqrt(hidden) (embed_backward scales back).
Tensor embed_tokens(const Model& m, const Tensor& ids, const Tensor& positions, bool sp = false);
Tensor embed_tokens_unscaled(const Model& m, const Tensor& ids, const Tensor& positions, bool sp);
// Gemma 2's final logit soft-capping, in place: cap tanh(logits / cap) (none when 0).
void softcap_logits(const ModelConfig& c, Tensor& logits);
// Sequence parallelism: this rank's rows -> every rank's rows (all-gather, any dtype), and
// partial sums over all rows -> this rank's rows of their tp sum (reduce-scatter, f32).
Tensor gather_rows(const Model& m, const Tensor& local);
void scatter_rows(const Model& m, const Tensor& full, Tensor& local);
// The embedding gradient: grads.embed (this rank's rows) += dres rows of the ids it holds;
// GPT-2's positions too.
void embed_backward(const Model& m, const Tensor& dres, const Tensor& ids, const Tensor& positions,
                    Params& grads);
// Logits (R, V) of hidden rows h (R, H) for inference: the head's GEMM over this rank's
// vocabulary rows, gathered across the tp group. rowwise: one GEMM call per row.
Tensor head_logits(const Model& m, const Tensor& h, bool rowwise);

// Mean-free cross-entropy over the head's logits (N, V local), dlogits written over them
// scaled by grad_scale; vocab-parallel under tp (group maxima and sums, never the whole
// logits). Targets are checked against the whole vocabulary.
kernels::CrossEntropyResult head_cross_entropy(const Model& m, Tensor& logits,
                                               const Tensor& targets, float grad_scale);

// Whether the training head runs vocabulary-major (head_loss_vocab_major): native bf16,
// no tp and no final soft-cap. TESSERA_HEAD_LAYOUT=rows keeps the (N, V) layout.
bool vocab_major_head(const Model& m);
// The training head in one piece, with the logits transposed: logits^T (V, N) = W h^T,
// the cross-entropy over them (kernels::cross_entropy_columns: one exp per logit, the
// exps written once in bf16, the per-token softmax scale and the targets' -grad_scale
// applied on the (N, H) sides of the products), dh (N, H) = dlogits W (overwritten) and,
// when dw is given, dw (V, H) (+)= dlogits^T h. With bf16 operands the three products
// then take the (V, H) weight as their plain left operand, the layout AMX's GEMMs run
// fastest at the few hundred rows of a training step (bench/head_layouts).
kernels::CrossEntropyResult head_loss_vocab_major(const Model& m, const Tensor& h,
                                                  const Tensor& targets, float grad_scale,
                                                  Tensor& dh, Tensor* dw, bool accumulate);

// Sums a row-parallel linear's partial outputs (or a column-parallel linear's partial
// input gradients) over the tp group; nothing at tp = 1.
void tp_reduce(const Model& m, Tensor& t);

// Views of the fused (rows, q + 2 kv) QKV buffer as (B, T, heads, head_dim).
struct QkvViews {
  Tensor q, k, v;
};
QkvViews qkv_views(const LocalDims& d, const Tensor& qkv, int64_t B, int64_t T);

// Causal attention parameters of layer `layer` (softmax scale 1/sqrt(head_dim), its
// sliding window); q_offset: the position of the first query row within the keys.
kernels::AttentionParams attention_params(const ModelConfig& c, int64_t q_offset, int64_t layer);
// Qwen3's per-head RMSNorm of the q and k columns of qkv, in place (before RoPE); with A,
// what backward needs (the columns before it, each head's rstd). Backward: the gradient
// w.r.t. the normed columns (after the inverse RoPE) becomes the one w.r.t. their inputs,
// and G.q_norm / G.k_norm gain the weights' gradients (summed over the tp group).
void qk_norm_forward(const Model& m, const LayerParams& W, Tensor& qkv, LayerActivations* A);
void qk_norm_backward(const Model& m, const LayerParams& W, const LayerActivations& A, Tensor& dqkv,
                      LayerParams& G);
// RoPE on the q and k columns of qkv (or of its gradient, inverse = true).
void apply_rope(const Model& m, Tensor& qkv, const Tensor& positions, bool inverse);
}  // namespace tessera::model
