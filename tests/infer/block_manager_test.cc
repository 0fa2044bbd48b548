// BlockManager: exact block ids, reference counts, copy-on-write, chain hashes, LRU eviction
// order and prefix-cache hits, with the invariant check after every mutation.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <numeric>

#include "tessera/base/error.h"
#include "tessera/infer/block_manager.h"

namespace tessera::infer {
namespace {

using Ids = std::vector<BlockId>;

std::vector<int32_t> iota(int n, int32_t first) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

BlockManager make(int64_t num_blocks, int64_t block_size, bool prefix_caching = true) {
  return BlockManager({num_blocks, block_size, prefix_caching});
}

TEST(BlockManager, RejectsBadConfig) {
  EXPECT_THROW(make(0, 16), Error);
  EXPECT_THROW(make(8, 0), Error);
  EXPECT_THROW(make(int64_t{1} << 32, 16), Error);
}

TEST(BlockManager, AllocatesInFifoOrderAndFailsWithoutSideEffects) {
  BlockManager bm = make(8, 4);
  EXPECT_EQ(bm.num_free_blocks(), 8);
  EXPECT_EQ(bm.allocate_cached_prefix(1, iota(10, 0)), 0);
  EXPECT_EQ(bm.block_table(1), Ids{});
  ASSERT_TRUE(bm.allocate_slots(1, 10));  // 3 blocks of 4 cover 10 tokens
  EXPECT_EQ(bm.block_table(1), (Ids{0, 1, 2}));
  EXPECT_EQ(bm.num_free_blocks(), 5);
  for (BlockId b : {0, 1, 2}) EXPECT_EQ(bm.ref_count(b), 1);
  ASSERT_TRUE(bm.allocate_slots(1, 12));  // still covered: nothing new
  EXPECT_EQ(bm.block_table(1), (Ids{0, 1, 2}));
  ASSERT_TRUE(bm.allocate_slots(1, 13));
  EXPECT_EQ(bm.block_table(1), (Ids{0, 1, 2, 3}));
  bm.check_invariants();

  EXPECT_FALSE(bm.allocate_slots(2, 17));  // 5 blocks, 4 free
  EXPECT_FALSE(bm.has_request(2));
  EXPECT_EQ(bm.num_free_blocks(), 4);
  ASSERT_TRUE(bm.allocate_slots(2, 16));
  EXPECT_EQ(bm.block_table(2), (Ids{4, 5, 6, 7}));
  EXPECT_EQ(bm.num_free_blocks(), 0);
  EXPECT_FALSE(bm.allocate_slots(2, 17));
  EXPECT_EQ(bm.block_table(2), (Ids{4, 5, 6, 7}));
  bm.check_invariants();

  // Nothing was committed, so nothing is cached: released blocks go back to the free list,
  // last block first, and are handed out again from the front.
  bm.free(1);
  EXPECT_EQ(bm.num_free_blocks(), 4);
  EXPECT_EQ(bm.num_cached_blocks(), 0);
  ASSERT_TRUE(bm.allocate_slots(3, 8));
  EXPECT_EQ(bm.block_table(3), (Ids{3, 2}));
  bm.check_invariants();
  bm.free(2);
  bm.free(3);
  bm.free(42);  // unknown: no-op
  EXPECT_EQ(bm.num_free_blocks(), 8);
  bm.check_invariants();

  EXPECT_THROW(bm.allocate_slots(5, -1), Error);
  EXPECT_THROW(bm.block_table(5), Error);
  EXPECT_THROW(bm.commit(5, iota(4, 0), 4), Error);
  bm.allocate_cached_prefix(6, iota(4, 0));
  EXPECT_THROW(bm.allocate_cached_prefix(6, iota(4, 0)), Error);  // already has a table
}

TEST(BlockManager, ForkSharesBlocksAndCopiesOnWrite) {
  BlockManager bm = make(8, 4);
  const std::vector<int32_t> t = iota(6, 100);
  bm.allocate_cached_prefix(1, t);
  ASSERT_TRUE(bm.allocate_slots(1, 6));
  bm.commit(1, t, 6);  // block 0 full and cached, block 1 half written
  EXPECT_TRUE(bm.cached_hash(0).has_value());
  EXPECT_FALSE(bm.cached_hash(1).has_value());

  bm.fork(1, 2);
  EXPECT_EQ(bm.block_table(2), (Ids{0, 1}));
  EXPECT_EQ(bm.ref_count(0), 2);
  EXPECT_EQ(bm.ref_count(1), 2);
  EXPECT_EQ(bm.block_hashes(2), bm.block_hashes(1));
  bm.check_invariants();
  EXPECT_THROW(bm.fork(1, 2), Error);  // child exists
  EXPECT_THROW(bm.fork(9, 10), Error);  // unknown parent

  // The child writes position 6 (block 1, shared): private copy 1 -> 2.
  CowResult c = bm.copy_on_write(2, 6);
  ASSERT_TRUE(c.ok);
  ASSERT_TRUE(c.copy.has_value());
  EXPECT_EQ(*c.copy, (std::pair<BlockId, BlockId>{1, 2}));
  EXPECT_EQ(bm.block_table(2), (Ids{0, 2}));
  EXPECT_EQ(bm.block_table(1), (Ids{0, 1}));
  EXPECT_EQ(bm.ref_count(1), 1);
  EXPECT_EQ(bm.ref_count(2), 1);
  EXPECT_EQ(bm.ref_count(0), 2);
  // The parent's block is now private: no copy.
  c = bm.copy_on_write(1, 7);
  EXPECT_TRUE(c.ok);
  EXPECT_FALSE(c.copy.has_value());
  bm.check_invariants();

  EXPECT_THROW(bm.copy_on_write(2, 2), Error);  // committed full block 0
  EXPECT_THROW(bm.copy_on_write(1, 8), Error);  // not covered
  EXPECT_THROW(bm.copy_on_write(7, 0), Error);  // unknown request

  // No block left for the copy: reported, nothing changed.
  bm.fork(1, 3);
  EXPECT_EQ(bm.ref_count(0), 3);
  EXPECT_EQ(bm.ref_count(1), 2);
  ASSERT_TRUE(bm.allocate_slots(4, 20));
  EXPECT_EQ(bm.block_table(4), (Ids{3, 4, 5, 6, 7}));
  EXPECT_EQ(bm.num_free_blocks(), 0);
  c = bm.copy_on_write(3, 6);
  EXPECT_FALSE(c.ok);
  EXPECT_FALSE(c.copy.has_value());
  EXPECT_EQ(bm.block_table(3), (Ids{0, 1}));
  EXPECT_EQ(bm.ref_count(1), 2);
  bm.check_invariants();
  bm.free(4);  // returns 7, 6, 5, 4, 3 to the free list in that order
  c = bm.copy_on_write(3, 6);
  ASSERT_TRUE(c.ok && c.copy.has_value());
  EXPECT_EQ(*c.copy, (std::pair<BlockId, BlockId>{1, 7}));
  bm.check_invariants();

  for (RequestId id : {1, 2, 3}) bm.free(id);
  EXPECT_EQ(bm.num_free_blocks(), 8);
  EXPECT_EQ(bm.eviction_order(), Ids{0});  // the one committed block stays cached
  bm.check_invariants();
}

TEST(BlockManager, ChainHashesEqualExactlyForEqualPrefixes) {
  BlockManager bm = make(16, 4);
  const std::vector<int32_t> a = iota(12, 0);
  std::vector<int32_t> b = a;
  b[9] = 99;  // differs in block 2 only
  std::vector<int32_t> c = a;
  c[0] = 77;  // differs in block 0 only: later blocks have equal tokens, unequal chains

  bm.allocate_cached_prefix(1, a);
  ASSERT_TRUE(bm.allocate_slots(1, 12));
  bm.commit(1, a, 12);
  const std::vector<uint64_t> ha = bm.block_hashes(1);
  ASSERT_EQ(ha.size(), 3u);
  // The documented formula, computed here directly from xxhash.
  EXPECT_EQ(ha[0], XXH3_64bits_withSeed(a.data(), 16, BlockManager::kRootHash));
  EXPECT_EQ(ha[1], XXH3_64bits_withSeed(a.data() + 4, 16, ha[0]));
  EXPECT_EQ(ha[2], XXH3_64bits_withSeed(a.data() + 8, 16, ha[1]));

  // b shares two blocks with a: both hit (the third could, but it differs).
  EXPECT_EQ(bm.allocate_cached_prefix(2, b), 8);
  ASSERT_TRUE(bm.allocate_slots(2, 12));
  EXPECT_EQ(bm.block_table(2), (Ids{0, 1, 3}));
  bm.commit(2, b, 12);
  const std::vector<uint64_t> hb = bm.block_hashes(2);
  ASSERT_EQ(hb.size(), 3u);
  EXPECT_EQ(hb[0], ha[0]);
  EXPECT_EQ(hb[1], ha[1]);
  EXPECT_NE(hb[2], ha[2]);

  EXPECT_EQ(bm.allocate_cached_prefix(3, c), 0);
  ASSERT_TRUE(bm.allocate_slots(3, 12));
  bm.commit(3, c, 12);
  const std::vector<uint64_t> hc = bm.block_hashes(3);
  for (int i = 0; i < 3; ++i) EXPECT_NE(hc[i], ha[i]) << "block " << i;
  EXPECT_EQ(bm.num_cached_blocks(), 7);  // a:3, b:1 new, c:3
  bm.check_invariants();

  // Two requests computing the same prompt at once: the first commit is cached, the second's
  // blocks stay private (and go to the free list, not the cache, when released).
  const std::vector<int32_t> d = iota(8, 500);
  bm.allocate_cached_prefix(4, d);
  bm.allocate_cached_prefix(5, d);
  ASSERT_TRUE(bm.allocate_slots(4, 8));
  ASSERT_TRUE(bm.allocate_slots(5, 8));
  EXPECT_EQ(bm.block_table(4), (Ids{7, 8}));
  EXPECT_EQ(bm.block_table(5), (Ids{9, 10}));
  bm.commit(4, d, 8);
  bm.commit(5, d, 8);
  EXPECT_EQ(bm.block_hashes(4), bm.block_hashes(5));
  EXPECT_TRUE(bm.cached_hash(7).has_value());
  EXPECT_FALSE(bm.cached_hash(9).has_value());
  bm.check_invariants();
  bm.free(5);
  EXPECT_EQ(bm.eviction_order(), Ids{});
  bm.free(4);
  EXPECT_EQ(bm.eviction_order(), (Ids{8, 7}));
  bm.check_invariants();
}

// Cache salts (multi-LoRA: an adapter changes the K/V of the same tokens): a request's chain
// starts from root_hash(salt), so equal tokens under another salt never hit, the same salt
// does, and a fork keeps its parent's salt.
TEST(BlockManager, CacheSaltsKeepChainsApart) {
  BlockManager bm = make(16, 4);
  const std::vector<int32_t> t = iota(9, 0);
  EXPECT_EQ(BlockManager::root_hash(0), BlockManager::kRootHash);
  EXPECT_EQ(BlockManager::root_hash(2), XXH3_64bits_withSeed(std::vector<int32_t>{2, 0}.data(), 8,
                                                              BlockManager::kRootHash));
  EXPECT_EQ(bm.allocate_cached_prefix(1, t, 2), 0);
  ASSERT_TRUE(bm.allocate_slots(1, 9));
  bm.commit(1, t, 8);
  EXPECT_EQ(bm.block_hashes(1)[0], XXH3_64bits_withSeed(t.data(), 16, BlockManager::root_hash(2)));
  bm.fork(1, 2);
  bm.commit(2, t, 8);  // the same chain: no error for the shared, already committed blocks
  EXPECT_EQ(bm.block_hashes(2), bm.block_hashes(1));
  EXPECT_EQ(bm.allocate_cached_prefix(3, t), 0);      // the base model's chain: no hit
  EXPECT_EQ(bm.allocate_cached_prefix(4, t, 1), 0);   // another adapter: no hit
  EXPECT_EQ(bm.allocate_cached_prefix(5, t, 2), 8);   // the same adapter: both blocks
  EXPECT_EQ(bm.block_table(5), (Ids{0, 1}));
  EXPECT_EQ(bm.stats().hit_blocks, 2);
  EXPECT_EQ(bm.stats().miss_blocks, 2 + 2 + 2);
  bm.check_invariants();
}

TEST(BlockManager, PrefixHitNeverCoversEveryToken) {
  BlockManager bm = make(8, 4);
  const std::vector<int32_t> t = iota(8, 0);
  bm.allocate_cached_prefix(1, t);
  ASSERT_TRUE(bm.allocate_slots(1, 8));
  bm.commit(1, t, 8);
  bm.free(1);
  // Same 8 tokens: the second block would cover everything, so only the first is a candidate.
  EXPECT_EQ(bm.allocate_cached_prefix(2, t), 4);
  EXPECT_EQ(bm.block_table(2), Ids{0});
  // One more token: both blocks hit.
  EXPECT_EQ(bm.allocate_cached_prefix(3, concat(t, {8})), 8);
  EXPECT_EQ(bm.block_table(3), (Ids{0, 1}));
  EXPECT_EQ(bm.ref_count(0), 2);
  EXPECT_EQ(bm.ref_count(1), 1);
  // Single-token and empty prompts have no candidate block.
  EXPECT_EQ(bm.allocate_cached_prefix(4, {0}), 0);
  EXPECT_EQ(bm.allocate_cached_prefix(5, {}), 0);
  const BlockManager::Stats s = bm.stats();
  EXPECT_EQ(s.queries, 5);
  EXPECT_EQ(s.hit_blocks, 3);
  EXPECT_EQ(s.miss_blocks, 1);  // request 1's one candidate
  EXPECT_EQ(s.evictions, 0);
  bm.check_invariants();
}

TEST(BlockManager, EvictsLeastRecentlyUsedCachedBlocksOnlyWhenNoFreeBlockIsLeft) {
  BlockManager bm = make(6, 4);
  const std::vector<int32_t> a = iota(8, 1), b = iota(8, 11);
  bm.allocate_cached_prefix(1, a);
  ASSERT_TRUE(bm.allocate_slots(1, 8));
  bm.commit(1, a, 8);
  bm.allocate_cached_prefix(2, b);
  ASSERT_TRUE(bm.allocate_slots(2, 8));
  bm.commit(2, b, 8);
  EXPECT_EQ(bm.block_table(1), (Ids{0, 1}));
  EXPECT_EQ(bm.block_table(2), (Ids{2, 3}));
  bm.free(1);
  EXPECT_EQ(bm.eviction_order(), (Ids{1, 0}));  // a request's tail goes before its head
  bm.free(2);
  EXPECT_EQ(bm.eviction_order(), (Ids{1, 0, 3, 2}));
  EXPECT_EQ(bm.num_free_blocks(), 6);
  EXPECT_EQ(bm.num_cached_blocks(), 4);
  bm.check_invariants();

  // Free blocks 4, 5 go first; then the least recently released cached block, 1.
  EXPECT_EQ(bm.allocate_cached_prefix(3, iota(12, 21)), 0);
  ASSERT_TRUE(bm.allocate_slots(3, 12));
  EXPECT_EQ(bm.block_table(3), (Ids{4, 5, 1}));
  EXPECT_EQ(bm.stats().evictions, 1);
  EXPECT_EQ(bm.eviction_order(), (Ids{0, 3, 2}));
  EXPECT_FALSE(bm.cached_hash(1).has_value());
  EXPECT_EQ(bm.num_cached_blocks(), 3);
  bm.check_invariants();

  // a's chain now stops after its first block.
  EXPECT_EQ(bm.allocate_cached_prefix(6, concat(a, {9})), 4);
  EXPECT_EQ(bm.block_table(6), Ids{0});
  EXPECT_EQ(bm.eviction_order(), (Ids{3, 2}));
  bm.free(6);
  EXPECT_EQ(bm.eviction_order(), (Ids{3, 2, 0}));  // used again: most recent now

  // Using b's prefix refreshes its blocks.
  EXPECT_EQ(bm.allocate_cached_prefix(4, concat(b, {19})), 8);
  EXPECT_EQ(bm.block_table(4), (Ids{2, 3}));
  EXPECT_EQ(bm.eviction_order(), Ids{0});
  EXPECT_EQ(bm.num_free_blocks(), 1);
  bm.free(4);
  EXPECT_EQ(bm.eviction_order(), (Ids{0, 3, 2}));
  bm.check_invariants();

  ASSERT_TRUE(bm.allocate_slots(5, 4));
  EXPECT_EQ(bm.block_table(5), Ids{0});
  ASSERT_TRUE(bm.allocate_slots(5, 8));
  EXPECT_EQ(bm.block_table(5), (Ids{0, 3}));
  EXPECT_EQ(bm.stats().evictions, 3);
  EXPECT_EQ(bm.eviction_order(), Ids{2});
  EXPECT_FALSE(bm.allocate_slots(5, 16));  // needs 2, 1 left
  EXPECT_EQ(bm.block_table(5), (Ids{0, 3}));
  bm.check_invariants();

  // b's first block (2) survives; its second (3) was evicted.
  EXPECT_EQ(bm.allocate_cached_prefix(7, concat(b, {19})), 4);
  const BlockManager::Stats s = bm.stats();
  EXPECT_EQ(s.queries, 6);
  EXPECT_EQ(s.hit_blocks, 1 + 2 + 1);
  EXPECT_EQ(s.miss_blocks, 1 + 1 + 2 + 1 + 0 + 1);
  for (RequestId id : {3, 5, 7}) bm.free(id);
  EXPECT_EQ(bm.num_free_blocks(), 6);
  bm.check_invariants();
}

TEST(BlockManager, PartialBlocksAreNeverCached) {
  BlockManager bm = make(8, 4);
  const std::vector<int32_t> t = iota(10, 0);
  bm.allocate_cached_prefix(1, t);
  ASSERT_TRUE(bm.allocate_slots(1, 10));
  bm.commit(1, t, 6);
  EXPECT_EQ(bm.block_hashes(1).size(), 1u);
  bm.commit(1, t, 10);
  EXPECT_EQ(bm.block_hashes(1).size(), 2u);
  EXPECT_FALSE(bm.cached_hash(2).has_value());
  EXPECT_THROW(bm.commit(1, t, 11), Error);  // more than the tokens
  bm.free(1);
  EXPECT_EQ(bm.eviction_order(), (Ids{1, 0}));
  bm.check_invariants();
}

TEST(BlockManager, PrefixCachingOffCachesNothing) {
  BlockManager bm = make(4, 4, /*prefix_caching=*/false);
  const std::vector<int32_t> t = iota(9, 0);
  EXPECT_EQ(bm.allocate_cached_prefix(1, t), 0);
  ASSERT_TRUE(bm.allocate_slots(1, 9));
  bm.commit(1, t, 9);
  EXPECT_TRUE(bm.block_hashes(1).empty());
  bm.free(1);
  EXPECT_EQ(bm.num_cached_blocks(), 0);
  EXPECT_EQ(bm.eviction_order(), Ids{});
  EXPECT_EQ(bm.allocate_cached_prefix(2, t), 0);
  ASSERT_TRUE(bm.allocate_slots(2, 4));
  EXPECT_EQ(bm.block_table(2), Ids{3});
  const BlockManager::Stats s = bm.stats();
  EXPECT_EQ(s.queries + s.hit_blocks + s.miss_blocks + s.evictions, 0);
  bm.check_invariants();
}

}  // namespace
}  // namespace tessera::infer

namespace tessera::infer {
namespace {

// Sliding-window release: the leading blocks go back (cached ones stay hits for others),
// the table keeps their ids, a fork shares only the live ones, and free() releases the rest
// once; the invariants hold throughout, also when a released block is taken again.
TEST(BlockManager, ReleaseLeadingFreesBlocksOutOfTheWindowOnce) {
  BlockManager bm(BlockManagerConfig{6, 4, true});
  std::vector<int32_t> toks(16);
  std::iota(toks.begin(), toks.end(), 100);
  ASSERT_TRUE(bm.allocate_slots(1, 16));
  bm.commit(1, toks, 16);
  const std::vector<BlockId> table = bm.block_table(1);
  EXPECT_EQ(bm.num_free_blocks(), 2);
  bm.release_leading(1, 2);
  bm.check_invariants();
  EXPECT_EQ(bm.num_released(1), 2);
  EXPECT_EQ(bm.block_table(1), table);  // ids kept
  EXPECT_EQ(bm.ref_count(table[0]), 0);
  EXPECT_EQ(bm.ref_count(table[2]), 1);
  EXPECT_EQ(bm.num_free_blocks(), 4);
  bm.release_leading(1, 1);  // fewer than before: no-op
  EXPECT_EQ(bm.num_released(1), 2);
  // Another request with the same 8-token prefix hits the released (cached) blocks.
  EXPECT_EQ(bm.allocate_cached_prefix(2, std::vector<int32_t>(toks.begin(), toks.begin() + 9)), 8);
  EXPECT_EQ(bm.ref_count(table[0]), 1);
  bm.fork(1, 3);
  EXPECT_EQ(bm.ref_count(table[3]), 2);
  EXPECT_EQ(bm.ref_count(table[0]), 1);  // the fork took no reference on released blocks
  bm.check_invariants();
  // Request 1 grows into blocks that may be the ones it released.
  ASSERT_TRUE(bm.allocate_slots(1, 24));
  bm.check_invariants();
  bm.free(1);
  bm.free(3);
  bm.free(2);
  bm.check_invariants();
  EXPECT_EQ(bm.num_free_blocks(), 6);
  EXPECT_THROW(bm.release_leading(7, 1), Error);
}

}  // namespace
}  // namespace tessera::infer
