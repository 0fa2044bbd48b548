// Generates the PyTorch reference directories (tests/parity/make_reference.py) once
// per test binary and hands tests the paths.
#pragma once
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "tessera/io/safetensors.h"
#include "tessera/tensor/tensor.h"

namespace tessera::testing {

// TESSERA_PARITY_DIR/<arch>, made by the ctest fixture `parity_references`; when the
// binary runs on its own and the directory is missing, it is generated here.
inline std::string parity_dir(const std::string& arch) {
  const std::string dir = std::string(TESSERA_PARITY_DIR) + "/" + arch;
  if (std::filesystem::exists(dir + "/reference.safetensors")) return dir;
  std::filesystem::create_directories(TESSERA_PARITY_DIR);
  const std::string cmd = std::string(TESSERA_SOURCE_DIR) + "/tests/parity/make_all.sh " +
                          TESSERA_PYTHON + " " + TESSERA_PARITY_DIR + " > " + TESSERA_PARITY_DIR +
                          "/make_all.log 2>&1";
  if (std::system(cmd.c_str()) != 0 || !std::filesystem::exists(dir + "/reference.safetensors")) {
    ADD_FAILURE() << "reference generation failed (" << cmd << ")";
    return "";
  }
  return dir;
}

// Sequence b of a (B, T) i32 tensor of token ids.
inline std::vector<int32_t> row(const Tensor& ids, int64_t b) {
  const Tensor r = ids.select(0, b).contiguous();
  return std::vector<int32_t>(r.data<int32_t>(), r.data<int32_t>() + r.numel());
}

// Largest |a - b| over the largest |b|: the error relative to the tensor's scale.
inline double relative_error(const Tensor& a, const Tensor& b) {
  const auto va = a.to_f32_vector(), vb = b.to_f32_vector();
  EXPECT_EQ(va.size(), vb.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < va.size() && i < vb.size(); ++i) {
    num = std::max(num, static_cast<double>(std::abs(va[i] - vb[i])));
    den = std::max(den, static_cast<double>(std::abs(vb[i])));
  }
  if (std::getenv("TESSERA_TEST_VERBOSE"))
    std::fprintf(stderr, "relative_error: max|a-b| %.3e max|b| %.3e n %zu\n", num, den, va.size());
  return den > 0 ? num / den : num;
}

}  // namespace tessera::testing
