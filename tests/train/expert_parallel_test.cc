// Expert parallelism by equivalence: the MoE layer with its experts split over ep = 2 and 4
// local ranks, each rank routing its own tokens, gives every rank the outputs and input
// gradients of the whole layer run on that rank's tokens alone, and each rank's experts
// the sum of their gradients over every rank's tokens; the bytes exchanged are the analytic
// count of the routed slots that leave their rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <random>

#include "tessera/comm/communicator.h"
#include "tessera/model/moe.h"
#include "tessera/parallel/expert_parallel.h"
#include "test_util/tensor_diff.h"

namespace tessera::parallel {
namespace {

Tensor randn(const Shape& shape, uint32_t seed, float sd) {
  std::mt19937 rng(seed);
  return tessera::testing::random_normal(shape, rng, sd);
}
using tessera::testing::max_rel_diff;

TEST(ExpertParallel, SplitExpertsGiveTheWholeLayersOutputsAndGradients) {
  const int64_t E = 8, H = 32, F = 48;
  model::MoeSpec spec;
  spec.num_experts = E;
  spec.top_k = 2;
  model::MoeWeights full{randn({E, H}, 1, 0.5f), randn({E, 2 * F, H}, 2, 0.2f), randn({E, H, F}, 3, 0.2f)};
  for (int P : {2, 4}) {
    SCOPED_TRACE("ep " + std::to_string(P));
    const int64_t El = E / P;
    // The whole layer on each rank's tokens, and the experts' gradients summed over ranks.
    std::vector<Tensor> h(P), dout(P), want_out(P), want_dh(P), want_router(P);
    model::MoeWeights sum{Tensor::zeros({E, H}, DType::kF32), Tensor::zeros({E, 2 * F, H}, DType::kF32),
                          Tensor::zeros({E, H, F}, DType::kF32)};
    int64_t leaving = 0;
    for (int r = 0; r < P; ++r) {
      const int64_t N = 9 + 7 * r;  // ranks hold different numbers of tokens
      h[r] = randn({N, H}, 10 + r, 1.f);
      dout[r] = randn({N, H}, 20 + r, 1.f);
      want_out[r] = Tensor::empty({N, H}, DType::kF32);
      want_dh[r] = Tensor::empty({N, H}, DType::kF32);
      model::MoeSaved sv;
      model::moe_forward(spec, full, h[r], want_out[r], &sv);
      model::MoeWeights g{Tensor::zeros({E, H}, DType::kF32), Tensor::zeros({E, 2 * F, H}, DType::kF32),
                          Tensor::zeros({E, H, F}, DType::kF32)};
      model::moe_backward(spec, full, h[r], sv, dout[r], want_dh[r], g);
      want_router[r] = g.router;
      for (int64_t i = 0; i < g.gate_up.numel(); ++i) sum.gate_up.data<float>()[i] += g.gate_up.data<float>()[i];
      for (int64_t i = 0; i < g.down.numel(); ++i) sum.down.data<float>()[i] += g.down.data<float>()[i];
      for (int64_t e = 0; e < E; ++e)
        if (e / El != r) leaving += sv.routing.load(e);
    }
    std::mutex mu;
    int64_t sent = 0;
    comm::run_local(P, [&](comm::Communicator& c) {
      const int r = c.rank();
      CommEp ep(c);
      model::MoeWeights mine{full.router, full.gate_up.slice(0, r * El, (r + 1) * El).contiguous(),
                             full.down.slice(0, r * El, (r + 1) * El).contiguous()};
      const int64_t N = h[r].size(0);
      Tensor out = Tensor::empty({N, H}, DType::kF32), dh = Tensor::empty({N, H}, DType::kF32);
      model::MoeSaved sv;
      model::moe_forward(spec, mine, h[r], out, &sv, &ep);
      model::MoeWeights g{Tensor::zeros({E, H}, DType::kF32), Tensor::zeros({El, 2 * F, H}, DType::kF32),
                          Tensor::zeros({El, H, F}, DType::kF32)};
      model::moe_backward(spec, mine, h[r], sv, dout[r], dh, g, nullptr, &ep);
      EXPECT_LT(max_rel_diff(out, want_out[r]), 1e-5f) << "rank " << r;
      EXPECT_LT(max_rel_diff(dh, want_dh[r]), 1e-5f) << "rank " << r;
      EXPECT_LT(max_rel_diff(g.router, want_router[r]), 1e-5f) << "rank " << r;
      EXPECT_LT(max_rel_diff(g.gate_up, sum.gate_up.slice(0, r * El, (r + 1) * El)), 1e-5f) << "rank " << r;
      EXPECT_LT(max_rel_diff(g.down, sum.down.slice(0, r * El, (r + 1) * El)), 1e-5f) << "rank " << r;
      std::lock_guard<std::mutex> lock(mu);
      sent += ep.bytes_sent();
    });
    // Each slot routed off its rank crosses as its input row, its expert id (i32) and its
    // output forward, and their two gradients backward: 4 rows of H f32 and 4 bytes.
    EXPECT_EQ(sent, leaving * (4 * H * 4 + 4));
  }
}

}  // namespace
}  // namespace tessera::parallel
