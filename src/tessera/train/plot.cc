// SVG loss-curve rendering: nice ticks, stacked panels on one step axis, training records
// turned into loss / learning-rate / grad-norm series.
#include "tessera/train/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <limits>

#include "tessera/base/error.h"
#include "tessera/base/strings.h"
#include "tessera/io/json_file.h"

namespace tessera::train {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
const char* const kPalette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#17becf"};

using base::appendf;

std::string xml_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default:
        // Control characters other than tab / newline are not allowed in XML 1.0.
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n') out += ' ';
        else out += c;
    }
  }
  return out;
}

// 10^e computed so that 10^-5 is the double nearest 1e-5 (pow can be off by an ulp).
double pow10i(int e) { return e >= 0 ? std::pow(10.0, e) : 1.0 / std::pow(10.0, -e); }

// Maps data values to pixels along one axis.
struct Axis {
  double lo = 0, hi = 1;  // data range shown
  bool log = false;
  double p0 = 0, p1 = 1;  // pixels where lo and hi land
  std::vector<double> ticks;
  double map(double v) const {
    const double t = log ? (std::log10(v) - std::log10(lo)) / (std::log10(hi) - std::log10(lo))
                         : (v - lo) / (hi - lo);
    return p0 + t * (p1 - p0);
  }
  bool accepts(double v) const { return std::isfinite(v) && (!log || v > 0); }
};

Axis make_axis(const std::vector<double>& values, bool log, int target) {
  Axis a;
  a.log = log;
  double mn = std::numeric_limits<double>::infinity(), mx = -mn;
  for (double v : values)
    if (a.accepts(v)) mn = std::min(mn, v), mx = std::max(mx, v);
  if (log && mn <= mx) {
    // Pad 3% of the span in log space; ticks fall inside the padded range.
    double span = std::log10(mx / mn);
    if (span == 0) span = 0.6;  // one value: show it half way up a factor-4 range
    a.lo = mn / std::pow(10.0, 0.03 * span + (mx == mn ? 0.3 : 0));
    a.hi = mx * std::pow(10.0, 0.03 * span + (mx == mn ? 0.3 : 0));
    a.ticks = log_ticks(a.lo, a.hi);
    return a;
  }
  a.log = false;  // no positive value: a log axis cannot show anything, fall back
  if (mn > mx) mn = 0, mx = 1;
  a.ticks = nice_ticks(mn, mx, target);
  a.lo = a.ticks.front();
  a.hi = a.ticks.back();
  return a;
}

// Series points in pixels, split into runs at non-finite values.
using Segment = std::vector<std::pair<double, double>>;

std::vector<Segment> to_segments(const PlotSeries& s, const Axis& ax, const Axis& ay) {
  std::vector<Segment> segs(1);
  for (size_t i = 0; i < s.x.size(); ++i) {
    if (std::isfinite(s.x[i]) && ay.accepts(s.y[i])) {
      segs.back().emplace_back(ax.map(s.x[i]), ay.map(s.y[i]));
    } else if (!segs.back().empty()) {
      segs.emplace_back();
    }
  }
  if (segs.back().empty()) segs.pop_back();
  return segs;
}

// Keeps the first, lowest, highest and last point of each pixel column: a line through
// what is left covers the same pixels as the full one.
Segment thin(const Segment& seg) {
  Segment out;
  size_t i = 0;
  while (i < seg.size()) {
    const double col = std::floor(seg[i].first);
    size_t j = i, lo = i, hi = i;
    while (j < seg.size() && std::floor(seg[j].first) == col) {
      if (seg[j].second < seg[lo].second) lo = j;
      if (seg[j].second > seg[hi].second) hi = j;
      ++j;
    }
    size_t keep[4] = {i, std::min(lo, hi), std::max(lo, hi), j - 1};
    for (int k = 0; k < 4; ++k)
      if (k == 0 || keep[k] != keep[k - 1]) out.push_back(seg[keep[k]]);
    i = j;
  }
  return out;
}

// True when record[key] is the JSON literal true (a flag of another type counts as false).
bool flag(const nlohmann::json& record, const char* key) {
  const auto it = record.find(key);
  return it != record.end() && it->is_boolean() && it->get<bool>();
}

double text_width(const std::string& s) { return 7.0 * static_cast<double>(s.size()); }

}  // namespace

std::vector<double> nice_ticks(double lo, double hi, int target) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) return {0, 1};
  if (hi < lo) std::swap(lo, hi);
  if (hi == lo) {
    const double d = lo == 0 ? 1 : std::fabs(lo) * 0.1;
    lo -= d;
    hi += d;
  }
  target = std::max(target, 1);
  const double raw = (hi - lo) / target;
  const int e = static_cast<int>(std::floor(std::log10(raw)));
  const double mag = pow10i(e);
  const double norm = raw / mag;
  const double nice = norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10;
  const double step = nice * mag;
  const int64_t k0 = static_cast<int64_t>(std::floor(lo / step + 1e-9));
  const int64_t k1 = static_cast<int64_t>(std::ceil(hi / step - 1e-9));
  std::vector<double> ticks;
  for (int64_t k = k0; k <= k1; ++k) {
    // k * nice / 10^-e rounds once, so 0.6 comes out as 0.6 and not 0.6000000000000001.
    ticks.push_back(e < 0 ? static_cast<double>(k) * nice / pow10i(-e) : static_cast<double>(k) * step);
  }
  return ticks;
}

std::vector<double> log_ticks(double lo, double hi) {
  if (!(lo > 0) || !(hi > lo) || !std::isfinite(hi)) return {};
  const int e0 = static_cast<int>(std::floor(std::log10(lo))) - 1;
  const int e1 = static_cast<int>(std::ceil(std::log10(hi))) + 1;
  auto gen = [&](std::initializer_list<int> mantissas) {
    std::vector<double> t;
    for (int e = e0; e <= e1; ++e)
      for (int m : mantissas) {
        const double v = e < 0 ? m / pow10i(-e) : m * pow10i(e);
        if (v >= lo * (1 - 1e-12) && v <= hi * (1 + 1e-12)) t.push_back(v);
      }
    return t;
  };
  std::vector<double> t = gen({1, 2, 5});
  if (t.size() > 8) t = gen({1});
  if (t.size() < 3) t = gen({1, 2, 3, 4, 5, 6, 7, 8, 9});
  if (t.size() < 2) {  // a narrow range inside one digit: linear ticks placed on the log axis
    t.clear();
    for (double v : nice_ticks(lo, hi, 4))
      if (v >= lo && v <= hi) t.push_back(v);
  }
  return t;
}

std::vector<std::string> format_ticks(const std::vector<double>& ticks) {
  double step = std::numeric_limits<double>::infinity(), maxabs = 0;
  for (size_t i = 0; i < ticks.size(); ++i) {
    maxabs = std::max(maxabs, std::fabs(ticks[i]));
    if (i > 0 && ticks[i] != ticks[i - 1]) step = std::min(step, std::fabs(ticks[i] - ticks[i - 1]));
  }
  if (!std::isfinite(step)) step = maxabs > 0 ? maxabs : 1;
  const bool sci = step < 1e-3 * (1 - 1e-9) || maxabs >= 1e7;
  const int step_exp = static_cast<int>(std::floor(std::log10(step) + 1e-9));
  std::vector<std::string> out;
  for (double v : ticks) {
    char buf[64];
    if (std::fabs(v) < step * 1e-6) {
      out.push_back("0");
    } else if (!sci) {
      const int decimals = std::max(0, -step_exp);
      std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
      out.push_back(buf);
    } else {
      const int v_exp = static_cast<int>(std::floor(std::log10(std::fabs(v)) + 1e-9));
      std::snprintf(buf, sizeof buf, "%.*e", std::clamp(v_exp - step_exp, 0, 15), v);
      std::string s = buf;  // "1.50e-04"
      const size_t e = s.find('e');
      std::string mant = s.substr(0, e);
      if (mant.find('.') != std::string::npos) {
        while (mant.back() == '0') mant.pop_back();
        if (mant.back() == '.') mant.pop_back();
      }
      out.push_back(mant + "e" + std::to_string(std::stoi(s.substr(e + 1))));
    }
  }
  return out;
}

std::string render_svg_panels(const std::vector<std::vector<PlotSeries>>& panels,
                              const std::vector<std::string>& panel_titles, const std::string& title,
                              const PlotOptions& options) {
  TESSERA_CHECK(!panels.empty(), "plot '", title, "': no panels to draw");
  TESSERA_CHECK(panel_titles.size() == panels.size(), "plot '", title, "': ", panels.size(),
                " panels but ", panel_titles.size(), " panel titles");
  for (const auto& panel : panels)
    for (const auto& s : panel)
      TESSERA_CHECK(s.x.size() == s.y.size(), "plot series '", s.name, "': ", s.x.size(), " x values but ",
                    s.y.size(), " y values");

  const double width = std::max(options.width, 320), panel_h = std::max(options.panel_height, 120);
  const double x0 = 78, x1 = width - 20, title_h = 40, bottom_h = 44;
  const double height = title_h + panel_h * static_cast<double>(panels.size()) + bottom_h;

  // One x axis for all panels, over every point that some panel can show.
  std::vector<double> all_x;
  for (const auto& panel : panels)
    for (const auto& s : panel)
      for (size_t i = 0; i < s.x.size(); ++i)
        if (std::isfinite(s.y[i])) all_x.push_back(s.x[i]);
  if (!all_x.empty() && std::all_of(all_x.begin(), all_x.end(), [&](double v) { return v == all_x[0]; })) {
    all_x.push_back(all_x[0] - 1);  // one step: show a few steps around it, not 0.9 .. 1.1
    all_x.push_back(all_x[0] + 1);
  }
  Axis ax = make_axis(all_x, false, 8);
  if (options.integer_x && ax.ticks.size() > 1 && ax.ticks[1] - ax.ticks[0] < 1) {
    ax.ticks.clear();  // steps are whole numbers: no ticks at 0.2, 0.4, ...
    for (double t = std::floor(ax.lo); t <= std::ceil(ax.hi); t += 1) ax.ticks.push_back(t);
    ax.lo = ax.ticks.front();
    ax.hi = ax.ticks.back();
  }
  ax.p0 = x0;
  ax.p1 = x1;
  const std::vector<std::string> x_labels = format_ticks(ax.ticks);

  std::string svg;
  svg.reserve(1 << 16);
  appendf(svg, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
  appendf(svg,
          "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
          "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"12\">\n",
          width, height, width, height);
  svg += "<title>" + xml_escape(title) + "</title>\n";
  appendf(svg, "<rect x=\"0\" y=\"0\" width=\"%.0f\" height=\"%.0f\" fill=\"white\"/>\n", width, height);
  appendf(svg, "<text x=\"%.1f\" y=\"26\" text-anchor=\"middle\" font-size=\"16\" font-weight=\"bold\">",
          width / 2);
  svg += xml_escape(title) + "</text>\n";

  for (size_t p = 0; p < panels.size(); ++p) {
    const double top = title_h + panel_h * static_cast<double>(p);
    const double y0 = top + 24, y1 = top + panel_h - 12;  // plot area, y0 at the top
    const bool log = p < options.log_y.size() && options.log_y[p];
    std::vector<double> ys;
    for (const auto& s : panels[p])
      for (size_t i = 0; i < s.y.size(); ++i)
        if (std::isfinite(s.x[i])) ys.push_back(s.y[i]);
    Axis ay = make_axis(ys, log, 5);
    ay.p0 = y1;
    ay.p1 = y0;
    bool any_point = false;
    for (double v : ys) any_point = any_point || ay.accepts(v);

    svg += "<g class=\"panel\">\n";
    appendf(svg, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" font-weight=\"bold\">", x0, top + 17);
    svg += xml_escape(panel_titles[p]) + (ay.log ? " (log scale)" : "") + "</text>\n";
    // Grid and tick labels.
    const std::vector<std::string> y_labels = format_ticks(ay.ticks);
    for (size_t i = 0; i < ay.ticks.size(); ++i) {
      const double y = ay.map(ay.ticks[i]);
      appendf(svg, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e6e6e6\"/>\n", x0, y, x1, y);
      appendf(svg, "<text class=\"ytick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">", x0 - 6, y + 4);
      svg += y_labels[i] + "</text>\n";
    }
    for (double t : ax.ticks) {
      const double x = ax.map(t);
      appendf(svg, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e6e6e6\"/>\n", x, y0, x, y1);
    }
    appendf(svg,
            "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#888888\"/>\n",
            x0, y0, x1 - x0, y1 - y0);
    // Events behind the data.
    for (const auto& ev : options.events) {
      if (!std::isfinite(ev.x) || ev.x < ax.lo || ev.x > ax.hi) continue;
      const double x = ax.map(ev.x);
      appendf(svg,
              "<line class=\"event\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#d62728\" "
              "stroke-dasharray=\"4 3\"/>\n",
              x, y0, x, y1);
      if (p == 0) {
        appendf(svg, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\" fill=\"#d62728\">", x + 3, y0 + 11);
        svg += xml_escape(ev.label) + "</text>\n";
      }
    }
    // Data.
    struct LegendEntry {
      std::string name, color;
      bool line, markers;
    };
    std::vector<LegendEntry> legend;
    const double max_points = 4 * (x1 - x0);
    for (size_t si = 0; si < panels[p].size(); ++si) {
      const PlotSeries& s = panels[p][si];
      const std::string color = s.color.empty() ? kPalette[si % std::size(kPalette)] : s.color;
      std::vector<Segment> segs = to_segments(s, ax, ay);
      size_t n_points = 0;
      for (const auto& seg : segs) n_points += seg.size();
      if (n_points == 0) continue;
      if (static_cast<double>(n_points) > max_points)
        for (auto& seg : segs) seg = thin(seg);
      const std::string name = xml_escape(s.name);
      if (s.line) {
        svg += "<path class=\"series\" data-name=\"" + name + "\" fill=\"none\" stroke=\"" + color +
               "\" stroke-width=\"1.5\" stroke-linejoin=\"round\" d=\"";
        for (const auto& seg : segs)
          for (size_t i = 0; i < seg.size(); ++i)
            appendf(svg, "%s%c%.1f %.1f", svg.back() == '"' ? "" : " ", i == 0 ? 'M' : 'L', seg[i].first,
                    seg[i].second);
        svg += "\"/>\n";
        // A point with no neighbour draws no line: give it a dot so it is not lost.
        if (!s.markers)
          for (const auto& seg : segs)
            if (seg.size() == 1)
              appendf(svg, "<circle class=\"isolated\" cx=\"%.1f\" cy=\"%.1f\" r=\"2.5\" fill=\"%s\"/>\n",
                      seg[0].first, seg[0].second, color.c_str());
      }
      if (s.markers) {
        svg += "<g class=\"markers\" data-name=\"" + name + "\" fill=\"" + color + "\">\n";
        for (const auto& seg : segs)
          for (const auto& [x, y] : seg) appendf(svg, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"2.5\"/>\n", x, y);
        svg += "</g>\n";
      }
      legend.push_back({s.name, color, s.line, s.markers});
    }
    if (!any_point) {
      appendf(svg, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" fill=\"#888888\">no data</text>\n",
              (x0 + x1) / 2, (y0 + y1) / 2);
    }
    if (!legend.empty()) {
      double w = 0;
      for (const auto& e : legend) w = std::max(w, text_width(e.name));
      w += 38;
      const double lx = x1 - w - 6, ly = y0 + 6, lh = 16.0 * static_cast<double>(legend.size()) + 6;
      appendf(svg,
              "<g class=\"legend\"><rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"white\" "
              "fill-opacity=\"0.85\" stroke=\"#cccccc\"/>\n",
              lx, ly, w, lh);
      for (size_t i = 0; i < legend.size(); ++i) {
        const double y = ly + 14 + 16.0 * static_cast<double>(i);
        const auto& e = legend[i];
        if (e.line)
          appendf(svg, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"/>\n",
                  lx + 6, y - 4, lx + 26, y - 4, e.color.c_str());
        if (e.markers)
          appendf(svg, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"2.5\" fill=\"%s\"/>\n", lx + 16, y - 4,
                  e.color.c_str());
        appendf(svg, "<text x=\"%.1f\" y=\"%.1f\">", lx + 32, y);
        svg += xml_escape(e.name) + "</text>\n";
      }
      svg += "</g>\n";
    }
    svg += "</g>\n";
  }

  // Step labels once, under the bottom panel.
  const double bottom = title_h + panel_h * static_cast<double>(panels.size()) - 12;
  for (size_t i = 0; i < ax.ticks.size(); ++i) {
    appendf(svg, "<text class=\"xtick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">", ax.map(ax.ticks[i]),
            bottom + 16);
    svg += x_labels[i] + "</text>\n";
  }
  appendf(svg, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">", (x0 + x1) / 2, bottom + 36);
  svg += xml_escape(options.x_label) + "</text>\n";
  svg += "</svg>\n";
  return svg;
}

std::string render_training_svg(const std::vector<nlohmann::json>& records, const std::string& title,
                                const TrainingPlotOptions& options) {
  auto named = [](const char* name) {
    PlotSeries s;
    s.name = name;
    return s;
  };
  PlotSeries loss = named("train loss"), val = named("val loss"), spike = named("loss spike"), lr = named("lr"),
             gnorm = named("grad norm (pre-clip)");
  val.markers = true;
  spike.line = false;
  spike.markers = true;
  spike.color = "#d62728";
  PlotOptions po;
  po.log_y = {options.log_loss, false, false};
  size_t with_step = 0, skipped = 0;

  // Appends (step, value of key); null or a non-number is a gap. A step that goes back
  // (a rollback replays steps) also starts a new line instead of drawing back over the old.
  auto add = [](PlotSeries& s, double step, const nlohmann::json& r, const char* key) {
    const auto it = r.find(key);
    if (it == r.end()) return;
    if (!s.x.empty() && step <= s.x.back()) {
      s.x.push_back(step);
      s.y.push_back(kNaN);
    }
    s.x.push_back(step);
    s.y.push_back(it->is_number() ? it->get<double>() : kNaN);
  };
  for (const auto& r : records) {
    if (!r.is_object()) continue;
    const auto st = r.find("step");
    const bool has_step = st != r.end() && st->is_number();
    if (const auto ev = r.find("event"); ev != r.end()) {
      if (has_step) po.events.push_back({st->get<double>(), ev->is_string() ? ev->get<std::string>() : ev->dump()});
      continue;
    }
    if (!has_step) continue;
    ++with_step;
    const double step = st->get<double>();
    if (flag(r, "skipped")) {
      ++skipped;
      continue;
    }
    add(loss, step, r, "loss");
    add(val, step, r, "val_loss");
    add(lr, step, r, "lr");
    add(gnorm, step, r, "grad_norm");
    if (flag(r, "spike")) add(spike, step, r, "loss");
  }
  TESSERA_CHECK(with_step > 0, "metrics: none of the ", records.size(),
                " records has a numeric \"step\"; nothing to plot");
  std::string loss_title = "loss";
  if (skipped) loss_title += " (" + std::to_string(skipped) + " skipped steps left out)";
  return render_svg_panels({{loss, val, spike}, {lr}, {gnorm}}, {loss_title, "learning rate", "grad norm"}, title,
                           po);
}

void write_training_svg(const std::vector<nlohmann::json>& records, const std::string& svg_path,
                        const std::string& title, const TrainingPlotOptions& options) {
  io::write_file_atomic(svg_path, render_training_svg(records, title, options));
}

}  // namespace tessera::train
