// Scheduler: chunked-prefill accounting, prefix hits, preemption and resumption with exact block
// ids, copy-on-write after a fork, and a randomised run that simulates the KV contents.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>

#include "tessera/base/error.h"
#include "tessera/infer/kv_host_tier.h"
#include "tessera/infer/scheduler.h"

namespace tessera::infer {
namespace {

using Ids = std::vector<BlockId>;
using Sampled = std::vector<std::pair<RequestId, int32_t>>;

std::vector<int32_t> iota(int n, int32_t first) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

SchedRequest req(RequestId id, std::vector<int32_t> prompt, int priority = 0) {
  SchedRequest r;
  r.id = id;
  r.num_prompt_tokens = static_cast<int64_t>(prompt.size());
  r.tokens = std::move(prompt);
  r.max_tokens = 16;
  r.priority = priority;
  return r;
}

// {id, start, num_tokens, samples} as a tuple, for exact comparisons.
using Entry = std::tuple<RequestId, int64_t, int64_t, bool>;
std::vector<Entry> entries(const SchedulerOutput& out) {
  std::vector<Entry> e;
  for (const ScheduledRequest& s : out.requests) e.emplace_back(s.id, s.start, s.num_tokens, s.samples);
  return e;
}

// Every request that samples gets token `base + id`.
Sampled sample_all(const SchedulerOutput& out, int32_t base) {
  Sampled s;
  for (const ScheduledRequest& r : out.requests)
    if (r.samples) s.emplace_back(r.id, base + static_cast<int32_t>(r.id));
  return s;
}

TEST(Scheduler, RejectsBadConfigAndRequests) {
  BlockManager bm({8, 4, true});
  EXPECT_THROW(Scheduler({0, 4, 16, true}, bm), Error);
  EXPECT_THROW(Scheduler({32, 4, 33, true}, bm), Error);   // 9 blocks > 8 in the pool
  EXPECT_THROW(Scheduler({16, 4, 32, false}, bm), Error);  // no chunking: budget < max_model_len
  Scheduler s({32, 4, 32, true}, bm);
  EXPECT_THROW(s.add_request(req(1, iota(33, 0))), Error);  // longer than max_model_len
  EXPECT_THROW(s.add_request(req(1, {})), Error);
  SchedRequest bad = req(1, iota(4, 0));
  bad.num_prompt_tokens = 5;
  EXPECT_THROW(s.add_request(bad), Error);
  s.add_request(req(1, iota(32, 0)));
  EXPECT_THROW(s.add_request(req(1, iota(3, 0))), Error);  // duplicate id
  EXPECT_THROW(s.finish_request(2), Error);
  s.abort_request(2);  // unknown: no-op
  EXPECT_EQ(s.num_waiting(), 1u);
}

TEST(Scheduler, ChunkedPrefillSplitsALongPromptUnderTheBudget) {
  BlockManager bm({64, 4, true});
  Scheduler s({32, 8, 128, true}, bm);
  s.add_request(req(1, iota(100, 0)));
  const std::vector<Entry> want = {{1, 0, 32, false}, {1, 32, 32, false}, {1, 64, 32, false},
                                   {1, 96, 4, true}};
  for (const Entry& e : want) {
    SchedulerOutput out = s.schedule();
    EXPECT_EQ(entries(out), std::vector<Entry>{e});
    EXPECT_EQ(out.num_batched_tokens, std::get<2>(e));
    s.update(out, sample_all(out, 1000));
    s.check_invariants();
  }
  EXPECT_EQ(s.find(1)->num_computed_tokens, 100);
  EXPECT_EQ(s.find(1)->tokens.size(), 101u);
  EXPECT_EQ(s.find(1)->tokens.back(), 1001);
  EXPECT_EQ(bm.block_table(1).size(), 25u);
  SchedulerOutput out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{1, 100, 1, true}}));
}

TEST(Scheduler, DecodesKeepFlowingDuringAChunkedPrefill) {
  BlockManager bm({64, 4, true});
  Scheduler s({33, 8, 128, true}, bm);
  s.add_request(req(1, iota(3, 500)));
  SchedulerOutput out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{1, 0, 3, true}}));
  s.update(out, sample_all(out, 0));
  s.add_request(req(2, iota(100, 0)));  // joins at the next step
  const std::vector<std::vector<Entry>> want = {
      {{1, 3, 1, true}, {2, 0, 32, false}},
      {{1, 4, 1, true}, {2, 32, 32, false}},
      {{1, 5, 1, true}, {2, 64, 32, false}},
      {{1, 6, 1, true}, {2, 96, 4, true}},  // the last chunk samples
      {{1, 7, 1, true}, {2, 100, 1, true}},
  };
  for (const auto& w : want) {
    out = s.schedule();
    EXPECT_EQ(entries(out), w);
    EXPECT_LE(out.num_batched_tokens, 33);
    s.update(out, sample_all(out, 0));
    s.check_invariants();
  }
  EXPECT_EQ(s.find(1)->tokens.size(), 9u);  // 3 prompt + 6 sampled
  EXPECT_EQ(s.find(2)->tokens.size(), 102u);
}

TEST(Scheduler, SingleTokenEntriesComeFirst) {
  BlockManager bm({64, 4, true});
  Scheduler s({32, 8, 128, true}, bm);
  s.add_request(req(1, iota(36, 0)));
  SchedulerOutput out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{1, 0, 32, false}}));
  s.update(out, {});
  s.add_request(req(2, {7}));  // a one-token prompt is admitted after 1's last chunk
  out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{2, 0, 1, true}, {1, 32, 4, true}}));
  EXPECT_EQ(out.num_batched_tokens, 5);
}

TEST(Scheduler, WithoutChunkingAPromptThatDoesNotFitWaits) {
  BlockManager bm({64, 4, true});
  Scheduler s({40, 8, 40, false}, bm);
  s.add_request(req(1, iota(3, 500)));
  s.add_request(req(4, iota(3, 600)));
  SchedulerOutput out = s.schedule();
  s.update(out, sample_all(out, 0));
  s.add_request(req(2, iota(39, 0)));   // 38 tokens of budget are left after two decodes
  s.add_request(req(3, iota(5, 100)));  // fits, but queues behind 2
  out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{1, 3, 1, true}, {4, 3, 1, true}}));
  EXPECT_FALSE(bm.has_request(2));  // the prefix lookup was undone
  s.update(out, sample_all(out, 0));
  s.check_invariants();
  s.finish_request(1);
  s.finish_request(4);
  out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{2, 0, 39, true}}));  // 3 no longer fits
  s.update(out, sample_all(out, 0));
  out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{2, 39, 1, true}, {3, 0, 5, true}}));
}

TEST(Scheduler, PrefixHitSkipsCachedPrefill) {
  BlockManager bm({32, 4, true});
  Scheduler s({64, 8, 64, true}, bm);
  const std::vector<int32_t> p = iota(10, 0);
  s.add_request(req(1, p));
  SchedulerOutput out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{1, 0, 10, true}}));
  EXPECT_EQ(bm.block_table(1), (Ids{0, 1, 2}));
  s.update(out, sample_all(out, 0));  // commits blocks 0 and 1
  s.finish_request(1);
  EXPECT_EQ(s.find(1), nullptr);
  EXPECT_EQ(bm.eviction_order(), (Ids{1, 0}));

  std::vector<int32_t> q(p.begin(), p.begin() + 8);
  q.insert(q.end(), {70, 71, 72});
  s.add_request(req(2, q));
  out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{2, 8, 3, true}}));
  EXPECT_EQ(out.num_batched_tokens, 3);
  EXPECT_EQ(bm.block_table(2), (Ids{0, 1, 3}));
  const BlockManager::Stats st = bm.stats();
  EXPECT_EQ(st.queries, 2);
  EXPECT_EQ(st.hit_blocks, 2);
  EXPECT_EQ(st.miss_blocks, 2);
  s.update(out, sample_all(out, 0));
  EXPECT_EQ(s.find(2)->num_computed_tokens, 11);
  s.check_invariants();
}

// Pool of 4 blocks of 4 tokens; two 6-token prompts fill it.
TEST(Scheduler, PreemptsTheLatestArrivalAndResumesItFromItsCachedPrefix) {
  BlockManager bm({4, 4, true});
  Scheduler s({64, 8, 16, true}, bm);
  s.add_request(req(1, iota(6, 0)));
  s.add_request(req(2, iota(6, 100)));
  SchedulerOutput out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{1, 0, 6, true}, {2, 0, 6, true}}));
  EXPECT_EQ(bm.block_table(1), (Ids{0, 1}));
  EXPECT_EQ(bm.block_table(2), (Ids{2, 3}));
  s.update(out, sample_all(out, 50));
  for (int step = 0; step < 2; ++step) {  // positions 6 and 7 still fit in the second blocks
    out = s.schedule();
    EXPECT_TRUE(out.preempted.empty());
    s.update(out, sample_all(out, 50));
  }
  // Request 1 needs a third block at position 8: request 2 (arrived later) gives its blocks up.
  out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{1, 8, 1, true}}));
  EXPECT_EQ(out.preempted, std::vector<RequestId>{2});
  EXPECT_EQ(bm.block_table(1), (Ids{0, 1, 3}));  // 2's blocks were cached, its tail evicted
  EXPECT_EQ(bm.eviction_order(), Ids{2});
  EXPECT_EQ(bm.stats().evictions, 1);
  const SchedRequest* r2 = s.find(2);
  EXPECT_EQ(r2->status, RequestStatus::kPreempted);
  EXPECT_EQ(r2->num_computed_tokens, 0);
  EXPECT_EQ(r2->num_preemptions, 1);
  EXPECT_EQ(r2->tokens.size(), 9u);  // its 3 sampled tokens are kept
  EXPECT_EQ(s.num_preemptions(), 1);
  EXPECT_EQ(s.num_waiting(), 1u);
  s.update(out, sample_all(out, 50));
  s.check_invariants();

  // Request 2 hits its first block but cannot get two more: it stays queued.
  out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{1, 9, 1, true}}));
  EXPECT_EQ(bm.eviction_order(), Ids{2});
  s.update(out, sample_all(out, 50));
  s.finish_request(1);  // block 3 (partial) is free; 1 and 0 (full) are cached
  EXPECT_EQ(bm.eviction_order(), (Ids{2, 1, 0}));
  s.check_invariants();

  // Resumed: block 2 is its cached prefix, only the other 5 tokens are recomputed.
  out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{2, 4, 5, true}}));
  EXPECT_EQ(bm.block_table(2), (Ids{2, 3, 1}));
  EXPECT_EQ(bm.stats().evictions, 2);
  s.update(out, sample_all(out, 50));
  EXPECT_EQ(s.find(2)->tokens,
            (std::vector<int32_t>{100, 101, 102, 103, 104, 105, 52, 52, 52, 52}));
  s.finish_request(2);
  EXPECT_EQ(bm.num_free_blocks(), 4);
  s.check_invariants();
}

TEST(Scheduler, ARequestCanPreemptItself) {
  BlockManager bm({4, 4, true});
  Scheduler s({64, 8, 16, true}, bm);
  s.add_request(req(1, iota(6, 0)));
  s.add_request(req(2, iota(8, 100)));
  SchedulerOutput out = s.schedule();
  s.update(out, sample_all(out, 50));
  // 1 decodes at 6 (fits); 2 needs a block at 8 and is itself the latest arrival.
  out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{1, 6, 1, true}}));
  EXPECT_EQ(out.preempted, std::vector<RequestId>{2});
  EXPECT_EQ(bm.eviction_order(), (Ids{3, 2}));  // both of 2's blocks were full and committed
  s.update(out, sample_all(out, 50));
  s.check_invariants();
  // Next step: 2 hits both cached blocks but needs a third: not admitted, the hits are returned.
  out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{1, 7, 1, true}}));
  EXPECT_EQ(bm.eviction_order(), (Ids{3, 2}));
  EXPECT_EQ(bm.stats().hit_blocks, 2);
  s.check_invariants();
}

TEST(Scheduler, PriorityPicksTheVictimAndRefundsItsScheduledTokens) {
  BlockManager bm({4, 4, true});
  Scheduler s({64, 8, 16, true}, bm);
  s.add_request(req(1, iota(6, 0), /*priority=*/1));
  SchedulerOutput out = s.schedule();
  s.update(out, sample_all(out, 50));
  s.add_request(req(2, iota(8, 100), /*priority=*/0));
  out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{1, 6, 1, true}, {2, 0, 8, true}}));
  s.update(out, sample_all(out, 50));
  // 1 is scheduled first (position 7), then 2 needs a block at 8: the victim is 1 (priority 1),
  // already scheduled in this step, so it is taken back out.
  out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{2, 8, 1, true}}));
  EXPECT_EQ(out.num_batched_tokens, 1);
  EXPECT_EQ(out.preempted, std::vector<RequestId>{1});
  EXPECT_EQ(bm.block_table(2), (Ids{2, 3, 1}));  // 1's partial block went to the free list
  EXPECT_EQ(bm.eviction_order(), Ids{0});
  s.update(out, sample_all(out, 50));
  s.check_invariants();
  // A new high-priority request is queued ahead of the preempted one.
  s.add_request(req(3, iota(2, 300), /*priority=*/0));
  EXPECT_EQ(s.waiting(), (std::vector<RequestId>{3, 1}));
}

TEST(Scheduler, TokensRefundedByAPreemptionGoToLaterRequests) {
  BlockManager bm({6, 4, true});
  Scheduler s({10, 8, 24, true}, bm);
  s.add_request(req(1, iota(10, 0), /*priority=*/1));
  SchedulerOutput out = s.schedule();
  EXPECT_EQ(bm.block_table(1), (Ids{0, 1, 2}));
  s.update(out, sample_all(out, 50));
  s.add_request(req(2, iota(4, 100)));
  s.add_request(req(3, iota(20, 200)));
  out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{1, 10, 1, true}, {2, 0, 4, true}, {3, 0, 5, false}}));
  EXPECT_EQ(bm.block_table(2), Ids{3});
  EXPECT_EQ(bm.block_table(3), (Ids{4, 5}));
  s.update(out, sample_all(out, 50));
  // 1 is scheduled (position 11 fits its third block); 2 then needs a block and preempts 1,
  // whose token comes back, so 3's chunk is 9 tokens, not 8.
  out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{2, 4, 1, true}, {3, 5, 9, false}}));
  EXPECT_EQ(out.preempted, std::vector<RequestId>{1});
  EXPECT_EQ(out.num_batched_tokens, 10);
  EXPECT_EQ(bm.block_table(2), (Ids{3, 2}));        // 1's partial block, from the free list
  EXPECT_EQ(bm.block_table(3), (Ids{4, 5, 1, 0}));  // 1's cached blocks, evicted tail first
  EXPECT_EQ(bm.stats().evictions, 2);
  s.check_invariants();
}

TEST(Scheduler, ForkedRequestCopiesTheSharedBlockOnWrite) {
  BlockManager bm({16, 4, true});
  Scheduler s({64, 8, 32, true}, bm);
  s.add_request(req(1, iota(6, 0)));
  SchedulerOutput out = s.schedule();
  s.update(out, {{1, 9}});
  s.fork_request(1, 2, 10);
  EXPECT_EQ(s.find(2)->tokens, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 10}));
  EXPECT_EQ(s.find(1)->tokens.back(), 9);
  EXPECT_EQ(bm.block_table(2), (Ids{0, 1}));
  EXPECT_EQ(bm.ref_count(1), 2);
  EXPECT_THROW(s.fork_request(1, 2, 11), Error);
  s.check_invariants();
  out = s.schedule();
  EXPECT_EQ(entries(out), (std::vector<Entry>{{1, 6, 1, true}, {2, 6, 1, true}}));
  EXPECT_EQ(out.copies, (std::vector<std::pair<BlockId, BlockId>>{{1, 2}}));
  EXPECT_EQ(bm.block_table(1), (Ids{0, 2}));
  EXPECT_EQ(bm.block_table(2), (Ids{0, 1}));
  EXPECT_EQ(bm.ref_count(0), 2);
  s.update(out, sample_all(out, 0));
  s.check_invariants();
  EXPECT_THROW(s.update(out, {}), Error);  // applying the same step twice
}

TEST(Scheduler, AbortAndFinishFreeBlocksAtOnce) {
  BlockManager bm({16, 4, true});
  Scheduler s({8, 8, 64, true}, bm);
  s.add_request(req(1, iota(20, 0)));
  s.add_request(req(2, iota(3, 100)));
  SchedulerOutput out = s.schedule();  // 1 takes the whole budget
  EXPECT_EQ(entries(out), (std::vector<Entry>{{1, 0, 8, false}}));
  s.update(out, {});
  EXPECT_EQ(bm.num_free_blocks(), 14);
  s.abort_request(1);
  EXPECT_EQ(s.find(1), nullptr);
  EXPECT_EQ(bm.num_free_blocks(), 16);
  s.abort_request(2);  // still waiting: nothing held
  EXPECT_EQ(s.num_waiting(), 0u);
  EXPECT_EQ(s.num_running(), 0u);
  s.check_invariants();
  // A request finished between schedule() and update() is skipped by update().
  s.add_request(req(3, iota(3, 200)));
  out = s.schedule();
  s.finish_request(3);
  s.update(out, sample_all(out, 0));
  EXPECT_EQ(bm.num_free_blocks(), 16);
  EXPECT_TRUE(s.schedule().requests.empty());
}

TEST(Scheduler, RejectsRunningPastTheContextLength) {
  BlockManager bm({8, 4, true});
  Scheduler s({64, 8, 8, true}, bm);
  s.add_request(req(1, iota(8, 0)));
  SchedulerOutput out = s.schedule();
  s.update(out, sample_all(out, 0));  // 9 tokens: the engine should have finished it
  EXPECT_THROW(s.schedule(), Error);
}

// Randomised: thousands of adds, forks, aborts, schedules, updates and finishes on a tiny pool.
// Besides both check_invariants() after every step, the test simulates the KV pool: each slot
// holds a fingerprint of the tokens [0, p] whose K/V it stands for (that is what position p's
// K/V depends on). Before each step every position a scheduled request attends to must read
// back the right fingerprint through its block table (so prefix hits, copy-on-write copies and
// recomputation after preemption are right), and every block it writes must be private and
// uncached. Each request's tokens are checked against an independent record.
uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

struct RandomRun {
  int64_t finished = 0, preemptions = 0, copies = 0, swapped = 0;
  BlockManager::Stats stats;
};

// Lower KV tiers over the simulated pool below (a HostKvTier of fingerprint slots): what
// comes back from it must be the fingerprints that went in.
struct SimTiers final : KvOffloader {
  std::vector<uint64_t>& kv;
  int64_t bs;
  HostKvTier host;
  SimTiers(std::vector<uint64_t>& pool, int64_t block_size, int64_t blocks)
      : kv(pool), bs(block_size), host(blocks * block_size * 8, block_size * 8) {}
  uint64_t* at(BlockId b) { return kv.data() + b * bs; }
  void offload(BlockId b, const BlockKey& key) override {
    if (uint8_t* p = host.insert(key)) std::memcpy(p, at(b), static_cast<size_t>(bs) * 8);
  }
  bool contains(const BlockKey& key) override { return host.find(key) != nullptr; }
  bool load(const BlockKey& key, BlockId dst) override {
    const uint8_t* p = host.find(key);
    if (p) std::memcpy(at(dst), p, static_cast<size_t>(bs) * 8);
    return p != nullptr;
  }
  bool swap_out(RequestId id, const std::vector<BlockId>& blocks, int64_t num_tokens) override {
    const auto slots = host.reserve_swap(id, static_cast<int64_t>(blocks.size()), num_tokens);
    for (size_t i = 0; i < slots.size(); ++i) std::memcpy(slots[i], at(blocks[i]), static_cast<size_t>(bs) * 8);
    return !slots.empty();
  }
  int64_t swapped_tokens(RequestId id) const override { return host.swapped_tokens(id); }
  void swap_in(RequestId id, int64_t first, const std::vector<BlockId>& dst) override {
    for (size_t i = 0; i < dst.size(); ++i)
      std::memcpy(at(dst[i]), host.swap_block(id, first + static_cast<int64_t>(i)), static_cast<size_t>(bs) * 8);
  }
  void drop_swap(RequestId id) override { host.drop_swap(id); }
};

// tier_blocks > 0: a SimTiers of that many blocks under the pool; swap: --preemption swap.
void run_random(uint64_t seed, bool chunked, bool caching, int steps, RandomRun& res, int64_t tier_blocks = 0,
                bool swap = false) {
  const int64_t bs = 4, num_blocks = 12, max_len = 32;
  std::mt19937_64 rng(seed);
  auto uniform = [&](int64_t lo, int64_t hi) {  // [lo, hi]
    return lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo + 1));
  };
  BlockManager bm({num_blocks, bs, caching});
  const int64_t budget = chunked ? uniform(6, 40) : uniform(max_len, 48);
  SchedulerConfig sc{budget, 6, max_len, chunked};
  sc.preemption_swap = swap;
  Scheduler s(sc, bm);
  std::vector<std::vector<int32_t>> prefixes;  // shared prompt starts, so prefixes get hit
  for (int i = 0; i < 3; ++i) {
    std::vector<int32_t> p;
    for (int64_t j = uniform(4, 12); j > 0; --j) p.push_back(static_cast<int32_t>(uniform(0, 3)));
    prefixes.push_back(p);
  }
  std::vector<uint64_t> kv(static_cast<size_t>(num_blocks * bs), 0);
  std::unique_ptr<SimTiers> tiers;
  if (tier_blocks > 0) {
    tiers = std::make_unique<SimTiers>(kv, bs, tier_blocks);
    bm.set_offloader(tiers.get());
  }
  std::map<RequestId, std::vector<int32_t>> expected;  // live requests' tokens
  RequestId next_id = 1;
  auto fingerprints = [](const std::vector<int32_t>& t) {
    std::vector<uint64_t> fp(t.size());
    uint64_t h = 0x1234;
    for (size_t p = 0; p < t.size(); ++p) fp[p] = h = splitmix(h ^ static_cast<uint32_t>(t[p]));
    return fp;
  };
  auto pick_live = [&]() {
    auto it = expected.begin();
    std::advance(it, uniform(0, static_cast<int64_t>(expected.size()) - 1));
    return it->first;
  };
  auto finish = [&](RequestId id) {
    s.finish_request(id);
    expected.erase(id);
    ++res.finished;
  };

  for (int step = 0; step < steps; ++step) {
    if (uniform(0, 2) == 0 && expected.size() < 12) {
      std::vector<int32_t> prompt;
      if (uniform(0, 1)) prompt = prefixes[uniform(0, 2)];
      for (int64_t j = uniform(prompt.empty() ? 1 : 0, 12); j > 0; --j)
        prompt.push_back(static_cast<int32_t>(uniform(0, 3)));
      SchedRequest r = req(next_id, prompt, static_cast<int>(uniform(0, 2)));
      r.max_tokens = uniform(1, 10);
      s.add_request(r);
      expected[next_id++] = prompt;
    }
    if (uniform(0, 19) == 0 && !expected.empty()) {
      const RequestId id = pick_live();
      s.abort_request(id);
      expected.erase(id);
    }
    if (uniform(0, 9) == 0 && !s.running().empty() && expected.size() < 12) {
      const RequestId parent = s.running()[uniform(0, static_cast<int64_t>(s.running().size()) - 1)];
      const SchedRequest* p = s.find(parent);
      if (static_cast<int64_t>(p->tokens.size()) == p->num_computed_tokens + 1) {
        const int32_t last = static_cast<int32_t>(uniform(0, 3));
        s.fork_request(parent, next_id, last);
        std::vector<int32_t> t = expected[parent];
        t.back() = last;
        expected[next_id++] = t;
      }
    }
    s.check_invariants();

    const SchedulerOutput out = s.schedule();
    s.check_invariants();
    if (tiers) tiers->host.check_invariants();
    res.preemptions += static_cast<int64_t>(out.preempted.size());
    res.copies += static_cast<int64_t>(out.copies.size());
    int64_t total = 0;
    bool seen_chunk = false;
    std::set<RequestId> ids;
    for (const ScheduledRequest& q : out.requests) {
      total += q.num_tokens;
      EXPECT_TRUE(ids.insert(q.id).second);
      if (q.num_tokens > 1) {
        seen_chunk = true;
      } else {
        EXPECT_FALSE(seen_chunk) << "a decode after a prefill chunk";
      }
      const SchedRequest* r = s.find(q.id);
      ASSERT_NE(r, nullptr);
      ASSERT_EQ(r->status, RequestStatus::kRunning);
      ASSERT_EQ(q.start, r->num_computed_tokens);
      ASSERT_GE(q.num_tokens, 1);
      ASSERT_LE(q.start + q.num_tokens, static_cast<int64_t>(r->tokens.size()));
      ASSERT_EQ(q.samples, q.start + q.num_tokens == static_cast<int64_t>(r->tokens.size()));
    }
    ASSERT_EQ(total, out.num_batched_tokens);
    ASSERT_LE(total, budget);
    for (RequestId id : out.preempted) {
      ASSERT_EQ(s.find(id)->status, RequestStatus::kPreempted);
      ASSERT_FALSE(ids.count(id));
    }
    // No running request is left out while the budget could still serve it.
    for (RequestId id : s.running()) {
      const SchedRequest* r = s.find(id);
      const int64_t remaining = static_cast<int64_t>(r->tokens.size()) - r->num_computed_tokens;
      if (!ids.count(id) && remaining > 0) {
        ASSERT_LT(budget - total, remaining) << "running request " << id << " was skipped";
      }
    }

    // The "model runner": copies first, then check what each request attends to, then write.
    for (const auto& [src, dst] : out.copies) {
      // A copy's destination is a block some scheduled request writes into in this step.
      bool written = false;
      for (const ScheduledRequest& q : out.requests) {
        const std::vector<BlockId>& table = bm.block_table(q.id);
        for (int64_t b = q.start / bs; b <= (q.start + q.num_tokens - 1) / bs; ++b)
          written = written || table[b] == dst;
      }
      ASSERT_TRUE(written) << "copy " << src << " -> " << dst << " into a block nobody writes";
      std::copy_n(kv.begin() + src * bs, bs, kv.begin() + dst * bs);
    }
    for (const ScheduledRequest& q : out.requests) {
      const std::vector<int32_t>& t = s.find(q.id)->tokens;
      const std::vector<uint64_t> fp = fingerprints(t);
      const std::vector<BlockId>& table = bm.block_table(q.id);
      ASSERT_GE(static_cast<int64_t>(table.size()) * bs, q.start + q.num_tokens);
      for (int64_t p = 0; p < q.start; ++p)
        ASSERT_EQ(kv[table[p / bs] * bs + p % bs], fp[p])
            << "request " << q.id << " reads wrong K/V at position " << p << " (step " << step << ")";
      for (int64_t p = q.start; p < q.start + q.num_tokens; ++p) {
        const BlockId b = table[p / bs];
        ASSERT_EQ(bm.ref_count(b), 1) << "write into shared block " << b;
        ASSERT_FALSE(bm.cached_hash(b).has_value()) << "write into cached block " << b;
        kv[b * bs + p % bs] = fp[p];
      }
    }

    if (uniform(0, 24) == 0 && !out.requests.empty()) {  // cancelled while the step ran
      const RequestId id = out.requests[uniform(0, static_cast<int64_t>(out.requests.size()) - 1)].id;
      s.abort_request(id);
      expected.erase(id);
    }
    Sampled sampled;
    for (const ScheduledRequest& q : out.requests) {
      if (!q.samples || !expected.count(q.id)) continue;
      const int32_t tok = static_cast<int32_t>(splitmix(q.id * 1000 + expected[q.id].size()) % 4);
      sampled.emplace_back(q.id, tok);
      expected[q.id].push_back(tok);
    }
    s.update(out, sampled);
    s.check_invariants();

    // The engine's stop rules: length, context length, or a random "stop token".
    std::vector<RequestId> done;
    for (const auto& [id, t] : expected) {
      const SchedRequest* r = s.find(id);
      ASSERT_NE(r, nullptr);
      ASSERT_EQ(r->tokens, t) << "request " << id;
      const int64_t generated = static_cast<int64_t>(t.size()) - r->num_prompt_tokens;
      if (generated >= r->max_tokens || static_cast<int64_t>(t.size()) >= max_len ||
          (r->status == RequestStatus::kRunning && uniform(0, 29) == 0))
        done.push_back(id);
    }
    for (RequestId id : done) finish(id);
    s.check_invariants();
    EXPECT_EQ(s.num_running() + s.num_waiting(), expected.size());
  }
  while (!expected.empty()) {
    s.abort_request(expected.begin()->first);
    expected.erase(expected.begin());
  }
  s.check_invariants();
  EXPECT_EQ(bm.num_free_blocks(), num_blocks);  // the pool is whole
  EXPECT_EQ(s.num_preemptions(), res.preemptions);
  res.stats = bm.stats();
  res.swapped = s.num_swapped_preemptions();
  if (tiers) {
    EXPECT_EQ(tiers->host.num_swapped_blocks(), 0) << "swapped blocks of finished requests leaked";
    tiers->host.check_invariants();
  }
  if (!caching) {
    EXPECT_EQ(bm.num_cached_blocks(), 0);
  }
}

TEST(Scheduler, RandomisedRunKeepsInvariantsAndLeaksNoBlock) {
  for (bool chunked : {true, false}) {
    for (bool caching : {true, false}) {
      for (uint64_t seed : {1, 2, 3}) {
        SCOPED_TRACE(testing::Message() << "chunked " << chunked << " caching " << caching
                                        << " seed " << seed);
        RandomRun r;
        run_random(seed, chunked, caching, 3000, r);
        if (HasFatalFailure()) return;
        // The run must have exercised what it claims to test.
        EXPECT_GT(r.finished, 300);
        EXPECT_GT(r.preemptions, 10);
        EXPECT_GT(r.copies, 10);
        if (caching) {
          EXPECT_GT(r.stats.hit_blocks, 100);
          EXPECT_GT(r.stats.evictions, 100);
        }
      }
    }
  }
}

// The same with lower KV tiers under the pool (and swap preemption): every position a request
// reads after a tier hit or a swap-in must hold its own K/V fingerprint.
TEST(Scheduler, RandomisedRunWithKvTiersAndSwapReadsBackTheRightKv) {
  for (bool swap : {false, true}) {
    for (int64_t tier_blocks : {6, 40}) {
      for (uint64_t seed : {4, 5}) {
        SCOPED_TRACE(testing::Message() << "swap " << swap << " tier blocks " << tier_blocks << " seed " << seed);
        RandomRun r;
        run_random(seed, true, true, 3000, r, tier_blocks, swap);
        if (HasFatalFailure()) return;
        EXPECT_GT(r.stats.tier_hit_blocks, 20);
        if (swap) {
          EXPECT_GT(r.swapped, 10);
          EXPECT_GT(r.stats.swap_in_blocks, 10);
        }
        if (swap && tier_blocks == 6) {
          EXPECT_LT(r.swapped, r.preemptions) << "a 6-block tier must refuse some";
        }
      }
    }
  }
}

}  // namespace
}  // namespace tessera::infer
