// LoRA fine-tuning ([lora] in the training config; docs/fine-tuning.md): the base model of
// model.init_from is loaded and frozen (no base gradient is computed or kept), adapters are
// added to the [lora] target modules and only they train, with the run's optimizer,
// schedule, clipping, gradient accumulation, data (token shards or chat data), evaluation,
// metrics, checkpoints (the adapter, its optimizer state and the trainer state) and exact
// resume. Data parallelism: every rank runs its share of each batch and the adapters'
// gradients are averaged over the ranks. Tensor, pipeline, context and expert parallelism,
// ZeRO and fp16 are not supported with LoRA yet (one-line errors).
#pragma once
#include <memory>
#include <vector>

#include "tessera/comm/communicator.h"
#include "tessera/model/lora.h"
#include "tessera/model/model.h"
#include "tessera/train/config.h"
#include "tessera/train/optimizer.h"
#include "tessera/train/trainer.h"

namespace tessera::train {

// The adapters' configuration from [lora] (target "all-linear": the seven modules).
model::LoraConfig lora_config(const LoraSection& s);

// Bytes of gradients and optimizer state of full fine-tuning of `m` (f32 gradients, AdamW's
// two f32 moments, and an f32 master copy under 16-bit compute) and of LoRA's (the adapters'
// gradients and moments; the frozen base keeps only its norms' small gradient buffers).
struct LoraMemory {
  int64_t full_bytes = 0, lora_bytes = 0;
  int64_t base_params = 0, adapter_params = 0;
};
LoraMemory lora_memory(const model::Model& m, const model::LoraWeights& w, const TrainConfig& c);

// The objects of a LoRA run's step, shared by the trainer and `tessera bench train` (so the
// benchmark times the step users run): the base rounded to the compute precision (bf16:
// the frozen weights hold bf16 values, no master copy), the adapters (fresh from lora.seed,
// or lora.init_from) and their gradients attached to the model, the frozen base's gradient
// buffers (its norms' only) and AdamW over the adapters.
struct LoraStep {
  LoraStep(model::Model& m, const TrainConfig& c);
  LoraStep(const LoraStep&) = delete;
  LoraStep& operator=(const LoraStep&) = delete;
  ~LoraStep();  // detaches the adapters from the model
  void zero_grads();
  // One micro-batch's forward and backward; gradients accumulate, scaled by `scale`.
  model::Model::LossResult micro_batch(const model::TokenBatch& b, float scale, uint64_t dropout_seed);
  // AdamW over the adapters with clip_coef (grad_clip's) applied as it reads each gradient.
  void update(double lr_scale, float clip_coef);

  model::Model& model;
  std::unique_ptr<model::LoraWeights> weights, grads;
  model::Params frozen;
  std::vector<ParamRef> refs;
  std::unique_ptr<Optimizer> opt;
};

TrainResult run_lora_training(const TrainConfig& c, const TrainOptions& o, comm::Communicator& comm);

}  // namespace tessera::train
