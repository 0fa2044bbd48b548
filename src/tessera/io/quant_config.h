// config.json's quantization_config: which ecosystem layout a quantized checkpoint's
// linears are stored in (AutoGPTQ "gptq", AutoAWQ "awq", and llm-compressor's
// "compressed-tensors" for W8A8, int8 weights per output channel and int8 activations per
// token at run time, and for fp8 e4m3 weights per channel or group). Parsing only: the tensors themselves are io/quant_checkpoint.h's.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace tessera::io {

constexpr const char* kCompressedTensors = "compressed-tensors";

struct QuantCheckpointFormat {
  std::string method = "gptq";  // "gptq" | "awq" | "compressed-tensors"
  int bits = 4;                 // 4 or 8 (awq: 4; compressed-tensors: 8)
  int64_t group_size = 128;     // -1: one group per output channel (gptq; compressed-tensors)
  bool sym = false;             // gptq: symmetric (zero point 2^(bits-1))
  bool desc_act = false;        // gptq: act-order (g_idx not k / group_size)
  int gptq_version = 1;         // checkpoint_format "gptq" (v1: zeros stored minus 1) or "gptq_v2"
  std::string quantizer;        // what made it here ("rtn", "gptq", "awq"); informational
  // Linear modules kept in full precision (transformers' AWQ loader converts every other
  // nn.Linear but lm_head); empty: none listed.
  std::vector<std::string> modules_to_not_convert;
  // compressed-tensors "float-quantized": fp8 e4m3 weights (W8A16-fp8), per output channel
  // (group_size -1) or per group; else "int-quantized" W8A8.
  bool fp8 = false;
  // fp8 with dynamic per-token fp8 activations (llm-compressor's FP8_DYNAMIC): run here
  // with float activations (weight-only, as vLLM's Marlin fallback does), written back as read.
  bool fp8_activations = false;
  // gptq: lm_head is quantized too (GPTQModel's "lm_head": true, which vLLM reads), with
  // the body's bits and group unless "dynamic" overrides them for it ({"+:lm_head":
  // {"bits": 8, "group_size": -1}}, GPTQModel's per-module rules). Otherwise it stays float.
  bool lm_head = false;
  struct ModuleOverride {
    int bits = 8;
    int64_t group_size = -1;
    bool sym = true;
    bool desc_act = false;
  };
  std::optional<ModuleOverride> lm_head_override;
  // The format lm_head's tensors are in (the body's with the override applied).
  QuantCheckpointFormat lm_head_format() const;
};

// config.json's quantization_config: one-line errors naming the field at fault (an
// unsupported quant_method, bits, group_size, awq version, checkpoint_format ...).
QuantCheckpointFormat parse_quantization_config(const nlohmann::json& j, const std::string& source);
nlohmann::json quantization_config_json(const QuantCheckpointFormat& f);
// What every user of f needs of it (method, bits, group size, version in range): a
// one-line error naming `where` otherwise.
void check_quant_format(const QuantCheckpointFormat& f, const std::string& where);

}  // namespace tessera::io
