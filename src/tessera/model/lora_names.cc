// LoRA's module names (Hugging Face PEFT's), apart from lora.cc so that the config parsers
// (and their fuzz targets) need nothing else of the model layer.
#include "tessera/model/lora.h"

namespace tessera::model {
namespace {

constexpr const char* kNames[kLoraModules] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};

}  // namespace

const char* lora_module_name(LoraModule m) { return kNames[static_cast<int>(m)]; }

std::optional<LoraModule> parse_lora_module(const std::string& name) {
  for (int i = 0; i < kLoraModules; ++i)
    if (name == kNames[i]) return static_cast<LoraModule>(i);
  return std::nullopt;
}

const char* lora_module_parent(LoraModule m) {
  return static_cast<int>(m) <= static_cast<int>(LoraModule::kO) ? "self_attn" : "mlp";
}

}  // namespace tessera::model
