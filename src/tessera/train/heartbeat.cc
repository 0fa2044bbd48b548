// Rank heartbeat files: the writer thread (Heartbeat) and the reader (read_heartbeats).
#include "tessera/train/heartbeat.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/base/logging.h"

namespace tessera::train {
namespace {

namespace fs = std::filesystem;

double unix_now_s() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

std::string this_host() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "";
  return buf;
}

// Writes tmp then renames over path. No fsync (unlike io::write_file_atomic): a beat is worth
// nothing after a machine crash, and an fsync a second per rank can stall on a busy shared
// filesystem, which would look like a silent rank.
void write_replace(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(tmp, ": cannot open for writing: ", std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      fail(tmp, ": write failed: ", std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0)
    fail(path, ": cannot rename ", tmp, " over it: ", std::strerror(errno));
}

// "rank-12.json" -> 12; -1 for any other name (temporaries included).
int rank_of_file_name(const std::string& name) {
  constexpr std::string_view kPrefix = "rank-", kSuffix = ".json";
  if (name.size() <= kPrefix.size() + kSuffix.size()) return -1;
  if (name.compare(0, kPrefix.size(), kPrefix) != 0) return -1;
  if (name.compare(name.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0) return -1;
  const std::string digits =
      name.substr(kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size());
  if (digits.empty() || digits.size() > 9) return -1;
  for (char c : digits)
    if (c < '0' || c > '9') return -1;
  return std::stoi(digits);
}

}  // namespace

std::string heartbeat_path(const std::string& dir, int rank) {
  return (fs::path(dir) / ("rank-" + std::to_string(rank) + ".json")).string();
}

Heartbeat::Heartbeat(std::string dir, int rank, double interval_s)
    : dir_(std::move(dir)), rank_(rank), interval_s_(interval_s), host_(this_host()) {
  TESSERA_CHECK(rank >= 0, "heartbeat: rank must be >= 0, got ", rank);
  TESSERA_CHECK(std::isfinite(interval_s) && interval_s > 0,
                "heartbeat: interval must be > 0 seconds, got ", interval_s);
  TESSERA_CHECK(!dir_.empty(), "heartbeat: empty directory");
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) fail(dir_, ": cannot create heartbeat directory: ", ec.message());
  path_ = heartbeat_path(dir_, rank_);
  write_beat(false);  // a bad directory shows here, in the caller, not in a thread
  thread_ = std::thread([this] { run(); });
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  try {
    write_beat(true);
  } catch (const std::exception& e) {
    TESSERA_LOG(kWarn, "heartbeat: last beat not written: ", e.what());
  }
}

void Heartbeat::write_beat(bool exited) {
  nlohmann::json j = {{"rank", rank_},
                      {"pid", static_cast<int64_t>(::getpid())},
                      {"host", host_},
                      {"step", step_.load(std::memory_order_relaxed)},
                      {"time", unix_now_s()}};
  if (exited) j["exited"] = true;
  write_replace(path_, j.dump() + "\n");
}

void Heartbeat::run() {
  const auto interval = std::chrono::duration<double>(interval_s_);
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, interval, [this] { return stop_; })) {
    lock.unlock();
    try {
      write_beat(false);
    } catch (const std::exception& e) {
      // Keep beating: a transient filesystem error must not end the rank's liveness for good.
      if (!warned_) TESSERA_LOG(kWarn, "heartbeat: ", e.what(), " (will keep trying)");
      warned_ = true;
    }
    lock.lock();
  }
}

std::unique_ptr<Heartbeat> Heartbeat::from_env(int rank) {
  const char* dir = std::getenv(kHeartbeatDirEnv);
  if (dir == nullptr || *dir == '\0') return nullptr;
  double interval = 1.0;
  if (const char* s = std::getenv(kHeartbeatIntervalEnv); s != nullptr && *s != '\0') {
    char* end = nullptr;
    errno = 0;
    interval = std::strtod(s, &end);
    TESSERA_CHECK(errno == 0 && end != s && *end == '\0' && std::isfinite(interval) &&
                      interval > 0,
                  kHeartbeatIntervalEnv, "='", s, "': expected seconds > 0");
  }
  return std::make_unique<Heartbeat>(dir, rank, interval);
}

std::vector<RankBeat> read_heartbeats(const std::string& dir) {
  std::vector<RankBeat> beats;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) return beats;
  const double now = unix_now_s();
  for (const auto& entry : it) {
    const std::string name = entry.path().filename().string();
    const int file_rank = rank_of_file_name(name);
    if (file_rank < 0) continue;
    const std::string path = entry.path().string();
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) continue;  // replaced or removed since listing
    std::ifstream in(path, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    const auto j = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) continue;
    RankBeat b;
    try {
      b.rank = j.value("rank", -1);
      b.pid = j.value("pid", int64_t{0});
      b.step = j.value("step", int64_t{-1});
      b.host = j.value("host", std::string());
      b.exited = j.value("exited", false);
    } catch (const nlohmann::json::exception&) {
      continue;  // a field of the wrong type: not one of our beats
    }
    if (b.rank != file_rank) continue;  // not a beat, or a beat under the wrong name
    b.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
    const auto t = j.find("time");
    if (t != j.end() && t->is_number()) b.time = t->get<double>();
    b.age_s = now - (b.time > 0 ? b.time : static_cast<double>(b.mtime_ns) * 1e-9);
    beats.push_back(b);
  }
  std::sort(beats.begin(), beats.end(),
            [](const RankBeat& a, const RankBeat& b) { return a.rank < b.rank; });
  return beats;
}

void clear_heartbeats(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail(dir, ": cannot create heartbeat directory: ", ec.message());
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("rank-", 0) == 0 && name.find(".json") != std::string::npos)
      fs::remove(entry.path(), ec);
  }
  if (ec) fail(dir, ": cannot clear heartbeat files: ", ec.message());
}

}  // namespace tessera::train
