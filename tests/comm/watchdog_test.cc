// The collective watchdog: a rank left waiting logs which collective (name, sequence
// number, group) timed out and aborts; tests swap the abort for a handler that records.
#include <gtest/gtest.h>

#include <mutex>
#include <string>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/comm/communicator.h"
#include "tessera/comm/local_backend.h"

namespace tessera::comm {
namespace {

class Watchdog : public ::testing::Test {
 protected:
  void SetUp() override {
    Communicator::set_timeout_handler([this](const std::string& m) {
      std::lock_guard<std::mutex> lk(mu_);
      messages_.push_back(m);
    });
  }
  void TearDown() override { Communicator::set_timeout_handler(nullptr); }

  // Runs fn on n ranks with a short timeout; expects run_local to fail with the watchdog.
  void run_expecting_timeout(int n, const std::function<void(Communicator&)>& fn) {
    try {
      run_local(n, [&](Communicator& c) {
        c.set_timeout(0.2);
        fn(c);
      });
      ADD_FAILURE() << "no timeout";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("did not finish within 0.2 s"), std::string::npos)
          << e.what();
    }
  }
  std::vector<std::string> messages() {
    std::lock_guard<std::mutex> lk(mu_);
    return messages_;
  }

  std::mutex mu_;
  std::vector<std::string> messages_;
};

TEST_F(Watchdog, NamesCollectiveSequenceAndGroup) {
  run_expecting_timeout(2, [](Communicator& c) {
    EXPECT_DOUBLE_EQ(c.timeout(), 0.2);
    c.set_timeout(60);  // a loaded machine may hold a rank past 0.2 s here: not the case under test
    c.barrier();
    c.set_timeout(0.2);
    if (c.rank() == 1) {
      Tensor t = Tensor::zeros({5}, DType::kF32);
      c.all_reduce(t, ReduceOp::kSum, Algorithm::kRing);  // rank 0 never joins
    }
  });
  const auto m = messages();
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(m[0],
            "comm watchdog: all_reduce #2 (ring, 5 x f32) on rank 1/2 (backend local) did not "
            "finish within 0.2 s (set_timeout); aborting the job");
}

TEST_F(Watchdog, CoversPointToPointWaitsAndSubGroups) {
  run_expecting_timeout(2, [](Communicator& c) {
    if (c.rank() == 1) {
      int v = 0;
      c.recv(&v, 4, 0, 3);  // never sent
    }
  });
  run_expecting_timeout(4, [](Communicator& c) {
    std::unique_ptr<Communicator> sub = c.split(c.rank() / 2, c.rank());
    EXPECT_DOUBLE_EQ(sub->timeout(), 0.2);  // inherited
    if (c.rank() == 3) {
      Tensor t = Tensor::zeros({7}, DType::kBF16);
      sub->broadcast(t, 0);  // rank 2 (the root, sub-rank 0) never joins
    }
  });
  const auto m = messages();
  ASSERT_EQ(m.size(), 2u);
  EXPECT_NE(m[0].find("wait on recv from rank 0 (tag 3, 4 bytes) on rank 1/2 (backend local)"),
            std::string::npos)
      << m[0];
  EXPECT_NE(m[1].find("broadcast #1 (tree, 7 x bf16) on rank 1/2 (backend local)"),
            std::string::npos)
      << m[1];
}

TEST_F(Watchdog, CoversAsyncCollectives) {
  run_expecting_timeout(2, [](Communicator& c) {
    if (c.rank() == 0) return;
    Tensor t = Tensor::zeros({3}, DType::kI64);
    RequestPtr r = c.all_reduce_async(t, ReduceOp::kMax, Algorithm::kHalvingDoubling);
    r->wait();
  });
  const auto m = messages();  // from the worker's collective; wait() gets its error
  ASSERT_EQ(m.size(), 1u);
  EXPECT_NE(m[0].find("all_reduce #1 (hd, 3 x i64) on rank 1/2 (backend local)"), std::string::npos)
      << m[0];
}

// The real path: log, then std::abort() (a death test runs it in a child process).
TEST(WatchdogDeathTest, DefaultHandlerAbortsTheJob) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(run_local(2,
                         [](Communicator& c) {
                           c.set_timeout(0.1);
                           if (c.rank() == 1) c.barrier();
                         }),
               "barrier #1 \\(dissemination\\) on rank 1/2 \\(backend local\\) did not finish "
               "within 0.1 s");
}

}  // namespace
}  // namespace tessera::comm
