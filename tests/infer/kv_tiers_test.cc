// The tiered KV cache (infer/kv_tiers.h): the host tier's LRU and swap slots, the disk tier's
// files (limit, restart, foreign and corrupt files), blocks evicted from a small pool served
// back from a lower tier with the prompt tokens computed given by the block arithmetic, and
// greedy outputs unchanged by the tiers and by swap preemption (against the dense reference
// for f32, against the engine without tiers for the quantized cache dtypes).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "tessera/infer/bench_serve.h"
#include "tessera/infer/engine.h"
#include "tessera/infer/kv_tiers.h"

namespace tessera::infer {
namespace {

namespace fs = std::filesystem;

std::vector<int32_t> iota_tokens(int32_t from, int64_t n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = from + static_cast<int32_t>(i);
  return t;
}

BlockKey key_of(uint64_t hash, uint64_t parent, const std::vector<int32_t>& tokens) {
  return {hash, parent, tokens.data(), static_cast<int64_t>(tokens.size())};
}

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name) {
    path = fs::temp_directory_path() / ("tessera_kv_tiers_" + name + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
  }
  ~TempDir() { fs::remove_all(path); }
  int64_t count(const std::string& ext = ".kvb") const {
    int64_t n = 0;
    if (!fs::exists(path)) return 0;
    for (const auto& de : fs::directory_iterator(path)) n += de.path().extension() == ext;
    return n;
  }
};

TEST(HostKvTier, LruKeepsTheMostRecentCapacityBlocksAndSwapsPinSlots) {
  const int64_t bb = 40;
  HostKvTier t(bb * 3 + bb / 2, bb);  // floor(3.5) = 3 slots
  ASSERT_EQ(t.capacity_blocks(), 3);
  std::vector<std::vector<int32_t>> toks;
  for (int i = 0; i < 5; ++i) toks.push_back(iota_tokens(10 * i, 4));
  for (int i = 0; i < 3; ++i) {
    uint8_t* p = t.insert(key_of(100 + i, 7, toks[i]));
    ASSERT_NE(p, nullptr);
    std::fill(p, p + bb, static_cast<uint8_t>(i + 1));
  }
  ASSERT_NE(t.find(key_of(100, 7, toks[0])), nullptr);  // 0 is now the most recent: 1 goes first
  ASSERT_NE(t.insert(key_of(103, 7, toks[3])), nullptr);
  EXPECT_EQ(t.find(key_of(101, 7, toks[1])), nullptr);
  const uint8_t* p0 = t.find(key_of(100, 7, toks[0]));
  ASSERT_NE(p0, nullptr);
  EXPECT_EQ(p0[bb - 1], 1);
  EXPECT_EQ(t.evictions(), 1);
  // A collision (same hash, other parent or tokens) is not a hit.
  EXPECT_EQ(t.find(key_of(100, 8, toks[0])), nullptr);
  EXPECT_EQ(t.find(key_of(100, 7, toks[1])), nullptr);
  EXPECT_EQ(t.insert(key_of(100, 7, toks[0])), nullptr);  // held already
  t.check_invariants();
  // Swap: 2 slots evict 2 cached blocks; then only 1 slot is left for anything else.
  auto slots = t.reserve_swap(42, 2, 7);
  ASSERT_EQ(slots.size(), 2u);
  EXPECT_EQ(t.num_cached_blocks(), 1);
  EXPECT_EQ(t.swapped_tokens(42), 7);
  EXPECT_TRUE(t.reserve_swap(43, 2, 5).empty()) << "2 blocks cannot fit beside 2 pinned ones";
  EXPECT_EQ(t.num_cached_blocks(), 1) << "a failed reservation evicts nothing";
  ASSERT_NE(t.insert(key_of(104, 7, toks[4])), nullptr);  // evicts 100, the one cached block
  ASSERT_NE(t.insert(key_of(105, 7, toks[4])), nullptr);  // evicts 104, never a swap slot
  EXPECT_EQ(t.find(key_of(104, 7, toks[4])), nullptr);
  EXPECT_EQ(t.num_cached_blocks(), 1);
  t.check_invariants();
  t.drop_swap(42);
  EXPECT_EQ(t.num_swapped_blocks(), 0);
  EXPECT_EQ(t.swapped_tokens(42), 0);
  t.check_invariants();
}

TEST(DiskKvTier, LruWithinTheSizeLimitSurvivesARestartAndIgnoresForeignAndCorruptFiles) {
  TempDir dir("lru");
  const int64_t T = 4, B = 100;
  const int64_t fb = DiskKvTier::file_bytes(T, B);
  EXPECT_EQ(fb, 64 + 4 * T + B);
  const int64_t limit = 3 * fb + fb / 2;  // floor(limit / file bytes) = 3 files
  std::vector<std::vector<int32_t>> toks;
  std::vector<std::vector<uint8_t>> bytes;
  for (int i = 0; i < 6; ++i) {
    toks.push_back(iota_tokens(100 * i, T));
    bytes.emplace_back(B, static_cast<uint8_t>(17 * i + 3));
  }
  {
    DiskKvTier d(dir.path.string(), limit, 0xabc, T, B);
    EXPECT_EQ(d.capacity_files(), 3);
    for (int i = 0; i < 3; ++i) d.put(key_of(1000 + i, 5, toks[i]), bytes[i].data());
    EXPECT_TRUE(d.contains(key_of(1000, 5, toks[0])));  // 0 most recent: 1 is the next victim
    d.put(key_of(1003, 5, toks[3]), bytes[3].data());
    d.put(key_of(1004, 5, toks[4]), bytes[4].data());
    d.flush();
    // 5 distinct blocks into 3 files: 5 - 3 = 2 evictions, the least recently used (1, 2).
    EXPECT_EQ(dir.count(), 3);
    EXPECT_EQ(d.stats().evictions, 2);
    EXPECT_EQ(d.stats().bytes, 3 * fb);
    EXPECT_FALSE(d.contains(key_of(1001, 5, toks[1])));
    EXPECT_FALSE(d.contains(key_of(1002, 5, toks[2])));
    std::vector<uint8_t> got(B);
    ASSERT_TRUE(d.get(key_of(1000, 5, toks[0]), got.data()));
    EXPECT_EQ(got, bytes[0]);
    EXPECT_FALSE(d.get(key_of(1000, 6, toks[0]), got.data())) << "another parent: a collision";
    EXPECT_EQ(fs::file_size(d.path_for(1003)), static_cast<uintmax_t>(fb));
  }
  // A file of another fingerprint (model / dtype) in the directory, and a truncated one.
  {
    DiskKvTier other(dir.path.string() + "_other", 10 * fb, 0xdef, T, B);
    other.put(key_of(1005, 5, toks[5]), bytes[5].data());
    other.flush();
    fs::copy_file(other.path_for(1005), dir.path / "foreign.kvb");
    std::ofstream(dir.path / "truncated.kvb") << "TSRKV";
  }
  fs::remove_all(dir.path.string() + "_other");
  {
    DiskKvTier d(dir.path.string(), limit, 0xabc, T, B);  // the restart
    const DiskTierStats s = d.stats();
    EXPECT_EQ(s.files, 3);
    EXPECT_EQ(s.ignored_files, 2);
    std::vector<uint8_t> got(B);
    for (int i : {0, 3, 4}) {
      ASSERT_TRUE(d.get(key_of(1000 + i, 5, toks[i]), got.data())) << i;
      EXPECT_EQ(got, bytes[i]) << i;
    }
    EXPECT_FALSE(d.contains(key_of(1005, 5, toks[5]))) << "another fingerprint's block is never loaded";
    // Corrupt one byte of block 3's payload: the checksum catches it, the file goes.
    const std::string p3 = d.path_for(1003);
    {
      std::fstream f(p3, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(fb - 1);
      f.put(static_cast<char>(0x5a));
    }
    EXPECT_FALSE(d.get(key_of(1003, 5, toks[3]), got.data()));
    EXPECT_EQ(d.stats().corrupt_reads, 1);
    EXPECT_FALSE(d.contains(key_of(1003, 5, toks[3])));
    d.flush();
    EXPECT_FALSE(fs::exists(p3));
  }
  {
    DiskKvTier d(dir.path.string(), fb, 0xabc, T, B);  // a smaller limit: the most recent file stays
    EXPECT_EQ(d.stats().files, 1);
    EXPECT_EQ(dir.count(), 3);  // that one and the two ignored files
  }
}

// A pool of 6 blocks of 4 tokens and a host tier: blocks evicted from the pool come back with
// their bytes, and the prefix lookup continues there (tier hits, not misses).
TEST(KvTiers, EvictedBlocksComeBackFromTheHostTierBitExact) {
  model::ModelConfig c = model::ModelConfig::named_shape("tiny");
  KvPool pool = KvPool::create(c, 6, 4, 0, kernels::KvCacheDtype::kInt8);
  const int64_t bb = pool.block_bytes();
  KvTierConfig tc;
  tc.host_bytes = 8 * bb;
  KvTiers tiers(pool, tc, 0);
  BlockManager bm(BlockManagerConfig{6, 4, true});
  bm.set_offloader(&tiers);
  auto fill = [&](RequestId id, int64_t n, uint8_t seed) {  // distinct bytes per block
    for (BlockId b : bm.block_table(id)) {
      std::vector<uint8_t> v(static_cast<size_t>(bb));
      for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(seed + b * 31 + i * 7);
      pool.write_block(b, v.data());
    }
    (void)n;
  };
  const std::vector<int32_t> a = iota_tokens(3, 13);  // 3 full blocks + 1 token
  ASSERT_EQ(bm.allocate_cached_prefix(1, a), 0);
  ASSERT_TRUE(bm.allocate_slots(1, 13));
  fill(1, 13, 1);
  std::vector<std::vector<uint8_t>> a_bytes;
  for (int k = 0; k < 3; ++k) {
    a_bytes.emplace_back(static_cast<size_t>(bb));
    pool.read_block(bm.block_table(1)[k], a_bytes.back().data());
  }
  bm.commit(1, a, 13);
  bm.free(1);
  bm.check_invariants();
  // Another request takes all 6 blocks: a's 3 cached blocks are evicted into the host tier.
  const std::vector<int32_t> b = iota_tokens(500, 24);
  ASSERT_EQ(bm.allocate_cached_prefix(2, b), 0);
  ASSERT_TRUE(bm.allocate_slots(2, 24));
  EXPECT_EQ(bm.stats().evictions, 3);
  EXPECT_EQ(tiers.stats().offloaded_blocks, 3);
  EXPECT_EQ(tiers.host()->num_cached_blocks(), 3);
  fill(2, 24, 99);  // overwrites a's old blocks in the pool
  bm.commit(2, b, 24);
  bm.free(2);
  bm.check_invariants();
  // a again: no block of it is in the pool; all 3 come from the host tier, bit-exact.
  const auto before = bm.stats();
  EXPECT_EQ(bm.allocate_cached_prefix(3, a), 12);
  EXPECT_EQ(bm.stats().hit_blocks - before.hit_blocks, 0);
  EXPECT_EQ(bm.stats().tier_hit_blocks - before.tier_hit_blocks, 3);
  EXPECT_EQ(bm.stats().miss_blocks - before.miss_blocks, 0);
  EXPECT_EQ(tiers.stats().host_hit_blocks, 3);
  EXPECT_EQ(tiers.stats().bytes_from_tiers, 3 * bb);
  for (int k = 0; k < 3; ++k) {
    std::vector<uint8_t> got(static_cast<size_t>(bb));
    pool.read_block(bm.block_table(3)[k], got.data());
    EXPECT_EQ(got, a_bytes[k]) << "block " << k;
    EXPECT_TRUE(bm.cached_hash(bm.block_table(3)[k]).has_value()) << "copied back blocks are cached again";
  }
  // (b's 3 blocks evicted for them went down in turn.)
  EXPECT_EQ(tiers.stats().offloaded_blocks, 6);
  bm.check_invariants();
  tiers.host()->check_invariants();
  // Swap: request 3's 3 blocks + a partial one (13 tokens) to the host tier and back.
  ASSERT_TRUE(bm.allocate_slots(3, 13));
  std::vector<uint8_t> last(static_cast<size_t>(bb), 0x33);
  pool.write_block(bm.block_table(3)[3], last.data());
  ASSERT_TRUE(bm.swap_out(3, 13));
  bm.free(3);
  EXPECT_EQ(tiers.swapped_tokens(3), 13);
  EXPECT_EQ(tiers.stats().swap_out_blocks, 4);
  // A request filling the pool evicts a's cached blocks again (to the host tier).
  ASSERT_EQ(bm.allocate_cached_prefix(4, iota_tokens(900, 24)), 0);
  ASSERT_TRUE(bm.allocate_slots(4, 24));
  bm.free(4);
  std::vector<int32_t> a14 = a;  // its tokens by then: the 13 computed and a sampled one
  a14.push_back(77);
  EXPECT_EQ(bm.allocate_cached_prefix(3, a14), 13);  // resumed at its 13 computed tokens
  std::vector<uint8_t> got(static_cast<size_t>(bb));
  pool.read_block(bm.block_table(3)[3], got.data());
  EXPECT_EQ(got, last);
  pool.read_block(bm.block_table(3)[1], got.data());
  EXPECT_EQ(got, a_bytes[1]);
  EXPECT_EQ(tiers.swapped_tokens(3), 13) << "kept until the admission succeeds";
  ASSERT_TRUE(bm.allocate_slots(3, 14));
  EXPECT_EQ(tiers.swapped_tokens(3), 0);
  bm.check_invariants();
  tiers.host()->check_invariants();
}

// ---- Engine level ----

model::Model make_model(uint64_t seed) {
  model::ModelConfig c = model::ModelConfig::named_shape("tiny");
  c.max_position_embeddings = 512;
  model::Model m = model::Model::random(c, DType::kF32, seed);
  auto& w = m.weights();  // widened logits: clear-cut greedy choices (as engine_test.cc)
  for (int64_t i = 0; i < w.lm_head.numel(); ++i) w.lm_head.data<float>()[i] *= 8.f;
  w.tie(c);
  return m;
}

std::vector<int32_t> dense_greedy(const model::Model& m, const std::vector<int32_t>& prompt, int64_t max_tokens) {
  model::KVCache cache = model::KVCache::create(m.config(), static_cast<int64_t>(prompt.size()) + max_tokens);
  Tensor logits = m.forward(prompt, cache);
  std::vector<int32_t> out;
  for (int64_t i = 0; i < max_tokens; ++i) {
    const float* x = logits.data<float>();
    out.push_back(static_cast<int32_t>(std::max_element(x, x + logits.numel()) - x));
    if (i + 1 < max_tokens) logits = m.forward({out.back()}, cache);
  }
  return out;
}

SamplingParams greedy(int64_t n) {
  SamplingParams p;
  p.max_tokens = n;
  p.ignore_eos = true;
  return p;
}

// Runs one request to the end; its output and cached tokens.
std::pair<std::vector<int32_t>, int64_t> run_one(Engine& e, const std::vector<int32_t>& prompt, int64_t n) {
  const RequestId id = e.add_request(prompt, greedy(n));
  std::vector<int32_t> out;
  int64_t cached = -1;
  while (e.has_unfinished())
    for (const auto& o : e.step()) {
      if (o.id != id) continue;
      out.insert(out.end(), o.new_tokens.begin(), o.new_tokens.end());
      if (o.finished) cached = o.num_cached_tokens;
      e.block_manager().check_invariants();
    }
  return {out, cached};
}

EngineConfig small_pool(const model::Model& m, int64_t blocks, kernels::KvCacheDtype dtype = kernels::KvCacheDtype::kF32) {
  EngineConfig ec;
  ec.block_size = 8;
  ec.max_model_len = 128;  // 16 blocks per request: the pool must hold 16
  ec.kv_cache_dtype = dtype;
  ec.kv_cache_memory = blocks * KvPool::bytes_per_block(m.config(), 8, 0, dtype);
  return ec;
}

// Prompt a (43 tokens: 5 full blocks + 3), then a 127-token prompt that needs all 16 blocks
// of the pool (every block of a is evicted), then a again.
TEST(KvTiers, APrefixEvictedFromThePoolIsServedFromTheHostTier) {
  const model::Model m = make_model(3);
  std::mt19937 rng(7);
  std::vector<int32_t> a(43), big(127);
  for (auto& t : a) t = static_cast<int32_t>(3 + rng() % 250);
  for (auto& t : big) t = static_cast<int32_t>(3 + rng() % 250);
  const auto ref = dense_greedy(m, a, 6);
  for (bool tiers : {false, true}) {
    SCOPED_TRACE(tiers ? "host tier" : "pool only");
    EngineConfig ec = small_pool(m, 16);
    if (tiers) ec.kv_host_memory = 64 * KvPool::bytes_per_block(m.config(), 8, 0, ec.kv_cache_dtype);
    Engine e(m, ec);
    EXPECT_EQ(run_one(e, a, 6).first, ref);
    run_one(e, big, 1);
    const EngineStats s0 = e.stats();
    const auto [out, cached] = run_one(e, a, 6);
    const EngineStats s1 = e.stats();
    EXPECT_EQ(out, ref);
    // a's 5 full blocks (only (43 - 1) / 8 = 5 can hit) all come back from the host tier:
    // 5 * 8 = 40 cached tokens and 43 - 40 = 3 computed; without it all 43 are computed.
    const int64_t host_hits = tiers ? 5 : 0;
    EXPECT_EQ(s1.kv_host_hit_blocks - s0.kv_host_hit_blocks, host_hits);
    EXPECT_EQ(cached, 8 * host_hits);
    EXPECT_EQ(s1.prompt_tokens - s0.prompt_tokens, 43 - 8 * host_hits);
    EXPECT_EQ(s1.prefix_hit_blocks - s0.prefix_hit_blocks, host_hits);
    EXPECT_EQ(s1.kv_bytes_from_tiers - s0.kv_bytes_from_tiers,
              host_hits * KvPool::bytes_per_block(m.config(), 8, 0, ec.kv_cache_dtype));
    EXPECT_EQ(s1.kv_blocks_used, 0);
  }
}

TEST(KvTiers, TheDiskTierSurvivesARestartAndIgnoresOtherModelsAndCorruptFiles) {
  TempDir dir("engine");
  const model::Model m = make_model(3);
  std::mt19937 rng(8);
  std::vector<int32_t> a(43), big(127);
  for (auto& t : a) t = static_cast<int32_t>(3 + rng() % 250);
  for (auto& t : big) t = static_cast<int32_t>(3 + rng() % 250);
  const auto ref = dense_greedy(m, a, 6);
  EngineConfig ec = small_pool(m, 16);
  ec.kv_offload_dir = dir.path.string();
  ec.kv_offload_size = 1 << 20;
  {
    Engine e(m, ec);
    EXPECT_EQ(run_one(e, a, 6).first, ref);
    // a's 6 committed blocks (43 prompt + 5 computed output tokens = 48 = 6 * 8) are evicted
    // by the 16-block request: written to disk.
    run_one(e, big, 1);
    EXPECT_EQ(e.stats().kv_disk_written_blocks, 6);
  }  // the writes finish here
  EXPECT_EQ(dir.count(), 6);
  {
    Engine e(m, ec);  // the restart
    const auto [out, cached] = run_one(e, a, 6);
    EXPECT_EQ(out, ref);
    EXPECT_EQ(e.stats().kv_disk_hit_blocks, 5);
    EXPECT_EQ(cached, 40);
    EXPECT_EQ(e.stats().prompt_tokens, 3);
  }
  {
    EngineConfig other = ec;  // another cache dtype: its fingerprint differs
    other.kv_cache_dtype = kernels::KvCacheDtype::kBF16;
    Engine e(m, other);
    EXPECT_EQ(e.kv_tiers()->disk()->stats().ignored_files, 6);
    EXPECT_EQ(run_one(e, a, 6).second, 0);
    EXPECT_EQ(e.stats().kv_disk_hit_blocks, 0);
    const model::Model m2 = make_model(4);  // another model (weights), same shapes and dtype
    Engine e2(m2, ec);
    EXPECT_EQ(e2.kv_tiers()->disk()->stats().ignored_files, 6);
    EXPECT_EQ(run_one(e2, a, 6).second, 0);
  }
  {
    Engine e(m, ec);
    // Corrupt a's third block: blocks 0 and 1 still come from disk, then the chain stops.
    uint64_t h = BlockManager::kRootHash;
    for (int k = 0; k < 3; ++k) h = BlockManager::hash_block(h, a.data() + 8 * k, 8);
    const std::string p = e.kv_tiers()->disk()->path_for(h);
    ASSERT_TRUE(fs::exists(p));
    {
      std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(200);
      const char c = static_cast<char>(f.peek());
      f.seekp(200);
      f.put(static_cast<char>(c ^ 1));
    }
    const auto [out, cached] = run_one(e, a, 6);
    EXPECT_EQ(out, ref);
    EXPECT_EQ(cached, 16);
    EXPECT_EQ(e.stats().kv_disk_hit_blocks, 2);
    EXPECT_EQ(e.stats().prompt_tokens, 43 - 16);
    EXPECT_EQ(e.kv_tiers()->disk()->stats().corrupt_reads, 1);
  }
}

// Waves of requests over 4 shared prefixes that together exceed a 20-block pool; the second
// wave finds its prefixes in the host tier. Outputs must equal the engine's without tiers.
std::pair<std::vector<std::vector<int32_t>>, EngineStats> run_waves(const model::Model& m, const EngineConfig& ec) {
  std::mt19937 rng(11);
  std::vector<std::vector<int32_t>> prefixes(4);
  for (auto& p : prefixes) {
    p.resize(40);
    for (auto& t : p) t = static_cast<int32_t>(3 + rng() % 250);
  }
  Engine e(m, ec);
  std::vector<std::vector<int32_t>> outs;
  for (int wave = 0; wave < 2; ++wave) {
    std::map<RequestId, size_t> index;
    const size_t base = outs.size();
    for (int i = 0; i < 8; ++i) {
      std::vector<int32_t> prompt = prefixes[static_cast<size_t>(i % 4)];
      for (int k = 0; k < 1 + static_cast<int>(rng() % 20); ++k) prompt.push_back(static_cast<int32_t>(3 + rng() % 250));
      index[e.add_request(prompt, greedy(1 + static_cast<int64_t>(rng() % 12)))] = outs.size();
      outs.emplace_back();
    }
    while (e.has_unfinished()) {
      for (const auto& o : e.step()) outs[index.at(o.id)].insert(outs[index.at(o.id)].end(), o.new_tokens.begin(),
                                                                   o.new_tokens.end());
      e.block_manager().check_invariants();
      if (e.kv_tiers() && e.kv_tiers()->host()) e.kv_tiers()->host()->check_invariants();
    }
    (void)base;
  }
  return {outs, e.stats()};
}

TEST(KvTiers, GreedyOutputsAreUnchangedByTheTiersInEveryCacheDtype) {
  const model::Model m = make_model(5);
  for (auto dt : {kernels::KvCacheDtype::kF32, kernels::KvCacheDtype::kBF16, kernels::KvCacheDtype::kInt8,
                  kernels::KvCacheDtype::kFp8}) {
    SCOPED_TRACE(kernels::kv_cache_dtype_name(dt));
    EngineConfig ec = small_pool(m, 20, dt);
    ec.max_num_seqs = 4;
    ec.batch_invariant = true;  // the same K/V whatever the batch, so only the tiers differ
    const auto [plain, s_plain] = run_waves(m, ec);
    ec.kv_host_memory = 40 * KvPool::bytes_per_block(m.config(), 8, 0, dt);
    const auto [tiered, s_tiered] = run_waves(m, ec);
    EXPECT_EQ(tiered, plain);
    EXPECT_GT(s_tiered.kv_host_hit_blocks, 0) << "the second wave should find prefixes in the host tier";
    EXPECT_LT(s_tiered.prompt_tokens, s_plain.prompt_tokens);
    EXPECT_GT(s_tiered.prefix_hit_blocks, s_plain.prefix_hit_blocks) << "tier hits count as prefix hits";
  }
}

// 24 concurrent requests on a 20-block pool: preemption is certain. Swap must give the
// outputs recompute gives (and the dense reference, in f32), and leave nothing behind.
TEST(KvTiers, SwapPreemptionGivesTheOutputsOfRecompute) {
  const model::Model m = make_model(6);
  std::mt19937 rng(12);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int64_t> lens;
  for (int i = 0; i < 24; ++i) {
    std::vector<int32_t> p(static_cast<size_t>(5 + rng() % 40));
    for (auto& t : p) t = static_cast<int32_t>(3 + rng() % 250);
    prompts.push_back(p);
    lens.push_back(8 + static_cast<int64_t>(rng() % 24));
  }
  auto run = [&](const EngineConfig& ec, EngineStats* st) {
    Engine e(m, ec);
    std::map<RequestId, size_t> index;
    for (size_t i = 0; i < prompts.size(); ++i) index[e.add_request(prompts[i], greedy(lens[i]))] = i;
    std::vector<std::vector<int32_t>> outs(prompts.size());
    while (e.has_unfinished()) {
      for (const auto& o : e.step())
        outs[index.at(o.id)].insert(outs[index.at(o.id)].end(), o.new_tokens.begin(), o.new_tokens.end());
      e.block_manager().check_invariants();
      if (e.kv_tiers()) e.kv_tiers()->host()->check_invariants();
    }
    *st = e.stats();
    if (e.kv_tiers()) {
      EXPECT_EQ(e.kv_tiers()->host()->num_swapped_blocks(), 0) << "swap slots leaked";
    }
    return outs;
  };
  for (auto dt : {kernels::KvCacheDtype::kF32, kernels::KvCacheDtype::kInt8}) {
    SCOPED_TRACE(kernels::kv_cache_dtype_name(dt));
    EngineConfig ec = small_pool(m, 20, dt);
    ec.max_num_seqs = 16;
    ec.batch_invariant = true;
    EngineStats recompute_stats, swap_stats, tight_stats;
    const auto recompute = run(ec, &recompute_stats);
    EXPECT_GT(recompute_stats.preemptions, 0);
    ec.preemption = "swap";
    ec.kv_host_memory = 512 * KvPool::bytes_per_block(m.config(), 8, 0, dt);
    const auto swapped = run(ec, &swap_stats);
    EXPECT_EQ(swapped, recompute);
    EXPECT_GT(swap_stats.swapped_preemptions, 0);
    EXPECT_EQ(swap_stats.swapped_preemptions, swap_stats.preemptions) << "the host tier had room for every victim";
    EXPECT_GT(swap_stats.kv_swap_in_blocks, 0);
    EXPECT_EQ(swap_stats.kv_blocks_used, 0);
    // A one-block host tier: most victims do not fit and are recomputed; outputs the same.
    ec.kv_host_memory = KvPool::bytes_per_block(m.config(), 8, 0, dt);
    EXPECT_EQ(run(ec, &tight_stats), recompute);
    EXPECT_LT(tight_stats.swapped_preemptions, tight_stats.preemptions);
    if (dt == kernels::KvCacheDtype::kF32) {
      for (size_t i = 0; i < prompts.size(); ++i) {
        EXPECT_EQ(swapped[i], dense_greedy(m, prompts[i], lens[i])) << i;
      }
    }
  }
}

TEST(KvTiers, BadFlagsAreOneLineErrorsNamingTheFlag) {
  const model::Model m = make_model(3);
  auto expect_error = [&](EngineConfig ec, const std::string& flag) {
    try {
      Engine e(m, ec);
      ADD_FAILURE() << "no error for " << flag;
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(flag), std::string::npos) << err.what();
    }
  };
  EngineConfig ec = small_pool(m, 16);
  EngineConfig c1 = ec;
  c1.preemption = "swap";
  expect_error(c1, "--kv-host-memory");
  c1.kv_host_memory = 1 << 20;
  c1.preemption = "sometimes";
  expect_error(c1, "--preemption");
  EngineConfig c2 = ec;
  c2.kv_offload_dir = "/tmp/x";
  expect_error(c2, "--kv-offload-size");
  c2.kv_offload_size = 10;
  expect_error(c2, "--kv-offload-size");  // not one block file
  EngineConfig c3 = ec;
  c3.kv_host_memory = 10;
  expect_error(c3, "--kv-host-memory");
  EngineConfig c4 = ec;
  c4.kv_host_memory = -1;
  expect_error(c4, "--kv-host-memory");
}

// bench serve's shared-prefix workload over a pool smaller than its prefixes: 4 prefixes of 64
// tokens (4 blocks each), 8 requests of 64 + 8 prompt tokens, one running at a time, a 10-block
// pool. A request has (72 - 1) / 16 = 4 candidate blocks, all prefix blocks: with the host tier
// every request gets all 64 prefix tokens from a cache; without it, fewer.
TEST(KvTiers, BenchServeSharedPrefixesBeyondThePool) {
  ServeBenchOptions o;
  o.shape = "tiny";
  o.num_requests = 8;
  o.num_prefixes = 4;
  o.shared_prefix = 64;
  o.prompt_len = {8, 8};
  o.output_len = {2, 2};
  o.baseline_requests = 0;
  o.compare_kv_tiers = true;
  o.compare_preemption = true;
  o.engine.block_size = 16;
  o.engine.max_model_len = 128;
  o.engine.max_num_seqs = 1;
  const model::ModelConfig c = model::ModelConfig::named_shape("tiny");
  o.engine.kv_cache_memory = 10 * KvPool::bytes_per_block(c, 16);
  o.engine.kv_host_memory = 64 * KvPool::bytes_per_block(c, 16);
  const ServeBenchResult r = run_serve_bench(o);
  EXPECT_EQ(r.main.cached_prompt_tokens, 8 * 64);
  EXPECT_GT(r.main.host_hit_blocks, 0);
  EXPECT_EQ(r.main.prefix_hit_blocks, 8 * 4);
  EXPECT_EQ(r.main.computed_tokens, 8 * (72 - 64) + 8 * 1) << "the prompts' own tokens, then one decode each";
  ASSERT_TRUE(r.no_tiers);
  EXPECT_EQ(r.no_tiers->host_hit_blocks, 0);
  EXPECT_LT(r.no_tiers->cached_prompt_tokens, 8 * 64);
  EXPECT_EQ(r.no_tiers->computed_tokens, 8 * 72 - r.no_tiers->cached_prompt_tokens + 8);
  EXPECT_GT(r.ttft_p50_no_tiers_over_tiers, 0);
  ASSERT_TRUE(r.other_preemption);
  EXPECT_EQ(r.other_preemption->label, "preemption swap");
  EXPECT_GT(r.throughput_swap_over_recompute, 0);
  const std::string text = format_serve_bench(r);
  EXPECT_NE(text.find("kv tiers: ttft p50 without / with"), std::string::npos) << text;
  EXPECT_NE(text.find("preemption: total throughput swap / recompute"), std::string::npos) << text;
  // The requests: request i starts with prefix i % 4, the 4 prefixes differ.
  BenchRequest w;
  std::vector<BenchRequest> more;
  const auto reqs = make_bench_requests(o, c.vocab_size, 128, &w, &more);
  ASSERT_EQ(more.size(), 3u);
  for (size_t i = 0; i < reqs.size(); ++i) {
    const std::vector<int32_t>& prefix = i % 4 == 0 ? w.prompt : more[i % 4 - 1].prompt;
    EXPECT_TRUE(std::equal(prefix.begin(), prefix.begin() + 64, reqs[i].prompt.begin())) << i;
  }
  EXPECT_FALSE(std::equal(w.prompt.begin(), w.prompt.begin() + 64, more[0].prompt.begin()));
}

}  // namespace
}  // namespace tessera::infer
