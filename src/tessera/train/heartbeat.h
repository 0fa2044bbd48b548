// Rank liveness for the elastic supervisor (elastic.h): each rank rewrites a small JSON file
// DIR/rank-<r>.json from a background thread; the supervisor reads the files back.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace tessera::train {

// Environment a supervisor sets for the job it starts (run_elastic) and Heartbeat::from_env reads.
inline constexpr const char* kHeartbeatDirEnv = "TESSERA_HEARTBEAT_DIR";
inline constexpr const char* kHeartbeatIntervalEnv = "TESSERA_HEARTBEAT_INTERVAL";  // seconds
inline constexpr const char* kElasticAttemptEnv = "TESSERA_ELASTIC_ATTEMPT";        // 0, 1, ...

// "DIR/rank-<r>.json".
std::string heartbeat_path(const std::string& dir, int rank);

// One rank's beat. The file holds {"rank","pid","host","step","time"} (time: Unix seconds,
// fractional), plus "exited": true in the last beat the destructor writes. It is replaced by
// an atomic tmp + rename, so a reader sees a whole beat, never a torn one.
//
// The thread beats while the process lives, even when the training loop is stuck in a hung
// collective: a beat means "the process runs", the step means "training progresses".
class Heartbeat {
 public:
  // Creates `dir` if needed, writes the first beat (throws tessera::Error naming the file if
  // it cannot), then starts the thread that rewrites it every interval_s.
  Heartbeat(std::string dir, int rank, double interval_s = 1.0);
  // Stops the thread and writes a last beat with "exited": true, so a supervisor does not
  // take the process's end for a crash; what the process exits with tells the rest.
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  // Progress (optimizer steps done); written with the next beat.
  void set_step(int64_t step) { step_.store(step, std::memory_order_relaxed); }
  const std::string& path() const { return path_; }

  // From the environment a supervisor sets: TESSERA_HEARTBEAT_DIR (nullptr when unset or
  // empty) and TESSERA_HEARTBEAT_INTERVAL (seconds, default 1; a bad value throws naming it).
  static std::unique_ptr<Heartbeat> from_env(int rank);

 private:
  void write_beat(bool exited);  // throws tessera::Error
  void run();

  std::string dir_;
  std::string path_;
  int rank_;
  double interval_s_;
  std::string host_;
  std::atomic<int64_t> step_{-1};  // -1: no step reported yet
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // guarded by mu_
  bool warned_ = false;  // one warning for failed background writes, not one per beat
  std::thread thread_;
};

// What a supervisor reads back. age_s: seconds from the beat's "time" to now (the file's
// modification time when the beat has no "time"); it trusts the rank's clock, so across hosts
// it is only as good as their clock sync; run_elastic instead times how long a file has not
// changed, on its own clock.
struct RankBeat {
  int rank = 0;
  int64_t pid = 0;      // 0 when the beat has none
  int64_t step = -1;    // -1 when no step was reported
  double time = 0;      // the beat's "time" (Unix seconds), 0 when absent
  double age_s = 0;
  std::string host;     // "" when the beat has none
  bool exited = false;  // the rank's Heartbeat was destroyed (orderly end of the process)
  int64_t mtime_ns = 0; // file modification time, ns since the epoch
};

// All readable DIR/rank-<r>.json beats, sorted by rank. A missing directory gives none; a
// file that is not a beat (bad JSON, no "rank") is skipped: the supervisor must not die of it.
std::vector<RankBeat> read_heartbeats(const std::string& dir);

// Removes the beat files (rank-*.json and their temporaries) from dir and creates dir if
// missing; leaves any other file alone. The supervisor calls it before each attempt.
void clear_heartbeats(const std::string& dir);

}  // namespace tessera::train
