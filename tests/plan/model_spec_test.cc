// Model shapes: preset parameter counts against the published ones, config.json reading
// (dense, MoE, MLA, GPT-2), the parametric shape, and bad inputs.
#include <gtest/gtest.h>

#include <cmath>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/plan/model_spec.h"

namespace tessera::plan {
namespace {

// Parameter counts Hugging Face reports for each checkpoint (safetensors metadata).
TEST(ModelSpec, PresetsMatchPublishedParameterCounts) {
  const std::pair<const char*, int64_t> want[] = {
      {"llama2-7b", 6738415616},    {"llama2-13b", 13015864320},  {"llama2-70b", 68976648192},
      {"llama3-8b", 8030261248},    {"llama3-70b", 70553706496},  {"llama3-405b", 405853388800},
      {"mixtral-8x7b", 46702792704}};
  for (const auto& [name, n] : want) EXPECT_EQ(model_preset(name).total_params(), n) << name;
}

TEST(ModelSpec, Gpt3AndDeepSeekV3MatchTheirPapers) {
  // GPT-3: "175.0B" (Brown et al. 2020, Table 2.1); DeepSeek-V3: 671B total, 37B activated
  // per token (DeepSeek-AI 2024, abstract; the 14B multi-token-prediction module excluded).
  EXPECT_NEAR(model_preset("gpt3-175b").total_params() / 175.0e9, 1.0, 0.005);
  const ModelSpec ds = model_preset("deepseek-v3");
  EXPECT_NEAR(ds.total_params() / 671e9, 1.0, 0.005);
  EXPECT_NEAR(ds.active_params() / 37e9, 1.0, 0.02);
  EXPECT_EQ(ds.moe_layer_count(), 58);
  // Mixtral: 12.9B active (Jiang et al. 2024, "13B active parameters").
  EXPECT_NEAR(model_preset("mixtral-8x7b").active_params() / 12.9e9, 1.0, 0.01);
}

TEST(ModelSpec, ReadsHuggingFaceConfigs) {
  // Mixtral-8x7B's config.json (the keys that matter).
  const auto mixtral = nlohmann::json::parse(R"({
    "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
    "tie_word_embeddings": false, "rope_theta": 1e6})");
  EXPECT_EQ(model_from_hf_json(mixtral, "m/config.json").total_params(), 46702792704);
  // DeepSeek-V3's config.json.
  const auto ds = nlohmann::json::parse(R"({
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280,
    "tie_word_embeddings": false})");
  const ModelSpec d = model_from_hf_json(ds, "ds/config.json");
  EXPECT_EQ(d.total_params(), model_preset("deepseek-v3").total_params());
  EXPECT_TRUE(d.mla);
  EXPECT_EQ(d.kv_elements_per_token_layer(), 512 + 64);
  // GPT-2 124M: 124,439,808 parameters (the published count).
  const auto gpt2 = nlohmann::json::parse(
      R"({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
          "n_positions": 1024})");
  EXPECT_EQ(model_from_hf_json(gpt2, "g/config.json").total_params(), 124439808);
  // Llama 3 with rope_scaling (which the engine rejects) is fine for planning.
  const auto l3 = nlohmann::json::parse(R"({
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})");
  EXPECT_EQ(model_from_hf_json(l3, "l3/config.json").total_params(), 8030261248);
}

TEST(ModelSpec, BadConfigsNameTheKey) {
  auto msg = [](const char* text) {
    try {
      model_from_hf_json(nlohmann::json::parse(text), "x/config.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(msg(R"({"hidden_size": 64})").find("missing string key 'model_type'"), std::string::npos);
  EXPECT_NE(msg(R"({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "vocab_size": 10})").find("'intermediate_size'"),
            std::string::npos);
  EXPECT_NE(msg(R"({"model_type": "llama", "hidden_size": "64"})").find("'hidden_size' must be an integer"),
            std::string::npos);
  EXPECT_NE(msg(R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3,
                    "vocab_size": 10})").find("do not divide"),
            std::string::npos);
  EXPECT_THROW(model_preset("llama9-1t"), Error);
  EXPECT_THROW(load_model("/nonexistent/config.json"), Error);
}

TEST(ModelSpec, ParametricShapeHitsTheCount) {
  ParametricOptions o;
  o.params = parse_count("200b", "--params");
  const ModelSpec m = parametric_model(o);
  EXPECT_NEAR(m.total_params() / 200e9, 1.0, 0.02);
  EXPECT_EQ(m.hidden % 128, 0);
  EXPECT_NEAR(static_cast<double>(m.hidden) / m.layers, 128, 40);  // aspect ratio
  o.layers = 80;
  const ModelSpec m80 = parametric_model(o);
  EXPECT_EQ(m80.layers, 80);
  EXPECT_NEAR(m80.total_params() / 200e9, 1.0, 0.02);
  o.layers = 0, o.hidden = 8192;
  const ModelSpec mh = parametric_model(o);
  EXPECT_EQ(mh.hidden, 8192);
  EXPECT_NEAR(mh.total_params() / 200e9, 1.0, 0.05);
}

TEST(ModelSpec, ParseCount) {
  EXPECT_DOUBLE_EQ(parse_count("200b", "x"), 200e9);
  EXPECT_DOUBLE_EQ(parse_count("1.5T", "x"), 1.5e12);
  EXPECT_DOUBLE_EQ(parse_count("7e9", "x"), 7e9);
  EXPECT_DOUBLE_EQ(parse_count("4M", "x"), 4e6);
  for (const char* bad : {"", "b", "12x", "-3b", "abc"}) EXPECT_THROW(parse_count(bad, "--params"), Error) << bad;
}

}  // namespace
}  // namespace tessera::plan
