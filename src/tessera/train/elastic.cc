// The elastic supervisor: spawn an attempt in its own process group, poll its exit and the
// ranks' heartbeats, tear the group down on a failure, restart (maybe smaller) or give up.
#include "tessera/train/elastic.h"

#include <dirent.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/base/logging.h"
#include "tessera/train/heartbeat.h"

extern char** environ;

namespace tessera::train {
namespace {

using Json = nlohmann::json;

// Set by the handler, read by the poll loop: the only state a signal handler touches.
// g_signal_count tells a second SIGINT from the first (same g_signal).
volatile std::sig_atomic_t g_signal = 0;
volatile std::sig_atomic_t g_signal_count = 0;
void on_signal(int sig) {
  g_signal = sig;
  g_signal_count = g_signal_count + 1;
}

// Installs SIGINT/SIGTERM handlers for run_elastic's duration. No SA_RESTART, so a signal
// cuts the poll loop's sleep short.
class SignalGuard {
 public:
  SignalGuard() {
    g_signal = 0;
    g_signal_count = 0;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
  }
  ~SignalGuard() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }

 private:
  struct sigaction old_int_ {}, old_term_ {};
};

double mono_now() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

double unix_now() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

void sleep_s(double s) {
  if (s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(s));
}

std::string fmt1(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", v);
  return buf;
}

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

// waitpid status -> shell-style exit code (128 + N for signal N) and a phrase.
int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}
std::string describe_status(int status) {
  if (WIFSIGNALED(status)) return "was killed by " + signal_name(WTERMSIG(status));
  return "exited with code " + std::to_string(exit_code_of(status));
}

std::string join_command(const std::vector<std::string>& argv) {
  std::string s;
  for (const auto& a : argv) {
    if (!s.empty()) s += ' ';
    s += a.find_first_of(" \t'\"") == std::string::npos ? a : "'" + a + "'";
  }
  return s;
}

std::string this_host() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "";
  return buf;
}

// /proc/PID/stat -> (state, pgrp); false when the process is gone or unreadable.
bool read_proc_stat(const std::string& pid_dir, char* state, long* pgrp) {
  std::ifstream in("/proc/" + pid_dir + "/stat");
  std::string line;
  if (!std::getline(in, line)) return false;
  const size_t close = line.rfind(')');  // the command name may hold spaces and ')'
  if (close == std::string::npos) return false;
  long ppid = 0;
  return std::sscanf(line.c_str() + close + 1, " %c %ld %ld", state, &ppid, pgrp) == 3;
}

// True when a process with this pid runs (zombies count as gone: they are only unreaped).
bool process_exists(int64_t pid) {
  if (pid <= 0) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM) return false;
  char state = 0;
  long pgrp = 0;
  if (!read_proc_stat(std::to_string(pid), &state, &pgrp)) return true;  // no /proc: trust kill
  return state != 'Z' && state != 'X';
}

// True while any live (non-zombie) process is in process group pgid. kill(-pgid, 0) alone
// is not enough: orphaned zombies of the group linger until init reaps them.
bool group_alive(pid_t pgid) {
  if (::kill(-pgid, 0) != 0 && errno == ESRCH) return false;
  DIR* d = ::opendir("/proc");
  if (d == nullptr) return true;
  bool alive = false;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    char state = 0;
    long pgrp = 0;
    if (read_proc_stat(e->d_name, &state, &pgrp) && pgrp == pgid && state != 'Z' &&
        state != 'X') {
      alive = true;
      break;
    }
  }
  ::closedir(d);
  return alive;
}

// One line to stderr ("elastic: ..."), to the result's events, and as JSON to the log.
class EventLog {
 public:
  EventLog(std::string path, std::vector<std::string>* lines)
      : path_(std::move(path)), lines_(lines) {
    if (path_.empty()) return;
    const int fd = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) fail(path_, ": cannot open elastic log for appending: ", std::strerror(errno));
    ::close(fd);
  }

  void emit(const std::string& event, const std::string& message, Json fields = Json::object()) {
    const std::string line = "elastic: " + message;
    std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
    lines_->push_back(line);
    if (path_.empty()) return;
    Json rec = {{"time", unix_now()}, {"event", event}};
    rec.update(fields);
    rec["message"] = message;
    const std::string text = rec.dump() + "\n";
    // One write() per line on O_APPEND: a crash loses at most the line being written.
    const int fd = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0 || ::write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size()))
      TESSERA_LOG(kWarn, path_, ": elastic log line not written: ", std::strerror(errno));
    if (fd >= 0) ::close(fd);
  }

 private:
  std::string path_;
  std::vector<std::string>* lines_;
};

// Starts argv as the leader of a new process group with `env_set` added to (and replacing
// in) this process's environment and stdin on /dev/null (a job in a background group that
// read the terminal would be stopped by SIGTTIN).
pid_t spawn_job(const std::vector<std::string>& argv,
                const std::vector<std::pair<std::string, std::string>>& env_set,
                const std::vector<std::string>& env_unset) {
  std::vector<std::string> env_strings;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    bool replaced = std::find(env_unset.begin(), env_unset.end(), key) != env_unset.end();
    for (const auto& [k, v] : env_set) replaced = replaced || k == key;
    if (!replaced) env_strings.push_back(kv);
  }
  for (const auto& [k, v] : env_set) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp, args;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (auto& s : argv_copy) args.push_back(s.data());
  args.push_back(nullptr);

  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setpgroup(&attr, 0);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGINT);  // our handlers do not survive exec, but an ignored
  sigaddset(&defaults, SIGTERM); // SIGINT (`cmd &` in a script) would: the job must obey us
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK |
                                      POSIX_SPAWN_SETSIGDEF);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  pid_t pid = 0;
  const int err = ::posix_spawnp(&pid, args[0], &fa, &attr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  if (err != 0) fail("elastic: cannot start '", argv[0], "': ", std::strerror(err));
  return pid;
}

// Ends every process of the job's group: `first` (SIGTERM, or the signal the user sent us)
// plus SIGCONT so a stopped process can act on it, then SIGKILL after kill_grace_s (at once
// when the user signals again). Reaps the leader. Returns whether SIGKILL was needed.
bool tear_down(pid_t pgid, bool* leader_reaped, int* leader_status, int first,
               double kill_grace_s) {
  auto reap = [&] {
    if (*leader_reaped) return;
    int st = 0;
    if (::waitpid(pgid, &st, WNOHANG) == pgid) {
      *leader_reaped = true;
      *leader_status = st;
    }
  };
  auto wait_gone = [&](double limit_s, bool stop_on_signal) {
    const double deadline = mono_now() + limit_s;
    const std::sig_atomic_t signals_before = g_signal_count;
    while (true) {
      reap();
      if (!group_alive(pgid)) return true;
      if (mono_now() >= deadline) return false;
      if (stop_on_signal && g_signal_count != signals_before) return false;  // asked again
      sleep_s(0.02);
    }
  };
  ::kill(-pgid, first);
  ::kill(-pgid, SIGCONT);
  bool killed = false;
  if (!wait_gone(kill_grace_s, true)) {
    ::kill(-pgid, SIGKILL);
    killed = true;
    if (!wait_gone(10, false))
      TESSERA_LOG(kWarn, "elastic: processes of group ", pgid, " survive SIGKILL");
  }
  if (!*leader_reaped) {
    int st = 0;
    while (::waitpid(pgid, &st, 0) < 0 && errno == EINTR) {
    }
    *leader_reaped = true;
    *leader_status = st;
  }
  return killed;
}

// A rank the watcher declares dead, with the line that says why.
struct DeadRank {
  int rank;
  int64_t pid;
  std::string reason;   // "silent", "gone", "missing"
  double age_s;         // seconds since its beat last changed (since the start when missing)
  std::string message;
};

// Tracks when each rank's beat last changed, on this process's monotonic clock, so clock
// skew between hosts (or a shared filesystem's server clock) cannot fake or hide a death.
class HeartbeatWatch {
 public:
  HeartbeatWatch(const ElasticOptions& o, int nproc, double start)
      : o_(o), start_(start), host_(this_host()), seen_(nproc) {}

  std::vector<DeadRank> check(double now) {
    for (const RankBeat& b : read_heartbeats(o_.heartbeat_dir)) {
      if (b.rank < 0 || b.rank >= static_cast<int>(seen_.size())) continue;
      Seen& s = seen_[b.rank];
      if (!s.seen || b.time != s.beat.time || b.mtime_ns != s.beat.mtime_ns ||
          b.step != s.beat.step || b.exited != s.beat.exited)
        s.changed_at = now;
      s.seen = true;
      s.beat = b;
    }
    std::vector<DeadRank> dead;
    for (int r = 0; r < static_cast<int>(seen_.size()); ++r) {
      Seen& s = seen_[r];
      const std::string who = "rank " + std::to_string(r);
      if (!s.seen) {
        if (now - start_ > o_.startup_grace_s)
          dead.push_back({r, 0, "missing", now - start_,
                          who + " sent no heartbeat within " + fmt1(o_.startup_grace_s) +
                              " s of the start: declared dead"});
        continue;
      }
      if (s.beat.exited) continue;  // ended in an orderly way; the job's exit code tells
      const std::string who_pid = who + " (pid " + std::to_string(s.beat.pid) + ")";
      const double age = now - s.changed_at;
      // Only a pid on this host can be checked; a remote one would name some local process.
      // A rank that just ended is given kGoneGrace for the job to exit by itself, which
      // mpirun does within moments of losing a rank, so the job's own exit code is kept.
      if (s.beat.pid > 0 && !s.beat.host.empty() && s.beat.host == host_ &&
          !process_exists(s.beat.pid)) {
        if (s.gone_since < 0) s.gone_since = now;
        const double grace = std::min(kGoneGrace, o_.heartbeat_timeout_s);
        if (now - s.gone_since >= grace)
          dead.push_back({r, s.beat.pid, "gone", age,
                          who_pid + " no longer exists (for " + fmt1(now - s.gone_since) +
                              " s, the job goes on): declared dead"});
      } else if (age > o_.heartbeat_timeout_s) {
        dead.push_back({r, s.beat.pid, "silent", age,
                        who_pid + " silent for " + fmt1(age) + " s: declared dead"});
      }
    }
    return dead;
  }

 private:
  struct Seen {
    bool seen = false;
    RankBeat beat;
    double changed_at = 0;
    double gone_since = -1;  // when its process was first found gone; -1 while it runs
  };
  static constexpr double kGoneGrace = 1.0;  // seconds
  const ElasticOptions& o_;
  double start_;
  std::string host_;
  std::vector<Seen> seen_;
};

void check_options(const ElasticOptions& o) {
  TESSERA_CHECK(o.nproc >= 1, "elastic: --nproc must be >= 1, got ", o.nproc);
  TESSERA_CHECK(o.min_nproc >= 0 && o.min_nproc <= o.nproc, "elastic: --min-nproc ", o.min_nproc,
                " must be between 0 (never shrink) and --nproc ", o.nproc);
  TESSERA_CHECK(o.shrink_multiple >= 1 && o.nproc % o.shrink_multiple == 0 &&
                    o.min_nproc % o.shrink_multiple == 0,
                "elastic: --nproc ", o.nproc, " and --min-nproc ", o.min_nproc,
                " must be multiples of the model-parallel size tp x pp x cp = ", o.shrink_multiple,
                " (the world shrinks by whole data-parallel replicas)");
  TESSERA_CHECK(o.max_restarts >= 0, "elastic: --max-restarts must be >= 0, got ",
                o.max_restarts);
  TESSERA_CHECK(static_cast<bool>(o.make_command), "elastic: no command to run (make_command)");
  TESSERA_CHECK(o.poll_interval_s > 0, "elastic: poll interval must be > 0 s, got ",
                o.poll_interval_s);
  TESSERA_CHECK(o.kill_grace_s >= 0, "elastic: kill grace must be >= 0 s, got ", o.kill_grace_s);
  if (o.heartbeat_timeout_s > 0) {
    TESSERA_CHECK(!o.heartbeat_dir.empty(), "elastic: heartbeat timeout ",
                  o.heartbeat_timeout_s, " s set but no heartbeat directory");
    TESSERA_CHECK(o.heartbeat_interval_s > 0 && o.heartbeat_interval_s < o.heartbeat_timeout_s,
                  "elastic: heartbeat interval ", o.heartbeat_interval_s,
                  " s must be > 0 and below the timeout ", o.heartbeat_timeout_s, " s");
  }
}

// How one attempt ended.
struct AttemptEnd {
  int exit_code = 0;
  std::vector<DeadRank> dead;  // non-empty when the watcher tore the job down
  int user_signal = 0;         // SIGINT/SIGTERM the supervisor got and forwarded
};

AttemptEnd run_attempt(const ElasticOptions& o, int attempt, int nproc, EventLog& log) {
  const bool watch = o.heartbeat_timeout_s > 0;
  if (!o.heartbeat_dir.empty()) clear_heartbeats(o.heartbeat_dir);
  const std::vector<std::string> argv = o.make_command(nproc, attempt);
  TESSERA_CHECK(!argv.empty() && !argv[0].empty(), "elastic: empty command for attempt ",
                attempt);
  std::ostringstream interval;
  interval << o.heartbeat_interval_s;
  std::vector<std::pair<std::string, std::string>> env = {
      {kElasticAttemptEnv, std::to_string(attempt)}};
  std::vector<std::string> unset;
  if (!o.heartbeat_dir.empty()) {
    env.push_back({kHeartbeatDirEnv, o.heartbeat_dir});
    env.push_back({kHeartbeatIntervalEnv, interval.str()});
  } else {
    unset = {kHeartbeatDirEnv, kHeartbeatIntervalEnv};  // not an outer supervisor's directory
  }
  const double start = mono_now();
  const pid_t pid = spawn_job(argv, env, unset);
  log.emit("start",
           "attempt " + std::to_string(attempt) + ": started " + std::to_string(nproc) +
               (nproc == 1 ? " rank" : " ranks") + " (pid " + std::to_string(pid) +
               "): " + join_command(argv),
           {{"attempt", attempt}, {"nproc", nproc}, {"pid", pid}, {"command", argv}});

  HeartbeatWatch watcher(o, nproc, start);
  AttemptEnd end;
  bool reaped = false;
  int status = 0;
  auto elapsed = [&] { return fmt1(mono_now() - start); };
  try {
    while (true) {
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        reaped = true;
        end.exit_code = exit_code_of(status);
        log.emit("exit",
                 "attempt " + std::to_string(attempt) + ": job " + describe_status(status) +
                     " after " + elapsed() + " s",
                 {{"attempt", attempt}, {"exit_code", end.exit_code}});
        break;
      }
      if (const int sig = g_signal; sig != 0) {
        end.user_signal = sig;
        log.emit("interrupted",
                 "got " + signal_name(sig) + ": forwarding it to the job and not restarting",
                 {{"attempt", attempt}, {"signal", signal_name(sig)}});
        tear_down(pid, &reaped, &status, sig, o.kill_grace_s);
        end.exit_code = 128 + sig;
        return end;
      }
      if (watch) end.dead = watcher.check(mono_now());
      if (!end.dead.empty()) {
        for (const DeadRank& d : end.dead) {
          const bool last = &d == &end.dead.back();
          log.emit("dead_rank", d.message + (last ? "; tearing the job down" : ""),
                   {{"attempt", attempt}, {"rank", d.rank}, {"pid", d.pid},
                    {"reason", d.reason}, {"age_s", d.age_s}});
        }
        const bool killed = tear_down(pid, &reaped, &status, SIGTERM, o.kill_grace_s);
        end.exit_code = 1;
        log.emit("teardown",
                 "attempt " + std::to_string(attempt) + ": job torn down after " + elapsed() +
                     " s" + (killed ? " (SIGKILL needed)" : ""),
                 {{"attempt", attempt}, {"sigkill", killed}});
        return end;
      }
      sleep_s(o.poll_interval_s);
    }
    // The leader exited; ranks it left behind must not live into the next attempt.
    if (group_alive(pid)) {
      log.emit("stragglers",
               "attempt " + std::to_string(attempt) +
                   ": processes of the job outlived it; terminating them",
               {{"attempt", attempt}});
      tear_down(pid, &reaped, &status, SIGTERM, o.kill_grace_s);
    }
  } catch (...) {
    if (!reaped) tear_down(pid, &reaped, &status, SIGKILL, 0);
    throw;
  }
  return end;
}

}  // namespace

ElasticResult run_elastic(const ElasticOptions& o) {
  check_options(o);
  ElasticResult result;
  EventLog log(o.log_path, &result.events);
  SignalGuard signals;
  const int min_nproc = o.min_nproc > 0 ? o.min_nproc : o.nproc;
  int nproc = o.nproc;
  // A signal that came between attempts (or during a teardown): no restart.
  auto stop_for_signal = [&] {
    result.interrupted = true;
    result.exit_code = 128 + g_signal;
    log.emit("interrupted", "got " + signal_name(g_signal) + ": not restarting",
             {{"signal", signal_name(g_signal)}});
    return result;
  };
  for (int attempt = 0;; ++attempt) {
    result.final_nproc = nproc;
    const AttemptEnd end = run_attempt(o, attempt, nproc, log);
    result.exit_code = end.exit_code;
    if (end.user_signal != 0) {
      result.interrupted = true;
      return result;
    }
    if (end.exit_code == 0) {
      log.emit("done",
               "job finished (exit code 0) after " + std::to_string(result.restarts) +
                   (result.restarts == 1 ? " restart" : " restarts"),
               {{"exit_code", 0}, {"restarts", result.restarts}, {"nproc", nproc}});
      return result;
    }
    if (g_signal != 0) return stop_for_signal();
    if (result.restarts >= o.max_restarts) {
      log.emit("give_up",
               "job failed and " + std::to_string(o.max_restarts) +
                   (o.max_restarts == 1 ? " restart is" : " restarts are") +
                   " used up; giving up with exit code " + std::to_string(end.exit_code),
               {{"exit_code", end.exit_code}, {"restarts", result.restarts}});
      return result;
    }
    // Drop the ranks found dead, or one when the job only exited non-zero (which rank failed
    // is not known then; only the count matters, ranks are renumbered on restart).
    const int drop = std::max<int>(1, static_cast<int>(end.dead.size()));
    // Whole data-parallel replicas: round down to the model-parallel size.
    const int k = o.shrink_multiple;
    const int next = std::max(min_nproc, std::min(nproc, (nproc - drop) / k * k));
    ++result.restarts;
    log.emit("restart",
             "restarting (restart " + std::to_string(result.restarts) + " of " +
                 std::to_string(o.max_restarts) + ") with " + std::to_string(next) +
                 (next == 1 ? " rank" : " ranks") +
                 (next != nproc ? " (was " + std::to_string(nproc) + ")" : "") +
                 " from the latest checkpoint",
             {{"restart", result.restarts}, {"max_restarts", o.max_restarts}, {"nproc", next},
              {"previous_nproc", nproc}});
    nproc = next;
    const double resume_at = mono_now() + o.restart_delay_s;
    while (g_signal == 0 && mono_now() < resume_at) sleep_s(std::min(0.05, o.restart_delay_s));
    if (g_signal != 0) return stop_for_signal();
  }
}

}  // namespace tessera::train
