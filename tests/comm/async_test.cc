// all_reduce_async: several in flight at once, completed by a worker thread while the
// caller computes, in issue order, each equal to the same all-reduce done synchronously
// by a reference.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <thread>
#include <vector>

#include "tessera/base/timer.h"
#include "tessera/comm/communicator.h"
#include "tessera/comm/local_backend.h"

namespace tessera::comm {
namespace {

TEST(AllReduceAsync, SeveralInFlightCompleteInIssueOrder) {
  const int N = 4;
  run_local(N, [&](Communicator& c) {
    const int r = c.rank();
    std::vector<float> a(1023);
    for (int i = 0; i < 1023; ++i) a[i] = 0.25f * (r + 1) + i;
    Tensor ta = Tensor::from_vector(a, {1023});
    Tensor tb = Tensor::from_vector<int64_t>({r * 10, -r, int64_t{1} << (40 + r)}, {3});
    Tensor tc = Tensor::empty({5}, DType::kBF16);
    tc.fill(static_cast<float>(r + 1));
    Tensor td = Tensor::from_vector<int32_t>({r + 1}, {1});
    std::vector<RequestPtr> reqs;
    reqs.push_back(c.all_reduce_async(ta, ReduceOp::kSum, Algorithm::kRing));
    reqs.push_back(c.all_reduce_async(tb, ReduceOp::kMax, Algorithm::kHalvingDoubling));
    reqs.push_back(c.all_reduce_async(tc, ReduceOp::kAvg, Algorithm::kBackend));
    // Two on the same tensor: only issue order gives 4 * (1 + 2 + 3 + 4).
    reqs.push_back(c.all_reduce_async(td, ReduceOp::kSum, Algorithm::kAuto));
    reqs.push_back(c.all_reduce_async(td, ReduceOp::kSum, Algorithm::kRing));
    EXPECT_EQ(c.collectives_issued(), 5u);  // counted at issue

    // Compute while they run: the worker makes progress without wait().
    double acc = 0;
    base::Timer timer;
    while (!reqs.back()->test() && timer.seconds() < 20) {
      for (int i = 0; i < 20000; ++i) acc += std::sqrt(static_cast<double>(i));
      std::this_thread::yield();
    }
    EXPECT_TRUE(reqs.back()->test()) << "the last async all-reduce made no progress";
    EXPECT_GT(acc, 0);
    for (auto it = reqs.rbegin(); it != reqs.rend(); ++it) (*it)->wait();  // any order

    for (int i = 0; i < 1023; ++i)
      ASSERT_FLOAT_EQ(ta.data<float>()[i], 0.25f * (1 + 2 + 3 + 4) + N * i);
    EXPECT_EQ(tb.data<int64_t>()[0], 30);
    EXPECT_EQ(tb.data<int64_t>()[1], 0);
    EXPECT_EQ(tb.data<int64_t>()[2], int64_t{1} << 43);
    for (int i = 0; i < 5; ++i) EXPECT_EQ(tc.item_f32(i), 2.5f);
    EXPECT_EQ(td.data<int32_t>()[0], 4 * 10);
  });
}

// A synchronous collective issued while async ones are queued runs after them (else the
// ranks could start different collectives and deadlock).
TEST(AllReduceAsync, SyncCollectiveAfterQueuedAsyncKeepsOrder) {
  run_local(3, [](Communicator& c) {
    Tensor t = Tensor::from_vector<float>({1.0f * c.rank()}, {1});
    RequestPtr r = c.all_reduce_async(t, ReduceOp::kSum);
    c.barrier();
    Tensor u = Tensor::from_vector<float>({2.0f}, {1});
    c.all_reduce(u, ReduceOp::kSum);
    r->wait();
    EXPECT_EQ(t.data<float>()[0], 3.0f);
    EXPECT_EQ(u.data<float>()[0], 6.0f);
    EXPECT_EQ(c.collectives_issued(), 3u);
  });
}

}  // namespace
}  // namespace tessera::comm

namespace tessera::comm {
namespace {

// reduce_scatter_async and all_gather_async share the queue with all_reduce_async: a
// chain reduce-scatter -> all-gather of the result -> all-reduce equals the reference
// sums, on odd sizes that do not divide by the group, for f32 and bf16.
TEST(CollectivesAsync, ReduceScatterThenAllGatherChainInIssueOrder) {
  for (int N : {2, 3, 4}) {
    run_local(N, [&](Communicator& c) {
      const int r = c.rank();
      for (int64_t n : {1, 3, 1023}) {
        for (DType dt : {DType::kF32, DType::kBF16}) {
          Tensor in = Tensor::empty({n}, DType::kF32);
          for (int64_t i = 0; i < n; ++i) in.data<float>()[i] = static_cast<float>((r + 1) * (i % 7));
          in = in.to(dt);
          const ChunkRange mine = chunk_range(n, N, r);
          Tensor part = Tensor::empty({mine.size()}, dt);
          Tensor full = Tensor::empty({n}, dt);
          auto a = c.reduce_scatter_async(in, part, ReduceOp::kSum, Algorithm::kRing);
          a->wait();  // part must be complete before it is gathered
          auto b = c.all_gather_async(part, full, Algorithm::kAuto);
          Tensor tot = Tensor::from_vector<float>({1.0f}, {1});
          auto d = c.all_reduce_async(tot, ReduceOp::kSum);
          d->wait();
          b->wait();
          const float sum_ranks = N * (N + 1) / 2.0f;
          for (int64_t i = 0; i < n; ++i)
            ASSERT_EQ(full.item_f32(i), sum_ranks * (i % 7)) << "n " << n << " i " << i;
          EXPECT_EQ(tot.data<float>()[0], static_cast<float>(N));
        }
      }
    });
  }
}

}  // namespace
}  // namespace tessera::comm
