// Loss-curve plots as SVG: panels stacked vertically on a shared step axis. Plain string
// building (no plotting library), so the trainer can write one at the end of every run.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace tessera::train {

// One line (and/or set of markers) in a panel. A non-finite y (NaN for a step that
// logged null) breaks the line there; the point itself is left out.
struct PlotSeries {
  std::string name;
  std::vector<double> x, y;   // same length
  bool line = true;           // draw a polyline through the points
  bool markers = false;       // draw a small circle at each point
  std::string color;          // CSS colour; empty picks from the palette by position
};

// A vertical dashed line across all panels at x (e.g. a rollback), labelled at the top.
struct PlotEvent {
  double x = 0;
  std::string label;
};

struct PlotOptions {
  std::vector<bool> log_y;         // per panel; a missing entry means a linear axis
  std::vector<PlotEvent> events;
  int width = 960;                 // px
  int panel_height = 230;          // px per panel
  std::string x_label = "step";
  bool integer_x = true;           // x values are whole numbers (steps): tick spacing >= 1
};

// Writes an SVG document with one panel per entry of `panels`, stacked vertically and
// sharing one x axis (ticks labelled under the bottom panel), each with its title and a
// legend, and `title` on top. Values <= 0 are left out of a log-scale panel.
// Series with more points than ~4 per pixel column are thinned to the first, lowest,
// highest and last point of each column, which draws the same picture.
std::string render_svg_panels(const std::vector<std::vector<PlotSeries>>& panels,
                              const std::vector<std::string>& panel_titles, const std::string& title,
                              const PlotOptions& options = {});

struct TrainingPlotOptions {
  bool log_loss = false;  // log-scale y axis for the loss panel
};

// The training plot of metrics records (read_metrics): panels "loss" (train "loss" plus
// "val_loss" where records have it, loss-spike steps marked), "learning rate" ("lr") and
// "grad norm" ("grad_norm") against "step". Records with "skipped": true are left out
// (their loss and norm are overflow garbage); records with an "event" key are drawn as
// vertical lines. Throws tessera::Error when no record has a numeric "step".
std::string render_training_svg(const std::vector<nlohmann::json>& records, const std::string& title,
                                const TrainingPlotOptions& options = {});
// render_training_svg written atomically to svg_path.
void write_training_svg(const std::vector<nlohmann::json>& records, const std::string& svg_path,
                        const std::string& title, const TrainingPlotOptions& options = {});

// Axis ticks by the 1-2-5 rule: the step is 1, 2 or 5 x 10^k, whichever is nearest to
// (hi - lo) / target (thresholds 1.5, 3 and 7 on the mantissa, as in Heckbert's "nice
// numbers"); ticks run from floor(lo / step) * step to ceil(hi / step) * step, so they
// frame [lo, hi]. Example: (0, 1000, 5) -> 0, 200, ..., 1000. lo == hi is widened first.
std::vector<double> nice_ticks(double lo, double hi, int target = 5);
// Ticks for a log axis over [lo, hi] (lo > 0): 1, 2, 5 x 10^k inside the range, only the
// powers of ten when those are more than 8, and 1..9 x 10^k when fewer than 3.
std::vector<double> log_ticks(double lo, double hi);
// Labels for an axis: fixed-point with as many decimals as the smallest tick spacing
// needs ("0.2", "1.5"), or "1.5e-4" style when the spacing is below 1e-3 or values reach
// 1e7. Zero is always "0".
std::vector<std::string> format_ticks(const std::vector<double>& ticks);

}  // namespace tessera::train
