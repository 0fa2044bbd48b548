// LoRA adapters (Hu et al. 2021, as Hugging Face PEFT defines them): for each targeted
// linear module W (out, in), a pair A (r, in), B (out, r) with y = x W^T + s B A dropout(x)
// and s = alpha / r (alpha / sqrt(r) with rsLoRA). The modules are PEFT's names of the
// llama-family block linears; Tessera fuses q/k/v into one linear and gate/up into another,
// so a module is a block of rows of the fused weight (lora_module_rows).
#pragma once
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/model/config.h"
#include "tessera/tensor/tensor.h"

namespace tessera::model {

enum class LoraModule { kQ, kK, kV, kO, kGate, kUp, kDown };
constexpr int kLoraModules = 7;
const char* lora_module_name(LoraModule m);  // "q_proj", ..., "down_proj"
// "q_proj" -> kQ; nullopt for a name that is not one of the seven.
std::optional<LoraModule> parse_lora_module(const std::string& name);
// PEFT's parent of the module: "self_attn" (q, k, v, o) or "mlp" (gate, up, down).
const char* lora_module_parent(LoraModule m);

struct LoraConfig {
  int64_t rank = 8;
  double alpha = 16;
  double dropout = 0;  // on the adapter's input, training passes only
  bool rslora = false;  // scale alpha / sqrt(rank) (PEFT use_rslora)
  std::vector<LoraModule> targets;
  double scale() const;
  bool targets_module(LoraModule m) const;
};

// Where module m sits in its fused block linear: which (0 qkv, 1 o, 2 up, 3 down), its
// first output row and rows there, and its input features. Errors (one line) for a model
// LoRA does not support: gpt2 (fused c_attn), latent attention (deepseek), and the MLP
// modules of a mixture-of-experts layer.
struct LoraRows {
  int which = 0;
  int64_t row0 = 0, rows = 0, in = 0;
};
LoraRows lora_module_rows(const ModelConfig& c, int64_t layer, LoraModule m);

// One adapted module.
struct LoraPair {
  Tensor a;  // (r, in) f32
  Tensor b;  // (rows, r) f32
};

// Every layer's adapters: layers[l][m] is defined for the targeted modules.
struct LoraWeights {
  LoraConfig config;
  std::vector<std::array<LoraPair, kLoraModules>> layers;

  // PEFT's initialisation: A kaiming-uniform (a = sqrt(5), as nn.Linear: U(-1/sqrt(in),
  // 1/sqrt(in))), B zero, so the adapted model starts equal to the base. Deterministic in seed.
  static LoraWeights init(const ModelConfig& c, const LoraConfig& config, uint64_t seed);
  // The same shapes, zero-filled (gradients).
  static LoraWeights zeros_like(const LoraWeights& w);
  // (PEFT name, tensor) for every A and B: "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight".
  std::vector<std::pair<std::string, Tensor>> named(const ModelConfig& c) const;
  std::vector<Tensor*> tensors();  // every A and B, in named() order
  int64_t num_parameters() const;
};

}  // namespace tessera::model
