// Beam search: BeamSearch's rules on hand-made log-probabilities; the engine's beam search
// against an independent reference (tests/parity/beam_search_reference.py: transformers'
// BeamSearchScorer algorithm over the PyTorch model, a full float64 forward per step);
// copy-on-write sharing of the prompt's blocks between beams and no block left afterwards;
// beams under preemption; the request checks that name the field.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "tessera/infer/beam_search.h"
#include "tessera/infer/engine.h"
#include "tessera/infer/sampling_json.h"
#include "test_util/run_command.h"
#include "test_util/scratch_dir.h"

namespace tessera::infer {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

SamplingParams beam_params(int64_t width, int64_t n, float lp, int64_t max_tokens) {
  SamplingParams p;
  p.use_beam_search = true;
  p.best_of = width;
  p.n = n;
  p.length_penalty = lp;
  p.max_tokens = max_tokens;
  return p;
}

// Candidates (token, logprob) of one beam, best first (as top_logprobs gives them).
std::vector<TokenLogprob> cands(std::initializer_list<std::pair<int32_t, float>> l) {
  std::vector<TokenLogprob> v;
  for (auto [t, lp] : l) v.push_back({t, lp});
  return v;
}

TEST(BeamSearchRules, HandWorkedSearch) {
  // W = 2, end token 0: K = max(2, 1 + 1) * 2 = 4 candidates per beam.
  BeamSearch bs(beam_params(2, 2, 1.f, 3), {0}, 3);
  EXPECT_EQ(bs.width(), 2);
  EXPECT_EQ(bs.candidates_per_beam(), 4);
  // Step 1 (one beam): the two best tokens become the live beams.
  auto next = bs.step({cands({{1, -0.1f}, {2, -0.5f}, {0, -1.0f}, {3, -2.0f}})});
  ASSERT_EQ(next.size(), 2u);
  EXPECT_EQ(next[0].token, 1);
  EXPECT_EQ(next[1].token, 2);
  // Step 2: by cumulative score: A.0 (-0.3, an end token of rank 0: a hypothesis scored
  // -0.3 / 2), B.3 (-0.6), B.0 (-0.8, an end token of rank 2 >= W: skipped), A.3 (-1.1).
  next = bs.step({cands({{0, -0.2f}, {3, -1.0f}, {4, -1.5f}, {5, -3.0f}}),
                  cands({{3, -0.1f}, {0, -0.3f}, {4, -2.0f}, {5, -3.0f}})});
  ASSERT_EQ(next.size(), 2u);
  EXPECT_EQ(next[0].parent, 1);
  EXPECT_EQ(next[0].token, 3);
  EXPECT_EQ(next[1].parent, 0);
  EXPECT_EQ(next[1].token, 3);
  EXPECT_FALSE(bs.done());
  EXPECT_NEAR(bs.beams()[0].cum_logprob, -0.6, 1e-6);
  EXPECT_EQ(bs.beams()[1].tokens, (std::vector<int32_t>{1, 3}));
  // Step 3: [2 3] ends (-0.65, score -0.65 / 3, kept); [1 3] ends at rank 1 (-1.2, score -0.4:
  // worse than both kept, dropped). Two kept, the worst (-0.2167) >= the best candidate's
  // -0.65 / 3: done before the finalize would add the live beams.
  next = bs.step({cands({{0, -0.05f}, {4, -1.0f}, {5, -2.0f}, {6, -3.0f}}),
                  cands({{0, -0.1f}, {5, -0.2f}, {4, -2.0f}, {6, -3.0f}})});
  EXPECT_TRUE(next.empty());
  EXPECT_TRUE(bs.done());
  const auto r = bs.results();
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].tokens, (std::vector<int32_t>{1}));
  EXPECT_NEAR(r[0].score, -0.3 / 2, 1e-6);
  EXPECT_EQ(r[0].finish_reason, "stop");
  EXPECT_EQ(r[1].tokens, (std::vector<int32_t>{2, 3}));
  EXPECT_NEAR(r[1].cum_logprob, -0.65, 1e-6);
  EXPECT_NEAR(r[1].score, -0.65 / 3, 1e-6);
}

TEST(BeamSearchRules, LengthPenaltyAndFinalize) {
  EXPECT_DOUBLE_EQ(BeamSearch::score(-3.0, 4, 2.0), -3.0 / 16);
  EXPECT_DOUBLE_EQ(BeamSearch::score(-3.0, 4, 0.5), -3.0 / 2);
  // No end token: after max_new the live beams are the hypotheses ("length"), and a longer
  // beam wins under a length penalty of 2 what it would lose at 0.
  BeamSearch bs(beam_params(2, 2, 2.f, 2), {}, 2);
  bs.step({cands({{1, -0.5f}, {2, -0.6f}, {3, -5.f}, {4, -6.f}})});
  bs.step({cands({{5, -0.1f}, {6, -0.2f}, {7, -5.f}, {8, -6.f}}), cands({{5, -0.3f}, {6, -0.4f}, {7, -5.f}, {8, -6.f}})});
  ASSERT_TRUE(bs.done());
  const auto r = bs.results();
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].tokens, (std::vector<int32_t>{1, 5}));
  EXPECT_EQ(r[0].finish_reason, "length");
  EXPECT_NEAR(r[0].score, -0.6 / 4, 1e-6);
  EXPECT_EQ(r[1].tokens, (std::vector<int32_t>{1, 6}));
}

TEST(BeamSearchRules, TopLogprobsIsLogSoftmax) {
  const std::vector<float> x = {1.f, 3.f, 2.f, 3.f};
  const auto t = top_logprobs(x.data(), 4, 3);
  const double lse = std::log(std::exp(1.0) + 2 * std::exp(3.0) + std::exp(2.0));
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(t[0].token, 1);  // a tie: lower id first
  EXPECT_EQ(t[1].token, 3);
  EXPECT_EQ(t[2].token, 2);
  EXPECT_NEAR(t[2].logprob, 2.0 - lse, 1e-6);
}

TEST(BeamSearchParams, ChecksNameTheField) {
  auto field = [](const SamplingParams& p) {
    const auto e = p.find_error();
    return e ? e->field : std::string("ok");
  };
  EXPECT_EQ(field(beam_params(4, 2, 0.5f, 8)), "ok");
  SamplingParams p = beam_params(2, 3, 1.f, 8);
  EXPECT_EQ(field(p), "best_of");  // best_of < n
  p = beam_params(2, 2, 1.f, 8);
  p.temperature = 0.7f;
  EXPECT_EQ(field(p), "temperature");
  p = beam_params(2, 2, 1.f, 8);
  p.top_p = 0.9f;
  EXPECT_EQ(field(p), "top_p");
  p = beam_params(2, 2, 1.f, 8);
  p.stop = {"x"};
  EXPECT_EQ(field(p), "stop");
  p = beam_params(2, 2, 1.f, 8);
  p.logprobs = 1;
  EXPECT_EQ(field(p), "logprobs");
  p = beam_params(2, 2, 1.f, 8);
  p.presence_penalty = 0.5f;
  EXPECT_EQ(field(p), "presence_penalty");
  p = beam_params(2, 2, NAN, 8);
  EXPECT_EQ(field(p), "length_penalty");
  SamplingParams s;  // without beam search
  s.length_penalty = 2.f;
  EXPECT_EQ(field(s), "length_penalty");
  s = SamplingParams{};
  s.temperature = 1.f;
  s.best_of = 3;
  EXPECT_EQ(field(s), "best_of");
  s.best_of = 1;
  EXPECT_EQ(field(s), "ok");
  // JSON: beam search without a temperature gets 0, not the server's default of 1.
  SamplingParams d;
  d.temperature = 1.f;
  const SamplingParams j = sampling_params_from_json(
      json{{"use_beam_search", true}, {"n", 2}, {"best_of", 3}, {"length_penalty", 0.5}}, "request", d);
  EXPECT_TRUE(j.use_beam_search);
  EXPECT_EQ(j.temperature, 0.f);
  EXPECT_EQ(j.best_of, 3);
  EXPECT_FLOAT_EQ(j.length_penalty, 0.5f);
  try {
    sampling_params_from_json(json{{"use_beam_search", true}, {"temperature", 0.5}}, "request", d);
    ADD_FAILURE() << "accepted a temperature with beam search";
  } catch (const FieldError& e) {
    EXPECT_EQ(e.field(), "temperature");
  }
}

model::ModelConfig tiny_config() {
  model::ModelConfig c = model::ModelConfig::named_shape("tiny");
  c.max_position_embeddings = 256;
  c.eos_token_id = -1;  // end tokens come from stop_token_ids, chosen per case
  return c;
}

// A random tiny Llama with its head scaled up (clear-cut choices, as the engine tests do),
// saved in the Hugging Face layout for the PyTorch reference.
const std::string& model_dir() {
  static const std::string dir = [] {
    const std::string d = testing::scratch_dir("tessera_beam_");
    const model::ModelConfig c = tiny_config();
    model::Model m = model::Model::random(c, DType::kF32, 23);
    auto& w = m.weights();
    Tensor& head = c.tie_word_embeddings ? w.embed : w.lm_head;
    for (int64_t i = 0; i < head.numel(); ++i) head.data<float>()[i] *= 3.f;
    w.tie(c);
    m.save(d);
    return d;
  }();
  return dir;
}

EngineConfig engine_config(int64_t kv_blocks) {
  EngineConfig ec;
  ec.kv_cache_dtype = kernels::KvCacheDtype::kF32;
  ec.block_size = 16;
  ec.max_model_len = 128;
  const model::ModelConfig c = tiny_config();
  ec.kv_cache_memory = kv_blocks * KvPool::bytes_per_block(c, 16, c.num_kv_heads, ec.kv_cache_dtype);
  return ec;
}

struct Case {
  std::vector<int32_t> prompt;
  int64_t width = 1, n = 1;
  float lp = 1.f;
  int64_t max_new = 12;
  std::vector<int32_t> end;
};

// The engine's results (by request, rank order), all cases submitted at once.
std::vector<std::vector<RequestOutput>> run_engine(const model::Model& m, const EngineConfig& ec,
                                                   const std::vector<Case>& cases, EngineStats* stats = nullptr) {
  Engine e(m, ec);
  std::map<RequestId, size_t> which;
  for (size_t i = 0; i < cases.size(); ++i) {
    SamplingParams p = beam_params(cases[i].width, cases[i].n, cases[i].lp, cases[i].max_new);
    p.stop_token_ids = cases[i].end;
    which[e.add_request(cases[i].prompt, p)] = i;
  }
  std::vector<std::vector<RequestOutput>> res(cases.size());
  for (int steps = 0; e.has_unfinished(); ++steps) {
    if (steps > 5000) {
      ADD_FAILURE() << "the engine did not finish";
      break;
    }
    for (RequestOutput& o : e.step()) {
      EXPECT_TRUE(o.finished) << "beam search reports whole hypotheses only";
      res[which.at(o.id)].push_back(std::move(o));
    }
    e.check_invariants();
  }
  for (auto& r : res) std::sort(r.begin(), r.end(), [](auto& a, auto& b) { return a.index < b.index; });
  if (stats) *stats = e.stats();
  EXPECT_EQ(e.stats().kv_blocks_used, 0) << "blocks left held after every request ended";
  return res;
}

std::vector<Case> reference_cases(const model::Model& m) {
  std::mt19937 rng(5);
  std::vector<Case> cases;
  const std::vector<int64_t> lens = {5, 20, 37};
  for (size_t pi = 0; pi < lens.size(); ++pi) {
    std::vector<int32_t> prompt(lens[pi]);
    for (auto& t : prompt) t = static_cast<int32_t>(rng() % 256);
    // An end token the search meets: the third token greedy decoding picks (prompts 1 and 2).
    std::vector<int32_t> end;
    if (pi > 0) {
      model::KVCache cache = model::KVCache::create(m.config(), 64);
      Tensor logits = m.forward(prompt, cache);
      for (int i = 0; i < 3; ++i) {
        const float* x = logits.data<float>();
        const int32_t t = static_cast<int32_t>(std::max_element(x, x + logits.numel()) - x);
        if (i == 2) end = {t};
        logits = m.forward(std::vector<int32_t>{t}, cache);
      }
    }
    for (int64_t w : {1, 2, 4})
      for (float lp : {0.5f, 1.f, 2.f}) cases.push_back({prompt, w, w, lp, 12, end});
  }
  return cases;
}

TEST(BeamSearchEngine, EqualsTheReferenceBeamSearchOverFullForwards) {
  const model::Model m = model::Model::load(model_dir());
  const std::vector<Case> cases = reference_cases(m);
  json jc = json::array();
  for (const Case& c : cases)
    jc.push_back({{"prompt", c.prompt}, {"width", c.width}, {"n", c.n}, {"length_penalty", c.lp},
                  {"max_new", c.max_new}, {"end_tokens", c.end}});
  const std::string cases_path = model_dir() + "/cases.json", out_path = model_dir() + "/ref.json";
  std::ofstream(cases_path) << jc.dump();
  const auto r = testing::run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR +
                                      "/tests/parity/beam_search_reference.py --model " + model_dir() +
                                      " --cases " + cases_path + " --out " + out_path);
  ASSERT_EQ(r.code, 0) << r.out;
  json ref;
  std::ifstream(out_path) >> ref;
  ASSERT_EQ(ref.size(), cases.size());

  const auto got = run_engine(m, engine_config(256), cases);
  int stops = 0, lengths = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const std::string what = "case " + std::to_string(i) + " (prompt of " + std::to_string(c.prompt.size()) +
                             ", width " + std::to_string(c.width) + ", length_penalty " + std::to_string(c.lp) +
                             "; the reference's smallest candidate gap " + ref[i]["min_gap"].dump() + ")";
    const json& hyps = ref[i]["hyps"];
    ASSERT_EQ(got[i].size(), hyps.size()) << what;
    for (size_t k = 0; k < hyps.size(); ++k) {
      const RequestOutput& o = got[i][k];
      EXPECT_EQ(o.index, static_cast<int64_t>(k)) << what;
      EXPECT_EQ(o.new_tokens, hyps[k]["tokens"].get<std::vector<int32_t>>()) << what << ", rank " << k;
      EXPECT_EQ(o.finish_reason, hyps[k]["finish_reason"].get<std::string>()) << what << ", rank " << k;
      EXPECT_NEAR(o.cumulative_logprob, hyps[k]["cum_logprob"].get<double>(), 2e-4) << what << ", rank " << k;
      EXPECT_NEAR(o.beam_score, hyps[k]["score"].get<double>(), 2e-4) << what << ", rank " << k;
      (o.finish_reason == "stop" ? stops : lengths)++;
    }
  }
  // Both kinds of hypotheses were compared.
  EXPECT_GT(stops, 5);
  EXPECT_GT(lengths, 5);
}

TEST(BeamSearchEngine, BeamsShareThePromptBlocksAndFreeEverything) {
  const model::Model m = model::Model::load(model_dir());
  Engine e(m, engine_config(64));
  std::vector<int32_t> prompt(40);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(7 * i % 256);
  e.add_request(prompt, beam_params(4, 2, 1.f, 20));
  int64_t seen = 0;
  std::vector<RequestOutput> outs;
  while (e.has_unfinished()) {
    for (auto& o : e.step()) outs.push_back(std::move(o));
    e.check_invariants();
    const KvUsage u = e.kv_usage();
    if (u.sequences != 4) continue;
    ++seen;
    // One beam alone holds ceil(tokens / 16) blocks; four share at least the prompt's two full
    // blocks (held once, not four times).
    const int64_t per_beam = (u.seq_tokens / 4 + 15) / 16;
    EXPECT_LE(u.blocks, 4 * per_beam - 3 * 2) << "tokens per beam " << u.seq_tokens / 4;
    EXPECT_LT(u.tokens, u.seq_tokens);
  }
  EXPECT_GT(seen, 10);
  ASSERT_EQ(outs.size(), 2u);
  EXPECT_GE(outs[0].beam_score, outs[1].beam_score);
  EXPECT_EQ(e.stats().kv_blocks_used, 0);
  EXPECT_EQ(e.kv_usage().blocks, 0);
  EXPECT_EQ(e.stats().running, 0);
}

TEST(BeamSearchEngine, PreemptedBeamsGiveTheSameHypotheses) {
  const model::Model m = model::Model::load(model_dir());
  std::vector<Case> cases;
  std::mt19937 rng(9);
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> prompt(10 + 7 * i);
    for (auto& t : prompt) t = static_cast<int32_t>(rng() % 256);
    cases.push_back({prompt, 4, 3, i % 2 ? 2.f : 0.5f, 24, {}});
  }
  EngineStats roomy_stats, tight_stats;
  const auto roomy = run_engine(m, engine_config(512), cases, &roomy_stats);
  const auto tight = run_engine(m, engine_config(20), cases, &tight_stats);
  EXPECT_EQ(roomy_stats.preemptions, 0);
  EXPECT_GT(tight_stats.preemptions, 0);
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_EQ(roomy[i].size(), 3u);
    ASSERT_EQ(tight[i].size(), 3u);
    for (size_t k = 0; k < 3; ++k) {
      EXPECT_EQ(tight[i][k].new_tokens, roomy[i][k].new_tokens) << "case " << i << " rank " << k;
      EXPECT_NEAR(tight[i][k].beam_score, roomy[i][k].beam_score, 1e-4);
    }
  }
}

TEST(BeamSearchEngine, AbortFreesEveryBeam) {
  const model::Model m = model::Model::load(model_dir());
  Engine e(m, engine_config(64));
  std::vector<int32_t> prompt(30, 5);
  const RequestId id = e.add_request(prompt, beam_params(4, 2, 1.f, 40));
  for (int i = 0; i < 6; ++i) EXPECT_TRUE(e.step().empty());
  EXPECT_EQ(e.kv_usage().sequences, 4);
  e.abort_request(id);
  std::vector<RequestOutput> outs;
  while (e.has_unfinished()) {
    for (auto& o : e.step()) outs.push_back(std::move(o));
    e.check_invariants();
  }
  ASSERT_FALSE(outs.empty());
  for (const auto& o : outs) EXPECT_EQ(o.finish_reason, "abort");
  EXPECT_EQ(e.stats().kv_blocks_used, 0);
  EXPECT_EQ(e.stats().running, 0);
  // The engine goes on serving.
  e.add_request(prompt, beam_params(2, 1, 1.f, 3));
  outs.clear();
  while (e.has_unfinished())
    for (auto& o : e.step()) outs.push_back(std::move(o));
  ASSERT_EQ(outs.size(), 1u);
  EXPECT_EQ(outs[0].new_tokens.size(), 3u);
  EXPECT_EQ(e.stats().kv_blocks_used, 0);
}

TEST(BeamSearchEngine, RefusesWhatItCannotDo) {
  const model::Model m = model::Model::load(model_dir());
  EngineConfig ec = engine_config(64);
  ec.speculative_method = "ngram";
  ec.num_speculative_tokens = 2;
  Engine e(m, ec);
  try {
    e.add_request({1, 2, 3}, beam_params(2, 1, 1.f, 4));
    ADD_FAILURE() << "beam search accepted with speculative decoding";
  } catch (const FieldError& err) {
    EXPECT_EQ(err.field(), "use_beam_search");
  }
  Engine plain(m, engine_config(64));
  try {  // width 128 with 2 end tokens ranks 3 x 128 = 384 candidates per beam; the vocabulary has 256
    SamplingParams p = beam_params(128, 1, 1.f, 4);
    p.stop_token_ids = {1, 2};
    plain.add_request({1, 2, 3}, p);
    ADD_FAILURE() << "a beam width beyond the vocabulary accepted";
  } catch (const FieldError& err) {
    EXPECT_EQ(err.field(), "best_of");
  }
  EXPECT_FALSE(plain.has_unfinished());
}

}  // namespace
}  // namespace tessera::infer
