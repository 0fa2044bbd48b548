// Every collective, algorithm and dtype on 1 to 8 ranks of the local backend (and on
// simulated multi-node layouts), at odd sizes, against a reference computed on one rank.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "comm_test_util.h"
#include "tessera/comm/algorithms.h"
#include "tessera/comm/communicator.h"
#include "tessera/comm/local_backend.h"

namespace tessera::comm {
namespace {

using testing::Expected;
using testing::get_value;
using testing::input_value;
using testing::op_name;
using testing::reduce_reference;

const DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kI32, DType::kI64};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax};
const int64_t kSizes[] = {0, 1, 3, 1023, 17001};

// Collects the first few mismatches of one rank (gtest assertions are thread-safe, but
// thousands of identical failures are not useful).
struct Checker {
  int rank;
  int failures = 0;
  template <typename Describe>
  void expect(bool ok, Describe&& what) {
    if (!ok && ++failures <= 5) ADD_FAILURE() << "rank " << rank << ": " << what();
  }
};

// Checks `ok`; the description is only formatted on failure.
#define EXPECT_AT(ok, ...) chk.expect(ok, [&] { return where(__VA_ARGS__); })

std::string where(const char* coll, const char* algo, DType dt, int64_t n, const char* op,
                  int64_t i, double got, double want) {
  return tessera::detail::concat(coll, " ", algo, " ", dtype_name(dt), " n=", n, " ", op, " [", i,
                                 "] got ", got, " want ", want);
}

// One (dtype, n) case: every rank's input and the reductions, computed once on one thread
// before the ranks start.
struct Case {
  DType dt;
  int64_t n;
  uint64_t seed;
  std::vector<std::vector<double>> inputs;    // (ranks, max(n, ranks * block))
  std::vector<std::vector<Expected>> ref;     // (3 ops, n)
  int64_t block() const { return n % 1000; }  // all_to_all block: 0, 1, 3, 23, 1
};

std::vector<Case> make_cases(const std::vector<int>& ids, uint64_t seed_base) {
  std::vector<Case> cases;
  const int N = static_cast<int>(ids.size());
  for (DType dt : kDTypes)
    for (int64_t n : kSizes) {
      Case k{dt, n, ++seed_base, {}, {}};
      const int64_t len = std::max(n, N * k.block());
      for (int id : ids) {
        k.inputs.emplace_back(len);
        for (int64_t i = 0; i < len; ++i) k.inputs.back()[i] = input_value(dt, k.seed, id, i);
      }
      k.ref.resize(3);
      for (int o = 0; o < 3; ++o)
        for (int64_t i = 0; i < n; ++i)
          k.ref[o].push_back(reduce_reference(dt, kOps[o], k.seed, ids, i));
      cases.push_back(std::move(k));
    }
  return cases;
}

Tensor tensor_of(DType dt, const std::vector<double>& v, int64_t begin, int64_t end) {
  Tensor t = Tensor::empty({end - begin}, dt);
  for (int64_t i = begin; i < end; ++i) testing::set_value(t, i - begin, v[i]);
  return t;
}

// Runs every collective on `c` for every case (group rank j's inputs are inputs[j]).
void check_collectives(Communicator& c, const std::vector<Case>& cases) {
  const int N = c.size(), r = c.rank();
  Checker chk{r};
  for (const Case& k : cases) {
    const DType dt = k.dt;
    const int64_t n = k.n;
    const std::vector<double>& mine_in = k.inputs[r];
    auto close = [&](double got, const Expected& e) { return std::fabs(got - e.value) <= e.tol; };

    for (Algorithm a : {Algorithm::kBackend, Algorithm::kRing, Algorithm::kHalvingDoubling,
                        Algorithm::kHierarchical, Algorithm::kAuto})
      for (int o = 0; o < 3; ++o) {
        Tensor t = tensor_of(dt, mine_in, 0, n);
        c.all_reduce(t, kOps[o], a);
        for (int64_t i = 0; i < n; ++i)
          EXPECT_AT(close(get_value(t, i), k.ref[o][i]), "all_reduce", algorithm_name(a), dt, n,
                    op_name(kOps[o]), i, get_value(t, i), k.ref[o][i].value);
      }

    const ChunkRange mine = chunk_range(n, N, r);
    for (Algorithm a :
         {Algorithm::kBackend, Algorithm::kRing, Algorithm::kHalvingDoubling, Algorithm::kAuto})
      for (int o = 0; o < 3; ++o) {
        Tensor in = tensor_of(dt, mine_in, 0, n);
        Tensor out = Tensor::empty({mine.size()}, dt);
        c.reduce_scatter(in, out, kOps[o], a);
        for (int64_t j = 0; j < mine.size(); ++j)
          EXPECT_AT(close(get_value(out, j), k.ref[o][mine.begin + j]), "reduce_scatter",
                    algorithm_name(a), dt, n, op_name(kOps[o]), mine.begin + j, get_value(out, j),
                    k.ref[o][mine.begin + j].value);
      }

    std::vector<int> owner(n);
    for (int j = 0; j < N; ++j) {
      const ChunkRange ch = chunk_range(n, N, j);
      for (int64_t i = ch.begin; i < ch.end; ++i) owner[i] = j;
    }
    for (Algorithm a :
         {Algorithm::kBackend, Algorithm::kRing, Algorithm::kHalvingDoubling, Algorithm::kAuto}) {
      Tensor in = tensor_of(dt, mine_in, mine.begin, mine.end);
      Tensor out = Tensor::zeros({n}, dt);
      c.all_gather(in, out, a);
      for (int64_t i = 0; i < n; ++i)
        EXPECT_AT(get_value(out, i) == k.inputs[owner[i]][i], "all_gather", algorithm_name(a), dt,
                  n, "-", i, get_value(out, i), k.inputs[owner[i]][i]);
    }

    for (int root : {0, N - 1}) {
      Tensor t = tensor_of(dt, mine_in, 0, n);
      c.broadcast(t, root);
      for (int64_t i = 0; i < n; ++i)
        EXPECT_AT(get_value(t, i) == k.inputs[root][i], "broadcast", "from", dt, n, "-", i,
                  get_value(t, i), k.inputs[root][i]);
    }

    const int root = N / 2;
    for (int o = 0; o < 3; ++o) {
      Tensor in = tensor_of(dt, mine_in, 0, n);
      Tensor out = r == root ? Tensor::zeros({n}, dt) : Tensor();
      c.reduce(in, out, kOps[o], root);
      if (r == root)
        for (int64_t i = 0; i < n; ++i)
          EXPECT_AT(close(get_value(out, i), k.ref[o][i]), "reduce", "", dt, n, op_name(kOps[o]), i,
                    get_value(out, i), k.ref[o][i].value);
    }

    const int64_t b = k.block();
    Tensor in = tensor_of(dt, mine_in, 0, N * b);
    Tensor out = Tensor::zeros({N * b}, dt);
    c.all_to_all(in, out);
    for (int j = 0; j < N; ++j)
      for (int64_t e = 0; e < b; ++e)
        EXPECT_AT(get_value(out, j * b + e) == k.inputs[j][r * b + e], "all_to_all", "", dt, b, "-",
                  j * b + e, get_value(out, j * b + e), k.inputs[j][r * b + e]);
    c.barrier();
  }
}

struct Layout {
  int ranks, ranks_per_node;
};

class Collectives : public ::testing::TestWithParam<Layout> {};

TEST_P(Collectives, MatchReference) {
  const Layout l = GetParam();
  const int64_t keep_segment = algo::segment_bytes(), keep_bcast = algo::broadcast_tree_max_bytes(),
                keep_reduce = algo::reduce_tree_max_bytes();
  algo::set_segment_bytes(256);  // several segments per chunk, so the pipelining is exercised
  // 17001 elements take the pipelined broadcast / reduce, 1023 the binomial trees.
  algo::set_tree_max_bytes(16 << 10, 16 << 10);
  std::vector<int> ids(l.ranks);
  for (int i = 0; i < l.ranks; ++i) ids[i] = i;
  const std::vector<Case> cases = make_cases(ids, 100);
  run_local(l.ranks, l.ranks_per_node, [&](Communicator& c) {
    c.set_timeout(60);
    check_collectives(c, cases);
    EXPECT_EQ(c.collectives_issued(), 5u * 5 * (15 + 12 + 4 + 2 + 3 + 2));
  });
  algo::set_segment_bytes(keep_segment);
  algo::set_tree_max_bytes(keep_bcast, keep_reduce);
}

// One node of 1..8 ranks; then simulated multi-node layouts for the hierarchical
// all-reduce (5 ranks in nodes of 2: unequal nodes, which fall back to the ring).
INSTANTIATE_TEST_SUITE_P(Ranks, Collectives,
                         ::testing::Values(Layout{1, 1}, Layout{2, 2}, Layout{3, 3}, Layout{4, 4},
                                           Layout{5, 5}, Layout{6, 6}, Layout{7, 7}, Layout{8, 8},
                                           Layout{4, 2}, Layout{6, 3}, Layout{8, 4}, Layout{5, 2}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return "n" + std::to_string(info.param.ranks) + "_per_node" +
                                  std::to_string(info.param.ranks_per_node);
                         });

// Sub-groups: 7 ranks split into even (4) and odd (3) ranks; every collective runs inside
// each group against references over the group's members only.
TEST(SubGroups, EvenOddSplitRunsEveryCollective) {
  const std::vector<int> even{0, 2, 4, 6}, odd{1, 3, 5};
  const std::vector<Case> even_cases = make_cases(even, 500), odd_cases = make_cases(odd, 600);
  run_local(7, [&](Communicator& c) {
    c.set_timeout(60);
    std::unique_ptr<Communicator> sub = c.split(c.rank() % 2, c.rank());
    ASSERT_NE(sub, nullptr);
    EXPECT_EQ(sub->size(), c.rank() % 2 ? 3 : 4);
    EXPECT_EQ(sub->rank(), c.rank() / 2);
    EXPECT_EQ(sub->backend(), "local");
    EXPECT_DOUBLE_EQ(sub->timeout(), 60);
    check_collectives(*sub, c.rank() % 2 ? odd_cases : even_cases);
    c.barrier();  // the parent group still works after the split
  });
}

}  // namespace
}  // namespace tessera::comm
