// Thread pool coverage, CPU feature sanity and aligned allocation.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <cstdint>
#include <vector>

#include "tessera/base/aligned_alloc.h"
#include "tessera/base/cpu_features.h"
#include "tessera/base/error.h"
#include "tessera/base/thread_pool.h"
#include "tessera/base/timer.h"

namespace tessera {
namespace {

TEST(ThreadPool, ParallelForCoversEveryIndexOnce) {
  for (int64_t n : {0, 1, 7, 129, 100000}) {
    std::vector<std::atomic<int>> hits(n);
    base::parallel_for(n, 3, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) hits[i]++;
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
  }
  EXPECT_GE(base::num_threads(), 1);
}

TEST(ThreadPool, NestedCallsRunInline) {
  std::atomic<int64_t> total{0};
  base::parallel_for(4, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      base::parallel_for(10, 1, [&](int64_t b2, int64_t e2) { total += e2 - b2; });
  });
  EXPECT_EQ(total.load(), 40);
}

TEST(CpuFeatures, ConsistentHierarchy) {
  const auto& f = base::cpu_features();
  if (f.avx512_bf16) {
    EXPECT_TRUE(f.avx512f);
  }
  if (f.amx_bf16) {
    EXPECT_TRUE(f.amx_tile);
  }
  EXPECT_FALSE(base::describe_cpu_features().empty());
}

TEST(AlignedAlloc, SixtyFourByteAligned) {
  for (size_t n : {1, 63, 64, 1000, 1 << 20}) {
    void* p = base::aligned_malloc(n);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
    base::aligned_free(p);
  }
}

TEST(Error, CheckThrowsWithMessage) {
  try {
    TESSERA_CHECK(1 + 1 == 3, "value ", 42, " is wrong");
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "value 42 is wrong");
  }
}

// The progress line of a resumed run: steps done before it started count towards the bar,
// not the rate; the ETA is what is left at that rate.
TEST(ProgressBar, RateAndEtaCountOnlyThisRunsWork) {
  base::ProgressBar bar("train", 100, 50);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ::testing::internal::CaptureStderr();
  bar.update(55, "", true);
  const std::string line = ::testing::internal::GetCapturedStderr();
  // 5 steps in about 0.5 s: about 10 it/s (not 110), 45 left: about 4-5 s.
  float rate = 0;
  ASSERT_EQ(std::sscanf(line.c_str() + line.find("55/100"), "55/100 %f it/s", &rate), 1) << line;
  EXPECT_GT(rate, 5.f) << line;
  EXPECT_LT(rate, 10.5f) << line;
  EXPECT_TRUE(line.find("ETA 4s") != std::string::npos || line.find("ETA 5s") != std::string::npos ||
              line.find("ETA 6s") != std::string::npos || line.find("ETA 7s") != std::string::npos ||
              line.find("ETA 8s") != std::string::npos || line.find("ETA 9s") != std::string::npos)
      << line;
  EXPECT_EQ(base::format_duration(42), "42s");
  EXPECT_EQ(base::format_duration(185), "3m05s");
  EXPECT_EQ(base::format_duration(7620), "2h07m");
}

}  // namespace
}  // namespace tessera
