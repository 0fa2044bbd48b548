// Running a shell command or the `tessera` binary from a test and capturing its output.
#pragma once
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace tessera::testing {

struct CommandResult {
  int code;         // exit status, -1 when it did not exit normally
  std::string out;  // stdout (+ stderr unless redirected by the command)
};

// Runs `cmd` through the shell; stderr is merged into out unless `merge_stderr` is false
// (then it goes wherever the command line sends it).
inline CommandResult run_command(const std::string& cmd, bool merge_stderr = true) {
  FILE* p = popen((merge_stderr ? cmd + " 2>&1" : cmd).c_str(), "r");
  if (!p) return {-1, "popen failed"};
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

#ifdef TESSERA_CLI_PATH
// `tessera ARGS` with stdout and stderr together.
inline CommandResult run_cli(const std::string& args) {
  return run_command(std::string(TESSERA_CLI_PATH) + " " + args);
}
#endif

}  // namespace tessera::testing
