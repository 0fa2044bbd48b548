// The transformer block body (block.h).
#include "tessera/model/block.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "tessera/kernels/activation.h"
#include "tessera/kernels/elementwise.h"
#include "tessera/kernels/embedding.h"
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/norm.h"
#include "tessera/kernels/quant.h"
#include "tessera/kernels/rope.h"
#include "tessera/model/layer_ops.h"
#include "tessera/model/lora_ops.h"

namespace tessera::model {
namespace {

// f(x, y) over the whole rows, or one row at a time when `rowwise` (the same kernel call
// for every row whatever N is: batch-invariant results).
template <typename F>
void by_rows(const Tensor& x, Tensor& y, bool rowwise, const F& f) {
  if (!rowwise) {
    f(x, y);
    return;
  }
  for (int64_t i = 0; i < x.size(0); ++i) {
    Tensor yi = y.slice(0, i, i + 1);
    f(x.slice(0, i, i + 1), yi);
  }
}

// y = x @ W^T for one of the block's linears; a row-parallel one's partial sums are then
// summed over the tp group (all-reduced in place, or under sequence parallelism
// reduce-scattered into *rows_out, this rank's rows); then the bias, added to the result.
void run_linear(const Model& m, const BlockLinear& spec, int64_t layer, const Tensor& x, Tensor& y,
                Bf16Mode mode, bool rowwise, Tensor* rows_out = nullptr) {
  const Linear& lin = m.compute_linear(layer, spec.which);
  // The bias goes into the GEMM unless a tp reduction comes between (row-parallel under tp).
  const bool bias_in_gemm = spec.style != LinearStyle::kRow || (!rows_out && !m.tp_comm());
  by_rows(x, y, rowwise, [&](const Tensor& xi, Tensor& yi) { linear_matmul(lin, xi, yi, mode, bias_in_gemm); });
  if (bias_in_gemm) return;
  Tensor* out = &y;
  if (spec.style == LinearStyle::kRow) {
    if (rows_out) {
      scatter_rows(m, y, *rows_out);
      out = rows_out;
    } else {
      tp_reduce(m, y);
    }
  }
  if (lin.bias.defined()) kernels::add_bias(*out, lin.bias);
}

// MLP activation: a (N, F) from u (N, 2F | F).
void mlp_activation(const Model& m, const Tensor& u, Tensor& a) {
  const int64_t F = a.size(1);
  if (m.config().gated_mlp() && m.config().gelu_mlp)
    kernels::geglu_forward(u.slice(1, 0, F), u.slice(1, F, 2 * F), a);
  else if (m.config().gated_mlp())
    kernels::swiglu_forward(u.slice(1, 0, F), u.slice(1, F, 2 * F), a);
  else
    kernels::gelu_forward(u, a);
}

// `t` when it has the shape (scratch reuse), else a new f32 tensor of that shape.
Tensor& scratch(Tensor& t, int64_t rows, int64_t cols) {
  if (!t.defined() || t.size(0) != rows || t.size(1) != cols) t = Tensor::empty({rows, cols}, DType::kF32);
  return t;
}

}  // namespace

MlaSpec mla_spec(const Model& m) {
  const ModelConfig& c = m.config();
  MlaSpec s;
  s.heads = m.dims().heads;
  s.q_lora_rank = c.q_lora_rank;
  s.kv_lora_rank = c.kv_lora_rank;
  s.qk_nope = c.qk_nope_head_dim;
  s.qk_rope = c.qk_rope_head_dim;
  s.v_head = c.v_head_dim;
  s.rope_theta = c.rope_theta;
  s.norm_eps = c.norm_eps;
  if (c.rope_scaling) {  // DeepSeek's YaRN
    s.inv_freq = yarn_inv_freq(*c.rope_scaling, s.qk_rope, c.rope_theta);
    s.rope_mscale = yarn_attention_factor(*c.rope_scaling);
    s.scale = static_cast<float>(s.softmax_scale() * yarn_softmax_factor(*c.rope_scaling));
  }
  return s;
}

kernels::AttentionParams attention_params(const ModelConfig& c, int64_t q_offset, int64_t layer) {
  kernels::AttentionParams p;
  p.scale = c.attention_scale();
  p.softcap = c.attn_softcap;
  p.causal = true;
  p.q_offset = q_offset;
  p.window = c.layer_window(layer);
  return p;
}

void apply_rope(const Model& m, Tensor& qkv, const Tensor& positions, bool inverse) {
  const auto& c = m.config();
  if (!c.uses_rope()) return;
  const LocalDims& d = m.dims();
  auto rotate = [&](int64_t b, int64_t e, const kernels::RopeFreqs& f) {
    Tensor q = qkv.slice(1, 0, d.q).slice(0, b, e);
    Tensor k = qkv.slice(1, d.q, d.q + d.kv).slice(0, b, e);
    const Tensor pos = positions.slice(0, b, e);
    kernels::rope_apply(q, c.head_dim, pos, f, inverse);
    kernels::rope_apply(k, c.head_dim, pos, f, inverse);
  };
  const int64_t N = positions.size(0);
  if (!c.rope_scaling || c.rope_scaling->type != "dynamic") {
    rotate(0, N, rope_freqs(c, 0));
    return;
  }
  // Dynamic NTK: each sequence's frequencies follow its length so far (its last position
  // here + 1), as transformers recomputes them per forward. Rows are runs of consecutive
  // positions, one per sequence; runs of the same length share one call.
  const int32_t* p = positions.data<int32_t>();
  int64_t b = 0;
  while (b < N) {
    int64_t e = b + 1;
    while (e < N && p[e] == p[e - 1] + 1) ++e;
    const int64_t len = std::max<int64_t>(p[e - 1] + 1, c.max_position_embeddings);
    int64_t end = e;  // later runs within max_position_embeddings (or as long) share the frequencies
    while (end < N) {
      int64_t f = end + 1;
      while (f < N && p[f] == p[f - 1] + 1) ++f;
      if (std::max<int64_t>(p[f - 1] + 1, c.max_position_embeddings) != len) break;
      end = f;
    }
    rotate(b, end, rope_freqs(c, len));
    b = end;
  }
}

void qk_norm_forward(const Model& m, const LayerParams& W, Tensor& qkv, LayerActivations* A) {
  const ModelConfig& c = m.config();
  const LocalDims& d = m.dims();
  const int64_t N = qkv.size(0), hd = c.head_dim, nq = d.q / hd, nk = d.kv / hd;
  Tensor raw = qkv.slice(1, 0, d.q + d.kv).clone();
  Tensor rstd = Tensor::empty({nq + nk, N}, DType::kF32);
  for (int64_t h = 0; h < nq + nk; ++h) {
    Tensor out = qkv.slice(1, h * hd, (h + 1) * hd), r = rstd.select(0, h);
    kernels::rmsnorm_forward(raw.slice(1, h * hd, (h + 1) * hd), h < nq ? W.q_norm : W.k_norm, c.norm_eps, out, &r);
  }
  if (A) A->qk_raw = std::move(raw), A->qk_rstd = std::move(rstd);
}

void qk_norm_backward(const Model& m, const LayerParams& W, const LayerActivations& A, Tensor& dqkv,
                      LayerParams& G) {
  const ModelConfig& c = m.config();
  const LocalDims& d = m.dims();
  const int64_t N = dqkv.size(0), hd = c.head_dim, nq = d.q / hd, nk = d.kv / hd;
  Tensor g = Tensor::zeros({2 * hd}, DType::kF32);  // q_norm's, then k_norm's
  Tensor gq = g.slice(0, 0, hd), gk = g.slice(0, hd, 2 * hd);
  Tensor dx = Tensor::empty({N, hd}, DType::kF32);
  for (int64_t h = 0; h < nq + nk; ++h) {
    Tensor dout = dqkv.slice(1, h * hd, (h + 1) * hd);
    Tensor& gw = h < nq ? gq : gk;
    kernels::rmsnorm_backward(dout, A.qk_raw.slice(1, h * hd, (h + 1) * hd), h < nq ? W.q_norm : W.k_norm,
                              A.qk_rstd.select(0, h), dx, gw);
    dout.copy_from(dx);
  }
  // Each rank saw only its heads: the weights' gradients are partial sums over the tp group.
  if (m.tp_comm()) tp_reduce(m, g);
  kernels::add_inplace(G.q_norm, gq);
  kernels::add_inplace(G.k_norm, gk);
}

Tensor gather_rows(const Model& m, const Tensor& local) {
  Tensor full = Tensor::empty({local.size(0) * m.tp_shard().size, local.size(1)}, local.dtype());
  m.tp_comm()->all_gather_rows(local.contiguous(), full);
  return full;
}

void scatter_rows(const Model& m, const Tensor& full, Tensor& local) {
  m.tp_comm()->reduce_scatter_rows(full, local);
}

namespace {

// Gemma: the embedding times sqrt(hidden) (in f32, transformers' normalizer in the
// activations' dtype), in place.
void scale_embedding(const ModelConfig& c, Tensor& x) {
  if (!c.embed_scale) return;
  const float s = std::sqrt(static_cast<float>(c.hidden_size));
  float* p = x.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) p[i] *= s;
}

}  // namespace

Tensor embed_tokens(const Model& m, const Tensor& ids, const Tensor& positions, bool sp) {
  Tensor x = embed_tokens_unscaled(m, ids, positions, sp);
  scale_embedding(m.config(), x);
  return x;
}

Tensor embed_tokens_unscaled(const Model& m, const Tensor& ids, const Tensor& positions, bool sp) {
  const auto& c = m.config();
  const LocalDims& d = m.dims();
  Tensor x = Tensor::empty({ids.numel(), c.hidden_size}, DType::kF32);
  if (!m.tp_comm()) {
    kernels::embedding_forward(m.weights().embed, ids, x);
  } else {
    // Ids outside this rank's rows look up row 0 and are cleared: the group's sum is then
    // the owner's row.
    const int64_t N = ids.numel();
    Tensor local = Tensor::empty({N}, DType::kI32);
    const int32_t* id = ids.data<int32_t>();
    int32_t* li = local.data<int32_t>();
    std::vector<int64_t> foreign;
    for (int64_t n = 0; n < N; ++n) {
      TESSERA_CHECK(id[n] >= 0 && id[n] < c.vocab_size, "embedding: ids[", n, "] = ", id[n],
                    " is out of range for vocab size ", c.vocab_size);
      const int64_t r = id[n] - d.vocab_begin;
      const bool mine = r >= 0 && r < d.vocab;
      li[n] = mine ? static_cast<int32_t>(r) : 0;
      if (!mine) foreign.push_back(n);
    }
    kernels::embedding_forward(m.weights().embed, local, x);
    for (int64_t n : foreign) x.slice(0, n, n + 1).zero();
    if (sp) {  // this rank's rows of the group's sum
      const int64_t rows = N / m.tp_shard().size, r0 = rows * m.tp_shard().rank;
      Tensor mine = Tensor::empty({rows, c.hidden_size}, DType::kF32);
      scatter_rows(m, x, mine);
      x = mine;
      if (c.arch == Arch::kGpt2)
        kernels::embedding_forward(m.weights().pos_embed, positions.slice(0, r0, r0 + rows), x, true);
      return x;
    }
    tp_reduce(m, x);
  }
  if (c.arch == Arch::kGpt2) kernels::embedding_forward(m.weights().pos_embed, positions, x, true);
  return x;
}

void embed_backward(const Model& m, const Tensor& dres_in, const Tensor& ids, const Tensor& positions,
                    Params& grads) {
  const LocalDims& d = m.dims();
  Tensor dres = dres_in;
  if (m.config().embed_scale) {  // (gemma) through the sqrt(hidden) factor
    dres = dres_in.contiguous().clone();
    scale_embedding(m.config(), dres);
  }
  if (!m.tp_comm()) {
    kernels::embedding_backward(dres, ids, grads.embed);
  } else {  // only the rows of the ids this rank holds
    const int32_t* id = ids.data<int32_t>();
    std::vector<int32_t> rows, local;
    for (int64_t n = 0; n < ids.numel(); ++n) {
      const int64_t r = id[n] - d.vocab_begin;
      if (r < 0 || r >= d.vocab) continue;
      rows.push_back(static_cast<int32_t>(n));
      local.push_back(static_cast<int32_t>(r));
    }
    if (!rows.empty()) {
      const int64_t K = static_cast<int64_t>(rows.size());
      Tensor picked = Tensor::empty({K, dres.size(1)}, DType::kF32);
      for (int64_t k = 0; k < K; ++k) picked.slice(0, k, k + 1).copy_from(dres.slice(0, rows[k], rows[k] + 1));
      kernels::embedding_backward(picked, Tensor::from_vector(local, {K}), grads.embed);
    }
  }
  if (m.config().arch == Arch::kGpt2) kernels::embedding_backward(dres, positions, grads.pos_embed);
}

Tensor head_logits(const Model& m, const Tensor& h, bool rowwise) {
  const int64_t R = h.size(0);
  const LocalDims& d = m.dims();
  Tensor local = Tensor::empty({R, d.vocab}, DType::kF32);
  if (const kernels::QuantWeight* q = m.quantized_lm_head()) {  // (whole models only: d.vocab is V)
    by_rows(h.dtype() == DType::kF32 ? h : h.to(DType::kF32), local, rowwise,
            [&](const Tensor& hi, Tensor& li) { kernels::quant_matmul(hi, *q, li); });
  } else {
    by_rows(matmul_input(h, m.bf16_mode()), local, rowwise, [&](const Tensor& hi, Tensor& li) {
      kernels::matmul(hi, m.compute_lm_head(), li, false, true);
    });
  }
  TpComm* tp = m.tp_comm();
  if (!tp) {
    softcap_logits(m.config(), local);
    return local;
  }
  Tensor full = Tensor::empty({R, m.config().vocab_size}, DType::kF32);
  tp->all_gather_columns(local, full);
  softcap_logits(m.config(), full);
  return full;
}

void softcap_logits(const ModelConfig& c, Tensor& logits) {
  if (c.final_softcap <= 0) return;
  const float cap = c.final_softcap, inv = 1.f / cap;
  float* p = logits.data<float>();
  for (int64_t i = 0; i < logits.numel(); ++i) p[i] = cap * std::tanh(p[i] * inv);
}

kernels::CrossEntropyResult head_cross_entropy(const Model& m, Tensor& logits,
                                               const Tensor& targets, float grad_scale) {
  TpComm* tp = m.tp_comm();
  if (!tp) return kernels::cross_entropy(logits, targets, nullptr, &logits, grad_scale);
  const int64_t N = logits.size(0);
  Tensor max = Tensor::empty({N}, DType::kF32);
  kernels::shard_row_max(logits, max);
  tp->all_reduce_max(max);
  Tensor sums = Tensor::empty({2 * N}, DType::kF32);
  kernels::shard_softmax_sums(logits, max, targets, m.dims().vocab_begin, m.config().vocab_size,
                              sums);
  tp->all_reduce_sum(sums);
  return kernels::shard_cross_entropy(logits, targets, m.dims().vocab_begin, max, sums, &logits,
                                      grad_scale);
}

void tp_reduce(const Model& m, Tensor& t) {
  if (TpComm* tp = m.tp_comm()) tp->all_reduce_sum(t);
}

QkvViews qkv_views(const LocalDims& d, const Tensor& qkv, int64_t B, int64_t T) {
  const int64_t W = qkv.stride(0), D = d.head_dim;
  QkvViews v;
  v.q = qkv.as_strided({B, T, d.heads, D}, {T * W, W, D, 1}, 0);
  v.k = qkv.as_strided({B, T, d.kv_heads, D}, {T * W, W, D, 1}, d.q);
  v.v = qkv.as_strided({B, T, d.kv_heads, D}, {T * W, W, D, 1}, d.q + d.kv);
  return v;
}

void block_forward(const Model& m, int64_t l, BlockState& s, const BlockOptions& opt,
                   const AttendFn& attend) {
  const auto& c = m.config();
  const LocalDims& d = m.dims();
  const LayerParams& W = m.weights().layers[l];
  // Under sequence parallelism (training) the residual stream and the norms hold this
  // rank's N of the rows; the tp region between the gather and the scatter holds all Nf.
  const bool sp = opt.save && m.sequence_parallel();
  const int64_t N = s.x.size(0), Nf = sp ? N * m.tp_shard().size : N, H = c.hidden_size;
  LayerActivations* A = opt.save;
  const bool ln = c.uses_layernorm();
  // Under `save`, h1, h2 and a feed only matmuls (here and for the weight gradients in
  // backward), so they are kept rounded as those want them: one rounding pass each, and
  // the matmuls take them as prepared (pm). Scratch operands are rounded per matmul.
  const Bf16Mode mode = m.bf16_mode(), pm = A ? prepared_mode(mode) : mode;
  auto fresh = [&](Tensor& keep, Tensor& scratch_t, int64_t rows, int64_t cols) -> Tensor& {
    if (!A) return scratch(scratch_t, rows, cols);
    keep = Tensor::empty({rows, cols}, DType::kF32);
    return keep;
  };
  auto stats = [&](Tensor& mean, Tensor& rstd, Tensor** pm_out, Tensor** pr_out) {
    *pm_out = *pr_out = nullptr;
    if (!A) return;
    if (ln) {
      mean = Tensor::empty({N}, DType::kF32);
      *pm_out = &mean;
    }
    rstd = Tensor::empty({N}, DType::kF32);
    *pr_out = &rstd;
  };
  // A row-parallel linear into s.delta (this rank's rows; through a partial (Nf, H) under sp).
  auto row_parallel = [&](const BlockLinear& spec, const Tensor& x, Bf16Mode md) -> Tensor& {
    Tensor& out = scratch(s.delta, N, H);
    if (!sp) {
      run_linear(m, spec, l, x, out, md, opt.rowwise);
      lora_forward(m, l, spec.which, x, out, opt.dropout, opt.lora_groups);  // (LoRA: tp 1 only)
    } else {
      Tensor partial = Tensor::empty({Nf, H}, DType::kF32);
      run_linear(m, spec, l, x, partial, md, opt.rowwise, &out);
    }
    return out;
  };
  // A column-parallel linear over every row of the tp region: h gathered first (sp), or
  // with sp_overlap the gather in flight while this rank's rows are multiplied.
  auto column_parallel = [&](const BlockLinear& spec, const Tensor& h, Tensor& y) {
    if (!sp) {
      run_linear(m, spec, l, h, y, pm, opt.rowwise);
      lora_forward(m, l, spec.which, h, y, opt.dropout, opt.lora_groups);
      return;
    }
    if (!m.sp_overlap()) {
      run_linear(m, spec, l, gather_rows(m, h), y, pm, opt.rowwise);
      return;
    }
    const int64_t r = m.tp_shard().rank, tp = m.tp_shard().size;
    Tensor full = Tensor::empty({Nf, h.size(1)}, h.dtype());
    const Tensor mine = h.contiguous();
    m.tp_comm()->all_gather_rows_start(mine, full);
    Tensor own = y.slice(0, r * N, (r + 1) * N);
    run_linear(m, spec, l, mine, own, pm, opt.rowwise);
    m.tp_comm()->all_gather_rows_wait();
    if (r > 0) {
      Tensor before = y.slice(0, 0, r * N);
      run_linear(m, spec, l, full.slice(0, 0, r * N), before, pm, opt.rowwise);
    }
    if (r + 1 < tp) {
      Tensor after = y.slice(0, (r + 1) * N, Nf);
      run_linear(m, spec, l, full.slice(0, (r + 1) * N, Nf), after, pm, opt.rowwise);
    }
  };
  Tensor *mean = nullptr, *rstd = nullptr;

  // Attention half.
  Tensor& h1 = fresh(A ? A->h1 : s.h, s.h, N, H);
  if (A) stats(A->mean1, A->rstd1, &mean, &rstd);
  if (s.delta.defined()) {
    add_norm_forward(c, W.norm1_w, W.norm1_b, s.x, s.delta, h1, mean, rstd);
  } else {
    norm_forward(c, W.norm1_w, W.norm1_b, s.x, h1, mean, rstd);
  }
  if (A && !A->x_in.defined()) A->x_in = s.x.clone();
  Tensor* attn_out;
  if (c.uses_mla()) {  // deepseek's latent attention (tp = 1), from h1 as the norm left it
    TESSERA_CHECK(opt.mla, "block_forward: layer ", l, " is latent attention and this pass gave no way to run it");
    attn_out = &scratch(s.delta, N, H);
    opt.mla(l, h1, *attn_out);
    tp_reduce(m, *attn_out);  // o_proj is row-parallel: this rank's heads' partial sums
  } else {
    if (A) round_matmul_input_in_place(h1, mode);
    Tensor& qkv = fresh(A ? A->qkv : s.qkv, s.qkv, Nf, d.qkv);
    column_parallel(kBlockLinears[0], h1, qkv);
    if (c.qk_norm) qk_norm_forward(m, W, qkv, A);
    apply_rope(m, qkv, *opt.positions, false);
    Tensor& att = fresh(A ? A->att : s.att, s.att, Nf, d.q);
    attend(l, qkv, att);
    attn_out = &row_parallel(kBlockLinears[1], att, mode);  // att stays exact for backward
  }
  // Gemma 2: the attention's output (and below the MLP's) is normalised before it joins the
  // residual stream; its input and statistics are kept for backward.
  auto post_norm = [&](const Tensor& w, Tensor& y, Tensor* keep_y, Tensor* keep_rstd) {
    Tensor in = y.clone(), r = Tensor::empty({y.size(0)}, DType::kF32);
    kernels::rmsnorm_forward(in, w, c.norm_eps, y, &r);
    if (keep_y) *keep_y = std::move(in), *keep_rstd = std::move(r);
  };
  if (c.sandwich_norms) post_norm(W.post_attn_norm, *attn_out, A ? &A->attn_y : nullptr, A ? &A->attn_rstd : nullptr);
  const Tensor& o = *attn_out;

  // MLP half.
  Tensor& h2 = fresh(A ? A->h2 : s.h, s.h, N, H);
  if (A) stats(A->mean2, A->rstd2, &mean, &rstd);
  add_norm_forward(c, W.norm2_w, W.norm2_b, s.x, o, h2, mean, rstd);
  if (A) {
    A->x_mid = s.x.clone();
    // Native bf16 would make h2 a bf16 tensor; a mixture-of-experts layer routes and
    // gathers f32 rows, and its products round them to bf16 as they read them.
    if (!c.layer_is_moe(l) || mode != Bf16Mode::kNative) round_matmul_input_in_place(h2, mode);
  }
  if (c.layer_is_moe(l)) {  // (tp = 1: no sequence parallelism, N rows throughout)
    Tensor& out = scratch(s.delta, N, H);
    const MoeWeights& E = m.compute_moe(l);
    TESSERA_CHECK(m.tp_shard().ep_size == 1 || m.ep_comm(), "an expert-parallel shard runs with its ep group "
                  "(Model::set_ep_comm)");
    if (A) {
      MoeSpec spec = moe_spec(c);
      spec.capacity_factor = m.moe_capacity_factor();
      moe_forward(spec, E, h2, out, &A->moe, m.ep_comm());
    } else if (m.ep_comm()) {
      // Inference under ep (lockstep serving: every rank holds the same tokens): each rank
      // routes its share of the rows, the outputs are all-gathered.
      std::vector<int64_t> load;
      moe_forward_replicated(moe_spec(c), E, h2, out, *m.ep_comm(), &load);
      m.count_expert_load(load);
    } else {  // inference: the routing is counted for the serving metrics
      by_rows(h2, out, opt.rowwise, [&](const Tensor& hi, Tensor& oi) {
        MoeSaved routed;
        moe_forward(moe_spec(c), E, hi, oi, &routed);
        m.count_expert_load(routed.routing);
      });
    }
    const int64_t F = layer_ffn(m, l);
    if (F == 0) return;  // no shared expert (mixtral)
    // The shared expert(s), every token: out += g * down(swiglu(up(h2))), with qwen2_moe's
    // gate g = sigmoid(h2 . shared_expert_gate), deepseek's g = 1.
    Tensor& u = fresh(A ? A->u : s.u, s.u, N, 2 * F);
    run_linear(m, kBlockLinears[2], l, h2, u, pm, opt.rowwise);
    Tensor& a = fresh(A ? A->a : s.a, s.a, N, F);
    mlp_activation(m, u, a);
    if (A) round_matmul_input_in_place(a, mode);
    Tensor y = Tensor::empty({N, H}, DType::kF32);
    run_linear(m, kBlockLinears[3], l, a, y, pm, opt.rowwise);
    if (!c.shared_expert) {
      kernels::add_inplace(out, y);
      return;
    }
    Tensor z = Tensor::empty({N, 1}, DType::kF32);
    by_rows(h2, z, opt.rowwise, [&](const Tensor& hi, Tensor& zi) { kernels::matmul(hi, E.shared_gate, zi, false, true); });
    const float* yp = y.data<float>();
    const float* zp = z.data<float>();
    float* op = out.data<float>();
    for (int64_t n = 0; n < N; ++n) {
      const float g = 1.f / (1.f + std::exp(-zp[n]));
      for (int64_t k = 0; k < H; ++k) op[n * H + k] += g * yp[n * H + k];
    }
    if (A) {
      A->shared_y = y;
      A->shared_z = z;
    }
    return;
  }
  const int64_t F = layer_ffn(m, l), U = c.gated_mlp() ? 2 * F : F;
  Tensor& u = fresh(A ? A->u : s.u, s.u, Nf, U);
  column_parallel(kBlockLinears[2], h2, u);
  Tensor& a = fresh(A ? A->a : s.a, s.a, Nf, F);
  mlp_activation(m, u, a);
  if (A) round_matmul_input_in_place(a, mode);
  Tensor& y = row_parallel(kBlockLinears[3], a, pm);
  if (c.sandwich_norms) post_norm(W.post_mlp_norm, y, A ? &A->mlp_y : nullptr, A ? &A->mlp_rstd : nullptr);
}

void final_norm_forward(const Model& m, BlockState& s, Tensor& out, Tensor* mean, Tensor* rstd) {
  const auto& c = m.config();
  const Params& w = m.weights();
  if (s.delta.defined())
    add_norm_forward(c, w.final_norm_w, w.final_norm_b, s.x, s.delta, out, mean, rstd);
  else
    norm_forward(c, w.final_norm_w, w.final_norm_b, s.x, out, mean, rstd);
  s.delta = Tensor();
}

}  // namespace tessera::model
