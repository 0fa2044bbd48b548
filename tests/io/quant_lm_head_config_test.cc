// A quantized lm_head in config.json's quantization_config, as GPTQModel writes it and vLLM
// reads it: "lm_head": true, and per-module overrides for it under "dynamic" ({"+:REGEX":
// {bits, group_size, sym, desc_act}}, "-:REGEX" skipping the module), matched from the start
// of the module's name as Python's re.match does.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "io_test_util.h"
#include "tessera/io/quant_config.h"

namespace tessera::io {
namespace {

using testing::error_of;

nlohmann::json parse(const std::string& text) { return nlohmann::json::parse(text); }

TEST(QuantizationConfigLmHead, ReadsGptqModelsLmHeadAndItsDynamicOverride) {
  // GPTQModel's QuantizeConfig.to_dict, 4 bits with the head quantized at the body's settings.
  const auto same = parse_quantization_config(parse(R"({"bits": 4, "dynamic": null, "group_size": 128,
      "desc_act": false, "sym": true, "lm_head": true, "quant_method": "gptq", "checkpoint_format": "gptq",
      "meta": {"quantizer": ["gptqmodel:1.4.5"]}})"), "x");
  EXPECT_TRUE(same.lm_head);
  EXPECT_FALSE(same.lm_head_override.has_value());
  const QuantCheckpointFormat h = same.lm_head_format();
  EXPECT_EQ(h.bits, 4);
  EXPECT_EQ(h.group_size, 128);
  EXPECT_FALSE(h.lm_head);
  // The head at 8 bits per channel through a dynamic rule (its keys in any order).
  const auto over = parse_quantization_config(parse(R"({"bits": 4, "group_size": 64, "sym": false,
      "lm_head": true, "quant_method": "gptq",
      "dynamic": {"+:lm_head": {"group_size": -1, "bits": 8, "sym": true}}})"), "x");
  ASSERT_TRUE(over.lm_head_override.has_value());
  const QuantCheckpointFormat o = over.lm_head_format();
  EXPECT_EQ(o.bits, 8);
  EXPECT_EQ(o.group_size, -1);
  EXPECT_TRUE(o.sym);
  EXPECT_EQ(over.bits, 4);  // the body's unchanged
  EXPECT_EQ(over.group_size, 64);
  // A bare regex is a positive rule; "-:" leaves the head float.
  EXPECT_TRUE(parse_quantization_config(parse(R"({"bits": 8, "lm_head": true, "quant_method": "gptq",
      "dynamic": {"lm_hea.": {"bits": 4, "group_size": 32}}})"), "x").lm_head_format().bits == 4);
  EXPECT_FALSE(parse_quantization_config(parse(R"({"bits": 8, "lm_head": true, "quant_method": "gptq",
      "dynamic": {"-:lm_head": {}}})"), "x").lm_head);
  // No lm_head key: the head stays float (AutoGPTQ's default), whatever dynamic says of it.
  const auto plain = parse_quantization_config(parse(R"({"bits": 4, "quant_method": "gptq",
      "dynamic": {"+:lm_head": {"bits": 8}}})"), "x");
  EXPECT_FALSE(plain.lm_head);
  EXPECT_FALSE(plain.lm_head_override.has_value());
}

TEST(QuantizationConfigLmHead, WritesWhatReadsBack) {
  QuantCheckpointFormat f;
  f.bits = 4, f.group_size = 128, f.sym = false, f.lm_head = true;
  f.lm_head_override = QuantCheckpointFormat::ModuleOverride{8, -1, true, false};
  const nlohmann::json j = quantization_config_json(f);
  EXPECT_EQ(j.at("lm_head"), true);
  EXPECT_EQ(j.at("dynamic").dump(),
            parse(R"({"+:lm_head": {"bits": 8, "group_size": -1, "sym": true, "desc_act": false}})").dump());
  const auto b = parse_quantization_config(j, "x");
  EXPECT_TRUE(b.lm_head);
  ASSERT_TRUE(b.lm_head_override.has_value());
  EXPECT_EQ(b.lm_head_format().bits, 8);
  EXPECT_EQ(b.lm_head_format().group_size, -1);
  // Without a head, neither key is written (AutoGPTQ's config, as before).
  QuantCheckpointFormat g;
  const nlohmann::json jg = quantization_config_json(g);
  EXPECT_FALSE(jg.contains("lm_head"));
  EXPECT_FALSE(jg.contains("dynamic"));
  // AutoAWQ's format has no quantized head.
  QuantCheckpointFormat a;
  a.method = "awq", a.lm_head = true;
  EXPECT_NE(error_of([&] { quantization_config_json(a); }).find("gptq's format only"), std::string::npos);
}

TEST(QuantizationConfigLmHead, RulesBeyondTheHeadAreOneLineErrorsNamingTheRule) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"quant_method": "gptq", "bits": 4, "lm_head": true, "dynamic": [1]})",
       "quantization_config.dynamic: expected an object of module rules"},
      {R"({"quant_method": "gptq", "bits": 4, "lm_head": true, "dynamic": {"+:.*": {"bits": 8}}})",
       "quantization_config.dynamic[\"+:.*\"]: per-module rules are read for lm_head only (this one also matches "
       "model.layers.0.self_attn.q_proj)"},
      {R"({"quant_method": "gptq", "bits": 4, "lm_head": true, "dynamic": {"+:.*down_proj": {"bits": 8}}})",
       "(this one does not match lm_head)"},
      {R"({"quant_method": "gptq", "bits": 4, "lm_head": true, "dynamic": {"+:lm_head": {"bits": 3}}})",
       "dynamic[\"+:lm_head\"].bits = 3 is not supported (4 or 8)"},
      {R"({"quant_method": "gptq", "bits": 4, "lm_head": true, "dynamic": {"+:lm_head": {"group_size": 0}}})",
       "dynamic[\"+:lm_head\"].group_size = 0 is not supported"},
      {R"({"quant_method": "gptq", "bits": 4, "lm_head": true, "dynamic": {"+:lm_head": {"sym": "yes"}}})",
       "dynamic[\"+:lm_head\"].sym: expected true or false"},
      {R"({"quant_method": "gptq", "bits": 4, "lm_head": true, "dynamic": {"+:lm_head": {"damp_percent": 0.1}}})",
       "dynamic[\"+:lm_head\"].damp_percent is not supported (bits, group_size, sym, desc_act)"},
      {R"({"quant_method": "gptq", "bits": 4, "lm_head": true, "dynamic": {"+:lm_head": 8}})",
       "dynamic[\"+:lm_head\"]: expected an object of overrides"},
      {R"({"quant_method": "gptq", "bits": 4, "lm_head": true, "dynamic": {"+:(lm_head": {}}})",
       "'(lm_head' is not a regular expression"},
      {R"({"quant_method": "gptq", "bits": 4, "lm_head": "yes"})", "quantization_config.lm_head: expected true or false"},
  };
  testing::expect_config_errors(cases, [](const std::string& text) {
    parse_quantization_config(parse(text), "DIR/config.json");
  });
}

}  // namespace
}  // namespace tessera::io
