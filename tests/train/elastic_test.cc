// Elastic supervisor and heartbeats, driven by a fake bash "job" whose ranks are background
// subshells writing their own beat files: clean exit, crash + restart, a SIGSTOPped rank
// (declared dead by timeout, group killed), a vanished rank, shrinking, giving up, signals.
#include "tessera/train/elastic.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/train/heartbeat.h"
#include "test_util/run_command.h"

namespace tessera::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = (fs::temp_directory_path() /
             ("tessera_elastic_" + std::string(info->name()) + "_" + std::to_string(::getpid())))
                .string();
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name) const { return (fs::path(path_) / name).string(); }
  const std::string& str() const { return path_; }

 private:
  std::string path_;
};

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

std::vector<json> read_log(const std::string& path) {
  std::vector<json> recs;
  for (const auto& l : read_lines(path)) recs.push_back(json::parse(l));
  return recs;
}

std::vector<json> events_named(const std::vector<json>& log, const std::string& name) {
  std::vector<json> out;
  for (const auto& r : log)
    if (r.at("event") == name) out.push_back(r);
  return out;
}

// The fake job: `bash worker.sh NPROC ATTEMPT` forks NPROC rank subshells; each writes a beat
// per step (its own JSON, the format Heartbeat writes) and calls `act RANK STEP`, which the
// scenario defines (exit, stop, vanish...). The job exits with the first non-zero rank status.
// It records "ATTEMPT NPROC $TESSERA_ELASTIC_ATTEMPT $TESSERA_HEARTBEAT_INTERVAL" in calls.txt,
// its pid (= process group) in pgids.txt and each rank's pid in rank_pids.txt.
// `before_wait` runs in the leader once the ranks are started.
std::string write_worker(const TempDir& dir, int steps, const std::string& scenario,
                         const std::string& before_wait = "") {
  const std::string path = dir.file("worker.sh");
  std::ofstream out(path);
  out << "W='" << dir.str() << "'\n"
      << "n=$1; attempt=$2; steps=" << steps << "\n"
      << R"(echo "$attempt $n $TESSERA_ELASTIC_ATTEMPT $TESSERA_HEARTBEAT_INTERVAL" >> "$W/calls.txt"
echo $$ >> "$W/pgids.txt"
beat() {
  local f="$TESSERA_HEARTBEAT_DIR/rank-$1.json"
  printf '{"rank":%d,"pid":%d,"host":"%s","step":%d,"time":%s}\n' \
    "$1" "$BASHPID" "$HOSTNAME" "$2" "$EPOCHREALTIME" > "$f.tmp" && mv -f "$f.tmp" "$f"
}
act() { :; }
)" << scenario << R"(
rank() {
  echo "$attempt $1 $BASHPID" >> "$W/rank_pids.txt"
  for ((step = 0; step < steps; step++)); do
    beat $1 $step
    act $1 $step
    sleep 0.05
  done
}
pids=()
for ((r = 0; r < n; r++)); do rank $r & pids+=($!); done
)" << before_wait << R"(
status=0
for p in "${pids[@]}"; do wait $p; s=$?; [[ $status == 0 ]] && status=$s; done
exit $status
)";
  return path;
}

ElasticOptions fast_options(const TempDir& dir, const std::string& worker) {
  ElasticOptions o;
  o.heartbeat_timeout_s = 1.0;
  o.heartbeat_interval_s = 0.1;
  o.startup_grace_s = 2.0;
  o.poll_interval_s = 0.05;
  o.kill_grace_s = 0.3;
  o.restart_delay_s = 0;
  o.heartbeat_dir = dir.file("heartbeats");
  o.log_path = dir.file("elastic.jsonl");
  o.make_command = [worker](int nproc, int attempt) {
    return std::vector<std::string>{"bash", worker, std::to_string(nproc),
                                    std::to_string(attempt)};
  };
  return o;
}

// Live (non-zombie) processes in group pgid, as `ps` lists them.
int live_in_group(const std::string& pgid) {
  const auto r = tessera::testing::run_command(
      "ps -e -o pgid=,stat= | awk '$1 == " + pgid + " && $2 !~ /^Z/' | wc -l");
  return std::stoi(r.out);
}

bool pid_alive(const std::string& pid) {
  std::ifstream in("/proc/" + pid + "/stat");
  std::string line;
  if (!std::getline(in, line)) return false;
  return line[line.rfind(')') + 2] != 'Z';
}

TEST(Elastic, CleanExitRunsOnce) {
  TempDir dir;
  auto o = fast_options(dir, write_worker(dir, 4, ""));
  o.nproc = 2;
  o.max_restarts = 3;
  const auto r = run_elastic(o);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.restarts, 0);
  EXPECT_EQ(r.final_nproc, 2);
  EXPECT_FALSE(r.interrupted);
  EXPECT_EQ(read_lines(dir.file("calls.txt")), std::vector<std::string>{"0 2 0 0.1"});
  const auto log = read_log(o.log_path);
  ASSERT_EQ(events_named(log, "start").size(), 1u);
  EXPECT_EQ(events_named(log, "start")[0].at("nproc"), 2);
  EXPECT_EQ(events_named(log, "done").size(), 1u);
  EXPECT_EQ(events_named(log, "restart").size(), 0u);
  // The ranks beat into the directory the supervisor handed them.
  EXPECT_EQ(read_heartbeats(o.heartbeat_dir).size(), 2u);
}

TEST(Elastic, CrashedRankRestartsWithResumeAttempt) {
  TempDir dir;
  // Rank 1 exits 3 at step 2 of attempt 0 only.
  auto o = fast_options(dir, write_worker(dir, 4, R"(
act() { if [[ $attempt == 0 && $1 == 1 && $2 == 2 ]]; then exit 3; fi; }
)"));
  o.nproc = 2;
  o.max_restarts = 2;
  const auto r = run_elastic(o);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.restarts, 1);
  EXPECT_EQ(r.final_nproc, 2);  // no --min-nproc: same world size
  EXPECT_EQ(read_lines(dir.file("calls.txt")),
            (std::vector<std::string>{"0 2 0 0.1", "1 2 1 0.1"}));
  const auto exits = events_named(read_log(o.log_path), "exit");
  ASSERT_EQ(exits.size(), 2u);
  EXPECT_EQ(exits[0].at("exit_code"), 3);
  EXPECT_EQ(exits[1].at("exit_code"), 0);
  bool said = false;
  for (const auto& e : r.events) said = said || e.find("exited with code 3") != std::string::npos;
  EXPECT_TRUE(said);
}

TEST(Elastic, StoppedRankDeclaredDeadAndGroupKilled) {
  TempDir dir;
  // Attempt 0: rank 1 ignores SIGTERM and stops itself at step 3 (only SIGKILL ends it; it
  // ignores the SIGHUP the kernel sends an orphaned stopped group too); the other ranks would
  // run 100 steps (5 s). Attempt 1 is short and clean.
  auto o = fast_options(dir, write_worker(dir, 100, R"(
[[ $attempt == 1 ]] && steps=3
act() { if [[ $attempt == 0 && $1 == 1 && $2 == 3 ]]; then trap '' TERM HUP; kill -STOP $BASHPID; fi; }
)"));
  o.nproc = 3;
  o.max_restarts = 1;
  const auto r = run_elastic(o);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.restarts, 1);
  EXPECT_EQ(r.final_nproc, 3);
  const auto log = read_log(o.log_path);
  const auto dead = events_named(log, "dead_rank");
  ASSERT_EQ(dead.size(), 1u);
  EXPECT_EQ(dead[0].at("rank"), 1);
  EXPECT_EQ(dead[0].at("reason"), "silent");
  // Judged after the timeout, and promptly: timeout + a beat interval + a poll, with slack.
  EXPECT_GE(dead[0].at("age_s").get<double>(), 1.0);
  EXPECT_LE(dead[0].at("age_s").get<double>(), 2.0);
  const auto starts = events_named(log, "start");
  const auto teardown = events_named(log, "teardown");
  ASSERT_EQ(starts.size(), 2u);
  ASSERT_EQ(teardown.size(), 1u);
  EXPECT_TRUE(teardown[0].at("sigkill").get<bool>());  // SIGTERM was ignored
  const double attempt0_s = teardown[0].at("time").get<double>() - starts[0].at("time").get<double>();
  EXPECT_LT(attempt0_s, 3.0);  // well before the healthy ranks would have finished (5 s)
  // The stderr line names the rank, its pid, the silence and what happens next.
  bool said = false;
  for (const auto& e : r.events)
    said = said || (e.find("elastic: rank 1 (pid ") == 0 &&
                    e.find("silent for 1.") != std::string::npos &&
                    e.find("declared dead; tearing the job down") != std::string::npos);
  EXPECT_TRUE(said);
  // Nothing of attempt 0's group is left (the stopped rank included).
  const auto pgids = read_lines(dir.file("pgids.txt"));
  ASSERT_EQ(pgids.size(), 2u);
  EXPECT_EQ(pgids[0], std::to_string(starts[0].at("pid").get<int>()));
  EXPECT_EQ(live_in_group(pgids[0]), 0);
  for (const auto& line : read_lines(dir.file("rank_pids.txt"))) {
    std::istringstream in(line);
    std::string attempt, rank, pid;
    in >> attempt >> rank >> pid;
    EXPECT_FALSE(pid_alive(pid)) << "rank " << rank << " of attempt " << attempt;
  }
}

TEST(Elastic, VanishedRankDetectedByPid) {
  TempDir dir;
  // Rank 1 SIGKILLs itself on attempt 0; the job would only exit after 60 steps (3 s) and
  // the beat timeout (5 s) is longer still, so only the pid check can catch it this fast.
  auto o = fast_options(dir, write_worker(dir, 60, R"(
[[ $attempt == 1 ]] && steps=2
act() { if [[ $attempt == 0 && $1 == 1 && $2 == 2 ]]; then kill -KILL $BASHPID; fi; }
)"));
  o.heartbeat_timeout_s = 5.0;
  o.nproc = 2;
  o.max_restarts = 1;
  const auto r = run_elastic(o);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.restarts, 1);
  const auto log = read_log(o.log_path);
  const auto dead = events_named(log, "dead_rank");
  ASSERT_EQ(dead.size(), 1u);
  EXPECT_EQ(dead[0].at("rank"), 1);
  EXPECT_EQ(dead[0].at("reason"), "gone");
  const double attempt0_s = events_named(log, "teardown")[0].at("time").get<double>() -
                            events_named(log, "start")[0].at("time").get<double>();
  EXPECT_LT(attempt0_s, 2.5);
}

TEST(Elastic, MissingRankJudgedAfterStartupGrace) {
  TempDir dir;
  // Rank 1 never beats on attempt 0 (its beats go nowhere).
  auto o = fast_options(dir, write_worker(dir, 40, R"sh(
[[ $attempt == 1 ]] && steps=2
if [[ $attempt == 0 ]]; then
  eval "orig_$(declare -f beat)"
  beat() { [[ $1 == 1 ]] || orig_beat "$@"; }
fi
)sh"));
  o.startup_grace_s = 0.5;
  o.nproc = 2;
  o.max_restarts = 1;
  const auto r = run_elastic(o);
  EXPECT_EQ(r.exit_code, 0);
  const auto dead = events_named(read_log(o.log_path), "dead_rank");
  ASSERT_EQ(dead.size(), 1u);
  EXPECT_EQ(dead[0].at("rank"), 1);
  EXPECT_EQ(dead[0].at("reason"), "missing");
  EXPECT_GE(dead[0].at("age_s").get<double>(), 0.5);
  EXPECT_LT(dead[0].at("age_s").get<double>(), 1.5);
}

TEST(Elastic, ShrinksByTheDeadRanksDownToMinNproc) {
  TempDir dir;
  // Attempt 0: rank 2 of 4 stops (silent) -> restart with 3. Attempt 1: rank 0 exits 1 and
  // is gone while the job goes on -> drop one, but 3 is the floor -> 3 again. Attempt 2 is clean.
  auto o = fast_options(dir, write_worker(dir, 60, R"(
[[ $attempt == 2 ]] && steps=2
act() {
  if [[ $attempt == 0 && $1 == 2 && $2 == 2 ]]; then kill -STOP $BASHPID; fi
  if [[ $attempt == 1 && $1 == 0 && $2 == 1 ]]; then exit 1; fi
}
)"));
  o.nproc = 4;
  o.min_nproc = 3;
  o.max_restarts = 3;
  const auto r = run_elastic(o);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.restarts, 2);
  EXPECT_EQ(r.final_nproc, 3);
  EXPECT_EQ(read_lines(dir.file("calls.txt")),
            (std::vector<std::string>{"0 4 0 0.1", "1 3 1 0.1", "2 3 2 0.1"}));
  const auto restarts = events_named(read_log(o.log_path), "restart");
  ASSERT_EQ(restarts.size(), 2u);
  EXPECT_EQ(restarts[0].at("previous_nproc"), 4);
  EXPECT_EQ(restarts[0].at("nproc"), 3);
  EXPECT_EQ(restarts[1].at("nproc"), 3);
}

TEST(Elastic, ShrinksOnPlainFailureWithoutHeartbeats) {
  TempDir dir;
  auto o = fast_options(dir, write_worker(dir, 3, R"(
act() { if [[ $attempt == 0 && $1 == 0 ]]; then exit 2; fi; }
)"));
  o.heartbeat_timeout_s = 0;  // watching off: only the exit code counts
  o.nproc = 3;
  o.min_nproc = 1;
  o.max_restarts = 1;
  const auto r = run_elastic(o);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.final_nproc, 2);
}

TEST(Elastic, ShrinksByWholeReplicasOfTheModelParallelSize) {
  // tp2 x pp2 replicas of 4 ranks: one rank of 8 exits -> 4 ranks (one replica), not 7.
  TempDir dir;
  auto o = fast_options(dir, write_worker(dir, 3, R"(
act() { if [[ $attempt == 0 && $1 == 5 ]]; then exit 2; fi; }
)"));
  o.heartbeat_timeout_s = 0;
  o.nproc = 8;
  o.min_nproc = 4;
  o.max_restarts = 1;
  o.shrink_multiple = 4;
  const auto r = run_elastic(o);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.final_nproc, 4);
  o.min_nproc = 2;  // not a whole replica
  try {
    run_elastic(o);
    ADD_FAILURE() << "min_nproc 2 with replicas of 4 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiples of the model-parallel size tp x pp x cp = 4"),
              std::string::npos) << e.what();
  }
}

TEST(Elastic, GivesUpWithTheJobsExitCode) {
  TempDir dir;
  auto o = fast_options(dir, write_worker(dir, 3, "act() { if [[ $1 == 0 ]]; then exit 5; fi; }"));
  o.nproc = 2;
  o.max_restarts = 2;
  const auto r = run_elastic(o);
  EXPECT_EQ(r.exit_code, 5);
  EXPECT_EQ(r.restarts, 2);
  EXPECT_EQ(read_lines(dir.file("calls.txt")).size(), 3u);
  const auto give_up = events_named(read_log(o.log_path), "give_up");
  ASSERT_EQ(give_up.size(), 1u);
  EXPECT_EQ(give_up[0].at("exit_code"), 5);
  EXPECT_NE(r.events.back().find("2 restarts are used up; giving up with exit code 5"),
            std::string::npos)
      << r.events.back();
}

TEST(Elastic, SignalToSupervisorIsForwardedAndStopsRestarts) {
  TempDir dir;
  // The job's leader signals its parent (the supervisor) once the ranks run, then waits;
  // it notes the signal the supervisor forwards to it.
  const std::string worker = write_worker(
      dir, 100, "",
      R"(trap 'echo TERM >> "$W/signals.txt"; exit 7' TERM; sleep 0.2; kill -TERM $PPID)");
  auto o = fast_options(dir, worker);
  o.nproc = 2;
  o.max_restarts = 3;
  const auto r = run_elastic(o);
  EXPECT_TRUE(r.interrupted);
  EXPECT_EQ(r.exit_code, 128 + SIGTERM);
  EXPECT_EQ(r.restarts, 0);
  EXPECT_EQ(read_lines(dir.file("calls.txt")).size(), 1u);
  const auto pgids = read_lines(dir.file("pgids.txt"));
  ASSERT_EQ(pgids.size(), 1u);
  EXPECT_EQ(live_in_group(pgids[0]), 0);
  EXPECT_EQ(read_lines(dir.file("signals.txt")), std::vector<std::string>{"TERM"});
  // The handlers are restored: SIGTERM is back to its default disposition.
  struct sigaction sa {};
  sigaction(SIGTERM, nullptr, &sa);
  EXPECT_EQ(sa.sa_handler, SIG_DFL);
}

TEST(Elastic, BadOptionsAndCommandsThrow) {
  TempDir dir;
  auto o = fast_options(dir, write_worker(dir, 1, ""));
  o.nproc = 2;
  o.min_nproc = 3;
  EXPECT_THROW(run_elastic(o), Error);
  o.min_nproc = 0;
  o.heartbeat_interval_s = 2.0;  // not below the 1 s timeout
  EXPECT_THROW(run_elastic(o), Error);
  o.heartbeat_interval_s = 0.1;
  o.make_command = [](int, int) { return std::vector<std::string>{"/nonexistent/tessera-x"}; };
  try {
    run_elastic(o);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot start '/nonexistent/tessera-x'"),
              std::string::npos)
        << e.what();
  }
}

// ---- Heartbeat ----

TEST(Heartbeat, WritesBeatsStepAndExitMark) {
  TempDir dir;
  const std::string hb_dir = dir.file("hb");  // created by the constructor
  const double t0 = std::chrono::duration<double>(
                        std::chrono::system_clock::now().time_since_epoch()).count();
  {
    Heartbeat hb(hb_dir, 3, 0.05);
    ASSERT_TRUE(fs::exists(hb_dir + "/rank-3.json"));  // written before the constructor returns
    auto beats = read_heartbeats(hb_dir);
    ASSERT_EQ(beats.size(), 1u);
    EXPECT_EQ(beats[0].rank, 3);
    EXPECT_EQ(beats[0].pid, ::getpid());
    EXPECT_EQ(beats[0].step, -1);
    EXPECT_FALSE(beats[0].exited);
    EXPECT_GE(beats[0].time, t0);
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    EXPECT_EQ(beats[0].host, host);
    hb.set_step(7);
    bool stepped = false;
    for (int i = 0; i < 100 && !stepped; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      beats = read_heartbeats(hb_dir);
      stepped = beats.size() == 1 && beats[0].step == 7;
    }
    EXPECT_TRUE(stepped);
    // The thread keeps rewriting: the beat stays younger than a few intervals.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    beats = read_heartbeats(hb_dir);
    EXPECT_LT(beats.at(0).age_s, 0.2);
  }
  // Stopped: one last beat marked exited, then no more; its age grows.
  auto beats = read_heartbeats(hb_dir);
  ASSERT_EQ(beats.size(), 1u);
  EXPECT_TRUE(beats[0].exited);
  EXPECT_EQ(beats[0].step, 7);
  const json j = json::parse(std::ifstream(hb_dir + "/rank-3.json"));
  for (const char* key : {"rank", "pid", "host", "step", "time", "exited"})
    EXPECT_TRUE(j.contains(key)) << key;
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto later = read_heartbeats(hb_dir);
  EXPECT_EQ(later.at(0).time, beats[0].time);
  EXPECT_GE(later.at(0).age_s, 0.3);
  EXPECT_FALSE(fs::exists(hb_dir + "/rank-3.json.tmp"));
}

TEST(Heartbeat, FromEnv) {
  TempDir dir;
  ::unsetenv("TESSERA_HEARTBEAT_DIR");
  ::unsetenv("TESSERA_HEARTBEAT_INTERVAL");
  EXPECT_EQ(Heartbeat::from_env(0), nullptr);
  ::setenv("TESSERA_HEARTBEAT_DIR", dir.str().c_str(), 1);
  ::setenv("TESSERA_HEARTBEAT_INTERVAL", "abc", 1);
  try {
    Heartbeat::from_env(0);
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("TESSERA_HEARTBEAT_INTERVAL='abc'"), std::string::npos);
  }
  ::setenv("TESSERA_HEARTBEAT_INTERVAL", "0.05", 1);
  auto hb = Heartbeat::from_env(2);
  ASSERT_NE(hb, nullptr);
  EXPECT_EQ(hb->path(), dir.file("rank-2.json"));
  EXPECT_TRUE(fs::exists(dir.file("rank-2.json")));
  hb.reset();
  ::unsetenv("TESSERA_HEARTBEAT_DIR");
  ::unsetenv("TESSERA_HEARTBEAT_INTERVAL");
}

TEST(Heartbeat, ReaderSkipsForeignFilesAndClearKeepsThem) {
  TempDir dir;
  const double now = std::chrono::duration<double>(
                         std::chrono::system_clock::now().time_since_epoch()).count();
  std::ofstream(dir.file("rank-0.json")) << json{{"rank", 0}, {"pid", 42}, {"step", 5},
                                                 {"time", now - 10}}.dump();
  std::ofstream(dir.file("rank-1.json")) << "{\"rank\": 1, \"pid\":";   // torn
  std::ofstream(dir.file("rank-2.json")) << R"({"rank": "two"})";       // wrong type
  std::ofstream(dir.file("rank-4.json")) << R"({"rank": 5, "time": 1})";  // wrong name
  std::ofstream(dir.file("rank-x.json")) << R"({"rank": 0})";
  std::ofstream(dir.file("rank-3.json.tmp")) << R"({"rank": 3})";
  std::ofstream(dir.file("notes.txt")) << "keep me";
  const auto beats = read_heartbeats(dir.str());
  ASSERT_EQ(beats.size(), 1u);
  EXPECT_EQ(beats[0].rank, 0);
  EXPECT_EQ(beats[0].pid, 42);
  EXPECT_EQ(beats[0].step, 5);
  EXPECT_NEAR(beats[0].age_s, 10.0, 0.5);
  EXPECT_TRUE(read_heartbeats(dir.file("no-such-dir")).empty());
  clear_heartbeats(dir.str());
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir.str()))
    left.push_back(e.path().filename().string());
  EXPECT_EQ(left, std::vector<std::string>{"notes.txt"});
}

}  // namespace
}  // namespace tessera::train
