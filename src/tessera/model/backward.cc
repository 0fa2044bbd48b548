// Forward + backward for training: cross-entropy loss and gradients of every
// parameter, accumulated into a Params of f32 gradients.
#include <algorithm>
#include <cmath>
#include <vector>

#include "tessera/base/aligned_alloc.h"
#include "tessera/kernels/activation.h"
#include "tessera/kernels/attention.h"
#include "tessera/kernels/cross_entropy.h"
#include "tessera/kernels/elementwise.h"
#include "tessera/kernels/embedding.h"
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/quant.h"
#include "tessera/kernels/rope.h"
#include "tessera/model/activations.h"
#include "tessera/model/block.h"
#include "tessera/model/layer_ops.h"
#include "tessera/model/lora_ops.h"

namespace tessera::model {
namespace {

void check_grads(const ModelConfig& c, const PpStage& stage, const Params& g) {
  const bool sized = static_cast<int64_t>(g.layers.size()) == c.num_layers + c.mtp_layers;
  // (The final norm: present whatever is frozen, Params::allocate_frozen.)
  const Tensor& probe = stage.holds_head() || !sized ? g.final_norm_w
                        : stage.holds_layer(stage.layers(0, c.num_layers).first)
                            ? g.layers[stage.layers(0, c.num_layers).first].norm1_w
                            : g.embed;
  TESSERA_CHECK(sized && probe.defined() && probe.dtype() == DType::kF32,
                "forward_backward: gradients must be Params::allocate(config, f32) for this stage");
}

int64_t activation_bytes(const Activations& a) {
  int64_t n = 0;
  auto add = [&](const Tensor& t) {
    if (t.defined()) n += static_cast<int64_t>(t.nbytes());
  };
  for (const auto& L : a.layers)
    for (const Tensor* t : {&L.x_in, &L.mean1, &L.rstd1, &L.h1, &L.qkv, &L.att, &L.lse, &L.x_mid,
                            &L.mean2, &L.rstd2, &L.h2, &L.u, &L.a, &L.moe.x, &L.moe.u, &L.moe.a, &L.moe.y,
                            &L.moe.routing.scores, &L.shared_y, &L.shared_z, &L.mla.qa, &L.mla.qa_n, &L.mla.ckv,
                            &L.mla.c_n, &L.mla.kv, &L.mla.qp, &L.mla.kp, &L.mla.vp, &L.mla.outp, &L.mla.lse,
                            &L.mla.att, &L.qk_raw, &L.qk_rstd, &L.attn_y, &L.attn_rstd, &L.mlp_y, &L.mlp_rstd})
      add(*t);
  for (const auto& L : a.layers) n += L.cp.bytes();
  for (const Tensor* t : {&a.ids, &a.positions, &a.x_final, &a.meanf, &a.rstdf, &a.hf}) add(*t);
  return n;
}

// GradWrite::kAssign: clears the gradients of `unit` (Params::unit_tensors) that backward
// adds into (norms, biases, embedding rows) once the unit is prepared; the weight-gradient
// GEMMs (beta 0) write the others whole: `gemm_written` (Params::matmul_weights, and a
// tied embed, which is lm_head and written by the head's GEMM before the embedding rows
// are added). `all` (no target counted: nothing writes them) clears those too.
void clear_assigned_grads(const ModelConfig& c, Params& g, int unit,
                          const std::vector<const Tensor*>& gemm_written, bool all) {
  for (auto& [name, t] : g.unit_tensors(c, unit)) {
    const bool written = std::find(gemm_written.begin(), gemm_written.end(), t) != gemm_written.end();
    if (all || !written) t->zero();
  }
}

// dx_full = dy_op @ W for the block linear `spec` of layer l (dy_op prepared for pm); a
// column-parallel linear's input gradient (each rank holds the part from its output
// features) is then summed over the tp group: all-reduced in place (dx is dx_full), or
// under sequence parallelism reduce-scattered into dx, this rank's rows.
void input_grad(const Model& m, const BlockLinear& spec, int64_t l, const Tensor& dy_op,
                Tensor& dx_full, Tensor& dx, Bf16Mode pm) {
  linear_backward_input(m.compute_linear(l, spec.which), dy_op, dx_full, pm);
  if (spec.style != LinearStyle::kColumn) return;
  if (m.sequence_parallel())
    scatter_rows(m, dx_full, dx);
  else
    tp_reduce(m, dx_full);
}

// norm_backward. Under sequence parallelism a rank sees only its rows, so the weight (and
// bias) gradients it finds are this micro-batch's partial sums: computed apart, summed
// over the tp group, then added.
void norm_grad(const Model& m, const Tensor& dout, const Tensor& x, const Tensor& w,
               const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor& db) {
  const auto& c = m.config();
  if (!m.sequence_parallel()) {
    norm_backward(c, dout, x, w, mean, rstd, dx, dw, db);
    return;
  }
  const int64_t H = c.hidden_size;
  const bool ln = c.uses_layernorm();
  Tensor g = Tensor::zeros({ln ? 2 * H : H}, DType::kF32);
  Tensor gw = g.slice(0, 0, H), gb = ln ? g.slice(0, H, 2 * H) : Tensor();
  norm_backward(c, dout, x, w, mean, rstd, dx, gw, gb);
  tp_reduce(m, g);
  kernels::add_inplace(dw, gw);
  if (ln) kernels::add_inplace(db, gb);
}

// This rank's rows under sequence parallelism -> every row (the tp region's operand).
Tensor all_rows(const Model& m, const Tensor& t) {
  return m.sequence_parallel() ? gather_rows(m, t) : t;
}

}  // namespace

Tensor Model::forward_chunk(int chunk, const Tensor& ids, const Tensor& input,
                            ChunkPass& pass, const Tensor& positions) const {
  base::set_cache_floor(size_t{64} << 10);  // training: the same activation sizes every step
  // (Each stage routes its own layers; only the balancing loss, taken over every layer's
  // routing at once, would need the other stages'.)
  TESSERA_CHECK(!config_.is_moe() || stage_.whole() || !(config_.output_router_logits && config_.router_aux_loss_coef > 0),
                "pipeline parallelism over a mixture-of-experts model that trains its balancing loss "
                "(output_router_logits) is not supported yet: the loss spans every stage's layers");
  pass.chunk = chunk;
  pass.acts = std::make_shared<Activations>();
  pass.head_input = Tensor();
  Tensor out = forward_train_chunk(*this, chunk, ids, input, *pass.acts, positions);
  pass.activation_bytes = activation_bytes(*pass.acts);
  if (!stage_.last_chunk(chunk)) return out;
  pass.head_input = std::move(out);  // hf, every row: the head runs in backward_chunk
  return Tensor();
}

Model::LossResult Model::forward_backward(const Tensor& ids, const Tensor& targets, Params& grads,
                                          float grad_scale, GradWrite write,
                                          const Tensor& positions) const {
  TESSERA_CHECK(stage_.whole(), "forward_backward runs the whole model; pipeline stage ",
                stage_.rank, " runs forward_chunk and backward_chunk");
  TESSERA_CHECK(targets.dtype() == DType::kI32 && targets.shape() == ids.shape(),
                "forward_backward: targets ", targets.describe(), " must be i32 shaped like ids ",
                ids.describe());
  if (!hooks_) check_grads(config_, stage_, grads);
  ChunkPass pass;
  forward_chunk(0, ids, Tensor(), pass, positions);  // leaves the head unit acquired
  LossResult result;
  backward_chunk(pass, targets, Tensor(), grads, grad_scale, write, &result);
  return result;
}

Tensor Model::backward_chunk(ChunkPass& pass, const Tensor& targets, const Tensor& grad_output,
                             Params& grads, float grad_scale, GradWrite write,
                             LossResult* out) const {
  const auto& c = config_;
  if (!hooks_) check_grads(c, stage_, grads);
  TESSERA_CHECK(pass.acts, "backward_chunk: the pass has no forward (or ran backward already)");
  Activations& acts = *pass.acts;
  const int chunk = pass.chunk;
  const bool first = stage_.first_chunk(chunk), last = stage_.last_chunk(chunk);
  const auto [l0, l1] = stage_.layers(chunk, c.num_layers);
  const bool assign = write == GradWrite::kAssign;
  const int64_t B = acts.B, T = acts.T, N = B * T;
  TrainHooks* hooks = hooks_;
  const int head = num_units() - 1;
  const bool tied = c.tie_word_embeddings;
  LossResult result;
  result.activation_bytes = pass.activation_bytes;
  // Mixture of experts: this chunk's layers' routing (every chunk reports its own; the
  // balancing loss below needs every layer's, so only a whole model trains it).
  if (acts.moe_balance) {
    result.expert_load = acts.moe_balance->routed;
    result.aux_loss = acts.moe_balance->loss();
    result.layer_load = acts.moe_balance->layer_routed;
    result.dropped = acts.moe_balance->dropped;
  }
  // A unit's gradient tensors exist (under ZeRO-2/3) once the hooks have prepared them.
  std::vector<const Tensor*> gemm_written;
  if (assign) {
    for (Tensor* w : grads.matmul_weights()) gemm_written.push_back(w);
    if (tied && last && first) gemm_written.push_back(&grads.embed);
  }
  int64_t count = 0;
  const bool sp = sequence_parallel_;
  const int64_t H = c.hidden_size;
  const int64_t Nl = sp ? N / shard_.size : N;
  Tensor tflat;
  if (last) {
    TESSERA_CHECK(targets.dtype() == DType::kI32 && targets.numel() == N,
                  "backward: targets ", targets.describe(), " must be i32 with the ", N,
                  " tokens of the forward");
    tflat = targets.contiguous().view({N});
    for (int64_t i = 0; i < N; ++i) count += tflat.data<int32_t>()[i] != kernels::kIgnoreIndex;
  } else {
    TESSERA_CHECK(grad_output.defined() && grad_output.dtype() == DType::kF32 &&
                      grad_output.numel() == Nl * H,
                  "backward: chunk ", chunk, " expects the next stage's (", Nl, ", ", H,
                  ") f32 gradient, got ", grad_output.defined() ? grad_output.describe() : "nothing");
  }
  const auto prepare = [&](int unit) {
    if (hooks) hooks->prepare_grads(unit);
    if (assign) clear_assigned_grads(c, grads, unit, gemm_written, last && count == 0);
  };
  if (last && hooks && tied && first) hooks->acquire(0);  // lm_head is embed
  if (last && count == 0) {
    // No target counted: every gradient is zero, but the hooks still see the whole walk
    // (a data-parallel peer with targets is waiting on the same collectives), and the
    // previous stage receives a zero gradient.
    prepare(head);
    if (tied && first) prepare(0);
    if (hooks) {
      if (tied && first) hooks->release(0);
      hooks->grads_ready(head);
      hooks->release(head);
    }
    for (int64_t l = l1 - 1; l >= l0; --l) {
      prepare(static_cast<int>(l) + 1);
      if (hooks) hooks->grads_ready(static_cast<int>(l) + 1);
    }
    if (first) {
      prepare(0);
      if (hooks) hooks->grads_ready(0);
    }
    pass.acts.reset();
    if (out) *out = result;
    return first ? Tensor() : Tensor::zeros({Nl, H}, DType::kF32);
  }
  const LocalDims& d = dims_;
  const int64_t Q = d.q;
  // Each activation or gradient that feeds matmuls is rounded once (mode; a bf16 copy
  // under kNative), and the matmuls are handed the rounded operands (pm): hf, h1, h2 and
  // a come rounded from forward_train.
  const Bf16Mode mode = bf16_mode_, pm = prepared_mode(mode);

  std::vector<float> moe_score_grad;  // the balancing loss's gradient per expert, when trained
  // DeepSeek-V2's per-layer balancing loss: its gradient per (group, expert) for each of this
  // chunk's MoE layers in order (its value joins the loss where the head is).
  std::vector<std::vector<float>> moe_group_grad;
  if (acts.moe_balance && c.trains_seq_aux())
    for (size_t i = 0; i < acts.moe_balance->layer_groups.size(); ++i)
      moe_group_grad.push_back(acts.moe_balance->group_score_grad(i, c.aux_loss_alpha * grad_scale));
  Tensor dres = Tensor::empty({Nl, H}, DType::kF32);  // gradient w.r.t. the residual stream
  Tensor dh = Tensor::empty({Nl, H}, DType::kF32);
  Tensor dh_full = sp ? Tensor::empty({N, H}, DType::kF32) : dh;
  // Block l's backward from dres, the gradient w.r.t. its output residual stream, which
  // becomes the gradient w.r.t. its input (A: what its forward kept).
  Tensor tmp = Tensor::empty({Nl, H}, DType::kF32);
  Tensor da, du;  // (N, F), (N, 2F | F): sized per layer (deepseek's dense and shared-expert MLPs differ)
  const bool mla = c.uses_mla();
  Tensor datt = mla ? Tensor() : Tensor::empty({N, Q}, DType::kF32);
  Tensor dqkv = mla ? Tensor() : Tensor::empty({N, d.qkv}, DType::kF32);
  auto block_backward = [&](int64_t l, const LayerActivations& A, Tensor& dres) {
    const LayerParams& W = weights_.layers[l];
    LayerParams& G = grads.layers[l];
    // A linear's weight (and bias) gradient, unless the caller froze it (left it undefined).
    auto weight_grad = [&](const Tensor& x, const Tensor& dy, const Tensor& dy_op, Linear& g) {
      if (g.weight.defined()) linear_backward_weight(x, dy, dy_op, g, pm, !assign);
    };
    const BlockLinear &Lqkv = kBlockLinears[0], &Lo = kBlockLinears[1], &Lup = kBlockLinears[2],
                      &Ldown = kBlockLinears[3];
    // The dense MLP's backward from its output gradient dy (all rows): x_out = x_mid +
    // down(act(up(norm2(x_mid)))); dh gets its input gradient. (qwen2_moe: the shared expert.)
    Tensor dres_all = c.sandwich_norms ? Tensor() : all_rows(*this, dres), op;  // (gemma2: after the post-norm)
    const int64_t F = layer_ffn(*this, l);
    if (F > 0 && (!da.defined() || da.size(1) != F)) {
      da = Tensor::empty({N, F}, DType::kF32);
      du = Tensor::empty({N, c.gated_mlp() ? 2 * F : F}, DType::kF32);
    }
    auto dense_mlp_backward = [&](const Tensor& dy) {
      op = matmul_operand(dy, mode);
      input_grad(*this, Ldown, l, op, da, da, pm);
      lora_backward(*this, l, Ldown.which, A.a, dy, da);
      weight_grad(A.a, dy, op, G.linear(Ldown.which));
      if (c.gated_mlp()) {
        Tensor dgate = du.slice(1, 0, F), dup = du.slice(1, F, 2 * F);
        if (c.gelu_mlp)
          kernels::geglu_backward(da, A.u.slice(1, 0, F), A.u.slice(1, F, 2 * F), dgate, dup);
        else
          kernels::swiglu_backward(da, A.u.slice(1, 0, F), A.u.slice(1, F, 2 * F), dgate, dup);
      } else {
        kernels::gelu_backward(da, A.u, du);
      }
      op = matmul_operand(du, mode);
      input_grad(*this, Lup, l, op, dh_full, dh, pm);
      lora_backward(*this, l, Lup.which, A.h2, du, dh);  // (LoRA: tp 1, dh is dh_full)
      weight_grad(all_rows(*this, A.h2), du, op, G.linear(Lup.which));
    };
    // Gemma 2: the gradient reaching a half's output passes back through its post-norm.
    auto post_norm_grad = [&](const Tensor& dout, const Tensor& y, const Tensor& w, const Tensor& rstd, Tensor& gw) {
      Tensor dy = Tensor::empty({dout.size(0), H}, DType::kF32), none;
      norm_grad(*this, dout, y, w, none, rstd, dy, gw, none);
      return dy;
    };
    if (c.sandwich_norms) {
      dense_mlp_backward(all_rows(*this, post_norm_grad(dres, A.mlp_y, W.post_mlp_norm, A.mlp_rstd, G.post_mlp_norm)));
    } else if (!c.layer_is_moe(l)) {
      dense_mlp_backward(dres_all);
    } else {
      // x_out = x_mid + moe(norm2(x_mid)) (tp = 1: every row here). The expert and router
      // gradients accumulate (prepare cleared them under kAssign).
      const MoeWeights& E = compute_moe(l);
      const std::vector<float>* aux = moe_score_grad.empty() ? nullptr : &moe_score_grad;
      if (!moe_group_grad.empty()) {  // this layer's place among the chunk's MoE layers
        size_t i = 0;
        for (int64_t j = l0; j < l; ++j) i += c.layer_is_moe(j) ? 1 : 0;
        aux = &moe_group_grad.at(i);
      }
      Tensor dh_moe = dh;
      if (c.shared_expert) {
        // qwen2_moe: + sigmoid(z) y, z = h2 . g, y the shared expert (the dense MLP):
        // dy = sigmoid(z) dout per row, dz = (dout . y) sigmoid'(z).
        Tensor dy = Tensor::empty({N, H}, DType::kF32), dz = Tensor::empty({N, 1}, DType::kF32);
        const float* gp = dres.data<float>();
        const float* yp = A.shared_y.data<float>();
        const float* zp = A.shared_z.data<float>();
        float* dyp = dy.data<float>();
        for (int64_t n = 0; n < N; ++n) {
          const float sg = 1.f / (1.f + std::exp(-zp[n]));
          double dot = 0;
          for (int64_t k = 0; k < H; ++k) {
            dyp[n * H + k] = sg * gp[n * H + k];
            dot += static_cast<double>(gp[n * H + k]) * yp[n * H + k];
          }
          dz.data<float>()[n] = static_cast<float>(dot) * sg * (1.f - sg);
        }
        dense_mlp_backward(dy);
        kernels::matmul(dz, E.shared_gate, dh, false, false, 1.f, 1.f);
        kernels::matmul(dz, A.h2, G.moe.shared_gate, true, false, 1.f, 1.f);
        dh_moe = Tensor::empty({N, H}, DType::kF32);
      }
      const bool ungated_shared = !c.shared_expert && F > 0;  // deepseek's shared experts: + y
      if (ungated_shared) {
        dense_mlp_backward(dres);
        dh_moe = Tensor::empty({N, H}, DType::kF32);
      }
      moe_backward(moe_spec(c), E, A.h2, A.moe, dres, dh_moe, G.moe, aux, ep_comm_);
      if (c.shared_expert || ungated_shared) kernels::add_inplace(dh, dh_moe);
    }
    norm_grad(*this, dh, A.x_mid, W.norm2_w, A.mean2, A.rstd2, tmp, G.norm2_w, G.norm2_b);
    kernels::add_inplace(dres, tmp);
    // Attention: x_mid = x_in + o(attention(qkv(norm1(x_in)))); dh gets d loss / d norm1's output.
    auto attention_backward = [&] {
      dres_all = all_rows(*this, c.sandwich_norms ? post_norm_grad(dres, A.attn_y, W.post_attn_norm, A.attn_rstd,
                                                                   G.post_attn_norm)
                                                  : dres);
      op = matmul_operand(dres_all, mode);
      input_grad(*this, Lo, l, op, datt, datt, pm);
      lora_backward(*this, l, Lo.which, A.att, dres_all, datt);
      if (G.linear(Lo.which).weight.defined()) weight_grad(matmul_operand(A.att, mode), dres_all, op, G.linear(Lo.which));
      // (Under Ulysses the layer kept no q, k, v, A.cp has them: these views give shapes.)
      const QkvViews v = qkv_views(d, A.qkv.defined() ? A.qkv : dqkv, B, T);
      QkvViews dv = qkv_views(d, dqkv, B, T);
      if (cp_comm_)  // context parallelism: the attention crosses the cp group's tokens
        cp_attention_backward(*cp_comm_, cp_method_, v.q, v.k, v.v, A.att.view({B, T, d.heads, d.head_dim}), A.lse,
                              A.cp, datt.view({B, T, d.heads, d.head_dim}), dv.q, dv.k, dv.v,
                              attention_params(c, 0, l).scale);
      else
        kernels::attention_backward(v.q, v.k, v.v, A.att.view({B, T, d.heads, d.head_dim}), A.lse,
                                    datt.view({B, T, d.heads, d.head_dim}), dv.q, dv.k, dv.v,
                                    train_attention_params(*this, l, acts));
      apply_rope(*this, dqkv, acts.positions, true);
      if (c.qk_norm) qk_norm_backward(*this, W, A, dqkv, G);
      op = matmul_operand(dqkv, mode);
      input_grad(*this, Lqkv, l, op, dh_full, dh, pm);
      lora_backward(*this, l, Lqkv.which, A.h1, dqkv, dh);
      if (d.kv_replicas > 1) {
        // A replicated kv head is read by the query heads of kv_replicas ranks: its weight
        // gradient sums theirs (the input gradient above took only this rank's part).
        Tensor dkv = dqkv.slice(1, d.q, d.qkv).contiguous();
        tp_comm_->all_reduce_kv_replicas(dkv);
        dqkv.slice(1, d.q, d.qkv).copy_from(dkv);
        op = matmul_operand(dqkv, mode);
      }
      weight_grad(all_rows(*this, A.h1), dqkv, op, G.linear(Lqkv.which));
    };
    if (mla)  // latent attention: x_mid = x_in + mla(norm1(x_in)) (tp = 1)
      mla_backward(mla_spec(*this), W.mla, A.mla, dres, dh, G.mla,
                   tp_comm_ ? [this](Tensor& t) { tp_comm_->all_reduce_sum(t); } : MlaReduce());
    else
      attention_backward();
    norm_grad(*this, dh, A.x_in, W.norm1_w, A.mean1, A.rstd1, tmp, G.norm1_w, G.norm1_b);
    kernels::add_inplace(dres, tmp);
  };
  // DeepSeek-V3's multi-token prediction module: position t's logits against token t + 2,
  // weighted; back through shared_head.norm, its block, eh_proj and the two norms to the
  // main model's final hidden state (d_hf) and the next tokens' embeddings (d_emb).
  bool mtp_wrote_head = false;
  // The module did not run (or predicted nothing): its gradients are 0 (cleared, when assigned).
  auto clear_mtp_grads = [&] {
    if (!assign || c.mtp_layers == 0) return;
    for (auto& [name, g] : grads.unit_tensors(c, head))
      if (name.rfind("layers.", 0) == 0 || name.rfind("mtp.", 0) == 0) g->zero();
  };
  // The head's weight for its products. A quantized head (QLoRA over a GPTQModel checkpoint
  // with lm_head quantized) runs through its dequantized weight, as the block linears do.
  // (Set once the head's unit is prepared, below.)
  Tensor head_w;
  auto mtp_backward = [&](MtpActivations& t, Tensor& d_hf, Tensor& d_emb) {
    const int64_t T = acts.T;
    Tensor targets_m = Tensor::empty({N}, DType::kI32);
    const int32_t* tg = tflat.data<int32_t>();
    int32_t* tm = targets_m.data<int32_t>();
    int64_t count_m = 0;
    for (int64_t n = 0; n < N; ++n) {
      tm[n] = n % T + 1 < T ? tg[n + 1] : kernels::kIgnoreIndex;
      count_m += tm[n] != kernels::kIgnoreIndex;
    }
    result.mtp_count = count_m;
    if (count_m == 0) return clear_mtp_grads();  // nothing to predict
    const MtpParams& P = weights_.mtp;
    Tensor logits = Tensor::empty({N, dims_.vocab}, DType::kF32);
    kernels::matmul(matmul_input(t.hm, pm), head_w, logits, false, true);
    const float scale = static_cast<float>(mtp_loss_weight_) * grad_scale / static_cast<float>(count_m);
    const auto ce = head_cross_entropy(*this, logits, targets_m, scale);
    result.mtp_loss = ce.loss_sum / static_cast<double>(ce.count);
    round_matmul_input_in_place(logits, mode);
    Tensor dhm = Tensor::empty({N, H}, DType::kF32), dx = Tensor::empty({N, H}, DType::kF32), none;
    kernels::matmul(matmul_input(logits, pm), head_w, dhm, false, false);
    tp_reduce(*this, dhm);  // vocab-parallel head: each rank's part from its rows
    matmul_weight_grad(logits, t.hm, grads.lm_head, pm, !assign);  // (the first writer; the head's adds)
    mtp_wrote_head = true;
    norm_grad(*this, dhm, t.x_out, P.head_norm, Tensor(), t.rstd, dx, grads.mtp.head_norm, none);
    block_backward(c.num_layers, t.layer, dx);  // dx: now d loss / d eh_proj's output
    Tensor dcat = Tensor::empty({N, 2 * H}, DType::kF32);
    kernels::matmul(dx, P.eh_proj, dcat, false, false);
    kernels::matmul(dx, t.cat, grads.mtp.eh_proj, true, false, 1.f, 1.f);
    d_emb = Tensor::empty({N, H}, DType::kF32);
    d_hf = Tensor::empty({N, H}, DType::kF32);
    norm_grad(*this, dcat.slice(1, 0, H).contiguous(), t.emb, P.enorm, Tensor(), t.e_rstd, d_emb, grads.mtp.enorm,
              none);
    norm_grad(*this, dcat.slice(1, H, 2 * H).contiguous(), t.h_in, P.hnorm, Tensor(), t.h_rstd, d_hf,
              grads.mtp.hnorm, none);
  };
  Tensor d_mtp_emb;  // the multi-token prediction module's gradient w.r.t. its embeddings
  if (last) {
    prepare(head);
    if (tied && first) prepare(0);
    head_w = compute_lm_head();
    if (quant_lm_head_) {
      head_w = kernels::dequantize(*quant_lm_head_);
      if (mode == Bf16Mode::kNative) head_w = head_w.to(DType::kBF16);
    }
    Tensor d_hf_mtp;  // ... and w.r.t. the final hidden state, added to the head's below
    if (acts.mtp)
      mtp_backward(*acts.mtp, d_hf_mtp, d_mtp_emb);
    else
      clear_mtp_grads();
    const Tensor& hf = pass.head_input;
    const float ce_scale = grad_scale / static_cast<float>(count);
    const bool head_accumulates = !assign || mtp_wrote_head;  // (the head's adds; before embed's scatter-add)
    kernels::CrossEntropyResult ce;
    if (vocab_major_head(*this)) {
      ce = head_loss_vocab_major(*this, hf, tflat, ce_scale, dh_full,
                                 grads.lm_head.defined() ? &grads.lm_head : nullptr, head_accumulates);
    } else {
      // Loss and d(loss)/d(logits), written over the logits.
      Tensor logits = Tensor::empty({N, dims_.vocab}, DType::kF32);
      kernels::matmul(matmul_input(hf, pm), head_w, logits, false, true);
      Tensor capped;  // gemma2: the soft-capped logits, for the cap's derivative below
      if (c.final_softcap > 0) {
        softcap_logits(c, logits);
        capped = logits.clone();
      }
      ce = head_cross_entropy(*this, logits, tflat, ce_scale);
      if (capped.defined()) {  // d/dz cap tanh(z / cap) = 1 - (capped / cap)^2
        const float inv = 1.f / c.final_softcap;
        float* g = logits.data<float>();
        const float* y = capped.data<float>();
        for (int64_t i = 0; i < logits.numel(); ++i) g[i] *= 1.f - (y[i] * inv) * (y[i] * inv);
      }
      Tensor& dlogits = logits;
      round_matmul_input_in_place(dlogits, mode);
      // lm_head: logits = hf @ Wlm^T. The residual stream's rows here: all N, or this rank's
      // N / tp under sequence parallelism (dh_full then holds the tp region's partial sums
      // over every row).
      kernels::matmul(matmul_input(dlogits, pm), head_w, dh_full, false, false);
      if (grads.lm_head.defined())  // (undefined: a frozen base)
        matmul_weight_grad(dlogits, hf, grads.lm_head, pm, head_accumulates);
    }
    result.loss = ce.loss_sum / static_cast<double>(ce.count);
    result.count = ce.count;
    // Mixture of experts: transformers adds router_aux_loss_coef x the balancing loss over
    // every layer's tokens when the config asks for router logits; its gradient reaches each
    // layer's router probabilities (moe_backward).
    if (acts.moe_balance && c.output_router_logits && c.router_aux_loss_coef > 0) {
      result.loss += c.router_aux_loss_coef * result.aux_loss;
      moe_score_grad = acts.moe_balance->score_grad(c.router_aux_loss_coef * grad_scale);
    }
    // DeepSeek-V2 (modeling_deepseek.py's MoEGate adds alpha x its loss per layer): this
    // chunk's layers' terms (under pipeline parallelism the other stages' are not in the
    // logged loss; their gradients are, on their own stage).
    if (acts.moe_balance && c.trains_seq_aux()) {
      result.aux_loss = acts.moe_balance->group_loss();
      result.loss += c.aux_loss_alpha * result.aux_loss;
    }
    // Vocab-parallel head: each rank's part from its rows, summed over the group.
    if (sp)
      scatter_rows(*this, dh_full, dh);
    else
      tp_reduce(*this, dh);
    if (d_hf_mtp.defined()) kernels::add_inplace(dh, d_hf_mtp);
    norm_grad(*this, dh, acts.x_final, weights_.final_norm_w, acts.meanf, acts.rstdf, dres,
              grads.final_norm_w, grads.final_norm_b);
    pass.head_input = Tensor();
    if (hooks) {
      if (tied && first) hooks->release(0);
      hooks->grads_ready(head);
      hooks->release(head);
    }
  } else {
    dres.copy_from(grad_output.view({Nl, H}));
  }

  for (int64_t l = l1 - 1; l >= l0; --l) {
    const int unit = static_cast<int>(l) + 1;
    if (hooks) hooks->acquire(unit);
    prepare(unit);
    // Activation checkpointing: rebuild what the forward pass did not keep.
    LayerActivations recomputed;
    if (recompute_ == Recompute::kFull) {
      recomputed.x_in = acts.layers[l].x_in;
      BlockState s;
      s.x = recomputed.x_in.clone();
      layer_forward_train(*this, l, acts, s, recomputed, true);
    } else if (recompute_ == Recompute::kSelective) {
      recompute_attention(*this, l, acts, acts.layers[l]);
    }
    block_backward(l, recompute_ == Recompute::kFull ? recomputed : acts.layers[l], dres);
    acts.layers[l] = LayerActivations{};  // done with this layer: release its memory now
    if (hooks) {
      hooks->grads_ready(unit);
      hooks->release(unit);
    }
  }
  if (out) *out = result;
  if (!first) {
    pass.acts.reset();
    return dres;  // to the previous virtual stage
  }
  prepare(0);  // (tied: prepared before the head; clearing again is a no-op then)
  if (grads.embed.defined()) embed_backward(*this, all_rows(*this, dres), acts.ids, acts.positions, grads);
  if (d_mtp_emb.defined()) embed_backward(*this, d_mtp_emb, acts.mtp->ids, acts.positions, grads);
  if (hooks) hooks->grads_ready(0);
  pass.acts.reset();
  return Tensor();
}

}  // namespace tessera::model
