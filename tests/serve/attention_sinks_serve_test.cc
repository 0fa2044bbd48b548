// `tessera serve --attention-sinks S --window W`: a completion whose prompt and max_tokens
// run far past max_model_len streams through a constant cache and ends by max_tokens; the
// same request without sinks is refused by name (context_length_exceeded).
#include <gtest/gtest.h>

#include "serve/server_process.h"

namespace tessera {
namespace {

using nlohmann::json;
using testing::ServerProcess;

const std::string kModel = TESSERA_SERVE_MODEL;

json long_request() {
  std::vector<int32_t> prompt;
  for (int i = 0; i < 200; ++i) prompt.push_back(5 + (i * 37) % 300);
  return {{"prompt", prompt}, {"max_tokens", 300}, {"temperature", 0}, {"ignore_eos", true}};
}

TEST(ServeAttentionSinks, StreamsPastMaxModelLenOnlyWithSinks) {
  ServerProcess s({"--model", kModel, "--max-model-len", "128", "--block-size", "8", "--attention-sinks", "4",
                   "--window", "60"});
  auto c = s.client();
  auto m = c.Get("/v1/models");
  ASSERT_TRUE(m && m->status == 200);
  EXPECT_EQ(json::parse(m->body)["data"][0]["max_model_len"], 128);
  auto r = c.Post("/v1/completions", long_request().dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(j["usage"]["prompt_tokens"], 200);
  EXPECT_EQ(j["usage"]["completion_tokens"], 300);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_NE(s.stderr_text().find("attention sinks 4 + window 60: 8 blocks per stream, prefix caching off"),
            std::string::npos)
      << s.stderr_text();

  ServerProcess plain({"--model", kModel, "--max-model-len", "128", "--block-size", "8"});
  auto p = plain.client();
  r = p.Post("/v1/completions", long_request().dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "context_length_exceeded");
}

}  // namespace
}  // namespace tessera
