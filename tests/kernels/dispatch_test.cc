// The kernels' one dispatch point: the ISA level every CPU kernel family reads agrees with
// the CPU's features (and TESSERA_ISA's cap, in the capped ctest runs), the families ask
// it rather than cpuid, and a device without a backend is a one-line error naming the op.
#include <gtest/gtest.h>

#include "tessera/base/cpu_features.h"
#include "tessera/base/error.h"
#include "tessera/kernels/cpu/attention_cpu.h"
#include "tessera/kernels/cpu/matmul_cpu.h"
#include "tessera/kernels/cpu/pointwise_common.h"
#include "tessera/kernels/dispatch.h"

namespace tessera::kernels {
namespace {

TEST(KernelDispatch, OneIsaLevelFromTheCpuFeaturesDrivesEveryFamily) {
  const auto& f = base::cpu_features();
  const IsaLevel l = cpu_isa_level();
  EXPECT_EQ(l >= IsaLevel::kAvx2, f.avx2 && f.fma) << isa_level_name(l);
  EXPECT_EQ(l >= IsaLevel::kAvx512, f.avx2 && f.fma && f.avx512f && f.avx512bw && f.avx512vl)
      << isa_level_name(l);
  if (l >= IsaLevel::kAvx512Bf16) { EXPECT_TRUE(f.avx512_bf16); }
  if (l == IsaLevel::kAmx) { EXPECT_TRUE(f.amx_bf16 && f.amx_os_enabled); }
  EXPECT_EQ(cpu::use_avx512(), cpu_has(IsaLevel::kAvx512));
  EXPECT_EQ(cpu::best_attention_isa() == cpu::AttnIsa::kAvx512, cpu_has(IsaLevel::kAvx512));
  EXPECT_EQ(cpu::best_attention_isa() == cpu::AttnIsa::kAvx2, l == IsaLevel::kAvx2);
  EXPECT_EQ(cpu::best_attention_isa() == cpu::AttnIsa::kScalar, l == IsaLevel::kScalar);
  EXPECT_EQ(cpu::skinny_isa_supported(cpu::SkinnyIsa::kAvx512), cpu_has(IsaLevel::kAvx512));
  EXPECT_EQ(cpu::skinny_isa_supported(cpu::SkinnyIsa::kAvx2), cpu_has(IsaLevel::kAvx2));
  std::printf("kernels ISA level: %s (%s)\n", isa_level_name(l), base::describe_cpu_features().c_str());
}

TEST(KernelDispatch, TheDeviceOfTheTensorsPicksTheBackend) {
  Tensor a = Tensor::zeros({2, 3}, DType::kF32), b = Tensor::zeros({2, 3}, DType::kF32);
  EXPECT_EQ(kernel_device("add_inplace", a, b, Tensor()), Device::kCPU);  // undefined: ignored
  try {
    no_backend("add_inplace", Device::kCUDA);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("add_inplace: no kernel for device cuda"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace tessera::kernels
