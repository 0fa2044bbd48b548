// `bench serve --url` against a second server implementation: an in-process mock that serves
// only the standard OpenAI fields (as vLLM does), or llama-server's `meta` block, driven with
// --tokenizer (text prompts, token counts from the tokenizer) and --dataset-path.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/io/tokenizer.h"
#include "serve/bench_options.h"
#include "tessera/serve/bench_client.h"

namespace tessera::serve {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const char* kText =
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "All that glitters is not gold. To be or not to be, that is the question. Hello world! How are you "
    "today? I am fine, thank you. The weather is nice and the sun is shining on the hills and the sea. ";

fs::path temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("tessera_bench_openai_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

// Writes a byte-level BPE trained on kText as a Hugging Face directory.
std::string make_tokenizer_dir() {
  const fs::path d = temp_dir("tokenizer");
  {
    std::ofstream out(d / "corpus.txt");
    for (int i = 0; i < 20; ++i) out << kText;
  }
  io::BpeTrainOptions bo;
  bo.vocab_size = 384;
  bo.special_tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  bo.progress = false;
  io::train_bpe({(d / "corpus.txt").string()}, bo).save(d.string());
  fs::remove(d / "corpus.txt");
  return d.string();
}

// Serves only what the OpenAI API defines: /v1/models entries of id, object, created and
// owned_by (plus `extra`, to mimic llama-server's meta or vLLM's max_model_len), and streaming
// /v1/completions whose chunks carry text only, with usage only when stream_options asks for
// it. A prompt that is not a string is refused (400), unless accept_token_ids.
class OpenAiMock {
 public:
  json extra = json::object();
  bool accept_token_ids = false;
  bool usage_supported = true;  // false: never sends usage, even when asked
  int tokens_per_chunk = 1;
  std::string piece = " the";   // the text of one output token

  OpenAiMock() {
    svr_.new_task_queue = [] { return new httplib::ThreadPool(16); };
    svr_.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      json m{{"id", "std-model"}, {"object", "model"}, {"created", 1700000000}, {"owned_by", "someone"}};
      m.update(extra);
      res.set_content(json{{"object", "list"}, {"data", json::array({m})}}.dump(), "application/json");
    });
    svr_.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      const json body = json::parse(req.body);
      {
        std::lock_guard<std::mutex> lock(mu_);
        bodies_.push_back(body);
      }
      if (!body.at("prompt").is_string() && !accept_token_ids) {
        res.status = 400;
        res.set_content(R"({"error": {"message": "prompt must be a string", "type": "invalid_request_error"}})",
                        "application/json");
        return;
      }
      const bool usage = usage_supported && body.contains("stream_options") &&
                         body["stream_options"].value("include_usage", false);
      // A byte-level server: prompt tokens are the prompt's bytes (ids: their count).
      const int64_t prompt_tokens = body["prompt"].is_string()
                                        ? static_cast<int64_t>(body["prompt"].get_ref<const std::string&>().size())
                                        : static_cast<int64_t>(body["prompt"].size());
      const int max_tokens = body.at("max_tokens").get<int>();
      auto sent = std::make_shared<int>(0);
      res.set_chunked_content_provider(
          "text/event-stream", [this, sent, max_tokens, usage, prompt_tokens](size_t, httplib::DataSink& sink) {
            std::string ev;
            if (*sent < max_tokens) {
              std::string text;
              for (int k = 0; k < tokens_per_chunk && *sent < max_tokens; ++k, ++*sent) text += piece;
              json chunk{{"id", "cmpl-1"},
                         {"object", "text_completion"},
                         {"created", 1700000000},
                         {"model", "std-model"},
                         {"choices", json::array({json{{"index", 0},
                                                       {"text", text},
                                                       {"logprobs", nullptr},
                                                       {"finish_reason", *sent == max_tokens ? json("length")
                                                                                             : json(nullptr)}}})}};
              ev = "data: " + chunk.dump() + "\n\n";
              return sink.write(ev.data(), ev.size());
            }
            if (usage)
              ev += "data: " +
                    json{{"id", "cmpl-1"},
                         {"object", "text_completion"},
                         {"choices", json::array()},
                         {"usage",
                          {{"prompt_tokens", prompt_tokens},
                           {"completion_tokens", max_tokens},
                           {"total_tokens", prompt_tokens + max_tokens}}}}
                        .dump() +
                    "\n\n";
            ev += "data: [DONE]\n\n";
            sink.write(ev.data(), ev.size());
            sink.done();
            return true;
          });
    });
    // A deep backlog, as MockServer in bench_client_test.cc (httplib listens with 5).
    auto fd = std::make_shared<socket_t>(-1);
    svr_.set_socket_options([fd](socket_t sock) {
      httplib::default_socket_options(sock);
      *fd = sock;
    });
    port_ = svr_.bind_to_any_port("127.0.0.1");
    if (port_ > 0) ::listen(*fd, 1024);
    thread_ = std::thread([this] { svr_.listen_after_bind(); });
  }
  ~OpenAiMock() {
    svr_.stop();
    thread_.join();
  }

  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_) + "/v1"; }
  std::vector<json> bodies() {
    std::lock_guard<std::mutex> lock(mu_);
    return bodies_;
  }

 private:
  httplib::Server svr_;
  std::thread thread_;
  int port_ = 0;
  std::mutex mu_;
  std::vector<json> bodies_;
};

HttpBenchOptions options(const OpenAiMock& m, int64_t n, int64_t prompt, int64_t output) {
  HttpBenchOptions o = bench_options(m.url(), n, prompt, output);
  o.seed = 3;
  return o;
}

// The suite's tokenizer directory, made once and removed at the end.
class HttpBenchOpenAi : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { dir_ = new std::string(make_tokenizer_dir()); }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
    dir_ = nullptr;
  }
  static const std::string& tokenizer_dir() { return *dir_; }

 private:
  static std::string* dir_;
};
std::string* HttpBenchOpenAi::dir_ = nullptr;

std::string error_of(const HttpBenchOptions& o) {
  try {
    run_http_bench(o);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST_F(HttpBenchOpenAi, TokenizerGivesTextPromptsAndUsageCountsOutputs) {
  const io::Tokenizer tok = io::Tokenizer::load(tokenizer_dir());
  OpenAiMock m;
  HttpBenchOptions o = options(m, 6, 24, 10);
  o.tokenizer = tokenizer_dir();
  const HttpBenchResult r = run_http_bench(o);
  EXPECT_EQ(r.model, "std-model");
  EXPECT_EQ(r.vocab_size, tok.vocab_size());
  EXPECT_EQ(r.vocab_from, "--tokenizer");
  EXPECT_EQ(r.max_model_len_from, "");  // nothing reported: unbounded
  EXPECT_EQ(r.prompt_format, "text");
  EXPECT_EQ(r.prompt_tokens_from, "tokenizer");
  EXPECT_EQ(r.completed, 6);
  EXPECT_EQ(r.failed, 0);  // the mock refuses token-id prompts
  EXPECT_EQ(r.output_tokens, 60);
  EXPECT_EQ(r.output_tokens_from, "usage");
  EXPECT_EQ(r.short_outputs, 0);

  // Counted independently: the prompts the server received, re-encoded.
  const auto bodies = m.bodies();
  ASSERT_EQ(bodies.size(), 7u);  // with the warm-up
  int64_t prompt_tokens = 0;
  std::set<std::string> prompts;
  for (const json& b : bodies) {
    ASSERT_TRUE(b.at("prompt").is_string()) << b.dump();
    EXPECT_EQ(b.at("stream_options").at("include_usage"), true);
    const std::string p = b.at("prompt").get<std::string>();
    const auto ids = tok.encode(p, false);
    for (int32_t id : ids) EXPECT_FALSE(tok.is_special(id)) << "special token " << id << " in " << p;
    if (b.at("max_tokens") == 1) continue;
    EXPECT_EQ(b.at("max_tokens"), 10);
    const auto n = static_cast<int64_t>(ids.size());
    EXPECT_EQ(n, 24) << p;  // fitted to the asked length
    prompt_tokens += n;
    prompts.insert(p);
  }
  EXPECT_EQ(r.prompt_tokens, prompt_tokens);
  EXPECT_EQ(prompts.size(), 6u);
  const json j = json::parse(http_bench_json(r));
  EXPECT_EQ(j.at("prompt_format"), "text");
  EXPECT_TRUE(j.at("max_model_len").is_null());
  EXPECT_NE(format_http_bench(r).find("vocab " + std::to_string(tok.vocab_size()) + " from --tokenizer"),
            std::string::npos);

  // The same seed sends the same text.
  OpenAiMock m2;
  o.url = m2.url();
  run_http_bench(o);
  std::set<std::string> again;
  for (const json& b : m2.bodies())
    if (b.at("max_tokens") != 1) again.insert(b.at("prompt").get<std::string>());
  EXPECT_EQ(again, prompts);
}

TEST_F(HttpBenchOpenAi, WithoutUsageTheTokenizerCountsStreamedText) {
  const io::Tokenizer tok = io::Tokenizer::load(tokenizer_dir());
  OpenAiMock m;
  ASSERT_EQ(tok.encode(m.piece + m.piece + m.piece, false).size(), 3u) << "' the' should be one token";
  m.usage_supported = false;
  m.tokens_per_chunk = 2;  // 10 tokens in 5 chunks: counting chunks would say 5
  HttpBenchOptions o = options(m, 4, 16, 10);
  o.tokenizer = tokenizer_dir();
  const HttpBenchResult r = run_http_bench(o);
  EXPECT_EQ(r.completed, 4);
  EXPECT_EQ(r.output_tokens, 40);
  EXPECT_EQ(r.output_tokens_from, "tokenizer");
  EXPECT_EQ(r.short_outputs, 0);
  double tpot = 0;
  for (const auto& q : r.requests) {
    EXPECT_EQ(q.output_tokens, 10);
    EXPECT_EQ(q.output_counted_by, "tokenizer");
    EXPECT_EQ(q.itl_s.size(), 4u);
    tpot += (q.e2e_s - q.ttft_s) / 9 / 4;
  }
  EXPECT_NEAR(r.tpot.mean, tpot, 1e-9);  // divided by the tokenizer's count, not the chunks'

  // Without a tokenizer (the vocabulary from llama-server's meta), chunks are all there is.
  OpenAiMock ids;
  ids.extra = {{"meta", {{"n_vocab", 500}}}};
  ids.accept_token_ids = true;
  ids.usage_supported = false;
  ids.tokens_per_chunk = 2;
  const HttpBenchResult c = run_http_bench(options(ids, 2, 8, 10));
  EXPECT_EQ(c.output_tokens, 10);
  EXPECT_EQ(c.output_tokens_from, "chunks");
}

TEST_F(HttpBenchOpenAi, LlamaServerMetaGivesVocabAndContext) {
  OpenAiMock m;
  m.extra = {{"owned_by", "llamacpp"},
             {"meta", {{"vocab_type", 2}, {"n_vocab", 1000}, {"n_ctx_train", 64}, {"n_embd", 256}}}};
  m.accept_token_ids = true;
  HttpBenchOptions o = options(m, 5, 20, 8);
  const HttpBenchResult r = run_http_bench(o);
  EXPECT_EQ(r.vocab_size, 1000);
  EXPECT_EQ(r.vocab_from, "meta.n_vocab");
  EXPECT_EQ(r.max_model_len, 64);
  EXPECT_EQ(r.max_model_len_from, "meta.n_ctx_train");
  EXPECT_EQ(r.prompt_format, "token ids");
  EXPECT_EQ(r.completed, 5);
  EXPECT_EQ(r.prompt_tokens, 5 * 20);
  EXPECT_EQ(r.output_tokens, 5 * 8);
  for (const json& b : m.bodies()) {
    ASSERT_TRUE(b.at("prompt").is_array());
    for (const json& id : b.at("prompt")) EXPECT_TRUE(id.get<int>() >= 0 && id.get<int>() < 1000) << id;
  }
  // n_ctx_train bounds the requests.
  o.prompt_len = {40, 40};
  o.output_len = {30, 30};
  const std::string e = error_of(o);
  EXPECT_NE(e.find("context length 64"), std::string::npos) << e;

  // A vocab_size beside meta (tessera serve's field) wins.
  m.extra["vocab_size"] = 700;
  const HttpBenchResult v = run_http_bench(options(m, 2, 4, 2));
  EXPECT_EQ(v.vocab_size, 700);
  EXPECT_EQ(v.vocab_from, "vocab_size");
}

TEST_F(HttpBenchOpenAi, NoVocabularyAnywhereIsOneClearError) {
  OpenAiMock m;
  m.extra = {{"max_model_len", 4096}};  // vLLM: a context length, no vocabulary
  const std::string e = error_of(options(m, 2, 8, 4));
  EXPECT_NE(e.find("vocabulary"), std::string::npos) << e;
  EXPECT_NE(e.find("--tokenizer"), std::string::npos) << e;
  EXPECT_NE(e.find("--dataset-path"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  EXPECT_TRUE(m.bodies().empty());  // refused before sending anything
}

TEST_F(HttpBenchOpenAi, TextDatasetWindows) {
  const fs::path dir = temp_dir("dataset");
  const std::string path = (dir / "prompts.txt").string();
  std::string text;
  for (int i = 0; i < 4; ++i) text += kText;
  std::ofstream(path) << text;

  // With the tokenizer: windows of its tokens, each a piece of the file.
  const io::Tokenizer tok = io::Tokenizer::load(tokenizer_dir());
  OpenAiMock m;
  m.extra = {{"max_model_len", 4096}};
  HttpBenchOptions o = options(m, 5, 12, 3);
  o.dataset_path = path;
  o.tokenizer = tokenizer_dir();
  HttpBenchResult r = run_http_bench(o);
  EXPECT_EQ(r.options.dataset, "text");
  EXPECT_EQ(r.completed, 5);
  EXPECT_EQ(r.max_model_len, 4096);
  int64_t want = 0;
  for (const json& b : m.bodies()) {
    const std::string p = b.at("prompt").get<std::string>();
    EXPECT_NE(text.find(p), std::string::npos) << p;
    if (b.at("max_tokens") != 1) want += static_cast<int64_t>(tok.encode(p, false).size());
  }
  EXPECT_EQ(r.prompt_tokens, want);
  EXPECT_NEAR(static_cast<double>(want), 5 * 12, 5);

  // Without a tokenizer or a vocabulary: windows of words; the server's usage counts them.
  OpenAiMock w;
  o = options(w, 5, 6, 3);
  o.dataset_path = path;
  r = run_http_bench(o);
  EXPECT_EQ(r.completed, 5);
  EXPECT_EQ(r.vocab_size, 0);
  EXPECT_EQ(r.prompt_tokens_from, "usage");
  want = 0;
  for (const json& b : w.bodies()) {
    const std::string p = b.at("prompt").get<std::string>();
    EXPECT_NE(text.find(p), std::string::npos) << p;
    if (b.at("max_tokens") == 1) continue;
    EXPECT_EQ(std::count(p.begin(), p.end(), ' '), 5) << p;  // 6 words
    want += static_cast<int64_t>(p.size());              // the mock's byte count
  }
  EXPECT_EQ(r.prompt_tokens, want);
  fs::remove_all(dir);
}

TEST_F(HttpBenchOpenAi, BadInputNamesTheFlagAndFile) {
  OpenAiMock m;
  const fs::path dir = temp_dir("bad");
  HttpBenchOptions o = options(m, 2, 8, 4);
  o.tokenizer = dir.string();  // no tokenizer.json in it
  std::string e = error_of(o);
  EXPECT_NE(e.find("--tokenizer " + dir.string()), std::string::npos) << e;
  EXPECT_NE(e.find("no tokenizer.json"), std::string::npos) << e;
  o.tokenizer = (dir / "missing").string();
  e = error_of(o);
  EXPECT_NE(e.find("--tokenizer"), std::string::npos) << e;
  EXPECT_NE(e.find("missing"), std::string::npos) << e;
  std::ofstream(dir / "tokenizer.json") << "{not json";
  o.tokenizer = dir.string();
  e = error_of(o);
  EXPECT_NE(e.find("--tokenizer"), std::string::npos) << e;
  EXPECT_NE(e.find("tokenizer.json"), std::string::npos) << e;
  EXPECT_TRUE(m.bodies().empty());

  o = options(m, 2, 8, 4);
  o.dataset_path = (dir / "nope.txt").string();
  e = error_of(o);
  EXPECT_NE(e.find("nope.txt"), std::string::npos) << e;
  std::ofstream(dir / "short.txt") << "only five words in here";
  o.dataset_path = (dir / "short.txt").string();
  e = error_of(o);
  EXPECT_NE(e.find("--dataset-path"), std::string::npos) << e;
  EXPECT_NE(e.find("5 words"), std::string::npos) << e;
  o.dataset = "random";
  e = error_of(o);
  EXPECT_NE(e.find("--dataset-path needs --dataset text"), std::string::npos) << e;
  o.dataset = "text";
  o.dataset_path.clear();
  e = error_of(o);
  EXPECT_NE(e.find("--dataset text needs --dataset-path"), std::string::npos) << e;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tessera::serve
