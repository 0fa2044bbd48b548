// `tessera train --config run.toml [--resume]`.
#include <cstdio>

#include "tessera/cli/commands.h"
#include "tessera/train/trainer.h"

namespace tessera::cli {

void add_train(CLI::App& app, Action& action) {
  struct Flags {
    std::string config;
    bool resume = false;
    int64_t stop_after = -1;
    std::string trace;
  };
  auto f = std::make_shared<Flags>();
  auto* cmd = app.add_subcommand("train", "Train a model as a TOML run config says (docs/training.md)");
  cmd->add_option("--config", f->config, "Run config (configs/*.toml)")->required();
  cmd->add_flag("--resume", f->resume, "Continue from OUT_DIR/checkpoints/latest");
  cmd->add_option("--trace", f->trace, "Write a Chrome trace (Perfetto) of the run to this file");
  cmd->add_option("--stop-after", f->stop_after,
                  "Stop after this many steps without the final save, as if killed (for tests)");
  cmd->callback([f, &action] {
    action = [f] {
      auto config = train::TrainConfig::load(f->config);
      if (!f->trace.empty()) config.logging.trace = f->trace;
      train::TrainOptions o;
      o.resume = f->resume;
      o.stop_after = f->stop_after;
      const auto r = train::run_training(config, o);
      std::printf("trained steps %lld..%lld in %.1f s: final loss %.4f", static_cast<long long>(r.start_step),
                  static_cast<long long>(r.start_step + r.steps_run), r.seconds, r.final_loss);
      if (r.val_loss >= 0) std::printf(", val loss %.4f", r.val_loss);
      std::printf("\n");
      if (!r.model_dir.empty()) std::printf("model: %s\n", r.model_dir.c_str());
      if (!r.svg_path.empty()) std::printf("loss curve: %s\n", r.svg_path.c_str());
      if (!config.logging.trace.empty()) std::printf("trace: %s\n", config.logging.trace.c_str());
      return 0;
    };
  });
}

}  // namespace tessera::cli
