// Scratch directories for tests: /tmp/<prefix><pid>, made fresh, and removed when the test
// process exits, so a suite run leaves nothing behind (a model or a checkpointed run is
// often hundreds of MB; repeated runs filled a 250 GB disk). TESSERA_KEEP_TEST_DIRS=1
// keeps them for a post-mortem. A forked child never removes its parent's directories.
#pragma once
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <string>
#include <system_error>
#include <vector>

namespace tessera::testing {

class ScratchDirs {
 public:
  static ScratchDirs& instance() {
    static ScratchDirs dirs;
    return dirs;
  }
  std::string make(const std::string& prefix) {
    const std::string d = (std::filesystem::temp_directory_path() / (prefix + std::to_string(::getpid()))).string();
    std::error_code ec;
    std::filesystem::remove_all(d, ec);
    std::filesystem::create_directories(d);
    std::lock_guard<std::mutex> lock(mu_);
    dirs_.push_back(d);
    return d;
  }
  ~ScratchDirs() {
    if (::getpid() != owner_ || std::getenv("TESSERA_KEEP_TEST_DIRS")) return;
    for (const auto& d : dirs_) {
      std::error_code ec;
      std::filesystem::remove_all(d, ec);
    }
  }

 private:
  ScratchDirs() : owner_(::getpid()) {}
  pid_t owner_;
  std::mutex mu_;
  std::vector<std::string> dirs_;
};

// A fresh, empty /tmp/<prefix><pid>, removed at exit.
inline std::string scratch_dir(const std::string& prefix) { return ScratchDirs::instance().make(prefix); }

}  // namespace tessera::testing
