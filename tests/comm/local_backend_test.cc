// The local backend's point to point (matching, order, sizes, failures), split, and the
// argument checks every collective makes.
#include "tessera/comm/local_backend.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/comm/communicator.h"

namespace tessera::comm {
namespace {

// Runs fn, which must throw tessera::Error whose message contains `part`.
template <typename Fn>
void expect_error(Fn&& fn, const std::string& part) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one containing '" << part << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(LocalP2P, SameTagArrivesInOrderAndTagsMatchIndependently) {
  run_local(2, [](Communicator& c) {
    if (c.rank() == 0) {
      const int32_t v[5] = {1, 2, 3, 20, 10};
      std::vector<RequestPtr> reqs;
      for (int i = 0; i < 3; ++i) reqs.push_back(c.isend(&v[i], 4, 1, 5));
      reqs.push_back(c.isend(&v[4], 4, 1, 1));  // tag 1 is sent first ...
      reqs.push_back(c.isend(&v[3], 4, 1, 2));
      for (auto& r : reqs) r->wait();
    } else {
      int32_t a = 0, b = 0, x = 0, y = 0, z = 0;
      c.recv(&a, 4, 0, 2);  // ... but received second
      c.recv(&b, 4, 0, 1);
      c.recv(&x, 4, 0, 5);
      c.recv(&y, 4, 0, 5);
      c.recv(&z, 4, 0, 5);
      EXPECT_EQ(a, 20);
      EXPECT_EQ(b, 10);
      EXPECT_EQ(x, 1);
      EXPECT_EQ(y, 2);
      EXPECT_EQ(z, 3);
    }
  });
}

TEST(LocalP2P, ReceivePostedFirstCompletesOnlyAfterTheSend) {
  run_local(2, [](Communicator& c) {
    if (c.rank() == 1) {
      std::vector<double> got(1000, 0);
      RequestPtr r = c.irecv(got.data(), 8000, 0, 9);
      EXPECT_FALSE(r->test());  // rank 0 sends only after the go below
      const char go = 1;
      c.send(&go, 1, 0, 8);
      r->wait();
      r->wait();  // a second wait is a no-op
      EXPECT_TRUE(r->test());
      for (int i = 0; i < 1000; ++i) ASSERT_EQ(got[i], i * 0.5);
    } else {
      char go = 0;
      c.recv(&go, 1, 1, 8);
      std::vector<double> v(1000);
      for (int i = 0; i < 1000; ++i) v[i] = i * 0.5;
      c.send(v.data(), 8000, 1, 9);
    }
  });
}

TEST(LocalP2P, BigMessageAndSelfSendAndEmptyMessage) {
  run_local(3, [](Communicator& c) {
    const int64_t n = 1 << 20;  // 8 MB
    std::vector<int64_t> out(n), in(n, -1);
    for (int64_t i = 0; i < n; ++i) out[i] = i * 3 + c.rank();
    const int to = (c.rank() + 1) % 3, from = (c.rank() + 2) % 3;
    RequestPtr s = c.isend(out.data(), n * 8, to, 0);
    c.recv(in.data(), n * 8, from, 0);
    s->wait();
    for (int64_t i = 0; i < n; i += 4099) ASSERT_EQ(in[i], i * 3 + from);
    int64_t self = 0;
    RequestPtr rs = c.irecv(&self, 8, c.rank(), 4);
    c.send(&out[7], 8, c.rank(), 4);
    rs->wait();
    EXPECT_EQ(self, out[7]);
    RequestPtr e = c.isend(nullptr, 0, to, 6);
    c.recv(nullptr, 0, from, 6);
    e->wait();
  });
}

TEST(LocalP2P, SizeMismatchFailsBothSidesWithOneLine) {
  run_local(2, [](Communicator& c) {
    int64_t v = 42;
    if (c.rank() == 0)
      expect_error([&] { c.send(&v, 8, 1, 3); }, "send of 8 bytes, receive of 4 bytes");
    else
      expect_error([&] { c.recv(&v, 4, 0, 3); }, "message from rank 0 to rank 1 (tag 3)");
  });
}

TEST(LocalP2P, BadArgumentsAreErrors) {
  run_local(2, [](Communicator& c) {
    int v = 0;
    expect_error([&] { c.isend(&v, 4, 2, 0); }, "isend: rank 2 out of range for a group of 2");
    expect_error([&] { c.irecv(&v, 4, -1, 0); }, "irecv: rank -1 out of range");
    expect_error([&] { c.isend(&v, 4, 0, -3); }, "tag -3 must be >= 0");
  });
  expect_error([] { run_local(0, [](Communicator&) {}); }, "at least 1 rank");
}

// A rank that throws wakes every rank waiting on it; run_local rethrows the first error.
TEST(LocalP2P, FailedRankWakesItsPeers) {
  std::atomic<int> woke{0};
  try {
    run_local(4, [&](Communicator& c) {
      if (c.rank() == 2) throw std::runtime_error("rank two broke");
      try {
        c.barrier();
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("rank 2 failed: rank two broke"), std::string::npos)
            << e.what();
        ++woke;
        throw;
      }
    });
    ADD_FAILURE() << "run_local did not rethrow";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "rank two broke");
  }
  EXPECT_EQ(woke.load(), 3);
}

TEST(LocalP2P, MismatchedCollectiveSizesFailInsteadOfHanging) {
  expect_error(
      [] {
        run_local(3, [](Communicator& c) {
          Tensor t = Tensor::zeros({c.rank() == 1 ? 6 : 5}, DType::kF32);
          c.all_reduce(t, ReduceOp::kSum, Algorithm::kBackend);
        });
      },
      "ranks disagree on a message size");
}

TEST(LocalSplit, KeysOrderRanksAndNegativeColourJoinsNothing) {
  run_local(6, 3, [](Communicator& c) {
    const int r = c.rank();
    // Ranks 0 and 5 stay out; the others form one group in reverse rank order.
    std::unique_ptr<Communicator> g = c.split(r == 0 || r == 5 ? -1 : 7, -r);
    if (r == 0 || r == 5) {
      EXPECT_EQ(g, nullptr);
    } else {
      ASSERT_NE(g, nullptr);
      EXPECT_EQ(g->size(), 4);
      EXPECT_EQ(g->rank(), 4 - r);
      EXPECT_EQ(g->node_id(), r / 3);  // nodes come along from the parent
      Tensor t = Tensor::from_vector<int64_t>({int64_t{1} << r}, {1});
      g->all_reduce(t);
      EXPECT_EQ(t.data<int64_t>()[0], 2 + 4 + 8 + 16);
      // Nested: split the group again by parity of the new rank.
      std::unique_ptr<Communicator> h = g->split(g->rank() % 2, 0);
      ASSERT_NE(h, nullptr);
      EXPECT_EQ(h->size(), 2);
      Tensor u = Tensor::from_vector<int32_t>({r}, {1});
      h->all_reduce(u, ReduceOp::kMax);
      // new ranks 0..3 are old ranks 4, 3, 2, 1: even new ranks {4, 2}, odd {3, 1}.
      EXPECT_EQ(u.data<int32_t>()[0], g->rank() % 2 ? 3 : 4);
    }
    c.barrier();
  });
}

TEST(CollectiveChecks, BadArgumentsFailWithOneClearLine) {
  run_local(2, [](Communicator& c) {
    Tensor u8 = Tensor::zeros({4}, DType::kU8);
    expect_error([&] { c.all_reduce(u8); }, "all_reduce: the dtype u8 is not supported");
    Tensor in = Tensor::zeros({5}, DType::kF32);
    Tensor bad = Tensor::zeros({4}, DType::kF32);
    expect_error([&] { c.reduce_scatter(in, bad); },
                 tessera::detail::concat("reduce_scatter: out has 4 elements, expected ",
                                         c.rank() == 0 ? 3 : 2, " (chunk ", c.rank(),
                                         " of 5 elements over 2 ranks)"));
    Tensor out_bf = Tensor::zeros({c.rank() == 0 ? 3 : 2}, DType::kBF16);
    expect_error([&] { c.reduce_scatter(in, out_bf); },
                 "reduce_scatter: out dtype bf16 differs from in dtype f32");
    expect_error([&] { c.all_gather(in, bad); }, "all_gather: in has 5 elements, expected 2");
    expect_error([&] { c.broadcast(in, 2); }, "broadcast: root 2 out of range for a group of 2");
    expect_error([&] { c.reduce(in, bad, ReduceOp::kSum, -1); }, "reduce: root -1 out of range");
    expect_error([&] { c.reduce(in, bad, ReduceOp::kSum, c.rank()); },
                 "reduce: out has 4 elements, expected 5");
    Tensor out5 = Tensor::zeros({5}, DType::kF32);
    expect_error([&] { c.all_to_all(in, out5); },
                 "all_to_all: in has 5 elements, not a multiple of the group size 2");
    Tensor m = Tensor::zeros({2, 3}, DType::kF32).transpose(0, 1);
    expect_error([&] { c.all_reduce(m); }, "is not contiguous");
    Tensor undefined;
    expect_error([&] { c.all_reduce(undefined); }, "tensor is undefined");
    EXPECT_EQ(c.collectives_issued(), 0u);  // nothing was issued
    c.barrier();
    EXPECT_EQ(c.collectives_issued(), 1u);
  });
}

// all_to_allv: rank r sends rank j (r + 2 j) % 4 rows (zero included), each row (7 i32) holding
// (r, j, row index, column); every rank receives each peer's rows, in rank order, and their counts.
TEST(LocalBackend, AllToAllvMovesRowsOfEveryCount) {
  for (int n : {1, 2, 3, 5}) {
    run_local(n, [n](Communicator& c) {
      const int r = c.rank();
      std::vector<int64_t> send(n);
      int64_t total = 0;
      for (int j = 0; j < n; ++j) total += send[j] = (r + 2 * j) % 4;
      Tensor in = Tensor::empty({total, 7}, DType::kI32);
      int64_t row = 0;
      for (int j = 0; j < n; ++j)
        for (int64_t i = 0; i < send[j]; ++i, ++row)
          for (int k = 0; k < 7; ++k) in.data<int32_t>()[row * 7 + k] = ((r * 16 + j) * 16 + static_cast<int>(i)) * 16 + k;
      std::vector<int64_t> recv;
      const Tensor out = c.all_to_allv(in, send, &recv);
      ASSERT_EQ(static_cast<int>(recv.size()), n);
      row = 0;
      for (int j = 0; j < n; ++j) {
        EXPECT_EQ(recv[j], (j + 2 * r) % 4) << "rank " << r << " from " << j;
        for (int64_t i = 0; i < recv[j]; ++i, ++row)
          for (int k = 0; k < 7; ++k)
            ASSERT_EQ(out.data<int32_t>()[row * 7 + k], ((j * 16 + r) * 16 + static_cast<int>(i)) * 16 + k)
                << "rank " << r << " row " << row;
      }
      EXPECT_EQ(out.size(0), row);
      EXPECT_EQ(out.size(1), 7);
      // Counts that do not add up to the rows, or a count per rank missing: one line.
      if (n > 1) {
        std::vector<int64_t> bad = send;
        bad[0] += 1;
        EXPECT_THROW(c.all_to_allv(in, bad), Error);
        EXPECT_THROW(c.all_to_allv(in, std::vector<int64_t>(n + 1, 0)), Error);
      }
    });
  }
}

}  // namespace
}  // namespace tessera::comm
