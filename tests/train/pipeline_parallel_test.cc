// Pipeline parallelism: the schedules replayed with unit pass costs (every pass once, no
// deadlock, the textbook bubble (pp-1)/(v m+pp-1) where it is exact, 1F1B's bounded
// in-flight passes), and the executor by equivalence with one process (torchtitan style):
// the stages of the same weights (local backend), under each schedule, give the single-
// process loss and every gradient (the one process's are held to PyTorch by parity_test),
// and send exactly the activation bytes the layout implies.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <mutex>

#include "tessera/base/error.h"
#include "tessera/comm/communicator.h"
#include "tessera/model/model.h"
#include "tessera/parallel/device_mesh.h"
#include "tessera/parallel/pipeline_parallel.h"
#include "tessera/parallel/tensor_parallel.h"

namespace tessera {
namespace {

using parallel::PipeAction;
using parallel::PipeSchedule;
using parallel::PipeShape;

TEST(PipelineSchedule, EveryPassRunsOnceWithoutDeadlockAndTheBubbleIsTheFormulas) {
  for (PipeSchedule s : {PipeSchedule::kGpipe, PipeSchedule::k1F1B, PipeSchedule::kInterleaved})
    for (int pp : {1, 2, 4})
      for (int m : {1, 2, 4, 8, 16}) {
        const int v = s == PipeSchedule::kInterleaved ? 2 : 1;
        if (s == PipeSchedule::kInterleaved && m % pp != 0) continue;
        const PipeShape shape{pp, m, v};
        const auto actions = parallel::pipe_schedule(s, shape);
        ASSERT_EQ(static_cast<int>(actions.size()), pp);
        for (const auto& a : actions) EXPECT_EQ(static_cast<int>(a.size()), 2 * m * v);
        // Interleaved chunks are 1/v of a stage: each pass costs 1/v.
        const auto t = parallel::simulate_schedule(actions, shape, 1.0 / v, 2.0 / v);
        const std::string what = std::string(parallel::pipe_schedule_name(s)) + " pp " +
                                 std::to_string(pp) + " m " + std::to_string(m);
        if (s != PipeSchedule::kInterleaved) {
          // GPipe and 1F1B take (m + pp - 1)(F + B) exactly.
          EXPECT_NEAR(t.makespan, (m + pp - 1) * 3.0, 1e-9) << what;
          EXPECT_NEAR(t.bubble, parallel::ideal_bubble(shape), 1e-9) << what;
          // Equal stages: the busiest rank idles exactly as much as the average one.
          EXPECT_NEAR(parallel::critical_bubble(t.spans), parallel::ideal_bubble(shape), 1e-9) << what;
        } else if (m > pp) {
          // Interleaving shrinks the bubble by about v (Narayanan et al. 2021).
          EXPECT_NEAR(t.bubble, parallel::ideal_bubble(shape), 0.02) << what;
        }
        if (s == PipeSchedule::kGpipe) { EXPECT_EQ(t.max_in_flight, m) << what; }
        if (s == PipeSchedule::k1F1B) { EXPECT_LE(t.max_in_flight, std::min(pp, m)) << what; }
      }
}

TEST(PipelineSchedule, TheCriticalBubbleIsTheBusiestRanksIdleShare) {
  // Rank 0 busy 2 of the 3.5 s span, rank 1 (the slowest stage) 3: the pipeline's idle
  // share over both ranks is 1 - 5 / 7, the busiest rank's 1 - 3 / 3.5.
  const std::vector<std::vector<parallel::PipeSpan>> spans = {{{0.0, 1.0}, {2.0, 3.0}},
                                                              {{0.5, 2.0}, {2.0, 3.5}}};
  EXPECT_NEAR(parallel::measured_bubble(spans), 1.0 - 5.0 / 7.0, 1e-12);
  EXPECT_NEAR(parallel::critical_bubble(spans), 1.0 - 3.0 / 3.5, 1e-12);
  EXPECT_EQ(parallel::critical_bubble({}), 0.0);
}

TEST(PipelineSchedule, PrintsOneLinePerRankAndRejectsShapesItCannotRun) {
  const auto a = parallel::pipe_schedule(PipeSchedule::k1F1B, {2, 3, 1});
  EXPECT_EQ(parallel::format_pipe_schedule(a, {2, 3, 1}),
            "rank 0: F0 F1 B0 F2 B1 B2\nrank 1: F0 B0 F1 B1 F2 B2\n");
  const auto i = parallel::pipe_schedule(PipeSchedule::kInterleaved, {2, 2, 2});
  EXPECT_EQ(parallel::format_pipe_schedule(i, {2, 2, 2}).substr(0, 8), "rank 0: ");
  for (auto [s, shape, want] :
       {std::tuple{PipeSchedule::kInterleaved, PipeShape{2, 3, 2}, "multiple of pp"},
        std::tuple{PipeSchedule::kInterleaved, PipeShape{2, 4, 1}, "pp_virtual_stages >= 2"},
        std::tuple{PipeSchedule::k1F1B, PipeShape{2, 4, 2}, "needs schedule = \"interleaved\""}}) {
    try {
      parallel::pipe_schedule(s, shape);
      ADD_FAILURE() << want;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  }
  // A list that waits for a pass nobody runs is reported, not hung on.
  auto bad = parallel::pipe_schedule(PipeSchedule::k1F1B, {2, 2, 1});
  bad[1] = {{PipeAction::kBackward, 0, 0}, {PipeAction::kForward, 0, 0}, {PipeAction::kForward, 1, 0},
            {PipeAction::kBackward, 1, 0}};
  EXPECT_THROW(parallel::simulate_schedule(bad, {2, 2, 1}), Error);
}

TEST(PipelineStage, BalancesParametersAndTakesGivenCuts) {
  model::ModelConfig c = model::ModelConfig::named_shape("tiny");
  c.num_layers = 8;
  const auto s = model::pipeline_stage(c, 1, 2);
  ASSERT_EQ(s.bounds.size(), 3u);
  EXPECT_EQ(s.bounds[0], 0);
  EXPECT_EQ(s.bounds[2], 8);
  // The embedding and the untied head are the same size: an even cut.
  EXPECT_EQ(s.bounds[1], 4);
  const auto v = model::pipeline_stage(c, 0, 2, 2, {1, 3, 3, 1});
  EXPECT_EQ(v.layers(0, 8), (std::pair<int64_t, int64_t>{0, 1}));
  EXPECT_EQ(v.layers(1, 8), (std::pair<int64_t, int64_t>{4, 7}));
  EXPECT_TRUE(v.holds_embed());
  EXPECT_FALSE(v.holds_head());
  EXPECT_THROW(model::pipeline_stage(c, 0, 2, 1, {3, 4}), Error);  // sums to 7
  EXPECT_THROW(model::pipeline_stage(c, 0, 4, 3), Error);           // 12 stages > 8 layers
}

model::ModelConfig four_layers() {
  model::ModelConfig c = model::ModelConfig::named_shape("tiny");
  c.vocab_size = 97;
  c.num_layers = 4;
  return c;
}

Tensor random_ids(int64_t B, int64_t T, int64_t V, uint64_t seed) {
  Tensor t = Tensor::empty({B, T}, DType::kI32);
  uint64_t s = seed;
  for (int64_t i = 0; i < B * T; ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    t.data<int32_t>()[i] = static_cast<int32_t>((s >> 33) % V);
    if (i % 11 == 5) t.data<int32_t>()[i] = -100;
  }
  return t;
}

double rel_err(const Tensor& got, const Tensor& want) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    num = std::max(num, static_cast<double>(std::abs(got.data<float>()[i] - want.data<float>()[i])));
    den = std::max(den, static_cast<double>(std::abs(want.data<float>()[i])));
  }
  return den == 0 ? num : num / den;
}

struct Reference {
  double loss_sum = 0;
  std::map<std::string, Tensor> grads;
};

// The one-process loss (sum of micro-batch means) and gradients of M micro-batches.
Reference one_process(const model::Model& m, const std::vector<parallel::MicroBatch>& mbs) {
  model::Params g = model::Params::allocate(m.config(), DType::kF32);
  Reference r;
  for (size_t i = 0; i < mbs.size(); ++i)
    r.loss_sum += m.forward_backward(mbs[i].ids, mbs[i].targets, g, 1.f / mbs.size()).loss;
  for (auto& [name, t] : g.named(m.config())) r.grads.emplace(name, t.clone());
  return r;
}

std::vector<parallel::MicroBatch> micro_batches(int M, int64_t V) {
  std::vector<parallel::MicroBatch> mbs;
  for (int i = 0; i < M; ++i) {
    Tensor ids = random_ids(2, 12, V, 100 + i);
    for (int64_t k = 0; k < ids.numel(); ++k)
      if (ids.data<int32_t>()[k] < 0) ids.data<int32_t>()[k] = 1;
    mbs.push_back({ids, random_ids(2, 12, V, 200 + i), Tensor()});
  }
  return mbs;
}

TEST(PipelineModel, EachScheduleGivesTheOneProcessLossAndGradients) {
  const model::ModelConfig c = four_layers();
  const model::Model whole = model::Model::random(c, DType::kF32, 11);
  const int M = 4;
  const auto mbs = micro_batches(M, c.vocab_size);
  const Reference ref = one_process(whole, mbs);
  const struct {
    PipeSchedule schedule;
    int pp, v;
  } cases[] = {{PipeSchedule::kGpipe, 2, 1},  {PipeSchedule::k1F1B, 2, 1},
               {PipeSchedule::k1F1B, 4, 1},   {PipeSchedule::kInterleaved, 2, 2},
               {PipeSchedule::kGpipe, 4, 1}};
  for (const auto& k : cases) {
    const std::string what = std::string(parallel::pipe_schedule_name(k.schedule)) + " pp" +
                             std::to_string(k.pp) + " v" + std::to_string(k.v);
    std::mutex mu;
    double loss_sum = 0;
    std::map<std::string, Tensor> grads;
    std::vector<int64_t> sent(k.pp);
    comm::run_local(k.pp, [&](comm::Communicator& comm) {
      const model::Model m = whole.stage(model::pipeline_stage(c, comm.rank(), k.pp, k.v));
      parallel::Pipeline pipe(m, comm, k.schedule, M);
      model::Params g = model::Params::allocate(c, DType::kF32, m.dims(), true, m.pp_stage());
      const auto step = pipe.run(mbs, g, 1.f / M);
      std::lock_guard<std::mutex> lock(mu);
      loss_sum += step.loss_sum;
      sent[comm.rank()] = step.sent_bytes;
      for (auto& p : g.pieces(c, {})) grads.emplace(p.name, p.view.clone());
      EXPECT_EQ(step.spans.size(), static_cast<size_t>(2 * M * k.v));
    });
    EXPECT_NEAR(loss_sum, ref.loss_sum, 1e-5 * ref.loss_sum) << what;
    ASSERT_EQ(grads.size(), ref.grads.size()) << what;  // every tensor on exactly one stage
    for (const auto& [name, want] : ref.grads) EXPECT_LT(rel_err(grads.at(name), want), 1e-5) << what << " " << name;
    // Each virtual-stage boundary carries one (B T, H) f32 activation forward and its
    // gradient back per micro-batch: the rank sends from its chunks' outputs and inputs.
    const int64_t act = 2 * 12 * c.hidden_size * 4;
    for (int r = 0; r < k.pp; ++r) {
      int64_t want = 0;
      for (int ch = 0; ch < k.v; ++ch) {
        const int vs = ch * k.pp + r;
        want += (vs + 1 < k.pp * k.v ? 1 : 0) * act * M + (vs > 0 ? 1 : 0) * act * M;
      }
      EXPECT_EQ(sent[r], want) << what << " rank " << r;
    }
  }
}

TEST(PipelineModel, TensorAndPipelineTogetherGiveTheOneProcessGradients) {
  // tp2 x pp2 over a 4-rank mesh (tp innermost), sequence parallelism on: the stages of
  // tp shards, each gradient block equal to the block of the one-process gradient.
  model::ModelConfig c = four_layers();
  c.vocab_size = 96;
  const model::Model whole = model::Model::random(c, DType::kF32, 5);
  const int M = 2;
  const auto mbs = micro_batches(M, c.vocab_size);
  const Reference ref = one_process(whole, mbs);
  for (bool sp : {false, true}) {
    std::mutex mu;
    double loss_sum = 0;
    std::vector<std::pair<model::Piece, Tensor>> blocks;
    comm::run_local(4, [&](comm::Communicator& world) {
      parallel::MeshShape shape;
      shape.pp = 2, shape.tp = 2, shape.dp = 1;
      parallel::DeviceMesh mesh(world, shape);
      const model::TpShard shard{mesh.coord(parallel::Axis::kTp), 2};
      parallel::CommTp tp(mesh.group(parallel::Axis::kTp), model::local_dims(c, shard).kv_replicas);
      model::Model m = whole.shard(shard).stage(model::pipeline_stage(c, mesh.coord(parallel::Axis::kPp), 2));
      m.set_tp_comm(&tp);
      m.set_sequence_parallel(sp);
      parallel::Pipeline pipe(m, mesh.group(parallel::Axis::kPp), PipeSchedule::k1F1B, M);
      model::Params g = model::Params::allocate(c, DType::kF32, m.dims(), true, m.pp_stage());
      const auto step = pipe.run(mbs, g, 1.f / M);
      std::lock_guard<std::mutex> lock(mu);
      if (mesh.coord(parallel::Axis::kTp) == 0) loss_sum += step.loss_sum;
      for (auto& p : g.pieces(c, shard)) blocks.emplace_back(p, p.view.clone());
    });
    EXPECT_NEAR(loss_sum, ref.loss_sum, 1e-5 * ref.loss_sum) << "sp " << sp;
    for (const auto& [piece, got] : blocks) {
      const Tensor want = piece.block_of(ref.grads.at(piece.name)).contiguous();
      const Tensor& whole_grad = ref.grads.at(piece.name);
      double num = 0, den = 0;
      for (int64_t i = 0; i < want.numel(); ++i)
        num = std::max(num, static_cast<double>(std::abs(got.data<float>()[i] - want.data<float>()[i])));
      for (int64_t i = 0; i < whole_grad.numel(); ++i)
        den = std::max(den, static_cast<double>(std::abs(whole_grad.data<float>()[i])));
      EXPECT_LT(num, 1e-5 * den) << piece.name << " sp " << sp;
    }
  }
}

}  // namespace
}  // namespace tessera
