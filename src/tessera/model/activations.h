// Activations the training forward saves for the backward pass. Internal to model/.
#pragma once
#include <memory>
#include <optional>
#include <vector>

#include "tessera/model/model.h"

namespace tessera::model {

struct LayerActivations {
  Tensor x_in;          // (N, H) residual stream entering the layer
  Tensor mean1, rstd1;  // (N)
  Tensor h1;            // (N, H) norm1 output
  Tensor qkv;           // (N, Q + 2 KV) after RoPE
  Tensor qk_raw;        // qwen3: (N, Q + KV) q and k before their norms
  Tensor qk_rstd;       // qwen3: (heads + kv heads, N) each head's norm statistics
  Tensor attn_y, attn_rstd;  // gemma2: (N, H) the attention's output before its post-norm, (N)
  Tensor mlp_y, mlp_rstd;    // gemma2: the MLP's output before its post-norm
  Tensor att;           // (N, Q) attention output
  Tensor lse;           // (B, heads, T)
  Tensor x_mid;         // (N, H) residual after attention
  Tensor mean2, rstd2;  // (N)
  Tensor h2;            // (N, H) norm2 output
  Tensor u;             // (N, 2F | F) MLP up projection (gate | up)
  Tensor a;             // (N, F) activation output
  MoeSaved moe;         // a mixture-of-experts layer's routing and expert activations
  Tensor shared_y;      // (N, H) qwen2_moe: the shared expert's output before its gate
  Tensor shared_z;      // (N, 1) and its gate's logit
  CpSaved cp;           // context parallelism: what its attention's backward needs
  MlaSaved mla;         // a latent-attention layer's (deepseek): kept under selective recompute too
};

// DeepSeek-V3's multi-token prediction module in a training pass (Model::mtp_loss_weight
// > 0): position t predicts token t + 2 from the main model's final hidden state at t and
// the embedding of token t + 1.
struct MtpActivations {
  Tensor ids;             // (N) i32: each position's next token (0 past the end of its sequence)
  Tensor emb;             // (N, H) their embeddings
  Tensor h_in;            // (N, H) the main model's final hidden state (hnorm's input)
  Tensor e_rstd, h_rstd;  // (N): enorm's and hnorm's statistics
  Tensor cat;             // (N, 2H): [enorm(emb) | hnorm(hf)], eh_proj's input
  LayerActivations layer; // the module's block (layer num_layers)
  Tensor x_out, rstd;     // (N, H) the block's output residual; (N) shared_head.norm's statistics
  Tensor hm;              // (N, H) shared_head.norm's output, the head's input
};

struct Activations {
  int64_t B = 0, T = 0;
  int chunk = 0;     // the pipeline chunk the forward ran (0: the whole model)
  Tensor ids;        // (N) i32
  Tensor positions;  // (N) i32
  bool packed = false;  // rows of several documents: positions restart at each (Model::forward_backward)
  bool train = true;    // a pass that trains (LoRA dropout on), not an evaluation (forward_batch)
  std::vector<LayerActivations> layers;
  Tensor x_final;           // (N, H)
  Tensor meanf, rstdf;      // (N)
  Tensor hf;                // (N, H) final norm output
  // Mixture-of-experts models: every layer's routing load, for the balancing loss (kept
  // whatever the layers keep, so a recomputing backward sees the forward's).
  std::optional<MoeBalance> moe_balance;
  std::shared_ptr<MtpActivations> mtp;  // when the pass trains the multi-token prediction module
};

// The multi-token prediction module's forward (activations.h MtpActivations): ids and
// embeddings while the embeddings are at hand, the rest from the final hidden state hf.
void mtp_embed(const Model& m, const Activations& acts, MtpActivations& mtp);
void mtp_forward(const Model& m, const Activations& acts, const Tensor& hf, MtpActivations& mtp);

// (B * T) i32: start, start + 1, ... for each of the B sequences of T tokens.
Tensor make_positions(int64_t B, int64_t T, int64_t start);

// Training-path forward; fills `acts` and returns the final hidden states hf (N, H).
// Under sequence parallelism the residual-stream activations hold this rank's rows
// (acts.hf too); the returned hf is every row.
// What each layer keeps follows m.recompute(): everything (kNone), everything but the
// attention output and log-sum-exp (kSelective), or only x_in (kFull).
// positions: packed rows (Model::forward_backward), or undefined.
Tensor forward_train(const Model& m, const Tensor& ids, Activations& acts,
                     const Tensor& positions = Tensor());
// The same for one chunk of a pipeline stage (Model::forward_chunk): starts from `input`
// past virtual stage 0, and returns the chunk's output residual stream unless it is the
// last virtual stage (then hf, as above).
Tensor forward_train_chunk(const Model& m, int chunk, const Tensor& ids, const Tensor& input,
                           Activations& acts, const Tensor& positions = Tensor());
// The attention of layer l in a training pass: attention_params, plus the document masks
// of packed rows.
kernels::AttentionParams train_attention_params(const Model& m, int64_t l, const Activations& acts);
// Checks packed-row positions (B, T) i32: each row starts a document at 0 and every token
// is 0 (a new document) or its predecessor's position + 1. Errors name the row and token.
void check_packed_positions(const Tensor& positions, int64_t B, int64_t T);

struct BlockState;
// One layer of the training forward (block_forward with `save`): runs the block over s
// and fills A (an x_in already defined is kept: a recompute from the saved input). With
// keep_attention false, A.att and A.lse are dropped afterwards (selective checkpointing:
// recompute_attention rebuilds them).
void layer_forward_train(const Model& m, int64_t l, const Activations& acts, BlockState& s,
                         LayerActivations& A, bool keep_attention);
// A.att and A.lse from A.qkv (the selective recompute of the backward pass).
void recompute_attention(const Model& m, int64_t layer, const Activations& acts, LayerActivations& A);

}  // namespace tessera::model
