// `tessera bench serve` end to end on the tiny shape: the report's lines (including the
// `N.NNx one-at-a-time` ratio), the JSON line's token counts, and one-line flag errors.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <regex>
#include <sstream>
#include <string>

#include "test_util/run_command.h"

namespace tessera {
namespace {

TEST(CliBenchServe, ReportsEveryFigure) {
  const auto r = testing::run_command(std::string(TESSERA_CLI_PATH) +
                                          " bench serve --shape tiny --num-requests 4 --prompt-len 12:20"
                                          " --output-len 6 --shared-prefix 16 --kv-cache-memory 4000000 --json",
                                      false);
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* want : {"[concurrent] 4 requests", "throughput: total ", "ttft (ms): p50 ",
                           "tpot (ms): p50 ", "e2e  (ms): p50 ", "prefix cache: hit rate ",
                           "preemptions: 0", "kv fragmentation", "contiguous max_model_len",
                           "[one-at-a-time] 4 requests"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(\n[^\n]*\b\d+\.\d\dx one-at-a-time\n)"))) << r.out;

  // The JSON line: 4 requests of 16 + (12..20) prompt tokens and exactly 6 outputs each.
  std::istringstream lines(r.out);
  std::string line, json;
  while (std::getline(lines, line))
    if (!line.empty() && line[0] == '{') json = line;
  ASSERT_FALSE(json.empty()) << r.out;
  const auto j = nlohmann::json::parse(json);
  EXPECT_EQ(j["main"]["output_tokens"].get<int64_t>(), 24);
  const int64_t prompt = j["main"]["prompt_tokens"].get<int64_t>();
  EXPECT_GE(prompt, 4 * 28);
  EXPECT_LE(prompt, 4 * 36);
  EXPECT_EQ(j["baseline"]["num_requests"].get<int64_t>(), 4);
  EXPECT_GT(j["speedup_vs_one_at_a_time"].get<double>(), 0.0);
  EXPECT_GT(j["main"]["prefix_hit_blocks"].get<int64_t>(), 0);  // the 16-token prefix is one block
}

TEST(CliBenchServe, BadFlagsGiveOneLine) {
  for (const char* args : {"--shape tiny --output-len 9:3", "--shape tiny --speculative magic",
                           "--shape huge", "--shape tiny --prompt-len 200 --output-len 100"}) {
    const auto r = testing::run_cli(std::string("bench serve --num-requests 1 ") + args);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_LE(std::count(r.out.begin(), r.out.end(), '\n'), 1) << args << ": " << r.out;
  }
  const auto h = testing::run_cli("bench serve --help");
  EXPECT_EQ(h.code, 0);
  EXPECT_NE(h.out.find("--compare-prefix-caching"), std::string::npos) << h.out;
}

}  // namespace
}  // namespace tessera
