// A decoder-only transformer (llama / qwen2 / gpt2) on one device: loading and
// saving in Hugging Face layout, inference with a per-sequence KV cache, and
// forward + backward over a batch for training.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tessera/model/config.h"
#include "tessera/model/context_parallel.h"
#include "tessera/model/params.h"
#include "tessera/model/precision.h"
#include "tessera/model/shard.h"
#include "tessera/tensor/tensor.h"

namespace tessera::io {
class SafetensorsModel;
}

namespace tessera::model {

// Activation checkpointing for forward_backward: keep every activation (kNone), recompute
// attention in the backward pass (kSelective: its output and log-sum-exp are not kept),
// or keep only each layer's input and recompute the whole layer (kFull).
enum class Recompute { kNone, kSelective, kFull };
Recompute parse_recompute(const std::string& name);  // "none" | "selective" | "full"
const char* recompute_name(Recompute r);

// Keys and values of one sequence for every layer. Only Model::forward appends.
struct KVCache {
  // per layer: (capacity, KV heads, head_dim) f32; latent attention (deepseek): k holds
  // (capacity, 1, kv_lora + rope), each token's latent row (model/mla.h), and v is undefined.
  std::vector<Tensor> k, v;
  int64_t length = 0;        // tokens cached so far
  int64_t capacity = 0;
  // The position of row 0: 0, or where a cache that starts mid-sequence begins (the
  // multi-token prediction module's, after a prefix-cache hit; Model::mtp_forward).
  int64_t first_position = 0;

  static KVCache create(const ModelConfig& config, int64_t capacity, TpShard shard = {});
  // The multi-token prediction layer's cache alone (Model::mtp_forward).
  static KVCache create_mtp(const ModelConfig& config, int64_t capacity);
  void reset() { length = 0, first_position = 0; }
};

// What forward_backward tells a data-parallel wrapper (parallel/) as it goes, so the
// wrapper can gather sharded weights just before use, free them after, and reduce a
// unit's gradients as soon as they are final (overlapping the rest of backward).
// Units: 0 = embeddings (embed, pos_embed; lm_head too when tied), 1..L = layer l-1,
// L+1 = head (final norm, untied lm_head). Forward acquires 0, 1, ..., L+1; backward
// walks L+1, L, ..., 1 and finishes with unit 0's gradients.
class TrainHooks {
 public:
  virtual ~TrainHooks() = default;
  virtual void acquire(int unit) = 0;        // the unit's weights are read from now on
  virtual void release(int unit) = 0;        // ... and not again until the next acquire
  virtual void prepare_grads(int unit) = 0;  // gradients of the unit are about to be added
  virtual void grads_ready(int unit) = 0;    // the unit's gradients are final for this call
};

// Where a serving engine's forward keeps K/V (forward_tokens): the model computes each
// layer's q, k, v for this step's tokens; the engine stores k, v (a paged cache) and
// computes attention over everything the tokens' sequences have cached.
class KvAttention {
 public:
  virtual ~KvAttention() = default;
  // q (N, Hq, D), k, v (N, Hkv, D): this step's tokens after RoPE (strided views of one
  // fused buffer, head dim contiguous). out (N, Hq, D) contiguous, to be overwritten.
  virtual void attend(int64_t layer, const Tensor& q, const Tensor& k, const Tensor& v,
                      Tensor& out) = 0;
  // Latent attention (deepseek, model/mla.h): rows (N, D) are this step's cache rows; the
  // cache stores them, then calls fn once per sequence with its query rows [q_begin,
  // q_begin + q_len) and every row the sequence has cached (context_len, D) f32, this
  // step's included. By default: an error (a cache of per-head keys and values).
  using LatentFn = std::function<void(int64_t q_begin, int64_t q_len, const Tensor& cached)>;
  virtual void attend_latent(int64_t layer, const Tensor& rows, const LatentFn& fn);
};

// DIR/config.json and generation_config.json (json_files) and DIR/model.safetensors with
// `tensors` under their Hugging Face names: what Model::save writes, for weights assembled
// elsewhere (the whole tensors of a tensor-parallel model).
// save_hf_directory for a whole model's named tensors (Params::named or a gather of
// them): adds what its checkpoints carry besides (DeepSeek-V3's MTP copies).
// save_as: floating-point weights converted to this dtype (config.json's torch_dtype says
// so); unset: as they are.
void save_hf_model(const std::string& dir, const ModelConfig& config,
                   const std::vector<std::pair<std::string, std::string>>& json_files,
                   std::vector<std::pair<std::string, Tensor>> tensors,
                   uint64_t max_shard_bytes = 5'000'000'000ull, std::optional<DType> save_as = std::nullopt);

struct Activations;  // activations.h: what a training forward saves for backward
struct LoraWeights;  // lora.h

// One training micro-batch: ids and targets (B, T) i32 (targets -100 are not counted);
// positions (B, T) i32 for rows packed with several documents (Model::forward_backward),
// undefined for plain rows.
struct TokenBatch {
  Tensor ids, targets, positions;
};

// One micro-batch's pass through one chunk of a pipeline stage, held between its forward
// (Model::forward_chunk) and its backward (Model::backward_chunk): pipeline schedules run
// other micro-batches in between.
struct ChunkPass {
  int chunk = 0;
  std::shared_ptr<Activations> acts;
  int64_t activation_bytes = 0;  // saved for backward when the forward ended
  Tensor head_input;             // the last virtual stage: hf, every row
};

// Above max_shard_bytes (transformers' save_pretrained default, 5 GB) the tensors go into
// model-0000k-of-0000n.safetensors shards with model.safetensors.index.json, as
// save_pretrained writes them.
constexpr uint64_t kDefaultMaxShardBytes = 5'000'000'000ull;
void save_hf_directory(const std::string& dir,
                       const std::vector<std::pair<std::string, std::string>>& json_files,
                       const std::vector<std::pair<std::string, Tensor>>& tensors,
                       uint64_t max_shard_bytes = kDefaultMaxShardBytes);

class Model {
 public:
  // Reads DIR/config.json and DIR/model.safetensors (or the sharded index), converting
  // weights to `dtype` (f32 or bf16). Errors name the file and tensor at fault.
  static Model load(const std::string& dir, DType dtype = DType::kF32);
  // A GGUF file (llama.cpp's format, model/gguf_import.cc) of a llama or qwen2 model; load()
  // takes one in place of a directory. Block linears stored in Q8_0 / Q4_0 / Q4_K / Q6_K
  // keep that quantization (when all of them do); everything else loads as `dtype`. A
  // tensor-parallel shard or pipeline stage reads only its blocks, as load() does.
  static Model load_gguf(const std::string& path, DType dtype = DType::kF32, TpShard shard = {},
                         const PpStage& stage = {});
  // One tensor-parallel shard: each split tensor's block (Params::pieces) is read from the
  // mmapped safetensors, so no rank materialises the whole model.
  static Model load(const std::string& dir, DType dtype, TpShard shard);
  // ... of pipeline stage `stage` only (the other stages' tensors are not read).
  static Model load(const std::string& dir, DType dtype, TpShard shard, const PpStage& stage);
  // Shard `shard` of this whole model (the same blocks load would read).
  Model shard(TpShard shard) const;
  // Pipeline stage `stage` of this model (a tp shard or whole): copies of the stage's
  // tensors only; the other stages' stay undefined.
  Model stage(const PpStage& stage) const;
  const PpStage& pp_stage() const { return stage_; }
  // The tp group's collectives for a shard (every tp > 1 forward needs them).
  void set_tp_comm(TpComm* tp) { tp_comm_ = tp; }
  // The ep group's token exchange for an expert-parallel shard (TpShard::ep_size > 1):
  // every MoE layer's forward and backward sends each routed slot to the rank holding its
  // expert, so all ranks of the group run their passes together, layer for layer. The
  // training passes (forward_backward, forward_batch) run each rank's own tokens; the
  // inference passes (forward, forward_tokens) the same tokens on every rank (lockstep
  // serving: each rank routes 1/ep of the rows and the outputs are all-gathered).
  void set_ep_comm(EpComm* ep);
  EpComm* ep_comm() const { return ep_comm_; }
  // Context parallelism (training passes): each sequence's tokens are split over the cp
  // group (cp_local_tokens says which this rank holds); RoPE runs at their global
  // positions and the attention crosses the group by `method` (model/context_parallel.h).
  // nullptr: off. Not with sequence parallelism.
  void set_cp_comm(CpComm* cp, CpMethod method);
  CpComm* cp_comm() const { return cp_comm_; }
  CpMethod cp_method() const { return cp_method_; }
  // Megatron sequence parallelism in the training passes (forward_batch, forward_backward):
  // the residual stream, norms and their saved activations hold N / tp of the rows; the
  // all-reduces become all-gathers before and reduce-scatters after each tp region. Needs
  // tp_comm and batch x sequence rows divisible by tp. Inference ignores it.
  void set_sequence_parallel(bool on);
  bool sequence_parallel() const { return sequence_parallel_; }
  // Under sequence parallelism: the forward's all-gather before each column-parallel
  // linear (qkv, gate/up) runs in the background while this rank's own rows are
  // multiplied, then the other ranks' rows (the same products, split by rows).
  void set_sp_overlap(bool on) { sp_overlap_ = on; }
  bool sp_overlap() const { return sp_overlap_; }
  // Random weights (normal-ish, std 0.02; norms 1; biases 0), deterministic in `seed`.
  static Model random(const ModelConfig& config, DType dtype, uint64_t seed);
  // The same weights, only this rank's tensor-parallel shard and pipeline stage of them:
  // each whole tensor is drawn in turn and cut, so no rank materialises the whole model.
  static Model random(const ModelConfig& config, DType dtype, uint64_t seed, TpShard shard,
                      const PpStage& stage);
  // Writes config.json, generation_config.json and model.safetensors (Hugging Face names),
  // sharded with an index above max_shard_bytes (save_hf_directory).
  void save(const std::string& dir, uint64_t max_shard_bytes = kDefaultMaxShardBytes) const;
  // (file name, contents) of config.json and generation_config.json as save() writes them.
  std::vector<std::pair<std::string, std::string>> hf_json_files() const;

  // Quantized inference: every block linear's weight W (out, in) f32, whole model, is
  // replaced by quantize(layer, which, W) and freed; embeddings, norms and the head stay.
  // `format` is how save() stores them (config.json's quantization_config and AutoGPTQ /
  // AutoAWQ tensors); without one (fp8, w8a8) the model runs but cannot be saved.
  // Whole models only (no tp shard or pipeline stage); training refuses quantized weights.
  using LinearQuantizer =
      std::function<kernels::QuantWeight(int64_t layer, int which, const Tensor& weight)>;
  void quantize_linears(const LinearQuantizer& quantize,
                        std::optional<io::QuantCheckpointFormat> format);
  // The same one layer at a time (calibrated quantizers run layer l over what the
  // quantized layers before it produce): quantize_layer for every layer in any order, then
  // finish_quantization once. Layer l's compute copies follow at once.
  void quantize_layer(int64_t layer, const LinearQuantizer& quantize);
  void finish_quantization(std::optional<io::QuantCheckpointFormat> format);
  // The head quantized too (llama.cpp quantizes its output tensor; GPTQModel's lm_head =
  // True): logits come from quantize(W) of the (V, H) f32 head, and an untied float head is
  // freed (a tied one stays: it is the embedding table). Before or after the linears, once.
  void quantize_lm_head(const std::function<kernels::QuantWeight(const Tensor& weight)>& quantize);
  // The quantized head, or nullptr when the head is float.
  const kernels::QuantWeight* quantized_lm_head() const { return quant_lm_head_.get(); }
  bool quantized() const { return quantized_; }
  // The scheme of the quantized linears ("int4 g128", "bf16" when not quantized), and the
  // head's when it is quantized ("int4 g128 (gptq), lm_head int8").
  std::string weights_description() const;
  // Bytes of matmul weights one decoded token reads: the block linears and the head as
  // stored (quantized or in the compute dtype).
  int64_t matmul_weight_bytes() const;

  const ModelConfig& config() const { return config_; }
  // The sizes this rank computes with (the whole model's unless tensor-parallel).
  const LocalDims& dims() const { return dims_; }
  TpShard tp_shard() const { return shard_; }
  // The tp group's collectives (nullptr: no tensor parallelism).
  TpComm* tp_comm() const { return tp_comm_; }
  Params& weights() { return weights_; }
  const Params& weights() const { return weights_; }
  DType dtype() const { return dtype_; }

  // Matmuls use a copy of the weights in `dtype` (bf16 mixed precision over f32
  // master weights). Call refresh_compute_weights() after the master weights change.
  // bf16 runs natively or emulated as choose_bf16_mode(dtype, request) decides (native
  // where bf16 products beat f32 ones; emulated, the copy holds bf16-rounded values in
  // f32 and matmul inputs are rounded the same way, which gives autocast's results
  // without converting per call).
  // f16 is always emulated that way (fp16 rounding, overflow to inf).
  void set_compute_dtype(DType dtype, Bf16Request request = Bf16Request::kAuto);
  // For a wrapper that keeps fp32 master weights itself and stores compute-precision
  // values (bf16- or fp16-rounded, in f32) in weights(). Emulated modes make no copy
  // (matmul inputs are rounded the same way); native bf16 keeps bf16 copies of the
  // matmul weights per TrainHooks unit, which the wrapper refreshes when it changes or
  // binds a unit's weights (refresh_compute_unit) and drops when it unbinds them.
  void set_compute_dtype_in_place(DType dtype, Bf16Request request = Bf16Request::kAuto);
  void refresh_compute_weights();  // every unit whose weights are present
  void refresh_compute_unit(int unit);
  void release_compute_unit(int unit);
  // The compute copy of the matmul weight stored in `weight` (the same storage as a
  // weights() tensor; the embedding's is the tied head's copy), or an undefined tensor when
  // it has none (emulated or f32 compute, not a matmul weight, a unit not present).
  Tensor compute_copy_of(const Tensor& weight) const;
  // Native bf16: keeps the block linears' and the experts' compute copies also packed in
  // the layout oneDNN multiplies from (kernels/packed_b.h), for the forward product and
  // the input gradient's, refreshed with the copies (not the LM head: its products gain
  // nothing). A wrapper that writes new weights into the copies itself (the optimizer's
  // pass) writes them packed through packed_targets_of. Off by default.
  void set_packed_weights(bool on);
  bool packed_weights() const { return packed_weights_; }
  // Where new values of `weight` (a weights() storage tensor) go packed; null when the
  // model keeps no packed copy of it.
  std::shared_ptr<const kernels::PackTargets> packed_targets_of(const Tensor& weight);
  DType compute_dtype() const { return compute_dtype_; }
  Bf16Mode bf16_mode() const { return bf16_mode_; }

  // Inference: runs `tokens` (appended after cache.length) and returns logits f32,
  // (T, V) when all_logits else (1, V) for the last token.
  // hidden (optional): every token's final hidden state (T, H), after the final norm.
  Tensor forward(const std::vector<int32_t>& tokens, KVCache& cache, bool all_logits = false,
                 Tensor* hidden = nullptr) const;

  // DeepSeek-V3's multi-token prediction module at inference (--speculative mtp): for the
  // next positions of a sequence (cache.first_position + cache.length on; a cache that
  // starts mid-sequence attends over its own positions only) with the main model's final hidden
  // states `hidden` (n, H) there and each position's next token `next` (n), appends the
  // module's latent rows to `cache` (KVCache::create_mtp) and returns its logits (1, V) for
  // the last position: the distribution of the token two ahead of it. out_hidden: the
  // module's own output there (1, H), before the head's norm: the `hidden` a further call
  // takes to predict one more token ahead (as vLLM chains one MTP layer for k > 1).
  Tensor mtp_forward(const std::vector<int32_t>& next, const Tensor& hidden, KVCache& cache,
                     Tensor* out_hidden = nullptr) const;

  // Serving forward over the flattened tokens of several sequences: ids, positions (N)
  // i32; attention through `kv`. Returns logits (logit_rows.size(), V) for the listed rows.
  // batch_invariant: every matmul runs one row at a time, so a token's logits do not
  // depend on what else is in the batch (bit for bit, given an invariant `kv`).
  // row_adapters (multi-LoRA serving, set_lora_bank): (N) per token, the index of its
  // adapter in the bank, -1 for the base model alone; nullptr: every row as set_lora says.
  // The base GEMMs run once over all rows; each adapter's low-rank products run over its
  // own rows (batch_invariant does not extend to them).
  Tensor forward_tokens(const Tensor& ids, const Tensor& positions, KvAttention& kv,
                        const std::vector<int64_t>& logit_rows, bool batch_invariant = false,
                        Tensor* hidden = nullptr, const std::vector<int32_t>* row_adapters = nullptr) const;

  // Training-path forward over a batch without a cache: ids (B, T) i32 -> logits (B, T, V).
  // positions: as forward_backward's.
  Tensor forward_batch(const Tensor& ids, const Tensor& positions = Tensor()) const;

  // Forward + backward: mean cross-entropy over targets != -100 (ids, targets (B, T) i32).
  // Gradients are accumulated (+=) into `grads` (f32, Params::allocate layout), scaled
  // by grad_scale (1 for a plain mean; 1/accumulation_steps for accumulation). With
  // GradWrite::kAssign they are written instead (=), whatever `grads` held: the first
  // micro-batch of a step then needs no zeroing pass (the weight-gradient GEMMs run with
  // beta 0; only the small norm, bias and embedding gradients are cleared first). kAssign
  // needs the plain Params layout, not train hooks.
  struct LossResult {
    double loss = 0.0;   // mean over counted targets
    int64_t count = 0;   // targets counted
    int64_t activation_bytes = 0;  // saved for backward at the end of the forward pass
    // Mixture-of-experts models: slots routed to each expert over every layer, and the
    // balancing loss (E sum f P) of this pass (included in `loss` when trained).
    std::vector<double> expert_load;
    double aux_loss = 0.0;
    std::vector<std::vector<double>> layer_load;  // per MoE layer: slots per expert
    int64_t dropped = 0;  // slots over capacity (set_moe_capacity_factor), every layer
    // DeepSeek-V3's multi-token prediction (set_mtp_loss_weight > 0): the module's mean
    // cross-entropy predicting token t + 2 at position t (not in `loss`; its weight x it is
    // in the gradients), over mtp_count targets.
    double mtp_loss = 0.0;
    int64_t mtp_count = 0;
  };
  //
  // positions (optional, (B, T) i32): rows packed with several documents (supervised
  // fine-tuning), each token numbered inside its own document (0 at its first token, then
  // +1 per token). RoPE (or GPT-2's position embedding) uses these positions and attention
  // never crosses a document, so each document is computed as if it ran alone. Undefined:
  // 0 .. T-1 in every row. Not with context parallelism or latent attention (deepseek).
  enum class GradWrite { kAccumulate, kAssign };
  LossResult forward_backward(const Tensor& ids, const Tensor& targets, Params& grads,
                              float grad_scale = 1.f,
                              GradWrite write = GradWrite::kAccumulate,
                              const Tensor& positions = Tensor()) const;

  // Pipeline parallelism: forward_backward cut at the stage's chunk boundaries. The forward
  // of chunk `chunk` starts from the token ids (B, T) at virtual stage 0 (embedding), else
  // from `input`, the residual stream the previous virtual stage returned ((B T, H) f32;
  // this rank's B T / tp rows under sequence parallelism); every stage needs ids for B, T
  // and the positions (packed rows: `positions` as forward_backward's). It returns the
  // residual stream for the next virtual stage, or, at the last one, an undefined tensor
  // (its forward ends with the final norm: the head and the loss run in its backward, so
  // no logits are kept between the two).
  Tensor forward_chunk(int chunk, const Tensor& ids, const Tensor& input, ChunkPass& pass,
                       const Tensor& positions = Tensor()) const;
  // The backward of `pass`: at the last virtual stage from the loss over `targets` (the
  // LossResult is the micro-batch's), elsewhere from `grad_output` = d loss / d output of
  // the forward. Gradients as forward_backward; returns d loss / d input (shaped like the
  // forward's input), undefined at virtual stage 0. Frees the pass's activations.
  Tensor backward_chunk(ChunkPass& pass, const Tensor& targets, const Tensor& grad_output,
                        Params& grads, float grad_scale, GradWrite write,
                        LossResult* result = nullptr) const;

  // Evaluation at the last virtual stage, after forward_chunk: the sum of the token losses
  // over targets != -100 and their count (LossResult::loss is the sum here); no gradients.
  // Frees the pass.
  LossResult loss_chunk(ChunkPass& pass, const Tensor& targets) const;

  // nullptr (the default): plain single-device training. With hooks, forward_backward
  // does not check the gradient layout: the hooks provide each unit's tensors.
  void set_train_hooks(TrainHooks* hooks) { hooks_ = hooks; }
  TrainHooks* train_hooks() const { return hooks_; }
  int num_units() const { return static_cast<int>(config_.num_layers) + 2; }

  // LoRA (model/lora.h): the adapters `weights` join the block linears in every forward
  // (nullptr: none). Training passes add the adapters' gradients into `grads` (scaled as the
  // base's are) and compute no base gradient whose tensor the caller left undefined: with
  // Params::allocate_frozen's gradients the base is frozen (no weight-gradient GEMMs).
  // Whole llama-family models at tp 1 (not gpt2, latent attention or mixtures of experts):
  // anything else is a one-line error. A base quantized weight-only (int8, int4, fp8) is
  // QLoRA: its input gradients run through the dequantized weights. The adapters' dropout masks are
  // drawn from lora_seed (set it per pass).
  void set_lora(const LoraWeights* weights, LoraWeights* grads = nullptr);
  const LoraWeights* lora() const { return lora_; }
  LoraWeights* lora_grads() const { return lora_grads_; }
  // Multi-LoRA serving (Punica / S-LoRA): a bank of adapters served at once, each row of a
  // forward_tokens batch picking one by index (row_adapters). The adapters may differ in rank
  // and target modules; each is checked as set_lora checks its adapter. The caller keeps them
  // alive. Inference only: the training passes and forward() use set_lora's adapter. An
  // empty bank: none.
  void set_lora_bank(std::vector<const LoraWeights*> bank);
  const std::vector<const LoraWeights*>& lora_bank() const { return lora_bank_; }
  void set_lora_seed(uint64_t seed) { lora_seed_ = seed; }
  uint64_t lora_seed() const { return lora_seed_; }

  void set_recompute(Recompute r) { recompute_ = r; }
  // Mixture-of-experts training passes (forward_batch, forward_backward): each expert takes
  // at most capacity_factor x its even share of a layer's slots (MoeSpec::capacity_factor;
  // 0, the default: no limit). Inference never drops.
  void set_moe_capacity_factor(double f);
  double moe_capacity_factor() const { return moe_capacity_factor_; }
  // DeepSeek-V3's multi-token prediction module (ModelConfig::mtp_layers): the training
  // passes of the whole model add weight x its cross-entropy to the objective (0, the
  // default: the module is not run and its gradients stay 0).
  void set_mtp_loss_weight(double w);
  double mtp_loss_weight() const { return mtp_loss_weight_; }
  Recompute recompute() const { return recompute_; }

  // Weight used by the matmuls (compute copy when one exists).
  const Linear& compute_linear(int64_t layer, int which) const;  // which: 0 qkv, 1 o, 2 up, 3 down
  const Tensor& compute_lm_head() const;
  const MoeWeights& compute_moe(int64_t layer) const;  // a mixture-of-experts layer's
  // Mixture-of-experts models: slots routed to each expert by the inference forwards so
  // far (every layer; training passes report theirs in LossResult). Empty for dense models.
  std::vector<int64_t> expert_load() const;
  void count_expert_load(const MoeRouting& r) const;
  void count_expert_load(const std::vector<int64_t>& load) const;  // slots per expert

 private:
  ModelConfig config_;
  TpShard shard_;
  PpStage stage_;
  LocalDims dims_;
  TpComm* tp_comm_ = nullptr;
  EpComm* ep_comm_ = nullptr;
  CpComm* cp_comm_ = nullptr;
  CpMethod cp_method_ = CpMethod::kRing;
  bool sequence_parallel_ = false;
  bool sp_overlap_ = false;
  Params weights_;
  DType dtype_ = DType::kF32;
  DType compute_dtype_ = DType::kF32;
  Params compute_;  // matmul weights in compute_dtype_ (only Linear weights + lm_head set)
  bool has_compute_copy_ = false;
  bool packed_weights_ = false;
  void pack_layer(int64_t l);  // compute_.layers[l]'s packed copies, made or dropped
  Bf16Mode bf16_mode_ = Bf16Mode::kOff;
  bool unit_holds_lm_head(int unit) const;  // whose weights the matmul lm_head is
  std::vector<int64_t> unit_layers(int unit) const;  // the blocks a TrainHooks unit holds
  bool quantized_ = false;
  std::shared_ptr<const kernels::QuantWeight> quant_lm_head_;  // quantize_lm_head / a checkpoint's
  // Keeps q (validated, (V, H)) as the head and frees an untied float head.
  void set_quantized_lm_head(kernels::QuantWeight q, const std::string& what);
  // MoE models: inference routing counts, made at the first count (copies made after it share it).
  mutable std::shared_ptr<ExpertLoad> expert_load_;
  std::shared_ptr<ExpertLoad> expert_counter() const;  // expert_load_, made at the first count
  // A quantized checkpoint's block linears (model/quantized.cc); their names into `used`.
  void load_quantized_linears(const io::SafetensorsModel& file, const std::string& dir,
                              std::set<std::string>& used);
  // The AutoGPTQ / AutoAWQ tensors save() writes for the quantized linears.
  std::vector<std::pair<std::string, Tensor>> quantized_tensors() const;
  Recompute recompute_ = Recompute::kNone;
  double moe_capacity_factor_ = 0.0;
  double mtp_loss_weight_ = 0.0;
  TrainHooks* hooks_ = nullptr;
  const LoraWeights* lora_ = nullptr;
  LoraWeights* lora_grads_ = nullptr;
  std::vector<const LoraWeights*> lora_bank_;
  uint64_t lora_seed_ = 0;
  void check_lora(const LoraWeights& weights, const LoraWeights* grads) const;
};

}  // namespace tessera::model
