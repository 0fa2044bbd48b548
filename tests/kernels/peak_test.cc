// Sanity checks of the peak measurements (their speed is the bench's business).
#include "tessera/kernels/peak.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>

namespace tessera::kernels {
namespace {

TEST(Peak, StreamTriadReturnsPositiveBandwidth) {
  const double gbps = measure_stream_triad_gbps(1 << 20, 2);
  EXPECT_GT(gbps, 0.1);
  EXPECT_LT(gbps, 1e5);
  EXPECT_THROW(measure_stream_triad_gbps(-1, 1), Error);
  EXPECT_THROW(measure_stream_triad_gbps(1 << 20, 0), Error);
}

TEST(Peak, StreamProbeTakesTrialsOnArraysItKeeps) {
  StreamProbe probe(1 << 20);
  EXPECT_EQ(probe.elements(), 1 << 20);
  for (int i = 0; i < 3; ++i) {  // (each trial checks the triad's result itself)
    const double gbps = probe.triad_gbps();
    EXPECT_GT(gbps, 0.1);
    EXPECT_LT(gbps, 1e5);
  }
  EXPECT_EQ(StreamProbe().elements(), stream_array_elements());
  EXPECT_THROW(StreamProbe(-1), Error);
}

TEST(Peak, StreamReadReturnsPositiveBandwidthAndChecksItsSum) {
  const double gbps = measure_stream_read_gbps((1 << 20) + 37, 2);  // (a tail past the 64-float steps)
  EXPECT_GT(gbps, 0.1);
  EXPECT_LT(gbps, 1e5);
  EXPECT_THROW(measure_stream_read_gbps(-1, 1), Error);
  EXPECT_THROW(measure_stream_read_gbps(1 << 20, 0), Error);
}

// STREAM's rule: each array at least 4x the last-level cache (unless that would take more
// than 1/16 of the memory per array), never below 32 Mi floats.
TEST(Peak, StreamArraysAreFourTimesTheLastLevelCache) {
  long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (llc <= 0) llc = sysconf(_SC_LEVEL2_CACHE_SIZE);
  const double mem = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  const int64_t n = stream_array_elements();
  EXPECT_GE(n, std::min<double>(int64_t{32} << 20, mem / 16 / 4));
  EXPECT_LE(static_cast<double>(n) * 4, mem / 16 + 4);
  if (llc > 0 && 4.0 * static_cast<double>(llc) <= mem / 16) {
    EXPECT_GE(n * 4, 4 * static_cast<int64_t>(llc));
  }
}

TEST(Peak, MatmulMeasurementDescribesTheProblem) {
  for (MatmulBackend be : {MatmulBackend::kOneDnn, MatmulBackend::kSkinny, MatmulBackend::kAuto}) {
    const GemmMeasurement r = measure_matmul_gflops(3, 40, 24, DType::kBF16, be, 0.001);
    EXPECT_EQ(r.m, 3);
    EXPECT_EQ(r.n, 40);
    EXPECT_EQ(r.k, 24);
    EXPECT_EQ(r.dtype, DType::kBF16);
    EXPECT_GT(r.seconds, 0);
    EXPECT_NEAR(r.gflops, 2.0 * 3 * 40 * 24 / r.seconds / 1e9, 1e-9 * r.gflops);
  }
  EXPECT_THROW(measure_matmul_gflops(0, 1, 1, DType::kF32, MatmulBackend::kAuto, 0.001), Error);
}

}  // namespace
}  // namespace tessera::kernels
