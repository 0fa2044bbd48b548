// The one precision decision: what the CPU picks, what TESSERA_BF16 and an explicit
// request override, and the errors bad values get.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "tessera/base/cpu_features.h"
#include "tessera/kernels/bf16_speed.h"
#include "tessera/model/precision.h"

namespace tessera::model {
namespace {

// Sets TESSERA_BF16 for one scope and restores what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_, old_.c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(Precision, AutoFollowsTheCpuAndNon16BitDtypesHaveFixedModes) {
  ScopedEnv env("TESSERA_BF16", nullptr);
  // Native where bf16 products beat f32 (always with AMX-BF16, which TESSERA_ISA=avx512
  // caps away; never without AVX512-BF16).
  const Bf16Mode expected = kernels::bf16_native_gemm_faster() ? Bf16Mode::kNative : Bf16Mode::kEmulated;
  if (base::cpu_features().amx_bf16) { EXPECT_EQ(expected, Bf16Mode::kNative); }
  if (!base::cpu_features().avx512_bf16 && !base::cpu_features().amx_bf16) {
    EXPECT_EQ(expected, Bf16Mode::kEmulated);
  }
  EXPECT_EQ(choose_bf16_mode(DType::kBF16), expected);
  EXPECT_EQ(choose_bf16_mode(DType::kF32, Bf16Request::kNative), Bf16Mode::kOff);
  EXPECT_EQ(choose_bf16_mode(DType::kF16, Bf16Request::kNative), Bf16Mode::kEmulatedF16);
  EXPECT_EQ(matmul_peak_dtype(Bf16Mode::kNative), DType::kBF16);
  EXPECT_EQ(matmul_peak_dtype(Bf16Mode::kEmulated), DType::kF32);
  EXPECT_EQ(matmul_peak_dtype(Bf16Mode::kOff), DType::kF32);
  EXPECT_NE(describe_compute(DType::kBF16, expected).find(bf16_mode_name(expected)), std::string::npos);
}

TEST(Precision, EnvironmentOverridesAutoAndAnExplicitRequestOverridesBoth) {
  {
    ScopedEnv env("TESSERA_BF16", "native");
    EXPECT_EQ(choose_bf16_mode(DType::kBF16), Bf16Mode::kNative);
    EXPECT_EQ(choose_bf16_mode(DType::kBF16, Bf16Request::kEmulated), Bf16Mode::kEmulated);
  }
  {
    ScopedEnv env("TESSERA_BF16", "emulated");
    EXPECT_EQ(choose_bf16_mode(DType::kBF16), Bf16Mode::kEmulated);
    EXPECT_EQ(choose_bf16_mode(DType::kBF16, Bf16Request::kNative), Bf16Mode::kNative);
  }
  {
    ScopedEnv env("TESSERA_BF16", "auto");
    EXPECT_EQ(choose_bf16_mode(DType::kBF16),
              kernels::bf16_native_gemm_faster() ? Bf16Mode::kNative : Bf16Mode::kEmulated);
  }
}

TEST(Precision, BadValuesNameWhereTheyCameFrom) {
  {
    ScopedEnv env("TESSERA_BF16", "amx");
    try {
      choose_bf16_mode(DType::kBF16);
      FAIL() << "TESSERA_BF16=amx was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("TESSERA_BF16 = 'amx' is not one of auto, native, emulated"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_THROW(parse_bf16_request("Native", "--bf16-mode"), std::exception);
  EXPECT_EQ(parse_bf16_request("emulated", "x"), Bf16Request::kEmulated);
  EXPECT_THROW(choose_bf16_mode(DType::kI32), std::exception);
}

}  // namespace
}  // namespace tessera::model
