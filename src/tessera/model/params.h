// The tensors of a decoder-only transformer in Tessera's layout, with the mapping
// to Hugging Face tensor names. The same struct holds weights and gradients.
//
// Layout choices (why): q/k/v projections are stacked into one (Q + 2KV, H) matrix
// and gate/up into one (2F, H) matrix so each is one matmul; the Hugging Face
// tensors are row blocks of these, i.e. contiguous views, so loading, saving and
// per-name gradients need no copies. GPT-2's Conv1D weights keep their (in, out)
// layout (`in_out`), as in the checkpoint.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/kernels/packed_b.h"
#include "tessera/kernels/quant.h"
#include "tessera/model/config.h"
#include "tessera/model/mla.h"
#include "tessera/model/moe.h"
#include "tessera/model/shard.h"
#include "tessera/tensor/tensor.h"

namespace tessera::model {

struct Linear {
  Tensor weight;        // (out, in), or (in, out) when in_out; undefined when quantized
  Tensor bias;          // (out), or undefined
  bool in_out = false;  // GPT-2 Conv1D layout (of weight; quant is always (out, in))
  // Inference only: the weight quantized (Model::quantize or a quantized checkpoint).
  // Shared by the model's compute copy; never changed once set.
  std::shared_ptr<const kernels::QuantWeight> quant;
  // Native bf16 with packed weights (Model::set_packed_weights): the compute copy also in
  // the layout oneDNN multiplies from, for y = x op(W) and for dx = dy op(W)^T.
  kernels::PackedB packed_fwd, packed_dx;
};

struct LayerParams {
  Tensor norm1_w, norm1_b;  // (H); bias only for LayerNorm
  Linear qkv;               // out = Q + 2 KV (q rows, then k, then v)
  Linear o;                 // (H, Q)
  Tensor norm2_w, norm2_b;  // (H)
  Linear up;                // out = 2F (gate rows, then up rows) when gated, else F
  Linear down;              // (H, F)
  MoeWeights moe;           // a mixture-of-experts layer's router and experts (up, down unset)
  MlaWeights mla;           // deepseek: latent attention (qkv, o unset)
  Tensor q_norm, k_norm;    // (head_dim) qwen3: RMSNorm weights over each head's q and k
  Tensor post_attn_norm, post_mlp_norm;  // (H) gemma2: norms of the attention's and the MLP's outputs

  // By BlockLinear::which: 0 qkv, 1 o, 2 up, 3 down.
  Linear& linear(int which) { return which == 0 ? qkv : which == 1 ? o : which == 2 ? up : down; }
  const Linear& linear(int which) const { return const_cast<LayerParams*>(this)->linear(which); }
};

// One Hugging Face tensor's block held by this rank: `view` is the block of tensor `name`
// (whole shape `full`) starting at `offset` (one entry per dim). The whole tensor at tp = 1
// and for replicated tensors; one tensor may have several pieces (GPT-2's fused c_attn
// under tp: its q, k and v column blocks).
struct Piece {
  std::string name;
  Tensor view;
  Shape full;
  std::vector<int64_t> offset;
  int64_t copies = 1;  // tp ranks holding this same block (tp for a replicated tensor)
  int block = 0;       // earlier pieces of the same tensor in this list (GPT-2's c_attn: 0-2)
  bool whole() const { return view.shape() == full; }
  // The block of a tensor of shape `full` that this piece covers.
  Tensor block_of(const Tensor& whole_tensor) const;
};

// DeepSeek-V3's multi-token prediction module (besides its layer, layers[num_layers]):
// x = eh_proj [enorm(embed(next token)); hnorm(h)], its logits lm_head(head_norm(layer(x))).
struct MtpParams {
  Tensor enorm, hnorm;  // (H)
  Tensor eh_proj;       // (H, 2H)
  Tensor head_norm;     // (H): shared_head.norm
};

struct Params {
  Tensor embed;                    // (V, H)
  Tensor pos_embed;                // (P, H), GPT-2 only
  // num_layers blocks, then the multi-token prediction module's (ModelConfig::mtp_layers),
  // held with the head (pipeline: by the last stage; TrainHooks: in the head unit).
  std::vector<LayerParams> layers;
  MtpParams mtp;
  Tensor final_norm_w, final_norm_b;  // (H)
  Tensor lm_head;                  // (V, H); shares embed's storage when tied

  // Zero-filled tensors of `dtype` shaped for `config`.
  static Params allocate(const ModelConfig& config, DType dtype);
  // Gradients of a frozen base (LoRA, Model::set_lora): only the norms' (small; their
  // gradients are computed and dropped), no embedding, linear or head tensors.
  static Params allocate_frozen(const ModelConfig& config);
  // The same for one tensor-parallel shard (local_dims sizes). zeroed false: the memory is
  // left untouched (for reading the layout of pieces() without paying for the tensors).
  // A pipeline stage allocates only its tensors (its layers; the embeddings on the first
  // stage, the final norm and lm_head on the last): the others stay undefined, and every
  // listing below skips them.
  static Params allocate(const ModelConfig& config, DType dtype, const LocalDims& dims,
                         bool zeroed = true, const PpStage& stage = {});
  // (Hugging Face name, view) for every distinct tensor; tied lm_head is not listed.
  // Whole-model Params only (tp = 1).
  std::vector<std::pair<std::string, Tensor>> named(const ModelConfig& config) const;
  // The pieces of every distinct tensor this rank holds as shard `shard` of the model
  // (tied lm_head not listed). At tp = 1 each piece is a whole tensor, as named() lists.
  std::vector<Piece> pieces(const ModelConfig& config, TpShard shard) const;
  // The storage tensors of one TrainHooks unit (0 embeddings, 1..L layers, L+1 head) with
  // stable names ("layers.3.qkv.weight"); pointers into this struct, defined ones only.
  // A tied lm_head is not listed (it aliases embed: call tie() after replacing embed).
  std::vector<std::pair<std::string, Tensor*>> unit_tensors(const ModelConfig& config, int unit);
  // lm_head = embed when the config ties them (and embed is here: a pipeline's last stage
  // holds a tied lm_head as its own copy, listed as "lm_head.weight").
  void tie(const ModelConfig& config);
  // Every linear weight in the model (for compute-dtype copies), lm_head included.
  std::vector<Tensor*> matmul_weights();
  void zero();
};

// The Hugging Face modules block linear `which` (0 qkv, 1 o, 2 up, 3 down) of `layer` is
// made of, in row order: their name prefixes ("model.layers.0.self_attn.q_proj") and output
// rows (whole model). A quantized checkpoint stores each module's tensors under its prefix.
struct LinearModule {
  std::string name;
  int64_t rows = 0;
};
std::vector<LinearModule> linear_modules(const ModelConfig& config, int64_t layer, int which);

// DeepSeek-V3 checkpoints store the multi-token prediction module's embedding and head as
// copies of the model's (model.layers.{L}.embed_tokens.weight, .shared_head.head.weight),
// which vLLM and SGLang read: appended to a named tensor list that holds the originals.
// Nothing for a model without the module. Loading ignores them (the module shares the
// model's own).
void add_mtp_shared_copies(const ModelConfig& config, std::vector<std::pair<std::string, Tensor>>& tensors);
bool is_mtp_shared_copy(const ModelConfig& config, const std::string& name);

// Names as `transformers` writes them for this architecture.
std::string hf_prefix(const ModelConfig& config);  // "model." or "transformer."
// The embedding table's name ("model.embed_tokens.weight", "transformer.wte.weight"): a
// tied model's lm_head too (a pipeline's last-stage copy of it reads its values).
std::string embedding_name(const ModelConfig& config);

}  // namespace tessera::model
