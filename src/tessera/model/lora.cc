// LoRA adapter shapes, names and initialisation.
#include "tessera/base/mix64.h"
#include "tessera/model/lora.h"

#include <algorithm>
#include <cmath>

#include "tessera/base/error.h"
#include "tessera/model/params.h"

namespace tessera::model {
namespace {

using base::mix64;

}  // namespace

double LoraConfig::scale() const {
  return rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

bool LoraConfig::targets_module(LoraModule m) const {
  return std::find(targets.begin(), targets.end(), m) != targets.end();
}

LoraRows lora_module_rows(const ModelConfig& c, int64_t layer, LoraModule m) {
  TESSERA_CHECK(c.arch != Arch::kGpt2, "LoRA on ", c.model_type, " (fused c_attn / c_fc modules) is not supported; "
                "it adapts the llama-family modules q_proj ... down_proj");
  TESSERA_CHECK(!c.uses_mla(), "LoRA on ", c.model_type, "'s latent attention is not supported yet");
  const int64_t H = c.hidden_size, Q = c.num_heads * c.head_dim, KV = c.num_kv_heads * c.head_dim;
  const int64_t F = c.intermediate_size;
  const bool mlp = static_cast<int>(m) >= static_cast<int>(LoraModule::kGate);
  TESSERA_CHECK(!mlp || !c.layer_is_moe(layer), "LoRA on ", lora_module_name(m), ": layer ", layer,
                " is a mixture-of-experts layer (its experts' modules are not supported yet)");
  switch (m) {
    case LoraModule::kQ: return {0, 0, Q, H};
    case LoraModule::kK: return {0, Q, KV, H};
    case LoraModule::kV: return {0, Q + KV, KV, H};
    case LoraModule::kO: return {1, 0, H, Q};
    case LoraModule::kGate: return {2, 0, F, H};
    case LoraModule::kUp: return {2, F, F, H};
    case LoraModule::kDown: return {3, 0, H, F};
  }
  fail("LoRA: unknown module");
}

LoraWeights LoraWeights::init(const ModelConfig& c, const LoraConfig& config, uint64_t seed) {
  TESSERA_CHECK(config.rank >= 1, "lora.rank ", config.rank, " must be at least 1");
  TESSERA_CHECK(!config.targets.empty(), "lora.target_modules is empty");
  LoraWeights w;
  w.config = config;
  w.layers.resize(static_cast<size_t>(c.num_layers));
  const int64_t r = config.rank;
  for (int64_t l = 0; l < c.num_layers; ++l)
    for (LoraModule m : config.targets) {
      const LoraRows g = lora_module_rows(c, l, m);
      LoraPair& p = w.layers[l][static_cast<int>(m)];
      p.a = Tensor::empty({r, g.in}, DType::kF32);
      p.b = Tensor::zeros({g.rows, r}, DType::kF32);
      // nn.Linear's kaiming_uniform_(a = sqrt(5)): U(-1/sqrt(in), 1/sqrt(in)).
      const double bound = 1.0 / std::sqrt(static_cast<double>(g.in));
      uint64_t state = mix64(seed ^ mix64(static_cast<uint64_t>(l * kLoraModules + static_cast<int>(m)) + 1));
      float* a = p.a.data<float>();
      for (int64_t i = 0; i < p.a.numel(); ++i) {
        const double u = static_cast<double>(mix64(state += 0x9E3779B97F4A7C15ull) >> 11) * 0x1.0p-53;
        a[i] = static_cast<float>((2 * u - 1) * bound);
      }
    }
  return w;
}

LoraWeights LoraWeights::zeros_like(const LoraWeights& w) {
  LoraWeights z;
  z.config = w.config;
  z.layers.resize(w.layers.size());
  for (size_t l = 0; l < w.layers.size(); ++l)
    for (int m = 0; m < kLoraModules; ++m)
      if (w.layers[l][m].a.defined()) {
        z.layers[l][m].a = Tensor::zeros(w.layers[l][m].a.shape(), DType::kF32);
        z.layers[l][m].b = Tensor::zeros(w.layers[l][m].b.shape(), DType::kF32);
      }
  return z;
}

std::vector<std::pair<std::string, Tensor>> LoraWeights::named(const ModelConfig& c) const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (size_t l = 0; l < layers.size(); ++l)
    for (int m = 0; m < kLoraModules; ++m) {
      const LoraPair& p = layers[l][m];
      if (!p.a.defined()) continue;
      const auto mod = static_cast<LoraModule>(m);
      const std::string base = "base_model.model." + hf_prefix(c) + "layers." + std::to_string(l) + "." +
                               lora_module_parent(mod) + "." + lora_module_name(mod);
      out.emplace_back(base + ".lora_A.weight", p.a);
      out.emplace_back(base + ".lora_B.weight", p.b);
    }
  return out;
}

std::vector<Tensor*> LoraWeights::tensors() {
  std::vector<Tensor*> out;
  for (auto& layer : layers)
    for (auto& p : layer)
      if (p.a.defined()) {
        out.push_back(&p.a);
        out.push_back(&p.b);
      }
  return out;
}

int64_t LoraWeights::num_parameters() const {
  int64_t n = 0;
  for (const auto& layer : layers)
    for (const auto& p : layer)
      if (p.a.defined()) n += p.a.numel() + p.b.numel();
  return n;
}

}  // namespace tessera::model
