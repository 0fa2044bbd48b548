// DeviceMesh: rank order (tp innermost, pp outermost) against the closed formula, every
// axis group checked with a real all-reduce on 8 ranks of the local backend, and a table of
// bad layouts, each one line naming the axis.
#include "tessera/parallel/device_mesh.h"

#include <gtest/gtest.h>

#include <mutex>
#include <set>

#include "tessera/base/error.h"
#include "tessera/comm/communicator.h"
#include "tessera/tensor/tensor.h"

namespace tessera::parallel {
namespace {

MeshShape shape(int64_t dp, int64_t pp, int64_t tp) {
  MeshShape s;
  s.dp = dp, s.pp = pp, s.tp = tp;
  return s;
}

TEST(DeviceMesh, RankOrderPutsTpInnermostAndPpOutermost) {
  const MeshShape s = shape(2, 2, 2);
  for (int r = 0; r < 8; ++r) {
    const auto c = DeviceMesh::coords_of(s, r);
    // rank = (pp * dp_size + dp) * tp_size + tp, written out independently of the code.
    EXPECT_EQ(c[static_cast<int>(Axis::kTp)], r % 2) << r;
    EXPECT_EQ(c[static_cast<int>(Axis::kDp)], (r / 2) % 2) << r;
    EXPECT_EQ(c[static_cast<int>(Axis::kPp)], r / 4) << r;
    EXPECT_EQ(DeviceMesh::rank_of(s, c), r);
  }
  EXPECT_EQ(shape(2, 2, 2).describe(), "dp2 x pp2 x tp2");
  EXPECT_EQ(shape(1, 1, 1).describe(), "1 rank");
}

TEST(DeviceMesh, EveryAxisGroupHoldsTheRanksThatDifferOnlyThere) {
  const MeshShape s = shape(2, 2, 2);
  std::mutex m;
  std::set<std::string> described;
  comm::run_local(8, [&](comm::Communicator& world) {
    DeviceMesh mesh(world, s);
    const int r = world.rank();
    for (Axis a : {Axis::kDp, Axis::kPp, Axis::kTp, Axis::kCp, Axis::kEp}) {
      comm::Communicator& g = mesh.group(a);
      ASSERT_EQ(g.size(), s.size(a)) << axis_name(a);
      EXPECT_EQ(g.rank(), mesh.coord(a)) << axis_name(a);
      // Sum of world ranks over the group against the ranks the formula puts in it.
      Tensor t = Tensor::zeros({1}, DType::kI64);
      t.data<int64_t>()[0] = r;
      g.all_reduce(t);
      int64_t want = 0;
      for (int k = 0; k < s.size(a); ++k) {
        auto c = DeviceMesh::coords_of(s, r);
        c[static_cast<int>(a)] = k;
        want += DeviceMesh::rank_of(s, c);
      }
      EXPECT_EQ(t.data<int64_t>()[0], want) << "rank " << r << " axis " << axis_name(a);
    }
    std::lock_guard<std::mutex> lock(m);
    described.insert(mesh.describe());
  });
  EXPECT_EQ(described.size(), 8u);
  EXPECT_TRUE(described.count("rank 5/8: dp 0/2, pp 1/2, tp 1/2")) << *described.begin();
}

TEST(DeviceMesh, DpDefaultsToTheRestOfTheWorld) {
  EXPECT_EQ(resolve_mesh_shape(shape(0, 2, 2), 8, "run.toml").dp, 2);
  EXPECT_EQ(resolve_mesh_shape(shape(0, 1, 1), 3, "run.toml").dp, 3);
  EXPECT_EQ(resolve_mesh_shape(shape(4, 1, 1), 4, "run.toml").dp, 4);
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(DeviceMesh, BadLayoutsAreOneLineErrorsNamingTheAxis) {
  model::ModelConfig m = model::ModelConfig::named_shape("tiny");  // 4 heads, 2 kv, 2 layers, mlp 128
  m.intermediate_size = 131;
  struct Case {
    MeshShape s;
    int64_t world, micro_batches;
    std::string want;
  };
  MeshShape cp2 = shape(1, 1, 1), ep2 = shape(1, 1, 1), neg = shape(1, 1, 1);
  cp2.cp = 2, ep2.ep = 2, neg.pp = -1;
  const std::vector<Case> cases = {
      {shape(2, 1, 1), 4, 1, "run.toml: [parallel] dp 2 x pp 1 x tp 1 = 2 ranks, but the job has 4"},
      {shape(0, 1, 3), 4, 1, "run.toml: [parallel] pp 1 x tp 3 = 3 does not divide the 4 ranks"},
      {shape(0, 3, 1), 4, 1, "pp 3 x tp 1 = 3 does not divide the 4 ranks"},
      {shape(1, 1, 0), 1, 1, "[parallel] tp must be in [1, 65536], got 0"},
      {neg, 1, 1, "[parallel] pp must be in [1, 65536], got -1"},
      {shape(-2, 1, 1), 2, 1, "[parallel] dp must be in [1, 65536]"},
      {cp2, 4, 1, "[parallel] dp 1 x pp 1 x tp 1 x cp 2 = 2 ranks, but the job has 4"},
      {ep2, 2, 1, "[parallel] ep = 2 needs a mixture-of-experts model; llama has no experts"},
      {shape(1, 1, 8), 8, 1, "[parallel] tp = 8 does not divide the model's 4 attention heads"},
      {shape(1, 1, 2), 2, 1, "[parallel] tp = 2 does not divide the model's MLP size 131"},
      {shape(1, 4, 1), 4, 4, "[parallel] pp = 4 is more pipeline stages than the model's 2 layers"},
      {shape(1, 2, 1), 2, 1, "[parallel] pp = 2 needs at least 2 micro-batches per step"},
  };
  model::ModelConfig gqa = model::ModelConfig::named_shape("tiny");
  gqa.num_heads = 12, gqa.num_kv_heads = 4, gqa.hidden_size = 96, gqa.head_dim = 8;
  gqa.intermediate_size = 192;
  EXPECT_NE(error_of([&] { check_layout(shape(1, 1, 3), gqa, 1, "run.toml"); })
                .find("tp = 3 and the model's 4 key/value heads: one must divide the other"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { check_layout(shape(1, 1, 4), gqa, 1, "run.toml"); }), "");   // kv split 4 ways
  EXPECT_EQ(error_of([&] { check_layout(shape(1, 1, 12), gqa, 1, "run.toml"); }), "");  // kv replicated
  ASSERT_GE(cases.size(), 10u);
  for (const auto& k : cases) {
    const std::string e = error_of([&] {
      const MeshShape r = resolve_mesh_shape(k.s, k.world, "run.toml");
      check_layout(r, m, k.micro_batches, "run.toml");
    });
    EXPECT_NE(e.find(k.want), std::string::npos) << "want '" << k.want << "', got '" << e << "'";
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

}  // namespace
}  // namespace tessera::parallel
