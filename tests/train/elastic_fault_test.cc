// Fault tolerance end to end: `tessera train --nproc 4 --max-restarts R` (an elastic
// supervisor around mpirun) loses a rank to SIGKILL, or has one hang (SIGSTOP) and the
// comm watchdog catch it, restarts from the latest checkpoint (the second time on 3
// ranks, --min-nproc) and finishes with the loss curve of an uninterrupted run.
#include <gtest/gtest.h>

#include <signal.h>

#include <chrono>
#include <cmath>
#include <thread>

#include "tessera/base/timer.h"
#include "tessera/io/json_file.h"
#include "tessera/train/heartbeat.h"
#include "tessera/train/metrics.h"
#include "tessera/train/trainer.h"
#include "test_util/run_command.h"
#include "train/trainer_test_util.h"

namespace tessera::train {
namespace {

std::string fault_config(const std::string& out, const std::string& data, double timeout_s) {
  std::string cfg = base_config(out, data, 80,
                                "[parallel]\nzero_stage = 2\ntimeout_s = " +
                                    std::to_string(timeout_s) + "\n" +
                                    "[checkpoint]\nevery = 2\n[optimizer]\nlr = 0.003\n");
  // 12 sequences per step split over 4 or 3 ranks.
  return cfg.replace(cfg.find("batch_size = 4"), 14, "batch_size = 12");
}

// Runs a command on a thread; joined on destruction, so a failed ASSERT cannot leave
// a joinable thread behind.
class Background {
 public:
  explicit Background(std::string cmd)
      : thread_([this, cmd] { result_ = testing::run_command(cmd); }) {}
  ~Background() { join(); }
  const testing::CommandResult& join() {
    if (thread_.joinable()) thread_.join();
    return result_;
  }

 private:
  testing::CommandResult result_;
  std::thread thread_;
};

// Waits until some rank's heartbeat reports at least `step`; returns that rank's pid.
int64_t wait_for_step(const std::string& hb_dir, int rank, int64_t step, double timeout_s) {
  base::Timer t;
  while (t.seconds() < timeout_s) {
    for (const auto& b : read_heartbeats(hb_dir))
      if (b.rank == rank && b.step >= step && b.pid > 0 && !b.exited) return b.pid;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return 0;
}

std::vector<double> losses_of(const std::string& out) {
  std::vector<double> l;
  for (const auto& rec : read_metrics(out + "/metrics.jsonl"))
    if (rec.contains("loss")) l.push_back(rec.at("loss").get<double>());
  return l;
}

void expect_same_curve(const std::vector<double>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(got[i], want[i], 1e-5 * want[i]) << "step " << i + 1;
}

class ElasticFault : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = temp_dir("elastic_fault");
    data_ = make_data(root_);
    reference_ = run_training(
        TrainConfig::parse(fault_config(root_ + "/reference", data_, 300), "r.toml")).losses;
  }
  static std::string root_, data_;
  static std::vector<double> reference_;
};
std::string ElasticFault::root_, ElasticFault::data_;
std::vector<double> ElasticFault::reference_;

TEST_F(ElasticFault, KilledRankRestartsAndFinishesOnTheSameCurve) {
  const std::string out = root_ + "/kill";
  io_write(out + ".toml", fault_config(out, data_, 300));
  // A whole run of this model takes about a second on a quiet machine: ranks beat every
  // 20 ms (not the default second) so the test sees step 5 while most of the run is ahead.
  Background job(std::string(TESSERA_CLI_PATH) + " train --config " + out +
                 ".toml --nproc 4 --max-restarts 2 --heartbeat-timeout 60 --heartbeat-interval 0.02");
  const int64_t pid = wait_for_step(out + "/heartbeats", 2, 5, 120);
  ASSERT_GT(pid, 0) << "rank 2 never reached step 5: " << job.join().out;
  ASSERT_EQ(::kill(static_cast<pid_t>(pid), SIGKILL), 0);
  const auto& r = job.join();
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("elastic: finished after 1 restart on 4 ranks"), std::string::npos) << r.out;
  expect_same_curve(losses_of(out), reference_);
}

TEST_F(ElasticFault, HungRankIsCaughtByTheWatchdogAndTheJobShrinks) {
  const std::string out = root_ + "/hang";
  const double timeout_s = 4;
  io_write(out + ".toml", fault_config(out, data_, timeout_s));
  Background job(std::string(TESSERA_CLI_PATH) + " train --config " + out +
                 ".toml --nproc 4 --min-nproc 3 --max-restarts 1 --heartbeat-timeout 120 "
                 "--heartbeat-interval 0.02");
  const int64_t pid = wait_for_step(out + "/heartbeats", 1, 5, 120);
  ASSERT_GT(pid, 0) << "rank 1 never reached step 5: " << job.join().out;
  base::Timer since_stop;
  ASSERT_EQ(::kill(static_cast<pid_t>(pid), SIGSTOP), 0);
  // The other ranks block in a collective; their watchdog aborts the job within the
  // timeout and the supervisor restarts it on 3 ranks. Rank 0 of the new job beating
  // again means the failure was detected and handled.
  bool restarted = false;
  while (since_stop.seconds() < 60 && !restarted) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (!fs::exists(out + "/elastic.jsonl")) continue;
    restarted = io::read_file_bytes(out + "/elastic.jsonl").find("restart") != std::string::npos;
  }
  const double detected_s = since_stop.seconds();
  const auto& r = job.join();
  ASSERT_TRUE(restarted) << r.out;
  EXPECT_LT(detected_s, timeout_s + 15) << "the hang took too long to detect";
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("comm watchdog:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("did not finish within 4 s"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("elastic: finished after 1 restart on 3 ranks"), std::string::npos) << r.out;
  expect_same_curve(losses_of(out), reference_);
}

TEST_F(ElasticFault, HungRankOfATensorParallelJobShrinksByAWholeReplica) {
  // dp2 x tp2 on 4 ranks: a hung rank takes its tp group's replica with it, so the job
  // comes back on 2 ranks (dp1 x tp2, the ZeRO-2 state resharded) and finishes on the
  // one-process curve.
  const std::string out = root_ + "/hang_tp";
  const double timeout_s = 4;
  std::string cfg = fault_config(out, data_, timeout_s);
  cfg.replace(cfg.find("[parallel]\n"), 11, "[parallel]\ntp = 2\n");
  io_write(out + ".toml", cfg);
  Background job(std::string(TESSERA_CLI_PATH) + " train --config " + out +
                 ".toml --nproc 4 --min-nproc 2 --max-restarts 1 --heartbeat-timeout 120 "
                 "--heartbeat-interval 0.02");
  const int64_t pid = wait_for_step(out + "/heartbeats", 3, 5, 120);
  ASSERT_GT(pid, 0) << "rank 3 never reached step 5: " << job.join().out;
  ASSERT_EQ(::kill(static_cast<pid_t>(pid), SIGSTOP), 0);
  const auto& r = job.join();
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("elastic: finished after 1 restart on 2 ranks"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("train: mesh dp2 x tp2,"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("train: mesh tp2,"), std::string::npos) << r.out;  // after the shrink
  expect_same_curve(losses_of(out), reference_);
}

}  // namespace
}  // namespace tessera::train
