// Sampler and StopChecker against independent references: distributions computed here in
// double from the formulas (softmax, top-k, top-p, min-p), hand-computed penalties,
// log_softmax in double, and a brute-force stop-string search.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>

#include "tessera/infer/sampler.h"

namespace tessera::infer {
namespace {

const std::vector<int32_t> kNone;

SamplingParams make(float t, int64_t k = 0, float p = 1.f, float min_p = 0.f,
                    std::optional<uint64_t> seed = 1) {
  SamplingParams s;
  s.temperature = t;
  s.top_k = k;
  s.top_p = p;
  s.min_p = min_p;
  s.seed = seed;
  return s;
}

std::vector<float> random_logits(int64_t vocab, uint64_t seed, float scale) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> l(vocab);
  for (auto& v : l) v = d(g);
  return l;
}

// The distribution the sampler must draw from, straight from the definitions:
// softmax(l / T); keep p_i >= min_p * p_max and the k largest; renormalise; keep tokens in
// descending order while the mass before them is < top_p; renormalise. Also checks that no
// token sits within 1e-5 of a threshold, so float-vs-double rounding cannot flip the test.
std::vector<double> reference_probs(const std::vector<float>& logits, const SamplingParams& sp) {
  const size_t V = logits.size();
  std::vector<int> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  const double T = sp.temperature, m = logits[order[0]];
  std::vector<double> p(V);
  double z = 0.0;
  for (size_t i = 0; i < V; ++i) z += p[i] = std::exp((logits[i] - m) / T);
  for (auto& v : p) v /= z;
  std::vector<bool> keep(V, true);
  for (size_t r = 0; r < V; ++r) {
    const int i = order[r];
    if (sp.top_k > 0 && static_cast<int64_t>(r) >= sp.top_k) {
      keep[i] = false;
    } else if (sp.min_p > 0) {
      const double ratio = p[i] / p[order[0]];
      EXPECT_GT(std::abs(ratio - sp.min_p), 1e-5) << "test logits too close to min_p at " << i;
      if (ratio < sp.min_p) keep[i] = false;
    }
  }
  auto renormalise = [&] {
    double s = 0.0;
    for (size_t i = 0; i < V; ++i) s += keep[i] ? p[i] : 0.0;
    for (size_t i = 0; i < V; ++i) p[i] = keep[i] ? p[i] / s : 0.0;
  };
  renormalise();
  if (sp.top_p < 1) {
    double before = 0.0;
    for (int i : order) {
      if (!keep[i]) continue;
      EXPECT_GT(std::abs(before - sp.top_p), 1e-5) << "test logits too close to top_p at " << i;
      if (before >= sp.top_p) keep[i] = false;
      before += p[i];
    }
    renormalise();
  }
  return p;
}

std::vector<int64_t> draw_counts(Sampler& s, const std::vector<float>& logits, int64_t draws,
                                 const std::vector<int32_t>& prompt = kNone,
                                 const std::vector<int32_t>& output = kNone) {
  std::vector<int64_t> c(logits.size(), 0);
  for (int64_t i = 0; i < draws; ++i)
    ++c[s.sample(logits.data(), static_cast<int64_t>(logits.size()), prompt, output).token];
  return c;
}

// Excluded tokens are never drawn; the others within 4.5 binomial sigmas.
void expect_frequencies(const std::vector<int64_t>& counts, const std::vector<double>& p,
                        int64_t draws) {
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] == 0.0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " is outside the allowed set";
      continue;
    }
    const double f = static_cast<double>(counts[i]) / draws;
    EXPECT_NEAR(f, p[i], 4.5 * std::sqrt(p[i] * (1 - p[i]) / draws) + 1e-12) << "token " << i;
  }
}

const std::vector<float> kLogits = {1.2f, -0.4f, 2.5f, 0.3f,  2.1f, -1.7f,
                                    0.9f, 1.6f,  -0.2f, 0.05f, 3.0f, -2.5f};

TEST(Sampler, GreedyIsArgmax) {
  Sampler s(make(0.f));
  for (uint64_t trial = 0; trial < 20; ++trial) {
    const auto l = random_logits(1000, trial, 3.f);
    const int32_t expect = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
    EXPECT_EQ(s.sample(l.data(), 1000, kNone, kNone).token, expect);
  }
  const std::vector<float> tie = {0.f, 5.f, 1.f, 5.f};
  EXPECT_EQ(s.sample(tie.data(), 4, kNone, kNone).token, 1);  // lowest id on ties
  Sampler tiny(make(1e-6f));  // below vLLM's 1e-5: greedy
  EXPECT_EQ(tiny.sample(kLogits.data(), 12, kNone, kNone).token, 10);
  // Tensor overload: (V) and (1, V); anything else is an error.
  EXPECT_EQ(s.sample(Tensor::from_vector(kLogits, {12})).token, 10);
  EXPECT_EQ(s.sample(Tensor::from_vector(kLogits, {1, 12})).token, 10);
  EXPECT_THROW(s.sample(Tensor::zeros({2, 3}, DType::kF32)), Error);
  const std::vector<float> nan = {0.f, std::nanf(""), 1.f};
  EXPECT_THROW(s.sample(nan.data(), 3, kNone, kNone), Error);
}

TEST(Sampler, SeedReproducesAndSeparates) {
  const std::vector<float> flat(16, 0.f);
  auto run = [&](Sampler s) {
    std::vector<int32_t> seq;
    for (int i = 0; i < 50; ++i) seq.push_back(s.sample(flat.data(), 16, kNone, kNone).token);
    return seq;
  };
  const auto a = run(Sampler(make(1.f, 0, 1.f, 0.f, 42)));
  EXPECT_EQ(a, run(Sampler(make(1.f, 0, 1.f, 0.f, 42))));
  EXPECT_NE(a, run(Sampler(make(1.f, 0, 1.f, 0.f, 43))));
  // Without a seed, two samplers draw different sequences (equal with chance 16^-50).
  EXPECT_NE(run(Sampler(make(1.f, 0, 1.f, 0.f, std::nullopt))),
            run(Sampler(make(1.f, 0, 1.f, 0.f, std::nullopt))));
  // Sample i of n starts from seed + i: differs from sample 0, reproducible.
  auto p = make(1.f, 0, 1.f, 0.f, 42);
  p.n = 2;
  const auto second = run(Sampler(p, {}, 1));
  EXPECT_NE(second, a);
  EXPECT_EQ(second, run(Sampler(make(1.f, 0, 1.f, 0.f, 43))));
  EXPECT_THROW(Sampler(p, {}, 2), Error);
}

TEST(Sampler, FrequenciesMatchFilteredSoftmax) {
  const int64_t draws = 200000;
  const std::vector<SamplingParams> cases = {
      make(1.f),          make(0.7f),        make(1.5f, 3),           make(1.f, -1),
      make(1.f, 0, 0.8f), make(0.9f, 0, 1.f, 0.2f),                   make(2.f, 0, 0.5f),
      make(1.3f, 5, 0.7f, 0.05f),            make(0.8f, 1),           make(1.f, 100, 0.95f)};
  for (size_t c = 0; c < cases.size(); ++c) {
    SCOPED_TRACE(testing::Message() << "case " << c << " T=" << cases[c].temperature << " k="
                                    << cases[c].top_k << " p=" << cases[c].top_p
                                    << " min_p=" << cases[c].min_p);
    auto sp = cases[c];
    sp.seed = 1000 + c;
    Sampler s(sp);
    expect_frequencies(draw_counts(s, kLogits, draws), reference_probs(kLogits, sp), draws);
  }
}

TEST(Sampler, LargeVocabularyNucleus) {
  // A nucleus of hundreds of tokens: top-p grows its sorted prefix in several chunks.
  const auto l = random_logits(4000, 7, 1.f);
  auto sp = make(1.f, 0, 0.6f);
  const auto p = reference_probs(l, sp);
  Sampler s(sp);
  const int64_t draws = 20000;
  const auto counts = draw_counts(s, l, draws);
  std::vector<int> kept;
  for (int i = 0; i < 4000; ++i)
    if (p[i] > 0) kept.push_back(i);
  ASSERT_GT(kept.size(), 300u);
  std::sort(kept.begin(), kept.end(), [&](int a, int b) { return l[a] > l[b]; });
  // Nothing outside the nucleus; mass per decile of the nucleus (by rank) as expected.
  int64_t inside = 0;
  std::vector<double> want(10, 0.0), got(10, 0.0);
  for (size_t r = 0; r < kept.size(); ++r) {
    const size_t b = r * 10 / kept.size();
    want[b] += p[kept[r]];
    got[b] += static_cast<double>(counts[kept[r]]) / draws;
    inside += counts[kept[r]];
  }
  EXPECT_EQ(inside, draws);
  for (int b = 0; b < 10; ++b)
    EXPECT_NEAR(got[b], want[b], 4.5 * std::sqrt(want[b] * (1 - want[b]) / draws)) << "decile " << b;

  // Full-size vocabulary with top-k (the heap path), min-p and top-p together.
  const auto big = random_logits(32000, 11, 3.f);
  auto sk = make(0.8f, 40, 0.8f, 0.03f);
  Sampler sb(sk);
  const auto pb = reference_probs(big, sk);
  auto support = [](const std::vector<double>& q) {
    return std::count_if(q.begin(), q.end(), [](double v) { return v > 0; });
  };
  auto no_min_p = sk, no_top_p = sk;
  no_min_p.min_p = 0.f;
  no_top_p.top_p = 1.f;
  // Each filter removes tokens here, so each one is exercised.
  EXPECT_LT(support(pb), support(reference_probs(big, no_min_p)));
  EXPECT_LT(support(pb), support(reference_probs(big, no_top_p)));
  EXPECT_LT(support(reference_probs(big, no_top_p)), 40);
  expect_frequencies(draw_counts(sb, big, 8000), pb, 8000);
}

TEST(Sampler, TiesAreBrokenByLowerId) {
  // Equal logits: top-k keeps the k lowest ids (both the heap and the nth_element path);
  // top-p keeps the lowest ids while the mass before them is < top_p.
  for (int64_t vocab : {12, 100}) {
    const std::vector<float> flat(vocab, 0.5f);
    for (const auto& sp : {make(1.f, 3), make(1.f, 0, 0.355f)}) {
      Sampler s(sp);
      const int64_t draws = 20000;
      const auto counts = draw_counts(s, flat, draws);
      const int kept = sp.top_k == 3 ? 3 : static_cast<int>(std::ceil(0.355 * vocab));
      std::vector<double> p(vocab, 0.0);
      for (int i = 0; i < kept; ++i) p[i] = 1.0 / kept;
      expect_frequencies(counts, p, draws);
      const auto ref = reference_probs(flat, sp);
      for (int64_t i = 0; i < vocab; ++i) EXPECT_NEAR(ref[i], p[i], 1e-12);
    }
  }
}

TEST(Sampler, PenaltiesMatchHandComputedLogits) {
  const std::vector<float> l = {2.0f, -1.0f, 0.5f, 0.0f, -0.3f, 3.0f};
  const std::vector<int32_t> prompt = {0, 1, 1}, output = {2, 2, 4, 2};
  auto sp = make(0.f);
  sp.repetition_penalty = 1.5f;
  sp.presence_penalty = 0.5f;
  sp.frequency_penalty = 0.25f;
  Sampler s(sp);
  // By hand: in prompt/output, positive / 1.5, negative * 1.5; output tokens then lose
  // 0.25 * count + 0.5. Tokens 3 and 5 appear nowhere.
  const std::vector<float> want = {2.0f / 1.5f,  -1.5f, 0.5f / 1.5f - 0.75f - 0.5f, 0.0f,
                                   -0.45f - 0.25f - 0.5f, 3.0f};
  const auto got = s.processed_logits(l.data(), 6, prompt, output);
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(got[i], want[i], 1e-6) << "token " << i;

  // Presence / frequency look only at output tokens; negative values encourage.
  auto pf = make(0.f);
  pf.presence_penalty = -1.f;
  pf.frequency_penalty = 2.f;
  Sampler spf(pf);
  const auto g2 = spf.processed_logits(l.data(), 6, {5, 5}, {3, 0, 3});
  EXPECT_FLOAT_EQ(g2[5], 3.0f);
  EXPECT_FLOAT_EQ(g2[3], 0.0f - 4.f + 1.f);
  EXPECT_FLOAT_EQ(g2[0], 2.0f - 2.f + 1.f);

  // A bad id is an error that leaves the sampler's scratch clean for the next call.
  EXPECT_THROW(s.processed_logits(l.data(), 6, prompt, {2, 99}), Error);
  EXPECT_THROW(s.processed_logits(l.data(), 6, {-1}, output), Error);
  const auto again = s.processed_logits(l.data(), 6, prompt, output);
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(again[i], want[i], 1e-6) << "token " << i;

  // Greedy sees penalised logits: 1.0 / 1.2 < 0.9.
  auto rp = make(0.f);
  rp.repetition_penalty = 1.2f;
  Sampler sr(rp);
  const std::vector<float> two = {1.0f, 0.9f};
  EXPECT_EQ(sr.sample(two.data(), 2, {0}, kNone).token, 1);
  EXPECT_EQ(sr.sample(two.data(), 2, kNone, kNone).token, 0);
}

TEST(Sampler, PenaltiesComeBeforeTemperature) {
  // softmax((l - penalty) / T), not softmax(l / T - penalty): the two differ for T != 1.
  auto sp = make(2.f);
  sp.frequency_penalty = 1.5f;
  sp.seed = 99;
  Sampler s(sp);
  const std::vector<int32_t> output = {10, 10, 2};
  std::vector<float> penalised = kLogits;
  penalised[10] -= 3.f;
  penalised[2] -= 1.5f;
  const int64_t draws = 200000;
  expect_frequencies(draw_counts(s, kLogits, draws, kNone, output),
                     reference_probs(penalised, sp), draws);
}

TEST(Sampler, MinTokensSuppressesStopAndEos) {
  const std::vector<float> l = {0.f, 1.f, 2.f, 5.f, 9.f};  // eos = 4, stop id = 3
  auto sp = make(0.f);
  sp.min_tokens = 2;
  sp.stop_token_ids = {3};
  Sampler s(sp, {4, -1});
  EXPECT_EQ(s.sample(l.data(), 5, kNone, kNone).token, 2);
  EXPECT_EQ(s.sample(l.data(), 5, kNone, {2}).token, 2);
  EXPECT_EQ(s.sample(l.data(), 5, kNone, {2, 2}).token, 4);
  const auto x = s.processed_logits(l.data(), 5, kNone, {2});
  EXPECT_TRUE(std::isinf(x[3]) && x[3] < 0);
  EXPECT_TRUE(std::isinf(x[4]) && x[4] < 0);
  EXPECT_TRUE(s.is_stop_token(4) && s.is_stop_token(3) && !s.is_stop_token(2));
  // ignore_eos: EOS is neither suppressed nor a stop; stop ids still are both.
  sp.ignore_eos = true;
  Sampler ie(sp, {4});
  EXPECT_EQ(ie.sample(l.data(), 5, kNone, kNone).token, 4);
  EXPECT_FALSE(ie.is_stop_token(4));
  EXPECT_TRUE(ie.is_stop_token(3));
}

// log_softmax in double, the reference for raw logprobs.
std::vector<double> log_softmax(const std::vector<float>& l) {
  const double m = *std::max_element(l.begin(), l.end());
  double s = 0.0;
  for (float v : l) s += std::exp(v - m);
  std::vector<double> out;
  for (float v : l) out.push_back(v - m - std::log(s));
  return out;
}

TEST(Sampler, LogprobsAreRawLogSoftmax) {
  for (int64_t vocab : {50, 32000}) {
    const auto l = random_logits(vocab, 5 + vocab, 2.f);
    const auto ref = log_softmax(l);
    std::vector<int32_t> by_rank(vocab);
    std::iota(by_rank.begin(), by_rank.end(), 0);
    std::sort(by_rank.begin(), by_rank.end(), [&](int a, int b) { return l[a] > l[b]; });
    // Processed (penalties, T, top-k) and unprocessed (T = 1: normaliser reused) and greedy.
    auto processed = make(0.7f, 5);
    processed.repetition_penalty = 1.3f;
    processed.logprobs = 5;
    auto plain = make(1.f);
    plain.logprobs = 20;
    auto greedy = make(0.f);
    greedy.logprobs = 3;
    for (const auto& sp : {processed, plain, greedy}) {
      Sampler s(sp);
      for (int i = 0; i < 5; ++i) {
        const auto r = s.sample(l.data(), vocab, {by_rank[0], 3}, {by_rank[1]});
        EXPECT_NEAR(r.logprob, ref[r.token], 1e-5) << "vocab " << vocab;
        ASSERT_EQ(r.top_logprobs.size(), static_cast<size_t>(*sp.logprobs));
        for (int j = 0; j < *sp.logprobs; ++j) {
          EXPECT_EQ(r.top_logprobs[j].token, by_rank[j]);
          EXPECT_NEAR(r.top_logprobs[j].logprob, ref[by_rank[j]], 1e-5);
        }
      }
    }
  }
  auto zero = make(1.f);
  zero.logprobs = 0;
  Sampler sz(zero);
  const auto r = sz.sample(kLogits.data(), 12, kNone, kNone);
  EXPECT_TRUE(r.top_logprobs.empty());
  EXPECT_NEAR(r.logprob, log_softmax(kLogits)[r.token], 1e-6);
  Sampler none(make(1.f));
  EXPECT_TRUE(none.sample(kLogits.data(), 12, kNone, kNone).top_logprobs.empty());
}

TEST(SamplingParams, ErrorsNameTheField) {
  struct Case {
    std::function<void(SamplingParams&)> set;
    const char* field;
  };
  const float nan = std::nanf(""), inf = INFINITY;
  const std::vector<Case> cases = {
      {[](auto& p) { p.temperature = -0.1f; }, "temperature"},
      {[&](auto& p) { p.temperature = nan; }, "temperature"},
      {[&](auto& p) { p.temperature = inf; }, "temperature"},
      {[](auto& p) { p.top_k = -2; }, "top_k"},
      {[](auto& p) { p.top_p = 0.f; }, "top_p"},
      {[](auto& p) { p.top_p = 1.5f; }, "top_p"},
      {[&](auto& p) { p.top_p = nan; }, "top_p"},
      {[](auto& p) { p.min_p = -0.1f; }, "min_p"},
      {[](auto& p) { p.min_p = 1.1f; }, "min_p"},
      {[](auto& p) { p.repetition_penalty = 0.f; }, "repetition_penalty"},
      {[&](auto& p) { p.repetition_penalty = inf; }, "repetition_penalty"},
      {[](auto& p) { p.presence_penalty = 2.5f; }, "presence_penalty"},
      {[&](auto& p) { p.presence_penalty = nan; }, "presence_penalty"},
      {[](auto& p) { p.frequency_penalty = -2.01f; }, "frequency_penalty"},
      {[](auto& p) { p.max_tokens = 0; }, "max_tokens"},
      {[](auto& p) { p.min_tokens = -1; }, "min_tokens"},
      {[](auto& p) { p.min_tokens = 17; }, "min_tokens"},  // > max_tokens 16
      {[](auto& p) { p.stop = {"ok", ""}; }, "stop"},
      {[](auto& p) { p.stop_token_ids = {3, -1}; }, "stop_token_ids"},
      {[](auto& p) { p.stop_token_ids = {50}; }, "stop_token_ids"},  // vocab 50
      {[](auto& p) { p.n = 0; }, "n"},
      {[](auto& p) { p.n = 129; }, "n"},
      {[](auto& p) { p.n = 2, p.temperature = 0.f; }, "n"},
      {[](auto& p) { p.logprobs = 21; }, "logprobs"},
      {[](auto& p) { p.logprobs = -1; }, "logprobs"},
  };
  for (const auto& c : cases) {
    SamplingParams p = make(1.f);
    c.set(p);
    const auto e = p.find_error(50);
    ASSERT_TRUE(e) << c.field;
    EXPECT_EQ(e->field, c.field);
    EXPECT_EQ(e->message.rfind(c.field, 0), 0u) << e->message;
    try {
      p.validate(50);
      ADD_FAILURE() << "no error for " << c.field;
    } catch (const Error& err) {
      EXPECT_EQ(std::string(err.what()), e->message);
    }
  }
  // The edges that are allowed.
  SamplingParams ok = make(0.8f, -1, 1.f, 1.f);
  ok.n = 128;
  ok.logprobs = 20;
  ok.presence_penalty = -2.f;
  ok.frequency_penalty = 2.f;
  ok.min_tokens = 16;
  ok.stop_token_ids = {49};
  EXPECT_FALSE(ok.find_error(50)) << ok.find_error(50)->message;
  EXPECT_FALSE(SamplingParams{}.find_error());
  SamplingParams bad = make(1.f);
  bad.top_p = 2.f;
  EXPECT_THROW(Sampler{bad}, Error);
}

// Brute force over the whole text: start of the earliest stop string, or npos.
size_t brute_force_stop(const std::string& text, const std::vector<std::string>& stops) {
  for (size_t pos = 0; pos < text.size(); ++pos)
    for (const auto& s : stops)
      if (text.compare(pos, s.size(), s) == 0) return pos;
  return std::string::npos;
}

// Longest suffix of text that is a proper prefix of some stop string.
size_t brute_force_hold(const std::string& text, const std::vector<std::string>& stops) {
  size_t best = 0;
  for (const auto& s : stops)
    for (size_t len = 1; len < s.size() && len <= text.size(); ++len)
      if (text.compare(text.size() - len, len, s, 0, len) == 0) best = std::max(best, len);
  return best;
}

TEST(StopChecker, FindsEarliestStopAcrossPieces) {
  {  // at the very start
    StopChecker c({"Hello"});
    const auto u = c.append("Hello world");
    EXPECT_TRUE(u.stopped);
    EXPECT_EQ(u.emit, "");
    EXPECT_EQ(c.text(), "");
  }
  {  // split over three pieces, with held-back bytes
    StopChecker c({"STOP"});
    auto u = c.append("abc ST");
    EXPECT_EQ(u.emit, "abc ");
    EXPECT_FALSE(u.stopped);
    EXPECT_EQ(c.append("O").emit, "");
    u = c.append("P more");
    EXPECT_TRUE(u.stopped);
    EXPECT_EQ(u.emit, "");
    EXPECT_EQ(c.text(), "abc ");
    EXPECT_EQ(c.append("later").emit, "");  // ignored after the stop
  }
  {  // a false alarm is released, the tail at the end is flushed
    StopChecker c({"STOP"});
    EXPECT_EQ(c.append("ST").emit, "");
    EXPECT_EQ(c.append("AR S").emit, "STAR ");
    EXPECT_EQ(c.flush(), "S");
    EXPECT_FALSE(c.stopped());
  }
  {  // self-overlapping stop: "aaa" then "b" matches at 1
    StopChecker c({"aab"});
    EXPECT_EQ(c.append("a").emit, "");
    EXPECT_EQ(c.append("a").emit, "");
    EXPECT_EQ(c.append("a").emit, "a");
    const auto u = c.append("b!");
    EXPECT_TRUE(u.stopped);
    EXPECT_EQ(c.text(), "a");
  }
  {  // stop in the middle of one piece
    StopChecker c({"\n\n"});
    const auto u = c.append("ab\n\nc");
    EXPECT_TRUE(u.stopped);
    EXPECT_EQ(u.emit, "ab");
  }
  StopChecker none({});
  EXPECT_EQ(none.append("anything").emit, "anything");
  EXPECT_THROW(StopChecker({"x", ""}), Error);
}

TEST(StopChecker, OverlappingStopsAndHoldBack) {
  StopChecker c({"abc", "bc"});
  auto m = c.find("xabcd");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->pos, 1u);
  EXPECT_EQ(m->stop_index, 0u);
  StopChecker d({"cd", "abc"});
  m = d.find("zabcd");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->pos, 1u);  // "abc" starts before "cd"
  EXPECT_EQ(m->stop_index, 1u);
  StopChecker e({"ab", "abc"});
  m = e.find("xabc");
  EXPECT_EQ(m->pos, 1u);
  EXPECT_EQ(m->stop_index, 0u);  // same start: first listed
  // find(text, new_from) reports only matches reaching byte new_from or later.
  StopChecker s({"STOP"});
  EXPECT_FALSE(s.find("STOPxx", 4));
  EXPECT_TRUE(s.find("STOPxx", 3));

  StopChecker h({"</s>", "###", "abab"});
  EXPECT_EQ(h.hold_back("text </"), 2u);
  EXPECT_EQ(h.hold_back("text #"), 1u);
  EXPECT_EQ(h.hold_back("text ##"), 2u);
  EXPECT_EQ(h.hold_back("a</s"), 3u);
  EXPECT_EQ(h.hold_back("text"), 0u);
  EXPECT_EQ(h.hold_back("xaba"), 3u);
  EXPECT_EQ(h.hold_back("xab"), 2u);
  EXPECT_EQ(h.hold_back("<"), 1u);
  EXPECT_EQ(h.hold_back(""), 0u);
}

TEST(StopChecker, RandomStreamsMatchBruteForce) {
  // Generation stops after the first piece that completes any stop string; the output is
  // cut at the earliest stop in the text at that moment. Until then exactly the bytes that
  // cannot start a stop string have been streamed.
  std::mt19937 g(3);
  auto word = [&](int max_len) {
    std::string w;
    const int n = 1 + static_cast<int>(g() % max_len);
    for (int i = 0; i < n; ++i) w += "ab"[g() % 2];
    return w;
  };
  int stopped_runs = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<std::string> stops;
    for (int i = 0, n = 1 + g() % 3; i < n; ++i) stops.push_back(word(4));
    const std::string text = word(30);
    StopChecker c(stops);
    std::string streamed, so_far, want;
    bool want_stop = false;
    for (size_t pos = 0; pos < text.size() && !want_stop;) {
      const size_t len = std::min<size_t>(1 + g() % 4, text.size() - pos);
      so_far += text.substr(pos, len);
      pos += len;
      const auto u = c.append(std::string_view(text).substr(pos - len, len));
      streamed += u.emit;
      if (const size_t at = brute_force_stop(so_far, stops); at != std::string::npos) {
        want_stop = true;
        want = so_far.substr(0, at);
      } else {
        ASSERT_EQ(streamed, so_far.substr(0, so_far.size() - brute_force_hold(so_far, stops)));
      }
      ASSERT_EQ(u.stopped, want_stop) << so_far;
    }
    if (!want_stop) {
      want = so_far;
      streamed += c.flush();
    }
    stopped_runs += want_stop;
    ASSERT_EQ(streamed, want) << "text " << text << " stop[0] " << stops[0];
    ASSERT_EQ(c.text(), want);
  }
  EXPECT_GT(stopped_runs, 500);  // both outcomes are exercised
  EXPECT_LT(stopped_runs, 1900);
}

}  // namespace
}  // namespace tessera::infer
