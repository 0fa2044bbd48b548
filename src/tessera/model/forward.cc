// Forward passes: inference with a KV cache, and the training forward that saves
// activations.
#include <cmath>

#include "tessera/kernels/activation.h"
#include "tessera/kernels/attention.h"
#include "tessera/kernels/cross_entropy.h"
#include "tessera/kernels/elementwise.h"
#include "tessera/kernels/embedding.h"
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/rope.h"
#include "tessera/model/activations.h"
#include "tessera/model/block.h"
#include "tessera/model/layer_ops.h"
#include "tessera/model/lora_ops.h"

namespace tessera::model {

Tensor make_positions(int64_t B, int64_t T, int64_t start) {
  Tensor p = Tensor::empty({B * T}, DType::kI32);
  int32_t* d = p.data<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) d[b * T + t] = static_cast<int32_t>(start + t);
  return p;
}

namespace {

// Latent attention over a dense per-sequence cache: this step's T rows appended at
// cache.length, then attended with everything cached before them.
std::function<void(int64_t, const Tensor&, Tensor&)> dense_cache_mla(const Model& m, KVCache& cache,
                                                                   const Tensor& positions) {
  return [&m, &cache, &positions](int64_t l, const Tensor& h1, Tensor& out) {
    const MlaSpec spec = mla_spec(m);
    const MlaWeights& W = m.weights().layers[l].mla;
    const int64_t T = h1.size(0), L = cache.length;
    Tensor q, rows, att = Tensor::empty({T, spec.heads * spec.v_head}, DType::kF32);
    mla_project(spec, W, h1, positions, q, rows);
    const Tensor kc = cache.k[l].view({cache.capacity, mla_cache_row(spec)});
    kc.slice(0, L, L + T).copy_from(rows);
    mla_attend(spec, W, q, kc, L, att);
    mla_output(W, att, out);
  };
}

}  // namespace

Tensor Model::forward(const std::vector<int32_t>& tokens, KVCache& cache, bool all_logits, Tensor* hidden) const {
  const auto& c = config_;
  const int64_t T = static_cast<int64_t>(tokens.size());
  TESSERA_CHECK(T > 0, "forward: no tokens");
  const int64_t L = cache.length;
  TESSERA_CHECK(L + T <= cache.capacity, "forward: ", L + T, " tokens exceed the KV cache capacity ",
                cache.capacity);
  TESSERA_CHECK(L + T <= c.max_position_embeddings || c.uses_rope(), "forward: position ", L + T - 1,
                " is past max_position_embeddings ", c.max_position_embeddings);
  TESSERA_CHECK(static_cast<int64_t>(cache.k.size()) >= c.num_layers,
                "forward: KV cache has ", cache.k.size(), " layers, model has ", c.num_layers);
  const LocalDims& d = dims_;
  const Tensor ids = Tensor::from_vector(tokens, {T});
  const Tensor positions = make_positions(1, T, L);
  // Attention over the cache: this step's k, v appended, then every cached position read.
  const AttendFn attend = [&](int64_t l, const Tensor& qkv, Tensor& att) {
    const int64_t KV = d.kv;
    Tensor kc = cache.k[l], vc = cache.v[l];
    kc.slice(0, L, L + T).view({T, KV}).copy_from(qkv.slice(1, d.q, d.q + KV));
    vc.slice(0, L, L + T).view({T, KV}).copy_from(qkv.slice(1, d.q + KV, d.q + 2 * KV));
    const QkvViews views = qkv_views(d, qkv, 1, T);
    const Tensor k = kc.as_strided({1, L + T, d.kv_heads, d.head_dim},
                                   {cache.capacity * KV, KV, d.head_dim, 1});
    const Tensor v = vc.as_strided({1, L + T, d.kv_heads, d.head_dim},
                                   {cache.capacity * KV, KV, d.head_dim, 1});
    Tensor att4 = att.view({1, T, d.heads, d.head_dim});
    kernels::attention_forward(views.q, k, v, att4, nullptr, attention_params(c, L, l));
  };
  BlockState s;
  s.x = embed_tokens(*this, ids, positions);
  BlockOptions opt;
  opt.positions = &positions;
  opt.mla = dense_cache_mla(*this, cache, positions);
  for (int64_t l = 0; l < c.num_layers; ++l) block_forward(*this, l, s, opt, attend);
  cache.length = L + T;
  Tensor h = Tensor::empty({T, c.hidden_size}, DType::kF32);
  final_norm_forward(*this, s, h, nullptr, nullptr);
  if (hidden) *hidden = h;
  return head_logits(*this, all_logits ? h : h.slice(0, T - 1, T), false);
}

Tensor Model::mtp_forward(const std::vector<int32_t>& next, const Tensor& hidden, KVCache& cache,
                          Tensor* out_hidden) const {
  const auto& c = config_;
  const int64_t n = static_cast<int64_t>(next.size()), L = cache.length, H = c.hidden_size;
  TESSERA_CHECK(c.mtp_layers > 0 && static_cast<int64_t>(cache.k.size()) > c.num_layers, "mtp_forward: ",
                c.model_type, " has no multi-token prediction module (or the cache is not its)");
  TESSERA_CHECK(n > 0 && hidden.dim() == 2 && hidden.size(0) == n && hidden.size(1) == H, "mtp_forward: ", n,
                " tokens with hidden states ", hidden.describe());
  TESSERA_CHECK(L + n <= cache.capacity, "mtp_forward: ", L + n, " positions exceed the cache's ", cache.capacity);
  const MtpParams& P = weights_.mtp;
  const Tensor ids = Tensor::from_vector(next, {n}), positions = make_positions(1, n, cache.first_position + L);
  Tensor cat = Tensor::empty({n, 2 * H}, DType::kF32);
  const Tensor emb = embed_tokens(*this, ids, positions);
  Tensor en = cat.slice(1, 0, H), hn = cat.slice(1, H, 2 * H);
  norm_forward(c, P.enorm, Tensor(), emb, en, nullptr, nullptr);
  norm_forward(c, P.hnorm, Tensor(), hidden.contiguous(), hn, nullptr, nullptr);
  BlockState s;
  s.x = Tensor::empty({n, H}, DType::kF32);
  kernels::matmul(cat, P.eh_proj, s.x, false, true);
  BlockOptions opt;
  opt.positions = &positions;
  opt.mla = dense_cache_mla(*this, cache, positions);
  block_forward(*this, c.num_layers, s, opt, nullptr);
  cache.length = L + n;
  kernels::add_inplace(s.x, s.delta);
  if (out_hidden) *out_hidden = s.x.slice(0, n - 1, n).clone();
  Tensor h = Tensor::empty({1, H}, DType::kF32);
  norm_forward(c, P.head_norm, Tensor(), s.x.slice(0, n - 1, n), h, nullptr, nullptr);
  return head_logits(*this, h, false);
}

Tensor Model::forward_tokens(const Tensor& ids, const Tensor& positions, KvAttention& kv,
                             const std::vector<int64_t>& logit_rows, bool batch_invariant, Tensor* hidden,
                             const std::vector<int32_t>* row_adapters) const {
  const auto& c = config_;
  TESSERA_CHECK(ids.dtype() == DType::kI32 && ids.dim() == 1 && positions.dtype() == DType::kI32 &&
                    positions.shape() == ids.shape(),
                "forward_tokens: ids and positions must be i32 (N), got ", ids.describe(), " and ",
                positions.describe());
  const int64_t T = ids.numel();
  TESSERA_CHECK(T > 0, "forward_tokens: no tokens");
  const int64_t H = c.hidden_size;
  const Tensor pos = positions.contiguous();
  for (int64_t i = 0; i < T; ++i)
    TESSERA_CHECK(pos.data<int32_t>()[i] >= 0 &&
                      (c.uses_rope() || pos.data<int32_t>()[i] < c.max_position_embeddings),
                  "forward_tokens: position ", pos.data<int32_t>()[i], " out of range");
  const bool rows = batch_invariant;
  const LocalDims& d = dims_;
  const AttendFn attend = [&](int64_t l, const Tensor& qkv, Tensor& att) {
    const int64_t Wd = qkv.stride(0), D = d.head_dim;
    Tensor out = att.view({T, d.heads, D});
    kv.attend(l, qkv.as_strided({T, d.heads, D}, {Wd, D, 1}, 0),
              qkv.as_strided({T, d.kv_heads, D}, {Wd, D, 1}, d.q),
              qkv.as_strided({T, d.kv_heads, D}, {Wd, D, 1}, d.q + d.kv), out);
  };
  BlockState s;
  s.x = embed_tokens(*this, ids.contiguous(), pos);
  BlockOptions opt;
  opt.positions = &pos;
  opt.rowwise = rows;
  LoraGroups lora_groups;
  if (row_adapters) {
    TESSERA_CHECK(static_cast<int64_t>(row_adapters->size()) == T, "forward_tokens: ", row_adapters->size(),
                  " row adapters for ", T, " tokens");
    TESSERA_CHECK(!lora_, "forward_tokens: row adapters with set_lora's adapter set; use one or the other");
    lora_groups = group_rows_by_adapter(*row_adapters, static_cast<int64_t>(lora_bank_.size()));
    opt.lora_groups = &lora_groups;
  }
  const MlaSpec spec = mla_spec(*this);
  opt.mla = [&](int64_t l, const Tensor& h1, Tensor& out) {  // each sequence over its cached latent rows
    const MlaWeights& W = weights_.layers[l].mla;
    Tensor q, latent, att = Tensor::empty({T, spec.heads * spec.v_head}, DType::kF32);
    mla_project(spec, W, h1, pos, q, latent);
    kv.attend_latent(l, latent, [&](int64_t q_begin, int64_t q_len, const Tensor& cached) {
      Tensor a = att.slice(0, q_begin, q_begin + q_len);
      mla_attend(spec, W, q.slice(0, q_begin, q_begin + q_len), cached, cached.size(0) - q_len, a);
    });
    mla_output(W, att, out);
  };
  for (int64_t l = 0; l < c.num_layers; ++l) block_forward(*this, l, s, opt, attend);
  Tensor h = Tensor::empty({T, H}, DType::kF32);
  final_norm_forward(*this, s, h, nullptr, nullptr);
  if (hidden) *hidden = h;
  const int64_t R = static_cast<int64_t>(logit_rows.size());
  Tensor hl = Tensor::empty({std::max<int64_t>(R, 1), H}, DType::kF32);
  for (int64_t i = 0; i < R; ++i) {
    TESSERA_CHECK(logit_rows[i] >= 0 && logit_rows[i] < T, "forward_tokens: logit row ",
                  logit_rows[i], " out of range [0, ", T, ")");
    hl.slice(0, i, i + 1).copy_from(h.slice(0, logit_rows[i], logit_rows[i] + 1));
  }
  if (R == 0) return Tensor::empty({0, c.vocab_size}, DType::kF32);
  return head_logits(*this, hl.slice(0, 0, R), rows);
}

namespace {

// The training attention: every position of each sequence, log-sum-exp kept for backward.
void train_attention(const Model& m, int64_t l, const Activations& acts, const Tensor& qkv, Tensor& att,
                     Tensor& lse, CpSaved& cp) {
  const LocalDims& d = m.dims();
  const int64_t B = acts.B, T = acts.T;
  const QkvViews v = qkv_views(d, qkv, B, T);
  Tensor att4 = att.view({B, T, d.heads, d.head_dim});
  if (m.cp_comm()) {  // context parallelism: the attention crosses the cp group's tokens
    cp_attention_forward(*m.cp_comm(), m.cp_method(), v.q, v.k, v.v, att4, lse, cp,
                         attention_params(m.config(), 0, l).scale);
    return;
  }
  lse = Tensor::empty({B, d.heads, T}, DType::kF32);
  kernels::attention_forward(v.q, v.k, v.v, att4, &lse, train_attention_params(m, l, acts));
}

}  // namespace

kernels::AttentionParams train_attention_params(const Model& m, int64_t l, const Activations& acts) {
  kernels::AttentionParams p = attention_params(m.config(), 0, l);
  p.bf16_products = m.bf16_mode() == Bf16Mode::kNative;  // as autocast multiplies attention
  if (acts.packed) {
    p.doc_positions = acts.positions.data<int32_t>();
    p.doc_positions_stride = acts.T;
  }
  return p;
}

void check_packed_positions(const Tensor& positions, int64_t B, int64_t T) {
  TESSERA_CHECK(positions.dtype() == DType::kI32 && positions.shape() == (Shape{B, T}),
                "forward: packed positions must be i32 (", B, ", ", T, ") like the ids, got ",
                positions.describe());
  const Tensor p = positions.contiguous();
  const int32_t* v = p.data<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int32_t x = v[b * T + t];
      TESSERA_CHECK(x == 0 || (t > 0 && x == v[b * T + t - 1] + 1), "forward: packed positions of row ", b,
                    ", token ", t, " is ", x, "; each document's tokens must be numbered 0, 1, 2, ...");
    }
}

void layer_forward_train(const Model& m, int64_t l, const Activations& acts, BlockState& s,
                         LayerActivations& A, bool keep_attention) {
  BlockOptions opt;
  opt.positions = &acts.positions;
  opt.save = &A;
  opt.dropout = acts.train;
  opt.mla = [&](int64_t, const Tensor& h1, Tensor& out) {
    mla_forward(mla_spec(m), m.weights().layers[l].mla, h1, acts.positions, acts.B, acts.T, out, &A.mla);
  };
  block_forward(m, l, s, opt, [&](int64_t, const Tensor& qkv, Tensor& att) {
    train_attention(m, l, acts, qkv, att, A.lse, A.cp);
  });
  if (!keep_attention && !m.config().uses_mla()) {  // selective checkpointing: recomputed in the backward pass
    A.att = Tensor();
    A.lse = Tensor();
    A.cp = CpSaved();
  } else if (A.cp.q.defined()) {
    // Ulysses keeps its heads' whole-sequence q, k, v for the backward: the layer's own
    // tokens' q, k, v would be the same bytes again, and nothing reads them.
    A.qkv = Tensor();
  }
}

void recompute_attention(const Model& m, int64_t l, const Activations& acts, LayerActivations& A) {
  if (m.config().uses_mla()) return;  // latent attention keeps what it saved
  A.att = Tensor::empty({acts.B * acts.T, m.dims().q}, DType::kF32);
  train_attention(m, l, acts, A.qkv, A.att, A.lse, A.cp);
}

Tensor forward_train(const Model& m, const Tensor& ids2d, Activations& acts, const Tensor& positions) {
  return forward_train_chunk(m, 0, ids2d, Tensor(), acts, positions);
}

Tensor forward_train_chunk(const Model& m, int chunk, const Tensor& ids2d, const Tensor& input,
                           Activations& acts, const Tensor& positions) {
  const auto& c = m.config();
  TESSERA_CHECK(ids2d.dim() == 2 && ids2d.dtype() == DType::kI32,
                "forward: token ids must be an i32 (batch, seq) tensor, got ", ids2d.describe());
  const int64_t B = ids2d.size(0), T = ids2d.size(1), N = B * T;
  TESSERA_CHECK(T <= c.max_position_embeddings || c.uses_rope(), "forward: sequence length ", T,
                " exceeds max_position_embeddings ", c.max_position_embeddings);
  const int64_t H = c.hidden_size;
  const PpStage& stage = m.pp_stage();
  TESSERA_CHECK(chunk >= 0 && chunk < stage.num_chunks(), "forward: chunk ", chunk,
                " is not one of this stage's ", stage.num_chunks());
  const auto [l0, l1] = stage.layers(chunk, c.num_layers);
  const bool first = stage.first_chunk(chunk), last = stage.last_chunk(chunk);
  acts.B = B;
  acts.T = T;
  acts.chunk = chunk;
  acts.ids = ids2d.contiguous().view({N});
  acts.packed = positions.defined();
  if (acts.packed) {  // rows of several documents: their own positions, no attention across them
    TESSERA_CHECK(!m.cp_comm(), "packed sequences (one row of several documents) with context parallelism "
                  "are not supported yet");
    TESSERA_CHECK(!c.uses_mla(), "packed sequences (one row of several documents) over ", c.model_type,
                  "'s latent attention are not supported yet");
    TESSERA_CHECK(m.mtp_loss_weight() <= 0, "packed sequences (one row of several documents) with the "
                  "multi-token prediction module are not supported yet (set training.mtp_loss_weight = 0)");
    check_packed_positions(positions, B, T);
    acts.positions = positions.contiguous().clone().view({N});
  } else {
    acts.positions = make_positions(B, T, 0);
  }
  if (m.cp_comm()) {  // this rank's tokens sit at their places in the whole sequences
    const auto pos = cp_positions(m.cp_method(), m.cp_comm()->rank(), m.cp_comm()->size(), T);
    int32_t* p = acts.positions.data<int32_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) p[b * T + t] = static_cast<int32_t>(pos[t]);
  }
  acts.layers.assign(c.num_layers, LayerActivations{});
  acts.moe_balance.reset();
  if (c.is_moe()) acts.moe_balance.emplace(c.num_experts);
  TESSERA_CHECK(!c.uses_mla() || !m.cp_comm(), "context parallelism over ", c.model_type,
                "'s latent attention is not supported yet");
  TESSERA_CHECK(c.sliding_window == 0 || !m.cp_comm(), "context parallelism with sliding-window attention "
                "(sliding_window ", c.sliding_window, ") is not supported yet");
  TESSERA_CHECK(!c.rope_scaling || c.rope_scaling->type != "dynamic" || !m.cp_comm(), "context parallelism "
                "with dynamic NTK rope scaling is not supported (each rank sees only its share of a sequence)");
  const bool ln = c.uses_layernorm();
  const Recompute rc = m.recompute();
  const bool sp = m.sequence_parallel();
  const int64_t tp = m.tp_shard().size;
  TESSERA_CHECK(!sp || N % tp == 0, "sequence parallelism: batch x sequence = ", N,
                " tokens do not split evenly over tp = ", tp, " ranks");
  const int64_t Nl = sp ? N / tp : N;  // rows of the residual stream on this rank

  TrainHooks* hooks = m.train_hooks();
  BlockState s;
  // DeepSeek-V3's multi-token prediction module trains with the whole model (its head).
  if (m.mtp_loss_weight() > 0 && stage.whole()) acts.mtp = std::make_shared<MtpActivations>();
  if (first) {
    if (hooks) hooks->acquire(0);
    s.x = embed_tokens(m, acts.ids, acts.positions, sp);
    if (acts.mtp) mtp_embed(m, acts, *acts.mtp);
    if (hooks) hooks->release(0);
  } else {
    TESSERA_CHECK(input.defined() && input.dtype() == DType::kF32 && input.dim() == 2 &&
                      input.size(0) == Nl && input.size(1) == H,
                  "forward: chunk ", chunk, " expects the previous stage's (", Nl, ", ", H,
                  ") f32 residual stream, got ", input.defined() ? input.describe() : "nothing");
    s.x = input.contiguous().clone();
  }
  // Each MoE layer's routing, for the balancing losses (DeepSeek-V2's per layer and per
  // sequence: the batch's B sequences are the groups).
  auto count_routing = [&](const MoeRouting& r) {
    if (c.trains_seq_aux())
      acts.moe_balance->add(r, c.seq_aux ? acts.B : 1);
    else
      acts.moe_balance->add(r);
  };
  for (int64_t l = l0; l < l1; ++l) {
    const int unit = static_cast<int>(l) + 1;
    if (hooks) hooks->acquire(unit);
    LayerActivations& A = acts.layers[l];
    if (rc == Recompute::kFull) {  // keep only the layer input; the rest is scratch
      LayerActivations scratch;
      layer_forward_train(m, l, acts, s, scratch, false);
      A.x_in = std::move(scratch.x_in);
      if (acts.moe_balance && c.layer_is_moe(l)) count_routing(scratch.moe.routing);
    } else {
      layer_forward_train(m, l, acts, s, A, rc == Recompute::kNone);
      if (acts.moe_balance && c.layer_is_moe(l)) count_routing(A.moe.routing);
    }
    if (hooks) hooks->release(unit);
  }
  if (!last) {  // to the next virtual stage: the residual stream with the last block's output
    if (s.delta.defined()) kernels::add_inplace(s.x, s.delta);
    return s.x;
  }
  // The head stays acquired: the caller runs lm_head and releases it (head_units).
  if (hooks) hooks->acquire(m.num_units() - 1);
  if (ln) acts.meanf = Tensor::empty({Nl}, DType::kF32);
  acts.rstdf = Tensor::empty({Nl}, DType::kF32);
  acts.hf = Tensor::empty({Nl, H}, DType::kF32);
  final_norm_forward(m, s, acts.hf, ln ? &acts.meanf : nullptr, &acts.rstdf);
  acts.x_final = s.x;
  if (acts.mtp) {  // (from hf as the norm left it); its routing counted after the blocks'
    mtp_forward(m, acts, acts.hf, *acts.mtp);
    if (acts.moe_balance && c.layer_is_moe(c.num_layers)) acts.moe_balance->add(acts.mtp->layer.moe.routing);
  }
  round_matmul_input_in_place(acts.hf, m.bf16_mode());  // feeds only the head's matmuls
  return sp ? gather_rows(m, acts.hf) : acts.hf;  // the head sees every row
}

Model::LossResult Model::loss_chunk(ChunkPass& pass, const Tensor& targets) const {
  TESSERA_CHECK(pass.acts && stage_.last_chunk(pass.chunk) && pass.head_input.defined(),
                "loss_chunk: needs the forward of the last virtual stage");
  const int64_t N = pass.acts->B * pass.acts->T;
  TESSERA_CHECK(targets.dtype() == DType::kI32 && targets.numel() == N, "loss_chunk: targets ",
                targets.describe(), " must be i32 with the ", N, " tokens of the forward");
  const bool tied = hooks_ && config_.tie_word_embeddings;
  if (tied) hooks_->acquire(0);
  Tensor logits = head_logits(*this, pass.head_input, false);
  if (tied) hooks_->release(0);
  if (hooks_) hooks_->release(num_units() - 1);
  LossResult r;
  // head_logits gives every vocabulary column on every rank: the plain cross-entropy.
  const auto ce = kernels::cross_entropy(logits, targets.contiguous().view({N}), nullptr, nullptr, 1.f);
  r.loss = ce.loss_sum;
  r.count = ce.count;
  pass.acts.reset();
  pass.head_input = Tensor();
  return r;
}

Tensor Model::forward_batch(const Tensor& ids, const Tensor& positions) const {
  TESSERA_CHECK(stage_.whole(), "forward_batch runs the whole model, not pipeline stage ",
                stage_.rank, " (", stage_.describe(), ")");
  Activations acts;
  acts.train = false;  // evaluation: no dropout
  const Tensor hf = forward_train(*this, ids, acts, positions);
  const bool tied = hooks_ && config_.tie_word_embeddings;
  if (tied) hooks_->acquire(0);
  Tensor logits = head_logits(*this, hf, false);
  if (tied) hooks_->release(0);
  if (hooks_) hooks_->release(num_units() - 1);
  return logits.view({acts.B, acts.T, config_.vocab_size});
}

}  // namespace tessera::model
