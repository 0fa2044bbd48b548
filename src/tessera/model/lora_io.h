// LoRA adapters on disk as Hugging Face PEFT saves them (adapter_config.json +
// adapter_model.safetensors), and merging an adapter into a model's weights.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/model/config.h"
#include "tessera/model/lora.h"

namespace tessera::model {

class Model;

// DIR/adapter_config.json with the keys PEFT writes for a LoRA CAUSAL_LM adapter (sorted,
// indent 2, as save_pretrained writes it) and DIR/adapter_model.safetensors with w.named(c)
// in f32. Both are written atomically; DIR is created.
void save_peft_adapter(const std::string& dir, const ModelConfig& c, const LoraWeights& w,
                       const std::string& base_model_name_or_path);

// The adapter_config.json text save_peft_adapter writes.
std::string peft_adapter_config_json(const LoraConfig& config, const std::string& base_model_name_or_path);

// Reads a PEFT LoRA adapter saved for a model of config `c`. Accepts target_modules as a
// list, one module name, or "all-linear"; tensor names with PEFT's ".default" adapter infix;
// bf16 / f16 tensors (converted to f32). One-line errors name the file and the key or tensor
// for what Tessera cannot apply exactly (DoRA, rank/alpha patterns, modules_to_save, biases,
// layers_to_transform, fan_in_fan_out), and for missing, unexpected or misshapen tensors.
LoraWeights load_peft_adapter(const std::string& dir, const ModelConfig& c);

// W[rows of each adapted module] += scale * B @ A, as PEFT's merge_and_unload, on the
// model's f32 master weights (a whole model: not quantized, not a tp shard or pipeline
// stage), then refreshes the compute copies.
// A model with adapters attached (set_lora / set_lora_bank) is an error: they would apply twice.
void merge_lora(Model& m, const LoraWeights& w);

// `tessera export --merge-lora`: base model (directory or GGUF file) + adapter, merged,
// written to out_dir as a Hugging Face model directory (Model::save) with the base's
// tokenizer files copied.
struct MergedLoraExport {
  int64_t modules = 0;                     // adapted modules merged (over all layers)
  LoraConfig config;                       // the adapter's
  std::vector<std::string> tokenizer_files;  // copied (or written from a GGUF file)
};
MergedLoraExport export_merged_lora(const std::string& adapter_dir, const std::string& base_model,
                                    const std::string& out_dir);

}  // namespace tessera::model
