// Metrics log: JSON lines appended with one write() each; reading tolerates a torn tail.
#include "tessera/train/metrics.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>

#include "tessera/base/error.h"
#include "tessera/base/logging.h"
#include "tessera/io/json_file.h"

namespace tessera::train {

namespace {

// nlohmann writes NaN and infinities as null already; be explicit so the log is valid JSON
// whatever the library version does.
nlohmann::json finite_or_null(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); }

struct ParsedLine {
  nlohmann::json record;
  std::string text;  // the line as it was in the file, without its newline
};

// Parses the lines of a metrics file. The last non-blank line may be torn (a crash while
// writing it): if it does not parse it is dropped with a warning.
std::vector<ParsedLine> parse_metrics_text(const std::string& text, const std::string& path) {
  std::vector<std::pair<size_t, std::string>> lines;  // (1-based line number, text)
  size_t pos = 0, line_no = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    ++line_no;
    std::string line = text.substr(pos, nl - pos);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") != std::string::npos) lines.emplace_back(line_no, std::move(line));
    pos = nl + 1;
  }
  std::vector<ParsedLine> out;
  out.reserve(lines.size());
  for (size_t i = 0; i < lines.size(); ++i) {
    const auto& [no, line] = lines[i];
    const bool last = i + 1 == lines.size();
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      if (last) {
        TESSERA_LOG(kWarn, path, ":", no, ": skipping a torn last line (", line.size(),
                    " bytes; the run probably stopped while writing it)");
        break;
      }
      std::string what = e.what();
      const size_t colon = what.find(": ", what.find("parse error"));
      if (colon != std::string::npos) what = what.substr(colon + 2);
      fail(path, ":", no, ":", e.byte, ": invalid JSON metrics line: ", what);
    }
    TESSERA_CHECK(j.is_object(), path, ":", no, ": metrics line is not a JSON object: ",
                  line.substr(0, 60));
    out.push_back({std::move(j), line});
  }
  return out;
}

}  // namespace

nlohmann::json StepMetrics::to_record() const {
  nlohmann::json r = {{"step", step},
                      {"loss", finite_or_null(loss)},
                      {"lr", finite_or_null(lr)},
                      {"grad_norm", finite_or_null(grad_norm)},
                      {"loss_scale", finite_or_null(loss_scale)},
                      {"tokens_per_s", finite_or_null(tokens_per_s)},
                      {"mfu", finite_or_null(mfu)},
                      {"peak_rss_mb", finite_or_null(peak_rss_mb)}};
  if (val_loss) r["val_loss"] = finite_or_null(*val_loss);
  if (skipped) r["skipped"] = true;
  if (spike) r["spike"] = true;
  return r;
}

double model_flops_utilization(double flops_per_token, double tokens_per_s, double peak_flops) {
  if (!(peak_flops > 0)) return 0;
  return flops_per_token * tokens_per_s / peak_flops;
}

MetricsWriter::MetricsWriter(const std::string& path, bool append) : path_(path) {
  if (!append) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
    if (fd_ < 0) fail(path, ": cannot create metrics log: ", std::strerror(errno));
    return;
  }
  // A crash mid-line leaves bytes without a newline; the next line must not be glued to
  // them, so cut the file back to its last complete line.
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
    const std::string bytes = io::read_file_bytes(path);
    if (!bytes.empty() && bytes.back() != '\n') {
      const size_t keep = bytes.rfind('\n') == std::string::npos ? 0 : bytes.rfind('\n') + 1;
      TESSERA_LOG(kWarn, path, ": dropping a torn last line (", bytes.size() - keep, " bytes)");
      if (::truncate(path.c_str(), static_cast<off_t>(keep)) != 0)
        fail(path, ": cannot drop the torn last line: ", std::strerror(errno));
    }
  }
  open_for_append();
}

MetricsWriter::~MetricsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsWriter::open_for_append() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(path_, ": cannot open metrics log for appending: ", std::strerror(errno));
}

void MetricsWriter::write(const nlohmann::json& record) {
  TESSERA_CHECK(record.is_object(), path_, ": a metrics record must be a JSON object, got ",
                record.type_name());
  std::string line = record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  line += '\n';
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(path_, ": cannot write metrics line: ", std::strerror(errno));
    }
    done += static_cast<size_t>(n);
  }
}

void MetricsWriter::truncate_from_step(int64_t step) {
  std::string kept;
  size_t dropped = 0;
  struct stat st;
  if (::stat(path_.c_str(), &st) == 0) {
    for (const auto& p : parse_metrics_text(io::read_file_bytes(path_), path_)) {
      const auto it = p.record.find("step");
      if (it != p.record.end() && it->is_number() && it->get<double>() >= static_cast<double>(step)) {
        ++dropped;
        continue;
      }
      kept += p.text;
      kept += '\n';
    }
  }
  io::write_file_atomic(path_, kept);
  // The rename replaced the file: the old descriptor points at the unlinked inode.
  open_for_append();
  if (dropped) TESSERA_LOG(kInfo, path_, ": dropped ", dropped, " records with step >= ", step);
}

std::vector<nlohmann::json> read_metrics(const std::string& path) {
  std::vector<nlohmann::json> out;
  for (auto& p : parse_metrics_text(io::read_file_bytes(path), path)) out.push_back(std::move(p.record));
  return out;
}

}  // namespace tessera::train
