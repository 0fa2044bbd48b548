// Layout checks and the search: invalid layouts are named, every ranked layout fits and
// beats the ones below it, nothing hand-picked beats the winner, and a model that fits
// nowhere reports the nearest miss.
#include <gtest/gtest.h>

#include "tessera/base/error.h"
#include "tessera/plan/search.h"
#include "tessera/plan/train_layout.h"
#include "tessera/plan/svg.h"

namespace tessera::plan {
namespace {

TrainSetup setup(int64_t devices, int64_t seq, int64_t batch) {
  TrainSetup s;
  s.devices = devices, s.seq = seq, s.global_batch = batch;
  return s;
}

TEST(Search, LayoutProblemsAreNamed) {
  const ModelSpec m = model_preset("llama2-7b");
  const Hardware hw = hardware_preset("h100-80g");
  const TrainSetup s = setup(16, 4096, 64);
  auto problem = [&](const std::string& text) { return layout_problem(m, hw, s, parse_layout(text, 16)); };
  EXPECT_EQ(problem("dp=2,tp=8"), "");
  EXPECT_NE(problem("dp=2,tp=4").find("= 8 devices, but --gpus is 16"), std::string::npos);
  EXPECT_EQ(problem("tp=16,dp=1"), "");  // 32 heads, 32 KV heads and 11008 all divide
  EXPECT_NE(layout_problem(model_preset("llama2-70b"), hw, s, parse_layout("tp=16", 16))
                .find("tp=16 does not divide the 8 key/value heads"),
            std::string::npos);
  EXPECT_NE(problem("dp=16,ep=2").find("dense"), std::string::npos);
  EXPECT_NE(problem("dp=8,pp=2,zero=3").find("zero=3 with pp=2"), std::string::npos);
  EXPECT_NE(problem("dp=16,mb=3").find("not divisible by dp=16 x mb=3"), std::string::npos);
  EXPECT_NE(problem("dp=16,sp=on").find("sp=on needs tp > 1"), std::string::npos);
  EXPECT_EQ(problem("dp=8,pp=2,vpp=3"), "");  // uneven chunks are allowed (Llama 3 ran so)
  EXPECT_NE(problem("dp=1,pp=16,vpp=4").find("vpp=4 model chunks exceed the 32 layers"),
            std::string::npos);
  const ModelSpec big = model_preset("llama3-405b");
  EXPECT_NE(layout_problem(big, hw, setup(128, 4096, 64), parse_layout("dp=1,pp=128", 128))
                .find("exceeds the 126 layers"),
            std::string::npos);
  EXPECT_NE(layout_problem(m, hw, setup(16, 4094, 64), parse_layout("dp=8,cp=2", 16))
                .find("not divisible by 2 x cp"),
            std::string::npos);
  EXPECT_NE(layout_problem(model_preset("mixtral-8x7b"), hw, s, parse_layout("dp=16,ep=16", 16))
                .find("does not divide the 8 experts"),
            std::string::npos);
}

// The planner's dp counts every data-parallel rank, ep ones included; the trainer's
// [parallel] dp is the replicas of each expert (ep is its own axis inside dp).
TEST(Search, ApplyLayoutPutsEpInsideDp) {
  train::TrainConfig c;
  c.data.batch_size = 8;
  apply_layout(parse_layout("dp=4,ep=2,tp=2", 8), c);
  EXPECT_EQ(c.parallel.dp, 2);
  EXPECT_EQ(c.parallel.ep, 2);
  EXPECT_EQ(c.parallel.tp, 2);
  EXPECT_EQ(c.parallel.dp * c.parallel.ep * c.parallel.tp, 8);  // the world the layout names
  EXPECT_EQ(c.data.batch_size, 4);  // dp x mb: every data-parallel rank takes its rows
  EXPECT_THROW(apply_layout(parse_layout("dp=2,cp=2,ep=4", 4), c), Error);  // ep across cp
}

TEST(Search, ParseLayoutErrors) {
  for (const char* bad : {"dp", "dp=x", "tp=0", "zero=4", "recompute=some", "sp=maybe",
                          "foo=2", "sched=zigzag", "tp=3"}) {
    EXPECT_THROW(parse_layout(bad, 16), Error) << bad;  // tp=3 does not divide 16 devices
  }
  const Layout l = parse_layout("tp=8,pp=2,zero=1,mb=2,recompute=selective,sp=on", 64);
  EXPECT_EQ(l.dp, 4);
  EXPECT_EQ(l.str(), "dp=4,tp=8,pp=2,cp=1,ep=1,zero=1,mb=2,recompute=selective,sp=on");
}

TEST(Search, RankedLayoutsFitAndNoneHandPickedBeatsTheWinner) {
  const ModelSpec m = model_preset("llama2-13b");
  const Hardware hw = hardware_preset("a100-80g");
  const TrainSetup s = setup(16, 4096, 256);
  const SearchResult r = search_layouts(m, hw, s);
  ASSERT_EQ(r.ranked.size(), 10u);
  EXPECT_EQ(r.valid, r.fitting + r.too_big);
  for (size_t i = 0; i < r.ranked.size(); ++i) {
    EXPECT_TRUE(r.ranked[i].fits());
    EXPECT_TRUE(layout_problem(m, hw, s, r.ranked[i].layout).empty());
    if (i) {
      EXPECT_GE(r.ranked[i - 1].time.tokens_per_s, r.ranked[i].time.tokens_per_s);
    }
  }
  for (const char* text : {"dp=16,zero=1,mb=1", "dp=2,tp=8,zero=1,mb=1,sp=on", "dp=4,tp=4,zero=1",
                           "dp=8,pp=2,zero=1,mb=2,recompute=selective", "dp=16,zero=3,mb=2,recompute=full"}) {
    const Evaluation ev = evaluate_layout(m, hw, s, parse_layout(text, 16));
    if (ev.fits()) {
      EXPECT_LE(ev.time.tokens_per_s, r.ranked[0].time.tokens_per_s) << text;
    }
  }
  for (const auto& miss : r.nearest_misses) EXPECT_GT(miss.memory.over_bytes(), 0);
}

TEST(Search, AModelThatFitsNowhereReportsTheNearestMiss) {
  const SearchResult r =
      search_layouts(model_preset("llama3-405b"), hardware_preset("a100-40g"), setup(8, 4096, 64));
  EXPECT_TRUE(r.ranked.empty());
  EXPECT_GT(r.valid, 0);
  ASSERT_FALSE(r.nearest_misses.empty());
  // ZeRO-3 over 8 devices still needs 16 / 8 bytes per parameter: over 800 GB > 40 GiB.
  EXPECT_GT(r.nearest_misses.front().memory.peak().total(), 2.0 * 405e9 / 8 * 0.99);
  for (size_t i = 1; i < r.nearest_misses.size(); ++i)
    EXPECT_LE(r.nearest_misses[i - 1].memory.over_bytes(), r.nearest_misses[i].memory.over_bytes());
}

TEST(Search, MoeSearchUsesExpertParallelism) {
  const SearchResult r = search_layouts(model_preset("mixtral-8x7b"), hardware_preset("h100-80g"),
                                        setup(32, 4096, 256));
  ASSERT_FALSE(r.ranked.empty());
  bool any_ep = false;
  for (const auto& ev : r.ranked) any_ep |= ev.layout.ep > 1;
  EXPECT_TRUE(any_ep);
}

TEST(Search, PipelineSimulationReproducesTheBubble) {
  Layout l;
  l.pp = 4;
  const std::vector<double> f(4, 1.0), b(4, 2.0);
  const auto ops = simulate_pipeline(l, 8, f, b);
  ASSERT_EQ(ops.size(), 4u * 8 * 2);
  double end = 0;
  for (const auto& op : ops) end = std::max(end, op.end);
  EXPECT_DOUBLE_EQ(end, (8 + 4 - 1) * 3.0);  // (m + pp - 1) (t_f + t_b)
  l.schedule = Schedule::kGPipe;
  double gend = 0;
  for (const auto& op : simulate_pipeline(l, 8, f, b)) gend = std::max(gend, op.end);
  EXPECT_DOUBLE_EQ(gend, (8 + 4 - 1) * 3.0);
  // Interleaved, v = 2: every op runs and the step is shorter than plain 1F1B.
  l.schedule = Schedule::kInterleaved;
  l.vpp = 2;
  const auto iops = simulate_pipeline(l, 8, f, b);
  ASSERT_EQ(iops.size(), 4u * 8 * 2 * 2);
  double iend = 0;
  for (const auto& op : iops) iend = std::max(iend, op.end);
  EXPECT_LT(iend, end);
  EXPECT_GE(iend, 8 * 3.0);
}

TEST(Hardware, TomlRoundTripAndMissingFields) {
  Hardware h = hardware_preset("a100-80g");
  h.name = "calibrated";
  h.store_16bit_as_f32 = true;
  h.elementwise_bandwidth = 12e9;
  h.attention_flops = 80e9;
  GemmTable t;
  t.k = {64, 256};
  t.mn = {128, 512, 2048};
  t.flops = {{1e10, 2e10, 3e10}, {4e10, 5e10, 6e10}};
  h.gemm["fp32"] = t;
  const Hardware back = hardware_from_toml(hardware_to_toml(h, "# comment\n"), "rt.toml");
  EXPECT_EQ(back.name, "calibrated");
  EXPECT_DOUBLE_EQ(back.memory_bytes, h.memory_bytes);
  EXPECT_DOUBLE_EQ(back.peak("bf16"), 312e12);
  EXPECT_DOUBLE_EQ(back.intra_latency, h.intra_latency);
  EXPECT_TRUE(back.store_16bit_as_f32);
  EXPECT_DOUBLE_EQ(back.elementwise_bandwidth, 12e9);
  EXPECT_DOUBLE_EQ(back.attention_flops, 80e9);
  ASSERT_EQ(back.gemm.count("fp32"), 1u);
  EXPECT_DOUBLE_EQ(back.gemm.at("fp32").flops[1][2], 6e10);
  EXPECT_NEAR(back.gemm_flops("fp32", 512, 512, 64, 4), 2e10, 1e3);
  auto error = [](const std::string& text) {
    try {
      hardware_from_toml(text, "hw.toml");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error("memory_gib = 80\n").find("missing hardware field 'memory_bandwidth_gbps'"),
            std::string::npos);
  EXPECT_NE(error("base = \"h100-80g\"\nlink_efficiency = 2\n").find("'link_efficiency' must be in (0, 1]"),
            std::string::npos);
  EXPECT_NE(error("base = \"h200\"\n").find("unknown --gpu 'h200'"), std::string::npos);
  EXPECT_NE(error("base = \"h100-80g\"\n[gemm.fp32]\nk = [1]\nmn = [1, 2]\ngflops = [[1]]\n").find("gemm.fp32"),
            std::string::npos);
  EXPECT_NE(error("= broken").find("hw.toml:1:1: invalid TOML"), std::string::npos);
}

}  // namespace
}  // namespace tessera::plan
