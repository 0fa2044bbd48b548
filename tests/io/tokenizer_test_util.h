// Helpers for the tokenizer tests: a per-suite temporary directory and running the Python
// reference (tests/parity/tokenizer_reference.py) with TESSERA_PYTHON.
#pragma once
#include "test_util/run_command.h"
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>

#include "tessera/base/error.h"

namespace tessera::io::testing {

inline std::string make_suite_dir(const std::string& name) {
  const auto p = std::filesystem::temp_directory_path() /
                 ("tessera_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

using tessera::testing::CommandResult;
using tessera::testing::run_command;

// Runs the reference script with `args`; throws with its output when it fails.
inline void run_reference(const std::string& args) {
  const auto r = run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR +
                             "/tests/parity/tokenizer_reference.py " + args);
  if (r.code != 0) fail("tokenizer_reference.py ", args, " failed (", r.code, "): ", r.out);
}

}  // namespace tessera::io::testing
