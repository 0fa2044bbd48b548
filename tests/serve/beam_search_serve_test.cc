// Beam search through `tessera serve`: use_beam_search / best_of / length_penalty on completions
// and chat give the n best hypotheses as choices in rank order, the same ones the engine gives
// in-process (whose search tests/infer/beam_search_test.cc checks against a PyTorch reference);
// stream: true sends them at the end; fields that beam search cannot honour are 400s naming them.
#include <gtest/gtest.h>

#include "serve/server_process.h"
#include "tessera/infer/engine.h"
#include "tessera/io/gguf_tokenizer.h"

namespace tessera {
namespace {

using nlohmann::json;
using testing::ServerProcess;
using testing::sse_data;

const std::string kModel = TESSERA_SERVE_MODEL;

httplib::Result post(httplib::Client& c, const std::string& path, const json& body) {
  return c.Post(path, body.dump(), "application/json");
}

// The engine in-process on the same model and KV dtype: the hypotheses by rank.
std::vector<infer::RequestOutput> engine_beams(const std::vector<int32_t>& prompt, int64_t width, int64_t n,
                                               float lp, int64_t max_tokens) {
  static const model::Model m = model::Model::load(kModel);
  static const std::optional<io::Tokenizer> tok = io::load_model_tokenizer(kModel);
  infer::EngineConfig ec;
  ec.kv_cache_dtype = kernels::KvCacheDtype::kF32;
  ec.kv_cache_memory = 64 << 20;
  infer::Engine e(m, ec, &*tok);
  infer::SamplingParams p;
  p.use_beam_search = true;
  p.best_of = width;
  p.n = n;
  p.length_penalty = lp;
  p.max_tokens = max_tokens;
  e.add_request(prompt, p);
  std::vector<infer::RequestOutput> out;
  while (e.has_unfinished())
    for (auto& o : e.step()) out.push_back(std::move(o));
  std::sort(out.begin(), out.end(), [](auto& a, auto& b) { return a.index < b.index; });
  return out;
}

class ServeBeams : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = new ServerProcess({"--model", kModel, "--kv-cache-dtype", "f32"}); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  static ServerProcess* server_;
};
ServerProcess* ServeBeams::server_ = nullptr;

TEST_F(ServeBeams, CompletionChoicesAreTheRankedHypotheses) {
  auto c = server_->client();
  const std::string prompt = "The quick brown fox";
  auto t = post(c, "/tokenize", {{"prompt", prompt}});
  ASSERT_TRUE(t && t->status == 200);
  const auto ids = json::parse(t->body)["tokens"].get<std::vector<int32_t>>();
  const json req = {{"prompt", prompt}, {"max_tokens", 10}, {"n", 3}, {"best_of", 4},
                    {"use_beam_search", true}, {"length_penalty", 0.5}};
  auto r = post(c, "/v1/completions", req);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  const auto want = engine_beams(ids, 4, 3, 0.5f, 10);
  ASSERT_EQ(want.size(), 3u);
  ASSERT_EQ(j["choices"].size(), 3u);
  int64_t completion = 0;
  for (size_t k = 0; k < 3; ++k) {
    const json& ch = j["choices"][k];
    EXPECT_EQ(ch["index"], k);
    EXPECT_EQ(ch["text"], json::parse(json(want[k].new_text).dump(-1, ' ', false, json::error_handler_t::replace)));
    EXPECT_EQ(ch["finish_reason"], want[k].finish_reason);
    completion += static_cast<int64_t>(want[k].new_tokens.size());
    if (k > 0) {
      EXPECT_GE(want[k - 1].beam_score, want[k].beam_score);
    }
  }
  EXPECT_NE(want[0].new_tokens, want[1].new_tokens);
  EXPECT_EQ(j["usage"]["completion_tokens"], completion);

  // stream: true sends the same choices, each whole (its token ids too), when the search ends.
  json sreq = req;
  sreq["stream"] = true;
  auto s = post(c, "/v1/completions", sreq);
  ASSERT_TRUE(s && s->status == 200) << (s ? s->body : "");
  std::vector<std::string> text(3);
  std::vector<json> finish(3);
  std::vector<std::vector<int32_t>> tokens(3);
  for (const auto& e : sse_data(s->body)) {
    if (e == "[DONE]") continue;
    const json ch = json::parse(e)["choices"][0];
    text[ch["index"].get<size_t>()] += ch["text"].get<std::string>();
    for (const auto& t : ch["token_ids"]) tokens[ch["index"].get<size_t>()].push_back(t.get<int32_t>());
    if (!ch["finish_reason"].is_null()) finish[ch["index"].get<size_t>()] = ch["finish_reason"];
  }
  for (size_t k = 0; k < 3; ++k) {
    EXPECT_EQ(text[k], j["choices"][k]["text"]) << "rank " << k;
    EXPECT_EQ(finish[k], j["choices"][k]["finish_reason"]);
    EXPECT_EQ(tokens[k], want[k].new_tokens) << "rank " << k;
  }
}

TEST_F(ServeBeams, ChatAcceptsBeamSearch) {
  auto c = server_->client();
  const json msgs = {{{"role", "user"}, {"content", "Hello"}}};
  auto r = post(c, "/v1/chat/completions",
                {{"messages", msgs}, {"max_tokens", 6}, {"n", 2}, {"use_beam_search", true}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  ASSERT_EQ(j["choices"].size(), 2u);
  auto t = post(c, "/tokenize", {{"messages", msgs}});
  const auto ids = json::parse(t->body)["tokens"].get<std::vector<int32_t>>();
  const auto want = engine_beams(ids, 2, 2, 1.f, 6);
  for (size_t k = 0; k < 2; ++k) {
    EXPECT_EQ(j["choices"][k]["index"], k);
    // The server's JSON replaces invalid UTF-8 (a random model's byte tokens) with U+FFFD.
    EXPECT_EQ(j["choices"][k]["message"]["content"],
              json::parse(json(want[k].new_text).dump(-1, ' ', false, json::error_handler_t::replace)))
        << "rank " << k;
    EXPECT_EQ(j["choices"][k]["finish_reason"], want[k].finish_reason);
  }
}

TEST_F(ServeBeams, FieldsBeamSearchCannotHonourAre400s) {
  auto c = server_->client();
  struct Bad {
    json body;
    std::string param;
  };
  const std::vector<Bad> bad = {
      {{{"prompt", "hi"}, {"use_beam_search", true}, {"temperature", 0.7}}, "temperature"},
      {{{"prompt", "hi"}, {"use_beam_search", true}, {"n", 3}, {"best_of", 2}}, "best_of"},
      {{{"prompt", "hi"}, {"use_beam_search", true}, {"stop", "x"}}, "stop"},
      {{{"prompt", "hi"}, {"use_beam_search", true}, {"top_p", 0.5}}, "top_p"},
      {{{"prompt", "hi"}, {"best_of", 3}, {"temperature", 1}}, "best_of"},
      {{{"prompt", "hi"}, {"length_penalty", 2}}, "length_penalty"},
      {{{"prompt", "hi"}, {"use_beam_search", "yes"}}, "use_beam_search"},
  };
  for (const Bad& b : bad) {
    auto r = post(c, "/v1/completions", b.body);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << b.body.dump() << " -> " << r->body;
    const json e = json::parse(r->body);
    EXPECT_EQ(e["error"]["param"], b.param) << b.body.dump() << " -> " << r->body;
  }
}

}  // namespace
}  // namespace tessera
