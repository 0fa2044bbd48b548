// Algorithm names, the chunk split, the pipelined broadcast / reduce variants called
// directly with tiny segments, and the auto table's shape.
#include "tessera/comm/algorithms.h"

#include <gtest/gtest.h>

#include <vector>

#include "tessera/base/error.h"
#include "tessera/comm/communicator.h"
#include "tessera/comm/local_backend.h"

namespace tessera::comm {
namespace {

TEST(Algorithms, NamesRoundTripAndUnknownNameIsAnError) {
  for (Algorithm a : {Algorithm::kAuto, Algorithm::kBackend, Algorithm::kRing,
                      Algorithm::kHalvingDoubling, Algorithm::kHierarchical, Algorithm::kShm})
    EXPECT_EQ(parse_algorithm(algorithm_name(a)), a);
  EXPECT_STREQ(algorithm_name(Algorithm::kHalvingDoubling), "hd");
  try {
    parse_algorithm("tree");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "unknown collective algorithm 'tree' (expected auto, backend, ring, hd, "
                 "hierarchical, shm)");
  }
}

TEST(Algorithms, ChunkRangeSplitsAsEvenlyAsPossible) {
  const int64_t expect[4][2] = {{0, 3}, {3, 6}, {6, 8}, {8, 10}};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(chunk_range(10, 4, r).begin, expect[r][0]);
    EXPECT_EQ(chunk_range(10, 4, r).end, expect[r][1]);
  }
  for (int64_t n : {0, 1, 3, 1023})
    for (int size = 1; size <= 8; ++size) {
      int64_t next = 0;
      for (int r = 0; r < size; ++r) {
        const ChunkRange c = chunk_range(n, size, r);
        EXPECT_EQ(c.begin, next);
        EXPECT_EQ(c.size(), n / size + (r < n % size ? 1 : 0));
        next = c.end;
      }
      EXPECT_EQ(next, n);
    }
  EXPECT_THROW(chunk_range(10, 4, 4), Error);
}

// Chain broadcast and ring+gather reduce with 8-byte segments: many segments per message.
TEST(Algorithms, PipelinedBroadcastAndReduceWithTinySegments) {
  const int64_t keep = algo::segment_bytes();
  algo::set_segment_bytes(8);
  run_local(5, [](Communicator& c) {
    const int r = c.rank(), root = 2;
    const int64_t n = 101;
    for (int chain = 0; chain < 2; ++chain) {
      std::vector<int32_t> v(n);
      for (int64_t i = 0; i < n; ++i) v[i] = r == root ? static_cast<int32_t>(i * 7) : -1;
      if (chain)
        algo::broadcast_chain(c, 1 << 21, v.data(), n * 4, root);
      else
        algo::broadcast_tree(c, 1 << 21, v.data(), n * 4, root);
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(v[i], i * 7) << "chain " << chain;

      std::vector<float> w(n);
      for (int64_t i = 0; i < n; ++i) w[i] = static_cast<float>(r * 1000 + i);
      if (chain)
        algo::reduce_ring_gather(c, 1 << 21, w.data(), n, DType::kF32, ReduceOp::kSum, root);
      else
        algo::reduce_tree(c, 1 << 21, w.data(), n, DType::kF32, ReduceOp::kMax, root);
      if (r == root) {
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(w[i], chain ? 10000.0f + 5 * i : 4000.0f + i) << "chain " << chain;
      }
    }
  });
  algo::set_segment_bytes(keep);
}

TEST(Algorithms, AutoTableNeverAnswersAutoAndHierarchicalOnlyAcrossNodes) {
  for (int size = 1; size <= 64; size *= 2)
    for (int64_t bytes = 0; bytes <= (int64_t{1} << 30); bytes = bytes * 4 + 4) {
      const Algorithm one = algo::auto_all_reduce(bytes, size, false);
      EXPECT_NE(one, Algorithm::kAuto);
      EXPECT_NE(one, Algorithm::kHierarchical);
      EXPECT_NE(algo::auto_all_reduce(bytes, size, true), Algorithm::kAuto);
      for (Algorithm a :
           {algo::auto_reduce_scatter(bytes, size), algo::auto_all_gather(bytes, size)})
        EXPECT_TRUE(a == Algorithm::kRing || a == Algorithm::kHalvingDoubling ||
                    a == Algorithm::kBackend);
    }
}

}  // namespace
}  // namespace tessera::comm
