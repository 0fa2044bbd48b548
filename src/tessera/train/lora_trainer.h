// LoRA fine-tuning ([lora] in the training config; docs/fine-tuning.md): the base model of
// model.init_from is loaded and frozen (no base gradient is computed or kept), adapters are
// added to the [lora] target modules and only they train, with the run's optimizer,
// schedule, clipping, gradient accumulation, data (token shards or chat data), evaluation,
// metrics, checkpoints (the adapter, its optimizer state and the trainer state) and exact
// resume. Data parallelism: every rank runs its share of each batch and the adapters'
// gradients are averaged over the ranks. Tensor, pipeline, context and expert parallelism,
// ZeRO and fp16 are not supported with LoRA yet (one-line errors).
#pragma once
#include "tessera/comm/communicator.h"
#include "tessera/model/lora.h"
#include "tessera/model/model.h"
#include "tessera/train/config.h"
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

TrainResult run_lora_training(const TrainConfig& c, const TrainOptions& o, comm::Communicator& comm);

}  // namespace tessera::train
