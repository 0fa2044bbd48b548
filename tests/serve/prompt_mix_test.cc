// bench serve --url --prompt-len-mix: the spec's parsing and the drawn lengths.
#include <gtest/gtest.h>

#include <map>

#include "tessera/base/error.h"
#include "tessera/serve/bench_prompts.h"

namespace tessera::serve {
namespace {

TEST(PromptMix, ParsesPairsAndRefusesBadItemsByName) {
  const auto m = parse_prompt_mix("64:0.8,1024:0.2");
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0].first, 64);
  EXPECT_DOUBLE_EQ(m[0].second, 0.8);
  EXPECT_EQ(m[1].first, 1024);
  for (const char* bad : {"", "64", "64:", ":0.5", "0:1", "64:0", "64:-1", "64:x", "64:0.5,", "6a:1", "64:1:2"}) {
    try {
      parse_prompt_mix(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--prompt-len-mix"), std::string::npos) << e.what();
    }
  }
}

TEST(PromptMix, LengthsComeFromTheMixInItsProportionsAndRepeatPerSeed) {
  HttpBenchOptions o;
  o.dataset = "random";
  o.num_requests = 2000;
  o.output_len = {8, 8};
  o.prompt_mix = {{32, 3}, {300, 1}};
  HttpPrompt w;
  const auto a = make_http_prompts(o, nullptr, 1000, 4096, &w);
  std::map<int64_t, int> count;
  for (const auto& p : a) {
    EXPECT_EQ(static_cast<int64_t>(p.ids.size()), p.tokens);
    ++count[p.tokens];
  }
  ASSERT_EQ(count.size(), 2u);
  // 3:1 -> 1500 and 500 expected; binomial sd ~19, so +-100 is > 5 sd.
  EXPECT_NEAR(count[32], 1500, 100);
  EXPECT_NEAR(count[300], 500, 100);
  const auto b = make_http_prompts(o, nullptr, 1000, 4096, &w);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].ids, b[i].ids);
  o.dataset = "text";
  o.dataset_path = "/dev/null";
  EXPECT_THROW(make_http_prompts(o, nullptr, 1000, 4096, &w), Error);
}

}  // namespace
}  // namespace tessera::serve
