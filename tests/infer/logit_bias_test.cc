// OpenAI logit_bias in the Sampler and the request parser, against the formulas: the
// processed logits are raw + bias (then the penalties, vLLM's order), +100 makes greedy pick
// a token, -100 bans one under seeded sampling, the returned logprobs stay raw
// (log_softmax of the model's logits, as vLLM's default logprobs mode); bad fields name
// logit_bias / prompt_logprobs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "tessera/infer/logit_bias.h"
#include "tessera/infer/sampler.h"
#include "tessera/infer/sampling_json.h"

namespace tessera::infer {
namespace {

using nlohmann::json;

std::vector<float> random_logits(int64_t vocab, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> d(0.f, 2.f);
  std::vector<float> l(vocab);
  for (auto& v : l) v = d(g);
  return l;
}

int32_t argmax(const std::vector<float>& x) {
  return static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin());
}

TEST(LogitBias, ProcessedLogitsAreRawPlusBiasThenPenalties) {
  const int64_t V = 50;
  const auto raw = random_logits(V, 3);
  SamplingParams p;
  p.logit_bias = {{4, 2.5f}, {9, -7.f}, {49, 100.f}};
  Sampler s(p);
  const auto got = s.processed_logits(raw.data(), V, {}, {});
  for (int64_t i = 0; i < V; ++i) {
    float want = raw[i];
    for (const auto& [t, b] : p.logit_bias)
      if (t == i) want += b;
    EXPECT_EQ(got[i], want) << i;
  }
  // With a repetition penalty the bias comes first: (x + b) / r for positive, * r otherwise
  // (vLLM applies the logit-bias processor before the penalties); presence after that.
  SamplingParams q = p;
  q.repetition_penalty = 1.5f;
  q.presence_penalty = 0.5f;
  Sampler sq(q);
  const auto pen = sq.processed_logits(raw.data(), V, {4}, {9, 20});
  for (int64_t i = 0; i < V; ++i) {
    float x = raw[i];
    for (const auto& [t, b] : q.logit_bias)
      if (t == i) x += b;
    if (i == 4 || i == 9 || i == 20) x = x > 0 ? x / 1.5f : x * 1.5f;
    if (i == 9 || i == 20) x -= 0.5f;
    EXPECT_FLOAT_EQ(pen[i], x) << i;
  }
}

TEST(LogitBias, PlusHundredMakesGreedyPickTheToken) {
  const int64_t V = 300;
  for (uint64_t seed = 0; seed < 20; ++seed) {
    const auto raw = random_logits(V, seed);
    const int32_t best = argmax(raw);
    const int32_t target = static_cast<int32_t>((best + 1 + seed * 37) % V);
    ASSERT_NE(target, best);
    SamplingParams p;  // greedy
    p.logit_bias = {{target, 100.f}};
    Sampler s(p);
    EXPECT_EQ(s.sample(raw.data(), V, {}, {}).token, target) << seed;
    Sampler plain(SamplingParams{});
    EXPECT_EQ(plain.sample(raw.data(), V, {}, {}).token, best);
  }
}

TEST(LogitBias, MinusHundredBansATokenUnderSampling) {
  // Token 7 holds almost all the mass: unbiased, it is drawn nearly every time; at -100 never.
  const int64_t V = 64;
  std::vector<float> raw(V, 0.f);
  raw[7] = 6.f;
  SamplingParams p;
  p.temperature = 1.f;
  p.seed = 123;
  Sampler plain(p);
  int unbiased = 0;
  for (int i = 0; i < 2000; ++i) unbiased += plain.sample(raw.data(), V, {}, {}).token == 7;
  EXPECT_GT(unbiased, 1500);  // p(7) = e^6 / (e^6 + 63) = 0.86
  p.logit_bias = {{7, -100.f}};
  for (float top_p : {1.f, 0.9f}) {
    for (int64_t top_k : {int64_t{0}, int64_t{3}}) {
      SamplingParams q = p;
      q.top_p = top_p;
      q.top_k = top_k;
      Sampler s(q);
      std::vector<int> counts(V, 0);
      for (int i = 0; i < 20000; ++i) ++counts[s.sample(raw.data(), V, {}, {}).token];
      EXPECT_EQ(counts[7], 0) << "top_p " << top_p << " top_k " << top_k;
      if (top_k == 0 && top_p == 1.f)  // the rest is uniform over 63 tokens: each about 317
        for (int64_t t = 0; t < V; ++t)
          if (t != 7) { EXPECT_GT(counts[t], 200) << t; }
    }
  }
}

TEST(LogitBias, LogprobsStayRaw) {
  const int64_t V = 40;
  const auto raw = random_logits(V, 11);
  SamplingParams p;
  p.logprobs = 3;
  p.logit_bias = {{5, 100.f}};
  Sampler s(p);
  const SampleResult r = s.sample(raw.data(), V, {}, {});
  EXPECT_EQ(r.token, 5);
  double m = *std::max_element(raw.begin(), raw.end()), sum = 0;
  for (float x : raw) sum += std::exp(x - m);
  const double lse = m + std::log(sum);
  EXPECT_NEAR(r.logprob, raw[5] - lse, 1e-5);  // the model's, not the biased distribution's
  ASSERT_EQ(r.top_logprobs.size(), 3u);
  EXPECT_EQ(r.top_logprobs[0].token, argmax(raw));
  EXPECT_NEAR(r.top_logprobs[0].logprob, raw[argmax(raw)] - lse, 1e-5);
}

std::string field_of(const json& j, int64_t vocab = 0) {
  try {
    SamplingParams p = sampling_params_from_json(j, "request");
    if (auto e = p.find_error(vocab)) return "find_error:" + e->field;
    return "";
  } catch (const FieldError& e) {
    return e.field();
  }
}

TEST(LogitBias, ParsedFromJsonSortedAndChecked) {
  const SamplingParams p =
      sampling_params_from_json(json::parse(R"({"logit_bias": {"50": -100, "7": 2.5, "0": 100}})"), "request");
  ASSERT_EQ(p.logit_bias.size(), 3u);
  EXPECT_EQ(p.logit_bias[0], (std::pair<int32_t, float>{0, 100.f}));
  EXPECT_EQ(p.logit_bias[1], (std::pair<int32_t, float>{7, 2.5f}));
  EXPECT_EQ(p.logit_bias[2], (std::pair<int32_t, float>{50, -100.f}));
  EXPECT_TRUE(sampling_params_from_json(json::parse(R"({"logit_bias": null})"), "r").logit_bias.empty());
  EXPECT_TRUE(sampling_params_from_json(json::parse(R"({"logit_bias": {}})"), "r").logit_bias.empty());
  for (const char* bad : {R"({"logit_bias": [1, 2]})", R"({"logit_bias": "7"})", R"({"logit_bias": {"abc": 1}})",
                          R"({"logit_bias": {"1.5": 1}})", R"({"logit_bias": {"": 1}})", R"({"logit_bias": {" 7": 1}})",
                          R"({"logit_bias": {"+7": 1}})", R"({"logit_bias": {"-1": 1}})",
                          R"({"logit_bias": {"99999999999999999999999": 1}})", R"({"logit_bias": {"2147483648": 1}})",
                          R"({"logit_bias": {"7": "1"}})", R"({"logit_bias": {"7": true}})",
                          R"({"logit_bias": {"7": null}})", R"({"logit_bias": {"7": 100.5}})",
                          R"({"logit_bias": {"7": -101}})", R"({"logit_bias": {"7": 1e300}})",
                          R"({"logit_bias": {"7": 1, "07": 2}})"})
    EXPECT_EQ(field_of(json::parse(bad)), "logit_bias") << bad;
  // Ids beyond the vocabulary are found once it is known (the engine, the server).
  EXPECT_EQ(field_of(json::parse(R"({"logit_bias": {"384": 1}})"), 384), "find_error:logit_bias");
  EXPECT_EQ(field_of(json::parse(R"({"logit_bias": {"383": 1}})"), 384), "");
  SamplingParams dup;
  dup.logit_bias = {{3, 1.f}, {3, 2.f}};
  ASSERT_TRUE(dup.find_error(10));
  EXPECT_EQ(dup.find_error(10)->field, "logit_bias");
  SamplingParams nan;
  nan.logit_bias = {{3, NAN}};
  EXPECT_EQ(nan.find_error(10)->field, "logit_bias");
  // prompt_logprobs (vLLM): 0..20.
  EXPECT_EQ(sampling_params_from_json(json::parse(R"({"prompt_logprobs": 5})"), "r").prompt_logprobs, 5);
  for (const char* bad : {R"({"prompt_logprobs": 21})", R"({"prompt_logprobs": -1})", R"({"prompt_logprobs": 1.5})",
                          R"({"prompt_logprobs": true})", R"({"prompt_logprobs": "2"})"})
    EXPECT_EQ(field_of(json::parse(bad)), "prompt_logprobs") << bad;
}

}  // namespace
}  // namespace tessera::infer
