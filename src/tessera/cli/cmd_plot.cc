// `tessera plot RUN_DIR`: the loss / learning-rate / grad-norm SVG of a run's metrics.jsonl.
#include <cstdio>
#include <filesystem>
#include <memory>

#include "tessera/base/error.h"
#include "tessera/cli/commands.h"
#include "tessera/io/json_file.h"
#include "tessera/train/metrics.h"
#include "tessera/train/plot.h"

namespace tessera::cli {

namespace {

struct PlotFlags {
  std::string run_dir;
  std::string out;
  bool log_loss = false;
};

int run_plot(const PlotFlags& f) {
  namespace fs = std::filesystem;
  std::error_code ec;
  TESSERA_CHECK(fs::is_directory(f.run_dir, ec), f.run_dir, ": no such run directory");
  const std::string metrics = (fs::path(f.run_dir) / "metrics.jsonl").string();
  TESSERA_CHECK(fs::exists(metrics, ec), metrics, ": no metrics log (a run writes it as it trains)");
  const auto records = train::read_metrics(metrics);
  TESSERA_CHECK(!records.empty(), metrics, ": no metrics records to plot");
  const std::string out = f.out.empty() ? (fs::path(f.run_dir) / "loss_curve.svg").string() : f.out;
  fs::path dir = fs::absolute(f.run_dir, ec).lexically_normal();
  if (dir.filename().empty()) dir = dir.parent_path();  // "runs/a/" -> "runs/a"
  std::string svg;
  try {
    svg = train::render_training_svg(records, "Training run " + dir.filename().string(), {f.log_loss});
  } catch (const Error& e) {
    fail(metrics, ": ", e.what());
  }
  io::write_file_atomic(out, svg);
  std::printf("%s\n", out.c_str());
  return 0;
}

}  // namespace

void add_plot(CLI::App& app, Action& action) {
  auto f = std::make_shared<PlotFlags>();
  auto* cmd = app.add_subcommand("plot", "Plot a run's loss, learning rate and grad norm as an SVG");
  cmd->add_option("RUN_DIR", f->run_dir, "Run directory holding metrics.jsonl")->required();
  cmd->add_option("--out", f->out, "SVG to write (default: RUN_DIR/loss_curve.svg)");
  cmd->add_flag("--log-loss", f->log_loss, "Log-scale loss axis");
  cmd->callback([&action, f] { action = [f] { return run_plot(*f); }; });
}

}  // namespace tessera::cli
