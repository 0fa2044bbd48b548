// Sanity checks of the peak measurements (their speed is the bench's business).
#include "tessera/kernels/peak.h"

#include <gtest/gtest.h>

namespace tessera::kernels {
namespace {

TEST(Peak, StreamTriadReturnsPositiveBandwidth) {
  const double gbps = measure_stream_triad_gbps(1 << 20, 2);
  EXPECT_GT(gbps, 0.1);
  EXPECT_LT(gbps, 1e5);
  EXPECT_THROW(measure_stream_triad_gbps(0, 1), Error);
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
