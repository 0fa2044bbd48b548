// `tessera train --config run.toml [--resume] [--nproc N --max-restarts R --min-nproc M]`:
// one process, or (with --nproc / --hosts) an elastic supervisor around `mpirun`.
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <csignal>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <cstdio>

#include "tessera/base/error.h"
#include "tessera/cli/commands.h"
#include "tessera/infer/kv_pool.h"
#include "tessera/plan/run_memory.h"
#include "tessera/plan/train_layout.h"
#include "tessera/train/elastic.h"
#include "tessera/train/trainer.h"
#include "tessera/train/trainer_setup.h"

namespace tessera::cli {
namespace {

struct Flags {
  std::string config;
  bool resume = false;
  int64_t stop_after = -1;
  std::string trace;
  int nproc = 0;
  int max_restarts = 0;
  int min_nproc = 0;
  std::string hosts;
  double heartbeat_timeout = 60;
  double heartbeat_interval = 1;
  std::string mpirun = "mpirun";
  bool print_schedule = false;
  std::string layout;
  double memory_limit_mb = -1;  // < 0: the config's [training] memory_limit_mb
  bool no_memory_check = false;
};

// Ctrl-C: the run stops at once (checkpoints are written atomically, so the latest one is
// whole) and says how to go on from it.
char g_interrupt_message[1024];
void on_interrupt(int) {
  const ssize_t n = ::write(2, g_interrupt_message, std::strlen(g_interrupt_message));
  (void)n;
  ::_exit(130);
}
void print_resume_hint_on_interrupt(const std::string& config_path, const std::string& out_dir) {
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");  // under mpirun rank 0 says it once
  if (rank && std::atoi(rank) != 0) return;
  std::snprintf(g_interrupt_message, sizeof g_interrupt_message,
                "\ntrain: interrupted; continue from the latest checkpoint in %s/checkpoints with:\n"
                "  tessera train --config %s --resume\n",
                out_dir.c_str(), config_path.c_str());
  std::signal(SIGINT, on_interrupt);
}

// The planner's estimate of a rank's bytes against this machine's free memory; a run that
// cannot fit ends here with the key to change (issue 22: it died with "out of memory
// allocating N bytes" or the OOM killer).
void check_memory(const train::TrainConfig& config, const model::ModelConfig& model, int64_t world,
                  int64_t local_ranks) {
  if (config.lora.enabled) return;  // the model's states are the adapters': the model over-counts
  const double available = static_cast<double>(infer::available_memory_bytes());
  if (available <= 0) return;  // unknown here
  const auto r = plan::estimate_run_memory(config, model, world, local_ranks, available);
  if (auto e = plan::run_memory_error(config, r)) fail(*e);
}

std::string self_path() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  TESSERA_CHECK(n > 0, "train: cannot find this program's path (/proc/self/exe)");
  return std::string(buf, static_cast<size_t>(n));
}

// The supervisor: each attempt is `mpirun -np N [--host H] tessera train --config C`,
// resuming from the latest checkpoint after the first (docs/elastic.md).
int run_supervised(const Flags& f, const train::TrainConfig& config) {
  const int nproc = f.nproc > 0 ? f.nproc : 1;
  TESSERA_CHECK(f.min_nproc >= 0 && f.min_nproc <= nproc, "--min-nproc ", f.min_nproc,
                " must be in [1, --nproc ", nproc, "]");
  TESSERA_CHECK(f.max_restarts >= 0, "--max-restarts must not be negative");
  // A configuration error is deterministic: it ends the job here, once, instead of every
  // rank repeating it under mpirun and the supervisor restarting it. So does a run that
  // cannot fit in memory.
  const model::ModelConfig model = train::check_run(config, nproc);
  if (!f.no_memory_check) {
    const int64_t hosts = f.hosts.empty() ? 1 : 1 + std::count(f.hosts.begin(), f.hosts.end(), ',');
    check_memory(config, model, nproc, (nproc + hosts - 1) / hosts);
  }
  const std::string exe = self_path();
  std::filesystem::create_directories(config.out_dir);
  train::ElasticOptions o;
  o.nproc = nproc;
  o.min_nproc = f.min_nproc;
  o.max_restarts = f.max_restarts;
  o.shrink_multiple =
      static_cast<int>(config.parallel.tp * config.parallel.pp * config.parallel.cp * config.parallel.ep);
  o.heartbeat_timeout_s = f.heartbeat_timeout;
  o.heartbeat_interval_s = f.heartbeat_interval;
  o.heartbeat_dir = config.out_dir + "/heartbeats";
  o.log_path = config.out_dir + "/elastic.jsonl";
  o.make_command = [f, exe](int n, int attempt) {
    std::vector<std::string> argv = {f.mpirun};
    if (::geteuid() == 0) argv.push_back("--allow-run-as-root");
    if (f.hosts.empty()) argv.push_back("--oversubscribe");  // ranks may outnumber cores here
    argv.insert(argv.end(), {"-np", std::to_string(n)});
    if (!f.hosts.empty()) argv.insert(argv.end(), {"--host", f.hosts});
    argv.insert(argv.end(), {exe, "train", "--config", f.config});
    if (f.resume || attempt > 0) argv.push_back("--resume");
    if (!f.trace.empty()) argv.insert(argv.end(), {"--trace", f.trace});
    if (!f.layout.empty()) argv.insert(argv.end(), {"--layout", f.layout});
    if (f.memory_limit_mb >= 0) argv.insert(argv.end(), {"--memory-limit", std::to_string(f.memory_limit_mb)});
    argv.push_back("--no-memory-check");  // checked (or waived) here, once
    return argv;
  };
  const train::ElasticResult r = train::run_elastic(o);
  std::printf("elastic: %s after %d restart%s on %d rank%s\n",
              r.exit_code == 0 ? "finished" : "failed", r.restarts, r.restarts == 1 ? "" : "s",
              r.final_nproc, r.final_nproc == 1 ? "" : "s");
  if (r.exit_code == 0) std::printf("model: %s/model\n", config.out_dir.c_str());
  return r.exit_code;
}

}  // namespace

void add_train(CLI::App& app, Action& action) {
  auto f = std::make_shared<Flags>();
  auto* cmd = app.add_subcommand("train", "Train a model as a TOML run config says (docs/training.md)");
  cmd->add_option("--config", f->config, "Run config (configs/*.toml)")->required();
  cmd->add_flag("--resume", f->resume, "Continue from OUT_DIR/checkpoints/latest");
  cmd->add_option("--trace", f->trace, "Write a Chrome trace (Perfetto) of the run to this file");
  cmd->add_option("--stop-after", f->stop_after,
                  "Stop after this many steps without the final save, as if killed (for tests)");
  cmd->add_option("--nproc", f->nproc,
                  "Data-parallel ranks: run under an elastic supervisor that starts "
                  "`mpirun -np N` (docs/distributed.md)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--max-restarts", f->max_restarts,
                  "Restart the job from its latest checkpoint this many times when a rank dies "
                  "or hangs (docs/elastic.md)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--min-nproc", f->min_nproc,
                  "Restart with fewer ranks, down to this many, when ranks are lost")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--hosts", f->hosts, "Hosts for mpirun --host (a:2,b:2); default this machine");
  cmd->add_option("--heartbeat-timeout", f->heartbeat_timeout,
                  "Seconds without a heartbeat before a rank is declared dead (default 60)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--heartbeat-interval", f->heartbeat_interval,
                  "Seconds between a rank's heartbeats (default 1; below --heartbeat-timeout)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--mpirun", f->mpirun, "The mpirun program to launch ranks with");
  cmd->add_option("--memory-limit", f->memory_limit_mb,
                  "Per-rank memory budget in MiB, checked after the first step ([training] memory_limit_mb; "
                  "0 = none)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--layout", f->layout,
                  "Parallel layout in tessera plan train's spelling (dp=2,tp=2,pp=2,zero=1,mb=2,"
                  "recompute=selective,sp=on,sched=1f1b,vpp=1): overrides [parallel]")
      ->check([](const std::string& s) { return s.empty() ? std::string("--layout is empty") : std::string(); });
  cmd->add_flag("--no-memory-check", f->no_memory_check,
                "Start even when the planner's memory model says the run does not fit in this machine's free memory");
  cmd->add_flag("--print-schedule", f->print_schedule,
                "Print the pipeline schedule (passes per rank, stage layers, bubble) and exit");
  cmd->callback([f, &action] {
    action = [f] {
      auto config = train::TrainConfig::load(f->config);
      if (!f->trace.empty()) config.logging.trace = f->trace;
      if (f->memory_limit_mb >= 0) config.training.memory_limit_mb = f->memory_limit_mb;
      if (!f->layout.empty()) {
        // The world: mpirun's, or --nproc's for the supervisor; one process otherwise.
        int64_t world = f->nproc;
        if (const char* n = std::getenv("OMPI_COMM_WORLD_SIZE"); n && *n) world = std::atoll(n);
        plan::apply_layout(plan::parse_layout(f->layout, plan::layout_devices(f->layout, world)), config);
      }
      if (f->print_schedule) {
        std::fputs(train::pipeline_schedule_text(config).c_str(), stdout);
        return 0;
      }
      if (config.data.format == "chat" && !config.data.path.empty()) {
        // The conversations are rendered here (the chat template is the serve layer's).
        ChatPrepareOptions c;
        c.jsonl = config.data.path;
        c.tokenizer_dir = config.data.tokenizer.empty() ? config.model.init_from : config.data.tokenizer;
        c.out_dir = config.data.dir;
        c.val_fraction = config.data.val_fraction;
        const auto r = prepare_chat_data(c);
        if (!r.reused || !f->resume) std::fprintf(stderr, "train: %s\n", describe_chat_data(r).c_str());
      }
      if (f->nproc > 0 || !f->hosts.empty() || f->max_restarts > 0) {
        TESSERA_CHECK(f->stop_after < 0, "--stop-after cannot be combined with --nproc");
        return run_supervised(*f, config);
      }
      if (!f->no_memory_check) {  // one process, or a rank under mpirun
        const char* ws = std::getenv("OMPI_COMM_WORLD_SIZE");
        const char* ls = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
        const int64_t world = ws && *ws ? std::atoll(ws) : 1, local = ls && *ls ? std::atoll(ls) : world;
        check_memory(config, train::check_run(config, world), world, local);
      }
      print_resume_hint_on_interrupt(f->config, config.out_dir);
      train::TrainOptions o;
      o.resume = f->resume;
      o.stop_after = f->stop_after;
      const auto r = train::run_training(config, o);
      if (r.rank != 0) return 0;  // rank 0 reports for the job
      if (r.already_finished) {
        std::printf("train: %s already finished its %lld steps; nothing to do (raise [training] steps to "
                    "train on, or choose another [run] out_dir)\n",
                    config.out_dir.c_str(), static_cast<long long>(r.start_step));
        return 0;
      }
      std::printf("trained steps %lld..%lld in %.1f s: final loss %.4f", static_cast<long long>(r.start_step),
                  static_cast<long long>(r.start_step + r.steps_run), r.seconds, r.final_loss);
      if (r.val_loss >= 0) std::printf(", val loss %.4f", r.val_loss);
      std::printf("\n");
      if (!r.model_dir.empty()) std::printf("model: %s\n", r.model_dir.c_str());
      if (!r.svg_path.empty()) std::printf("loss curve: %s\n", r.svg_path.c_str());
      if (!r.trace_path.empty()) std::printf("trace: %s\n", r.trace_path.c_str());
      return 0;
    };
  });
}

}  // namespace tessera::cli
