// Multi-head latent attention (DeepSeek-V2/V3's DeepseekV2Attention): queries through an
// optional low-rank compression (q_a_proj -> RMSNorm -> q_b_proj, or q_proj), keys and
// values through a shared low-rank latent (kv_a_proj_with_mqa -> the latent c, RMSNorm ->
// kv_b_proj -> per-head k_nope and v) plus one decoupled RoPE key shared by every head.
// Scores are q_nope . k_nope + q_pe . k_pe over qk_nope + qk_rope dims; values have
// v_head_dim.
//
// Two ways to run it:
//   mla_forward / mla_backward: the training passes over B sequences of T tokens (k and v
//     made per head, causal attention by the flash kernel).
//   mla_decode: inference over a cache holding only each token's normalised latent c and
//     its rope key (kv_lora_rank + qk_rope_head_dim numbers per token and layer), with the
//     absorbed weights: q_nope is folded into kv_b's key rows (scores against c directly)
//     and the attention-weighted latent through kv_b's value rows, so no per-head k or v is
//     ever made. The same outputs as mla_forward.
// RoPE rotates adjacent pairs (the interleaved layout DeepSeek's checkpoints use: its
// apply_rotary_pos_emb de-interleaves before rotate_half; the scores are the same).
// Internal to model/ (the block will call it for deepseek_v2 / deepseek_v3 layers).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "tessera/tensor/tensor.h"

namespace tessera::model {

struct MlaSpec {
  int64_t heads = 0;
  int64_t q_lora_rank = 0;  // 0: q_proj straight from the hidden state
  int64_t kv_lora_rank = 0;
  int64_t qk_nope = 0, qk_rope = 0, v_head = 0;
  double rope_theta = 10000.0;
  float norm_eps = 1e-6f;
  float scale = 0.f;  // 0: 1 / sqrt(qk_nope + qk_rope)
  // Scaled RoPE (DeepSeek's YaRN, model/rope_scaling.h): the rope/2 frequencies (empty:
  // rope_theta^(-2i/rope)) and the factor on cos and sin.
  std::vector<double> inv_freq;
  double rope_mscale = 1.0;
  int64_t qk_dim() const { return qk_nope + qk_rope; }
  float softmax_scale() const;
};

// One layer's weights in Hugging Face's shapes (f32).
struct MlaWeights {
  Tensor q_proj;                  // (heads qk, H) when q_lora_rank == 0
  Tensor q_a, q_a_norm, q_b;      // (q_lora, H), (q_lora), (heads qk, q_lora)
  Tensor kv_a;                    // (kv_lora + rope, H): kv_a_proj_with_mqa
  Tensor kv_a_norm;               // (kv_lora)
  Tensor kv_b;                    // (heads (nope + v), kv_lora): per head k_nope rows, then v rows
  Tensor o;                       // (H, heads v)
};
// Zero-filled gradients shaped like w.
MlaWeights mla_zero_grads(const MlaWeights& w);

// What mla_backward needs of its forward.
struct MlaSaved {
  int64_t B = 0, T = 0;
  Tensor x, positions;
  Tensor qa, qa_rstd, qa_n;   // the query latent, its norm's statistics and output (q_lora > 0)
  Tensor ckv, c_rstd, c_n;    // kv_a's output (latent | raw rope key), the latent's norm
  Tensor kv;                  // (N, heads (nope + v))
  Tensor qp, kp, vp, outp, lse;  // the attention's padded (B, T, heads, D) operands, output, lse
  Tensor att;                 // (N, heads v)
};

// out (N, H) for x (N, H) f32, N = B T (B sequences of T tokens, positions (N) i32).
void mla_forward(const MlaSpec& spec, const MlaWeights& w, const Tensor& x, const Tensor& positions, int64_t B,
                 int64_t T, Tensor& out, MlaSaved* save);
// dx (N, H) overwritten; grads (shaped as w) accumulated into.
// Tensor parallelism (the heads split over the ranks: q_proj / q_b and kv_b by rows, o by
// columns; q_a, kv_a and their norms replicated): `reduce` sums a tensor over the group.
// The gradients of the replicated latents are summed before the replicated weights see
// them, so their gradients and dx come out whole on every rank.
using MlaReduce = std::function<void(Tensor&)>;
void mla_backward(const MlaSpec& spec, const MlaWeights& w, const MlaSaved& saved, const Tensor& dout, Tensor& dx,
                  MlaWeights& grads, const MlaReduce& reduce = {});

// Inference, in two steps, so the cache can live anywhere (a dense buffer, a paged pool):
// mla_project gives the queries q (n, heads qk) of x (n, H) at `positions` (i32, n), RoPE
// applied, and each token's cache row (n, kv_lora + rope): its normalised latent, then its
// rope key. mla_attend then runs queries of one sequence, the first at position `past`,
// over that sequence's cached rows (at least past + n of them, f32, any row stride, unit
// column stride) with the absorbed weights: q_nope is folded into kv_b's key rows (scores
// against the latent directly) and the attention-weighted latent through kv_b's value rows,
// so no per-head k or v is ever made. att (n, heads v) is overwritten; o_proj is the
// caller's (mla_output). The same outputs as mla_forward.
int64_t mla_cache_row(const MlaSpec& spec);  // kv_lora + rope
void mla_project(const MlaSpec& spec, const MlaWeights& w, const Tensor& x, const Tensor& positions, Tensor& q,
                 Tensor& rows);
void mla_attend(const MlaSpec& spec, const MlaWeights& w, const Tensor& q, const Tensor& cached, int64_t past,
                Tensor& att);
// out (n, H) = att @ o^T.
void mla_output(const MlaWeights& w, const Tensor& att, Tensor& out);

// One sequence's latent cache: per token its row (normalised latent, then rope key).
struct MlaCache {
  Tensor rows;  // (capacity, kv_lora + rope)
  int64_t length = 0;
  static MlaCache create(const MlaSpec& spec, int64_t capacity);
};
// Runs x (n, H), the sequence's next n tokens at positions length .. length + n - 1:
// appends their rows to the cache and returns their outputs in out (n, H).
void mla_decode(const MlaSpec& spec, const MlaWeights& w, const Tensor& x, MlaCache& cache, Tensor& out);

// KV cache bytes per token and layer: MLA's latent and rope key, against the same
// attention's per-head keys (qk dims) and values (v dims) as multi-head attention caches them.
int64_t mla_cache_bytes_per_token(const MlaSpec& spec, int64_t bytes_per_value);
int64_t mha_cache_bytes_per_token(const MlaSpec& spec, int64_t bytes_per_value);

}  // namespace tessera::model
