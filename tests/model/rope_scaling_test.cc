// config.json's rope_scaling and partial_rotary_factor (model/rope_scaling.h): what each type
// reads, the context it gives the model, the frequencies of transformers' formulas at hand-
// checked points, and one-line errors for what is not supported. Logits and gradients under
// each type are checked against PyTorch in parity_test.cc (the *_rope_* fixtures).
#include "tessera/model/rope_scaling.h"

#include <gtest/gtest.h>

#include <cmath>

#include <nlohmann/json.hpp>

#include "tessera/model/config.h"
#include "test_util/throws.h"

namespace tessera {
namespace {

using nlohmann::json;

json llama(json extra) {
  json j = {{"model_type", "llama"}, {"vocab_size", 100}, {"hidden_size", 64}, {"intermediate_size", 96},
            {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
            {"max_position_embeddings", 128}, {"rope_theta", 10000.0}};
  if (!extra.is_null()) j.update(extra);
  return j;
}

// The call throws a tessera::Error whose one-line message holds every needle.
template <typename Fn>
::testing::AssertionResult throws_error(Fn&& fn, std::initializer_list<const char*> needles) {
  return testing::throws_error(std::forward<Fn>(fn), needles, true);
}

model::ModelConfig parse(json extra) { return model::ModelConfig::from_json(llama(std::move(extra)), "config.json"); }

TEST(RopeScaling, EachTypeReadsAndGivesItsContext) {
  const auto plain = parse({});
  EXPECT_FALSE(plain.rope_scaling);
  EXPECT_EQ(model::max_context(plain), 128);
  EXPECT_FALSE(parse({{"rope_scaling", {{"rope_type", "default"}}}}).rope_scaling);

  const auto lin = parse({{"rope_scaling", {{"type", "linear"}, {"factor", 4.0}}}});
  ASSERT_TRUE(lin.rope_scaling);
  EXPECT_EQ(lin.rope_scaling->type, "linear");
  EXPECT_EQ(model::max_context(lin), 512);
  const auto dyn = parse({{"rope_scaling", {{"type", "dynamic"}, {"factor", 2.0}}}});
  EXPECT_EQ(model::max_context(dyn), 256);
  // Llama 3.1's max_position_embeddings is already the extended length.
  const auto l3 = parse({{"rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                                           {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 64}}}});
  EXPECT_EQ(model::max_context(l3), 128);
  // Qwen2.5's YaRN: factor x the original context.
  const auto yarn = parse({{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0},
                                             {"original_max_position_embeddings", 4096}}}});
  EXPECT_EQ(model::max_context(yarn), 16384);
  // Each writes back what it read.
  for (const auto* c : {&lin, &dyn, &l3, &yarn}) {
    const auto again = model::ModelConfig::from_json(c->to_json(), "to_json");
    EXPECT_EQ(again.to_json(), c->to_json());
    ASSERT_TRUE(again.rope_scaling);
    EXPECT_EQ(again.rope_scaling->type, c->rope_scaling->type);
    EXPECT_EQ(model::max_context(again), model::max_context(*c));
  }
}

TEST(RopeScaling, FrequenciesFollowTransformersFormulas) {
  // head_dim 16, theta 1e4: inv_freq[i] = 1e4^(-i/8).
  auto f0 = [](int i) { return 1.0f / std::pow(10000.f, static_cast<float>(2 * i) / 16.f); };
  const auto plain = model::rope_freqs(parse({}), 0);
  ASSERT_EQ(plain.inv_freq.size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(plain.inv_freq[i], f0(i));
  EXPECT_EQ(plain.attention_factor, 1.f);

  const auto lin = model::rope_freqs(parse({{"rope_scaling", {{"type", "linear"}, {"factor", 4.0}}}}), 0);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(lin.inv_freq[i], f0(i) / 4.f);

  // llama3, original 64 (wavelengths: high-frequency below 16, low-frequency above 64):
  // 6.3 kept; 19.9 and 62.8 smoothed; 199 and longer divided by 8.
  const auto l3 = model::rope_freqs(
      parse({{"rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                               {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 64}}}}), 0);
  EXPECT_EQ(l3.inv_freq[0], f0(0));
  for (int i : {1, 2}) {
    const double wavelen = 2 * M_PI / f0(i), smooth = (64.0 / wavelen - 1.0) / 3.0;
    EXPECT_NEAR(l3.inv_freq[i], (1 - smooth) * f0(i) / 8 + smooth * f0(i), 1e-6 * f0(i)) << i;
  }
  for (int i = 3; i < 8; ++i) EXPECT_EQ(l3.inv_freq[i], f0(i) / 8.f) << i;

  // Dynamic NTK: unchanged up to max_position_embeddings, then base x (2 x 256/128 - 1)^(16/14).
  const auto dyn = parse({{"rope_scaling", {{"type", "dynamic"}, {"factor", 2.0}}}});
  EXPECT_EQ(model::rope_freqs(dyn, 100).inv_freq, plain.inv_freq);
  const float base = static_cast<float>(10000.0 * std::pow(3.0, 16.0 / 14.0));
  const auto d256 = model::rope_freqs(dyn, 256);
  for (int i = 0; i < 8; ++i)
    EXPECT_EQ(d256.inv_freq[i], 1.0f / std::pow(base, static_cast<float>(2 * i) / 16.f)) << i;

  // YaRN at theta 1e4 over an original 4096: correction range [floor 2.75, ceil 5.70] = [2, 6];
  // below it the frequency stays, above it it is divided by the factor; cos/sin x 0.1 ln 4 + 1.
  const auto yarn = model::rope_freqs(
      parse({{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 4096}}}}), 0);
  EXPECT_FLOAT_EQ(yarn.attention_factor, static_cast<float>(0.1 * std::log(4.0) + 1.0));
  EXPECT_EQ(yarn.inv_freq[0], f0(0));
  EXPECT_EQ(yarn.inv_freq[2], f0(2));
  EXPECT_NEAR(yarn.inv_freq[4], 0.5 * f0(4) / 4 + 0.5 * f0(4), 1e-6 * f0(4));
  EXPECT_NEAR(yarn.inv_freq[7], f0(7) / 4, 1e-6 * f0(7));
  // An explicit attention_factor wins.
  const auto af = model::rope_freqs(parse({{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0},
                                                             {"attention_factor", 1.5}}}}), 0);
  EXPECT_EQ(af.attention_factor, 1.5f);
}

TEST(RopeScaling, PartialRotaryRotatesTheLeadingFeatures) {
  const auto c = parse({{"partial_rotary_factor", 0.5}});
  EXPECT_EQ(model::rotary_dim(c), 8);
  EXPECT_EQ(model::rope_freqs(c, 0).inv_freq.size(), 4u);
  EXPECT_EQ(model::rope_freqs(c, 0).inv_freq[1], 1.0f / std::pow(10000.f, 2.f / 8.f));  // over rotary_dim
  EXPECT_EQ(model::ModelConfig::from_json(c.to_json(), "again").partial_rotary_factor, 0.5);
  EXPECT_EQ(model::rotary_dim(parse({})), 16);
}

TEST(RopeScaling, UnsupportedOrIncompleteScalingIsOneLineError) {
  EXPECT_TRUE(throws_error([] { parse({{"rope_scaling", {{"rope_type", "longrope"}, {"factor", 2.0}}}}); },
                           {"config.json", "rope_scaling", "longrope", "not supported"}));
  EXPECT_TRUE(throws_error([] { parse({{"rope_scaling", {{"type", "linear"}}}}); },
                           {"config.json", "linear", "needs 'factor'"}));
  EXPECT_TRUE(throws_error([] { parse({{"rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}}}}); },
                           {"llama3", "needs 'low_freq_factor'"}));
  EXPECT_TRUE(throws_error([] { parse({{"rope_scaling", {{"type", "linear"}, {"factor", 0.5}}}}); },
                           {"factor", "[1, "}));
  EXPECT_TRUE(throws_error([] { parse({{"rope_scaling", 4}}); }, {"rope_scaling", "object"}));
  EXPECT_TRUE(throws_error([] { parse({{"partial_rotary_factor", 0.0625}}); },
                           {"partial_rotary_factor", "rotates 1", "even"}));
  EXPECT_TRUE(throws_error([] { parse({{"partial_rotary_factor", 1.5}}); }, {"partial_rotary_factor"}));
}

}  // namespace
}  // namespace tessera
