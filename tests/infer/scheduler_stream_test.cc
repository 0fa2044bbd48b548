// The scheduler with attention sinks, randomised: adds, forks, aborts and preemption on a
// tiny pool, with a simulated KV pool where each cache row holds the stream index of the
// token it stands for. The runner applies the step's copies and window shifts as the
// engine does; before each step every row a request attends to must hold the right token
// (sinks 0 .. S-1, then the window's tokens in order), a shift must come exactly when the
// cache is full and drop one block, a step must never take the cache past S + W, and
// every token must see at least W - block_size + 1 window tokens. Plus exact counts on one
// stream.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "tessera/infer/scheduler.h"

namespace tessera::infer {
namespace {

constexpr int64_t kBs = 4, kSinks = 3, kWindow = 13, kCap = kSinks + kWindow;

SchedulerConfig stream_config(int64_t budget) {
  SchedulerConfig c;
  c.max_num_batched_tokens = budget;
  c.max_num_seqs = 6;
  c.max_model_len = 20;  // streams run far past it
  c.attention_sinks = kSinks;
  c.stream_window = kWindow;
  return c;
}

TEST(SchedulerStream, OneStreamShiftsAtExactTokens) {
  BlockManager bm({8, kBs, false});
  Scheduler s(stream_config(5), bm);
  SchedRequest r;
  r.id = 1;
  r.tokens.assign(40, 7);
  r.num_prompt_tokens = 40;
  s.add_request(r);
  // Budget 5: rows 0-5-10-15-16 (full), then a shift of 4 before each 4 tokens.
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> want = {  // start, tokens, shift after the step's shift
      {0, 5, 0}, {5, 5, 0}, {10, 5, 0}, {15, 1, 0}, {16, 4, 4}, {20, 4, 8}, {24, 4, 12}, {28, 4, 16},
      {32, 4, 20}, {36, 4, 24}};
  for (const auto& [start, n, shift] : want) {
    const SchedulerOutput out = s.schedule();
    ASSERT_EQ(out.requests.size(), 1u);
    EXPECT_EQ(out.requests[0].start, start);
    EXPECT_EQ(out.requests[0].num_tokens, n);
    EXPECT_EQ(out.requests[0].shift, shift);
    if (shift > 0 && start >= kCap) {
      ASSERT_EQ(out.shifts.size(), 1u);
      EXPECT_EQ(out.shifts[0].length, kCap);
      EXPECT_EQ(out.shifts[0].delta, kBs);
      EXPECT_EQ(out.shifts[0].sinks, kSinks);
    } else {
      EXPECT_TRUE(out.shifts.empty());
    }
    EXPECT_LE(static_cast<int64_t>(bm.block_table(1).size()), kCap / kBs);
    s.update(out, {});
    s.check_invariants();
  }
  EXPECT_EQ(s.find(1)->num_computed_tokens, 40);
  EXPECT_EQ(Scheduler::blocks_per_request(stream_config(5), kBs), 4);
}

TEST(SchedulerStream, RandomisedStreamsReadTheRightRows) {
  for (uint64_t seed : {1, 2, 3}) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937_64 rng(seed);
    auto uniform = [&](int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(rng() % (hi - lo + 1)); };
    const int64_t num_blocks = 14, budget = uniform(4, 24);
    BlockManager bm({num_blocks, kBs, false});
    Scheduler s(stream_config(budget), bm);
    std::vector<int64_t> kv(static_cast<size_t>(num_blocks * kBs), -1);  // stream index per row
    std::map<RequestId, int64_t> live;  // id -> max_tokens
    RequestId next = 1;
    int64_t shifts = 0, preempted = 0, copies = 0, forks = 0;
    for (int step = 0; step < 3000; ++step) {
      if (uniform(0, 3) == 0 && live.size() < 8) {
        SchedRequest r;
        r.id = next++;
        for (int64_t j = uniform(1, 60); j > 0; --j) r.tokens.push_back(static_cast<int32_t>(uniform(0, 9)));
        r.num_prompt_tokens = static_cast<int64_t>(r.tokens.size());
        s.add_request(r);
        live[r.id] = uniform(1, 50);
      }
      if (uniform(0, 29) == 0 && !live.empty()) {
        auto it = live.begin();
        std::advance(it, uniform(0, static_cast<int64_t>(live.size()) - 1));
        s.abort_request(it->first);
        live.erase(it);
      }
      if (uniform(0, 7) == 0 && !s.running().empty() && live.size() < 8) {
        const RequestId parent = s.running()[uniform(0, static_cast<int64_t>(s.running().size()) - 1)];
        const SchedRequest* p = s.find(parent);
        if (static_cast<int64_t>(p->tokens.size()) == p->num_computed_tokens + 1) {
          s.fork_request(parent, next, 3);
          live[next++] = live[parent];
          ++forks;
        }
      }
      const SchedulerOutput out = s.schedule();
      s.check_invariants();
      preempted += static_cast<int64_t>(out.preempted.size());
      copies += static_cast<int64_t>(out.copies.size());
      for (const auto& [src, dst] : out.copies) std::copy_n(kv.begin() + src * kBs, kBs, kv.begin() + dst * kBs);
      for (const KvShift& k : out.shifts) {
        const auto& table = bm.block_table(k.id);
        ASSERT_EQ(k.length, kCap) << "a shift before the cache is full";
        ASSERT_EQ(k.delta, kBs);
        ASSERT_EQ(k.sinks, kSinks);
        for (int64_t t = k.sinks; t + k.delta < k.length; ++t) {
          ASSERT_EQ(bm.ref_count(table[t / kBs]), 1) << "a shift writes a shared block";
          kv[table[t / kBs] * kBs + t % kBs] = kv[table[(t + k.delta) / kBs] * kBs + (t + k.delta) % kBs];
        }
        ++shifts;
      }
      for (const ScheduledRequest& q : out.requests) {
        const auto& table = bm.block_table(q.id);
        const int64_t rows = q.start - q.shift;  // cached rows before this step's tokens
        ASSERT_LE(rows + q.num_tokens, kCap);
        if (q.start >= kCap) {
          ASSERT_GE(rows - kSinks + 1, kWindow - kBs + 1) << "the first token sees too little";
        }
        for (int64_t p = 0; p < rows; ++p)
          ASSERT_EQ(kv[table[p / kBs] * kBs + p % kBs], p < kSinks ? p : p + q.shift)
              << "request " << q.id << " row " << p << " (step " << step << ")";
        for (int64_t i = 0; i < q.num_tokens; ++i) {
          const int64_t p = rows + i;
          ASSERT_EQ(bm.ref_count(table[p / kBs]), 1);
          kv[table[p / kBs] * kBs + p % kBs] = q.start + i;
        }
      }
      std::vector<std::pair<RequestId, int32_t>> sampled;
      for (const ScheduledRequest& q : out.requests)
        if (q.samples) sampled.emplace_back(q.id, static_cast<int32_t>(uniform(0, 9)));
      s.update(out, sampled);
      s.check_invariants();
      std::vector<RequestId> done;
      for (const auto& [id, max_tokens] : live) {
        const SchedRequest* r = s.find(id);
        if (static_cast<int64_t>(r->tokens.size()) - r->num_prompt_tokens >= max_tokens) done.push_back(id);
      }
      for (RequestId id : done) {
        s.finish_request(id);
        live.erase(id);
      }
    }
    for (const auto& [id, m] : live) s.abort_request(id);
    s.check_invariants();
    EXPECT_EQ(bm.num_free_blocks(), num_blocks);
    EXPECT_GT(shifts, 200);
    EXPECT_GT(preempted, 5);
    EXPECT_GT(copies, 5);
    EXPECT_GT(forks, 20);
  }
}

}  // namespace
}  // namespace tessera::infer
