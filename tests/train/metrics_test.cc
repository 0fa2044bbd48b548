// Metrics log (JSON lines round trip, torn tails, resume truncation), the loss-curve SVG
// (well-formed, one path per series with every finite point, 1-2-5 ticks) and `tessera plot`.
#include <gtest/gtest.h>

#include "test_util/run_command.h"
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <regex>
#include <sstream>
#include <string>

#include "tessera/base/error.h"
#include "tessera/io/json_file.h"
#include "tessera/train/metrics.h"
#include "tessera/train/plot.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("tessera_metrics_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::vector<int64_t> steps_of(const std::vector<json>& records) {
  std::vector<int64_t> s;
  for (const auto& r : records) s.push_back(r.contains("step") ? r["step"].get<int64_t>() : -1);
  return s;
}

using CmdResult = tessera::testing::CommandResult;
using tessera::testing::run_cli;
using tessera::testing::run_command;

// ---- metrics log ----

TEST(Metrics, JsonLinesRoundTrip) {
  TempDir dir;
  const std::string path = dir.file("metrics.jsonl");
  train::StepMetrics m;
  m.step = 7;
  m.loss = 3.25;
  m.lr = 3e-4;
  m.grad_norm = kNaN;  // an overflowed step: must come out as null, not as invalid JSON
  m.loss_scale = 65536;
  m.tokens_per_s = 12345.5;
  m.mfu = 0.41;
  m.peak_rss_mb = 812.5;
  m.val_loss = 3.5;
  m.spike = true;
  const std::vector<json> written = {
      {{"step", 1}, {"loss", 10.5}, {"lr", 1e-5}, {"note", "naïve \"quoted\"\n"}},
      {{"event", "rollback"}, {"step", 1}, {"to_step", 0}},
      m.to_record(),
  };
  {
    train::MetricsWriter w(path, /*append=*/false);
    for (const auto& r : written) w.write(r);
    // Each line reaches the file when written, before the writer closes.
    EXPECT_EQ(train::read_metrics(path).size(), 3u);
    EXPECT_THROW(w.write(json::array({1, 2})), Error);
  }
  const auto back = train::read_metrics(path);
  ASSERT_EQ(back.size(), 3u);
  EXPECT_EQ(back[0], written[0]);
  EXPECT_EQ(back[1], written[1]);
  const json want = {{"step", 7},          {"loss", 3.25},    {"lr", 3e-4},          {"grad_norm", nullptr},
                     {"loss_scale", 65536}, {"tokens_per_s", 12345.5}, {"mfu", 0.41}, {"peak_rss_mb", 812.5},
                     {"val_loss", 3.5},     {"spike", true}};
  EXPECT_EQ(back[2], want);
  const std::string text = io::read_file_bytes(path);
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 3);
  EXPECT_EQ(text.back(), '\n');

  // An independent JSON parser (Python's) reads every line the same way.
  const auto py = run_command(std::string(TESSERA_PYTHON) +
                              " -c \"import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; "
                              "print(len(r), r[2]['grad_norm'], r[2]['lr'], repr(r[0]['note']))\" " + path);
  ASSERT_EQ(py.code, 0) << py.out;
  EXPECT_EQ(py.out, "3 None 0.0003 'naïve \"quoted\"\\n'\n");
}

TEST(Metrics, TornLastLineIsSkippedMalformedMiddleLineNamesFileAndLine) {
  TempDir dir;
  const std::string path = dir.file("metrics.jsonl");
  write_text(path, "{\"step\":1,\"loss\":2}\n\n{\"step\":2,\"loss\":1.5}\n{\"step\":3,\"lo");
  EXPECT_EQ(steps_of(train::read_metrics(path)), (std::vector<int64_t>{1, 2}));

  write_text(path, "{\"step\":1}\nnot json\n{\"step\":3}\n");
  try {
    train::read_metrics(path);
    ADD_FAILURE() << "malformed middle line accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path + ":2:"), std::string::npos) << e.what();
  }
  write_text(path, "{\"step\":1}\n[1, 2]\n{\"step\":3}\n");
  try {
    train::read_metrics(path);
    ADD_FAILURE() << "non-object line accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path + ":2: metrics line is not a JSON object"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(train::read_metrics(dir.file("missing.jsonl")), Error);
}

TEST(Metrics, AppendingAfterACrashDropsTheTornLine) {
  TempDir dir;
  const std::string path = dir.file("metrics.jsonl");
  write_text(path, "{\"step\":1}\n{\"step\":2,\"lo");
  {
    train::MetricsWriter w(path, /*append=*/true);
    w.write({{"step", 2}});
  }
  EXPECT_EQ(io::read_file_bytes(path), "{\"step\":1}\n{\"step\":2}\n");
  {
    train::MetricsWriter w(path, /*append=*/false);  // a new run starts an empty log
  }
  EXPECT_EQ(io::read_file_bytes(path), "");
}

TEST(Metrics, TruncateFromStepKeepsEarlierStepsAndAppendsToTheNewFile) {
  TempDir dir;
  const std::string path = dir.file("metrics.jsonl");
  {
    train::MetricsWriter w(path, false);
    w.write({{"run", "header without a step"}});
    for (int s = 1; s <= 10; ++s) w.write({{"step", s}, {"loss", 1.0 / s}});
    w.write({{"event", "rollback"}, {"step", 8}});
  }
  {
    std::ofstream(path, std::ios::app) << "{\"step\":11,\"lo";  // torn by a crash
  }
  train::MetricsWriter w(path, /*append=*/true);
  w.truncate_from_step(6);
  w.write({{"step", 6}, {"loss", 0.5}});  // must land in the rewritten file, not the old inode
  const auto back = train::read_metrics(path);
  EXPECT_EQ(steps_of(back), (std::vector<int64_t>{-1, 1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(back.back()["loss"], 0.5);
  EXPECT_EQ(back[3]["loss"], 1.0 / 3);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

// ---- ticks ----

TEST(Plot, NiceTicksFollowThe125Rule) {
  EXPECT_EQ(train::nice_ticks(0, 1000, 5), (std::vector<double>{0, 200, 400, 600, 800, 1000}));
  // raw step 1000/8 = 125 -> mantissa 1.25 < 1.5 -> step 100, framed to 0..1000
  EXPECT_EQ(train::nice_ticks(1, 1000, 8).size(), 11u);
  EXPECT_EQ(train::nice_ticks(1, 1000, 8).front(), 0);
  // raw 5.6/5 = 1.12 -> 1; framed outwards to whole numbers
  EXPECT_EQ(train::nice_ticks(2.3, 7.9, 5), (std::vector<double>{2, 3, 4, 5, 6, 7, 8}));
  // raw 0.236 -> 2 x 0.1
  const auto neg = train::nice_ticks(-0.37, 0.81, 5);
  const std::vector<double> want_neg = {-0.4, -0.2, 0, 0.2, 0.4, 0.6, 0.8, 1.0};
  ASSERT_EQ(neg.size(), want_neg.size());
  for (size_t i = 0; i < neg.size(); ++i) EXPECT_DOUBLE_EQ(neg[i], want_neg[i]);
  EXPECT_EQ(train::format_ticks(neg),
            (std::vector<std::string>{"-0.4", "-0.2", "0", "0.2", "0.4", "0.6", "0.8", "1.0"}));
  // raw 6e-5 -> mantissa 6 < 7 -> 5e-5: a typical learning-rate axis
  const auto lr = train::nice_ticks(0, 3e-4, 5);
  ASSERT_EQ(lr.size(), 7u);
  EXPECT_EQ(train::format_ticks(lr),
            (std::vector<std::string>{"0", "5e-5", "1e-4", "1.5e-4", "2e-4", "2.5e-4", "3e-4"}));
  EXPECT_EQ(train::format_ticks(train::nice_ticks(0, 1000, 5)),
            (std::vector<std::string>{"0", "200", "400", "600", "800", "1000"}));
  // A constant series still gets an axis around its value.
  const auto flat = train::nice_ticks(5, 5, 5);
  EXPECT_LE(flat.front(), 4.5);
  EXPECT_GE(flat.back(), 5.5);

  EXPECT_EQ(train::log_ticks(0.9, 120), (std::vector<double>{1, 2, 5, 10, 20, 50, 100}));
  EXPECT_EQ(train::log_ticks(1e-6, 1.5).size(), 7u);  // 1e-6 .. 1: powers of ten only
  EXPECT_EQ(train::log_ticks(2.2, 7.5), (std::vector<double>{3, 4, 5, 6, 7}));
}

// ---- SVG ----

// Tiny XML check: every start tag closed in order, attribute quotes balanced, '&' only
// in entities. Returns "" when fine, else what is wrong.
std::string check_xml(const std::string& s) {
  std::vector<std::string> stack;
  const std::regex entity("^&(amp|lt|gt|quot|apos);");
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '&' && !std::regex_search(s.substr(i, 8), entity)) return "bare & at " + std::to_string(i);
    if (s[i] != '<') continue;
    const size_t end = s.find('>', i);
    if (end == std::string::npos) return "unterminated tag at " + std::to_string(i);
    const std::string tag = s.substr(i + 1, end - i - 1);
    i = end;
    if (tag.empty()) return "empty tag";
    if (std::count(tag.begin(), tag.end(), '"') % 2 != 0) return "unbalanced quotes in <" + tag + ">";
    if (tag[0] == '?' || tag[0] == '!') continue;
    if (tag[0] == '/') {
      if (stack.empty() || stack.back() != tag.substr(1)) return "unexpected </" + tag.substr(1) + ">";
      stack.pop_back();
    } else if (tag.back() != '/') {
      stack.push_back(tag.substr(0, tag.find_first_of(" \n")));
    }
  }
  return stack.empty() ? "" : "unclosed <" + stack.back() + ">";
}

// Value of attribute `name` in the tag that starts at `tag` ("" if absent).
std::string attr(const std::string& svg, size_t tag, const std::string& name) {
  const size_t end = svg.find('>', tag);
  const size_t a = svg.find(" " + name + "=\"", tag);
  if (a == std::string::npos || a > end) return "";
  const size_t v = a + name.size() + 3;
  return svg.substr(v, svg.find('"', v) - v);
}

// data-name -> the points of its <path class="series" d="M x y L x y ...">; moves counts
// the "M"s (line breaks + 1). Hand-parsed: std::regex recurses per character and
// overflows the stack on long paths.
std::map<std::string, std::vector<std::pair<double, double>>> series_paths(const std::string& svg,
                                                                          std::map<std::string, int>* moves) {
  std::map<std::string, std::vector<std::pair<double, double>>> out;
  for (size_t t = svg.find("<path class=\"series\""); t != std::string::npos;
       t = svg.find("<path class=\"series\"", t + 1)) {
    const std::string name = attr(svg, t, "data-name");
    std::istringstream d(attr(svg, t, "d"));
    auto& pts = out[name];
    char cmd;
    double x, y;
    while (d >> cmd >> x >> y) {
      EXPECT_TRUE(cmd == 'M' || cmd == 'L') << cmd;
      pts.emplace_back(x, y);
      if (cmd == 'M' && moves) (*moves)[name]++;
    }
  }
  return out;
}

struct Frame {
  double x, y, w, h;
};
// The plot-area frames (<rect ... fill="none" stroke="#888888"/>), top panel first.
std::vector<Frame> frames(const std::string& svg) {
  std::vector<Frame> out;
  for (size_t t = svg.find("<rect "); t != std::string::npos; t = svg.find("<rect ", t + 1))
    if (attr(svg, t, "fill") == "none" && attr(svg, t, "stroke") == "#888888")
      out.push_back({std::stod(attr(svg, t, "x")), std::stod(attr(svg, t, "y")), std::stod(attr(svg, t, "width")),
                     std::stod(attr(svg, t, "height"))});
  return out;
}

// Texts of <text class="ytick"> in svg[begin, end).
std::vector<std::string> ytick_labels(const std::string& svg, size_t begin, size_t end) {
  std::vector<std::string> out;
  const std::string tag = "<text class=\"ytick\"";
  for (size_t t = svg.find(tag, begin); t != std::string::npos && t < end; t = svg.find(tag, t + 1)) {
    const size_t b = svg.find('>', t) + 1;
    out.push_back(svg.substr(b, svg.find('<', b) - b));
  }
  return out;
}

train::PlotSeries series(const std::string& name, std::vector<double> x, std::vector<double> y) {
  train::PlotSeries s;
  s.name = name;
  s.x = std::move(x);
  s.y = std::move(y);
  return s;
}

int count_of(const std::string& s, const std::string& needle) {
  int n = 0;
  for (size_t p = s.find(needle); p != std::string::npos; p = s.find(needle, p + 1)) ++n;
  return n;
}

std::vector<json> sample_records() {
  std::vector<json> r;
  for (int s = 1; s <= 50; ++s) {
    json rec = {{"step", s},
                {"loss", 10 * std::exp(-s / 20.0) + 2},
                {"lr", s <= 10 ? 1e-4 * s : 1e-3},
                {"grad_norm", 1.0 + 0.01 * s},
                {"loss_scale", 65536}};
    if (s == 10) rec["loss"] = nullptr;         // logged NaN: a gap in the loss line
    if (s == 35) rec["grad_norm"] = nullptr;
    if (s % 10 == 0) rec["val_loss"] = 10 * std::exp(-s / 20.0) + 2.2;
    if (s == 20) rec["skipped"] = true, rec["loss"] = 1e9;  // overflow garbage, left out
    if (s == 30) rec["spike"] = true;
    r.push_back(rec);
    if (s == 40) r.push_back({{"event", "rollback"}, {"step", 40}, {"to_step", 30}});
  }
  return r;
}

TEST(Plot, TrainingSvgIsWellFormedWithEveryFinitePoint) {
  const auto records = sample_records();
  const std::string svg = train::render_training_svg(records, "run <a> & b");
  EXPECT_EQ(check_xml(svg), "");
  EXPECT_NE(svg.find("run &lt;a&gt; &amp; b"), std::string::npos);
  std::map<std::string, int> moves;
  const auto paths = series_paths(svg, &moves);
  ASSERT_EQ(paths.size(), 4u) << svg.substr(0, 2000);
  EXPECT_EQ(paths.at("train loss").size(), 48u);  // 50 - skipped step 20 - null at step 10
  EXPECT_EQ(moves.at("train loss"), 2);           // the null breaks the line once
  EXPECT_EQ(paths.at("val loss").size(), 4u);     // steps 10, 30, 40, 50 (20 was skipped)
  EXPECT_EQ(paths.at("lr").size(), 49u);
  EXPECT_EQ(paths.at("grad norm (pre-clip)").size(), 48u);
  EXPECT_EQ(count_of(svg, "<circle"), 4 + 1 + 2);  // val markers, one spike, two legend swatches
  EXPECT_EQ(count_of(svg, "class=\"event\""), 3);  // the rollback, across three panels
  EXPECT_NE(svg.find("loss (1 skipped steps left out)"), std::string::npos);

  // x: steps 1..50 get ticks 0, 5, ..., 50 (raw 6.1 -> 5), so step 0 and step 50 sit on
  // the frame edges and pixel x is linear in step; all series share that mapping.
  const auto& lr = paths.at("lr");
  const auto& loss = paths.at("train loss");
  const auto fr = frames(svg);
  ASSERT_EQ(fr.size(), 3u);
  const double px_per_step = (lr.back().first - lr[0].first) / 49;
  EXPECT_NEAR(lr[0].first - px_per_step, fr[1].x, 0.1);
  EXPECT_NEAR(lr.back().first, fr[1].x + fr[1].w, 0.1);
  EXPECT_NEAR(lr[23].first, fr[1].x + 0.5 * fr[1].w, 0.1);  // step 25 (step 20 was skipped)
  EXPECT_NEAR(loss[0].first, lr[0].first, 0.05);
  // lr ticks 0..1e-3 (raw 2e-4): the 1e-3 plateau on the frame top, 1e-4 (step 1) and
  // 6e-4 (step 6) a tenth and six tenths of the way up.
  const double bottom = fr[1].y + fr[1].h;
  EXPECT_NEAR(lr.back().second, fr[1].y, 0.1);
  EXPECT_NEAR(lr[0].second, bottom - 0.1 * fr[1].h, 0.1);
  EXPECT_NEAR(lr[5].second, bottom - 0.6 * fr[1].h, 0.1);
  EXPECT_EQ(ytick_labels(svg, svg.find("learning rate"), svg.find("grad norm")),
            (std::vector<std::string>{"0", "2e-4", "4e-4", "6e-4", "8e-4", "1e-3"}));
  // The skipped step's 1e9 is not on the loss axis: loss runs 2.82 .. 11.51 (val loss
  // inside it), raw step 1.87 -> 2, ticks 2..12.
  EXPECT_EQ(ytick_labels(svg, 0, svg.find("learning rate")),
            (std::vector<std::string>{"2", "4", "6", "8", "10", "12"}));
}

TEST(Plot, PythonXmlParserAcceptsTheSvg) {
  TempDir dir;
  const std::string path = dir.file("loss_curve.svg");
  train::write_training_svg(sample_records(), path, "run & <check>", {/*log_loss=*/true});
  const auto py = run_command(std::string(TESSERA_PYTHON) +
                              " -c \"import sys, xml.etree.ElementTree as ET; r = ET.parse(sys.argv[1]).getroot(); "
                              "ns='{http://www.w3.org/2000/svg}'; "
                              "print(r.tag == ns + 'svg', len(list(r.iter(ns + 'path'))), r.find(ns + 'title').text)\" " +
                              path);
  ASSERT_EQ(py.code, 0) << py.out;
  EXPECT_EQ(py.out, "True 4 run & <check>\n");
  EXPECT_NE(io::read_file_bytes(path).find("loss (1 skipped steps left out) (log scale)"), std::string::npos);
}

TEST(Plot, GenericPanelsMapLinearlySkipNaNAndThinLongSeries) {
  const train::PlotSeries a = series("a", {0, 2.5, 5, 10}, {0, 0.75, kNaN, 1});
  const std::string svg = train::render_svg_panels({{a}}, {"one"}, "t");
  EXPECT_EQ(check_xml(svg), "");
  const auto pts = series_paths(svg, nullptr).at("a");
  ASSERT_EQ(pts.size(), 3u);
  // ticks frame 0..10 and 0..1 exactly, so positions are the data's fractions of the frame.
  EXPECT_NEAR((pts[1].first - pts[0].first) / (pts[2].first - pts[0].first), 0.25, 0.002);
  EXPECT_NEAR((pts[1].second - pts[0].second) / (pts[2].second - pts[0].second), 0.75, 0.002);
  EXPECT_LT(pts[2].second, pts[0].second);  // larger values are higher up

  // 20000 points of noise in [-1, 1] with one spike to 5: thinned, the spike kept.
  train::PlotSeries big = series("big", {}, {});
  for (int i = 0; i < 20000; ++i) {
    big.x.push_back(i);
    big.y.push_back(i == 12345 ? 5.0 : std::sin(i * 0.7));
  }
  const auto thin = series_paths(train::render_svg_panels({{big}}, {"big"}, "t"), nullptr).at("big");
  EXPECT_LT(thin.size(), 4000u);
  EXPECT_GT(thin.size(), 800u);
  // y ticks -1..5 frame the data: the spike must still touch the frame top, and the
  // lowest sine sample (within 1e-4 of -1) the bottom.
  const auto fr = frames(train::render_svg_panels({{big}}, {"big"}, "t"));
  ASSERT_EQ(fr.size(), 1u);
  double min_y = 1e9, max_y = -1e9;
  for (const auto& p : thin) min_y = std::min(min_y, p.second), max_y = std::max(max_y, p.second);
  EXPECT_NEAR(min_y, fr[0].y, 0.1);
  EXPECT_NEAR(max_y, fr[0].y + fr[0].h, 0.1);

  EXPECT_THROW(train::render_svg_panels({{series("bad", {1, 2}, {1})}}, {"p"}, "t"), Error);
  EXPECT_THROW(train::render_training_svg({json{{"event", "start"}}}, "t"), Error);
}

TEST(Plot, ReplayedStepsStartANewLineAndLonePointsShow) {
  // After a rollback the log replays steps 3..5: two runs of the line, not a line back.
  std::vector<json> records;
  for (int s : {1, 2, 3, 4, 5, 3, 4, 5, 6}) records.push_back({{"step", s}, {"loss", 10.0 - s}, {"lr", 1e-3}});
  records.push_back({{"step", 7}, {"grad_norm", 2.0}});  // the only grad norm: a lone point
  const std::string svg = train::render_training_svg(records, "t");
  std::map<std::string, int> moves;
  const auto paths = series_paths(svg, &moves);
  EXPECT_EQ(paths.at("train loss").size(), 9u);
  EXPECT_EQ(moves.at("train loss"), 2);
  for (size_t i = 1; i < paths.at("train loss").size(); ++i)
    if (i != 5) {
      EXPECT_GT(paths.at("train loss")[i].first, paths.at("train loss")[i - 1].first) << i;
    }
  EXPECT_EQ(count_of(svg, "<circle class=\"isolated\""), 1);

  // A single record: the step axis still has whole-step ticks around it.
  const std::string one = train::render_training_svg({json{{"step", 1}, {"loss", 5.0}}}, "t");
  EXPECT_EQ(count_of(one, "<circle class=\"isolated\""), 1);
  for (const char* label : {">0</text>", ">1</text>", ">2</text>"}) EXPECT_NE(one.find(label), std::string::npos);
  EXPECT_EQ(one.find("class=\"xtick\" x=\"0.0\""), std::string::npos);
  EXPECT_EQ(count_of(one, "class=\"xtick\""), 3);  // 0, 1, 2: no fractional steps
}

// ---- CLI ----

TEST(PlotCli, WritesTheSvgAndFailsWithOneLine) {
  TempDir dir;
  {
    train::MetricsWriter w(dir.file("metrics.jsonl"), false);
    for (const auto& r : sample_records()) w.write(r);
  }
  auto r = run_cli("plot " + dir.str());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out, dir.file("loss_curve.svg") + "\n");
  EXPECT_EQ(check_xml(io::read_file_bytes(dir.file("loss_curve.svg"))), "");

  r = run_cli("plot " + dir.str() + " --out " + dir.file("other.svg") + " --log-loss");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(io::read_file_bytes(dir.file("other.svg")).find("(log scale)"), std::string::npos);

  auto expect_error = [](const CmdResult& r, const std::string& needle) {
    EXPECT_NE(r.code, 0) << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
    EXPECT_NE(r.out.find(needle), std::string::npos) << r.out;
  };
  expect_error(run_cli("plot " + dir.file("nope")), dir.file("nope") + ": no such run directory");
  fs::create_directories(dir.file("empty_run"));
  expect_error(run_cli("plot " + dir.file("empty_run")), "empty_run/metrics.jsonl: no metrics log");
  write_text(dir.file("empty_run/metrics.jsonl"), "");
  expect_error(run_cli("plot " + dir.file("empty_run")), "empty_run/metrics.jsonl: no metrics records");
  write_text(dir.file("empty_run/metrics.jsonl"), "{\"event\":\"start\"}\n");
  expect_error(run_cli("plot " + dir.file("empty_run")), "has a numeric \"step\"");
  write_text(dir.file("empty_run/metrics.jsonl"), "{\"step\":1}\n{oops\n{\"step\":2}\n");
  expect_error(run_cli("plot " + dir.file("empty_run")), "empty_run/metrics.jsonl:2:");
  EXPECT_NE(run_cli("plot").code, 0);
  r = run_cli("plot --help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("RUN_DIR"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace tessera
