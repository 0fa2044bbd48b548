// A `tessera serve` child process for protocol tests: started on a free port, its stderr
// collected, stopped with a signal, its exit status and RSS readable.
#pragma once
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <mutex>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>

namespace tessera::testing {

class ServerProcess {
 public:
  // Starts `tessera serve ARGS --port 0` and waits for its "listening on" line.
  // command: the subcommand ("serve", or "router" for the disaggregation front).
  explicit ServerProcess(const std::vector<std::string>& args, const std::vector<std::string>& env = {},
                         const std::string& command = "serve") {
    int fds[2];
    if (pipe(fds) != 0) throw std::runtime_error("pipe failed");
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], 2);
      close(fds[0]);
      close(fds[1]);
      for (const auto& e : env) putenv(const_cast<char*>(e.c_str()));
      setenv("OMP_WAIT_POLICY", "PASSIVE", 0);
      std::vector<std::string> all = {TESSERA_CLI_PATH, command};
      all.insert(all.end(), args.begin(), args.end());
      all.push_back("--port");
      all.push_back("0");
      std::vector<char*> argv;
      for (auto& a : all) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(fds[1]);
    fd_ = fds[0];
    reader_ = std::thread([this] {
      char buf[4096];
      ssize_t n;
      while ((n = read(fd_, buf, sizeof buf)) > 0) {
        std::lock_guard<std::mutex> lock(m_);
        err_.append(buf, static_cast<size_t>(n));
      }
    });
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    static const std::regex re("listening on http://[^:]+:([0-9]+)");
    while (std::chrono::steady_clock::now() < deadline) {
      {
        std::lock_guard<std::mutex> lock(m_);
        std::smatch m;
        if (std::regex_search(err_, m, re)) {
          port_ = std::stoi(m[1]);
          return;
        }
      }
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        status_ = status;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    throw std::runtime_error("tessera " + command + " did not start: " + stderr_text());
  }
  ~ServerProcess() {
    if (!exited_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (reader_.joinable()) reader_.join();
    close(fd_);
  }

  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  httplib::Client client(double timeout_s = 60) const {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(static_cast<time_t>(timeout_s), 0);
    c.set_write_timeout(static_cast<time_t>(timeout_s), 0);
    return c;
  }
  std::string stderr_text() const {
    std::lock_guard<std::mutex> lock(m_);
    return err_;
  }
  void signal(int sig) const { kill(pid_, sig); }
  // Waits for the process to exit; its exit code, or -1 on a signal / timeout.
  int wait(double timeout_s = 60) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (!exited_ && std::chrono::steady_clock::now() < deadline) {
      if (waitpid(pid_, &status_, WNOHANG) == pid_) exited_ = true;
      else std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!exited_) return -1;
    return WIFEXITED(status_) ? WEXITSTATUS(status_) : -1;
  }
  // Resident set size in KiB, from /proc.
  int64_t rss_kib() const {
    std::ifstream in("/proc/" + std::to_string(pid_) + "/status");
    std::string line;
    while (std::getline(in, line))
      if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
    return -1;
  }
  // GET /stats as JSON.
  nlohmann::json stats() const {
    auto c = client(10);
    auto r = c.Get("/stats");
    return r && r->status == 200 ? nlohmann::json::parse(r->body) : nlohmann::json();
  }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  int port_ = 0;
  bool exited_ = false;
  int status_ = 0;
  mutable std::mutex m_;
  std::string err_;
  std::thread reader_;
};

// The "data:" payloads of an SSE body, in order ("[DONE]" included).
inline std::vector<std::string> sse_data(const std::string& body) {
  std::vector<std::string> out;
  std::istringstream in(body);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("data: ", 0) == 0) out.push_back(line.substr(6));
  return out;
}

}  // namespace tessera::testing
