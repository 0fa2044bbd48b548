// Helpers shared by the io tests: a per-test temporary directory and file writing.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/base/error.h"

namespace tessera::io::testing {

// A fresh directory per test, removed when the test ends.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            ("tessera_io_" + std::to_string(::getpid()) + "_" + info->test_suite_name() + "_" +
             info->name());
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// The message of the tessera::Error `fn` throws, or "<no error>".
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

// Each case (input text, expected part of the message): parse(text) fails with one line
// that names "DIR/config.json" (the source the caller passes) and holds the expected part.
inline void expect_config_errors(const std::vector<std::pair<std::string, std::string>>& cases,
                                 const std::function<void(const std::string& text)>& parse) {
  for (const auto& [text, want] : cases) {
    const std::string e = error_of([&] { parse(text); });
    EXPECT_NE(e.find(want), std::string::npos) << text << "\n  got: " << e;
    EXPECT_NE(e.find("DIR/config.json"), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

}  // namespace tessera::io::testing

// `stmt` throws a one-line tessera::Error containing `fragment`.
#define EXPECT_ERROR(stmt, fragment)                                                                \
  do {                                                                                              \
    const std::string msg_ = ::tessera::io::testing::error_of([&] { stmt; });                      \
    EXPECT_NE(msg_.find(fragment), std::string::npos) << "error was: " << msg_;                   \
    EXPECT_EQ(msg_.find('\n'), std::string::npos) << "not one line: " << msg_;                     \
  } while (0)
