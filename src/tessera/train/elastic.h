// Elastic job supervisor behind `tessera train --max-restarts`: runs the training job in its
// own process group, watches its exit and its ranks' heartbeats (heartbeat.h), tears it down
// when a rank dies or goes silent, and restarts it from the latest checkpoint. docs/elastic.md.
#pragma once
#include <functional>
#include <string>
#include <vector>

namespace tessera::train {

struct ElasticOptions {
  int nproc = 1;         // world size of the first attempt
  int min_nproc = 0;     // 0: same as nproc (never shrink); else restarts may shrink down to it
  int max_restarts = 0;  // restarts after the first attempt; 0: fail on the first failure
  // The world shrinks by whole data-parallel replicas: multiples of this (the model-parallel
  // size tp x pp x cp of the layout; nproc and min_nproc must be multiples of it).
  int shrink_multiple = 1;
  // A rank whose beat has not changed for this long is declared dead. <= 0: heartbeats are
  // not watched (failures are then seen only as the job's exit).
  double heartbeat_timeout_s = 60;
  double heartbeat_interval_s = 1;  // handed to the ranks as TESSERA_HEARTBEAT_INTERVAL
  double startup_grace_s = 120;     // a rank that has not beaten yet is not judged before this
  double poll_interval_s = 0.2;
  double kill_grace_s = 5;          // SIGTERM to the job's group, then SIGKILL after this
  double restart_delay_s = 1;       // pause before a restart (lets ports and GPUs free up)
  std::string heartbeat_dir;        // e.g. OUT/heartbeats; its beat files are cleared per attempt
  // argv of one attempt from (world size, attempt number, 0 first). The CLI builds
  // `mpirun -np N ... tessera train --config C [--resume]`; attempts > 0 must resume.
  std::function<std::vector<std::string>(int nproc, int attempt)> make_command;
  std::string log_path;  // appends one JSON object per event (see docs/elastic.md); "" none
};

struct ElasticResult {
  // 0 when an attempt exited 0. After a failure with no restarts left: the job's exit code
  // (128 + N when killed by signal N), or 1 when the supervisor tore it down (dead rank).
  // After SIGINT/SIGTERM to the supervisor: 128 + that signal.
  int exit_code = 0;
  int restarts = 0;          // attempts started after the first
  int final_nproc = 0;       // world size of the last attempt
  bool interrupted = false;  // stopped by SIGINT/SIGTERM to the supervisor
  std::vector<std::string> events;  // the lines printed to stderr, in order
};

// Runs attempts until one exits 0, restarts are used up, or the supervisor gets SIGINT or
// SIGTERM (forwarded to the job's group; no restart follows). Each attempt's process is
// started with TESSERA_HEARTBEAT_DIR, TESSERA_HEARTBEAT_INTERVAL and TESSERA_ELASTIC_ATTEMPT
// in its environment and stdin on /dev/null, as the leader of a new process group; every
// process of that group is gone (SIGTERM, then SIGKILL) before the next attempt starts.
// Installs SIGINT/SIGTERM handlers for its duration (restored on return), so one run_elastic
// at a time per process. Throws tessera::Error for bad options or a command that cannot start.
ElasticResult run_elastic(const ElasticOptions& o);

}  // namespace tessera::train
