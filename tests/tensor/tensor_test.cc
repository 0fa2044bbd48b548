// Tensor views, copies and dtype conversions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "tessera/base/aligned_alloc.h"
#include "tessera/tensor/tensor.h"

namespace tessera {
namespace {

TEST(Tensor, EmptyIsAlignedAndContiguous) {
  Tensor t = Tensor::empty({3, 5, 7}, DType::kF32);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw_data()) % 64, 0u);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.numel(), 105);
  EXPECT_EQ(t.strides(), (Shape{35, 7, 1}));
  EXPECT_EQ(t.device(), Device::kCPU);
}

TEST(Tensor, SliceSelectTransposeShareStorage) {
  std::vector<float> v(24);
  for (int i = 0; i < 24; ++i) v[i] = static_cast<float>(i);
  Tensor t = Tensor::from_vector(v, {4, 6});
  Tensor s = t.slice(1, 2, 5);  // (4, 3), row stride 6
  EXPECT_FALSE(s.is_contiguous());
  EXPECT_EQ(s.stride(0), 6);
  Tensor c = s.contiguous();
  EXPECT_EQ(c.to_f32_vector(), (std::vector<float>{2, 3, 4, 8, 9, 10, 14, 15, 16, 20, 21, 22}));
  Tensor r = t.select(0, 2);
  EXPECT_EQ(r.to_f32_vector(), (std::vector<float>{12, 13, 14, 15, 16, 17}));
  Tensor tr = t.transpose(0, 1).contiguous();  // (6, 4)
  EXPECT_EQ(tr.item_f32(1), 6.f);
  EXPECT_EQ(tr.item_f32(4), 1.f);
  EXPECT_THROW(s.fill(0.f), Error);  // not contiguous
}

TEST(Tensor, ViewChecksAndInfers) {
  Tensor t = Tensor::zeros({4, 6}, DType::kF32);
  EXPECT_EQ(t.view({-1, 3}).shape(), (Shape{8, 3}));
  EXPECT_THROW(t.view({5, 5}), Error);
  EXPECT_THROW(t.slice(1, 2, 5).view({12}), Error);
  EXPECT_THROW(t.slice(0, 3, 9), Error);
  EXPECT_THROW(t.as_strided({5, 6}, {6, 1}), Error);
}

TEST(Tensor, Bf16RoundTripRoundsToNearestEven) {
  // 1 + 2^-8 is halfway between two bf16 values: ties to even (1.0).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.00390625f)), 1.0f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.01171875f)), 1.015625f);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  std::vector<float> v;
  for (int i = 0; i < 1000; ++i) v.push_back(std::sin(i * 0.37f) * (i + 1));
  Tensor f = Tensor::from_vector(v, {1000});
  Tensor b = f.to(DType::kBF16);
  Tensor back = b.to(DType::kF32);
  for (int i = 0; i < 1000; ++i) {
    EXPECT_EQ(b.data<bf16>()[i].bits, f32_to_bf16(v[i])) << i;  // vector path == scalar
    EXPECT_NEAR(back.item_f32(i), v[i], std::abs(v[i]) * (1.f / 256));
  }
}

TEST(Tensor, F16ConversionMatchesIeee) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(65504.f), 0x7bff);
  EXPECT_EQ(f32_to_f16(1e6f), 0x7c00);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.f, -24));
  for (float x : {0.1f, -3.14159f, 1000.5f, 6e-5f}) EXPECT_NEAR(f16_to_f32(f32_to_f16(x)), x, std::abs(x) * 1e-3);
}

TEST(Tensor, CopyFromConvertsAcrossStrides) {
  Tensor a = Tensor::from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor dst = Tensor::zeros({3, 2}, DType::kBF16);
  dst.copy_from(a.transpose(0, 1));
  EXPECT_EQ(dst.to_f32_vector(), (std::vector<float>{1, 4, 2, 5, 3, 6}));
  Tensor wrong = Tensor::zeros({2, 2}, DType::kF32);
  EXPECT_THROW(wrong.copy_from(a), Error);
  Tensor ints = Tensor::zeros({2, 3}, DType::kI32);
  EXPECT_THROW(ints.copy_from(a), Error);
  EXPECT_THROW(a.data<int32_t>(), Error);
}

TEST(DType, ParseNamesAndRejectsUnknown) {
  EXPECT_EQ(parse_dtype("bfloat16"), DType::kBF16);
  EXPECT_EQ(parse_dtype("f32"), DType::kF32);
  EXPECT_THROW(parse_dtype("f64"), Error);
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

TEST(Tensor, Bf16RoundedEqualsRoundTripThroughBf16) {
  std::vector<float> v;
  for (int i = 0; i < 3001; ++i) v.push_back(std::sin(i * 0.91f) * std::exp((i % 40) - 20.f));
  v[5] = NAN;
  v[6] = INFINITY;
  v[7] = -0.f;
  v[8] = 3.3895314e38f;  // rounds up to inf in bf16
  Tensor t = Tensor::from_vector(v, {3001});
  Tensor r = bf16_rounded(t);
  Tensor want = t.to(DType::kBF16).to(DType::kF32);
  for (int i = 0; i < 3001; ++i) {
    if (std::isnan(v[i])) {
      EXPECT_TRUE(std::isnan(r.item_f32(i)));
      continue;
    }
    EXPECT_EQ(r.item_f32(i), want.item_f32(i)) << i << " " << v[i];
  }
}

TEST(Tensor, CopyRoundedEqualsRoundTripThroughTheFormat) {
  std::vector<float> v;
  for (int i = 0; i < 70001; ++i) v.push_back(std::sin(i * 0.37f) * std::exp((i % 30) - 15.f));
  v[9] = INFINITY;
  v[10] = -0.f;
  v[11] = 70000.f;  // past fp16's range: inf
  const Tensor src = Tensor::from_vector(v, {70001});
  for (DType format : {DType::kBF16, DType::kF16, DType::kF32}) {
    Tensor dst = Tensor::zeros({70001}, DType::kF32);
    copy_rounded(dst, src, format);
    const Tensor want = src.to(format).to(DType::kF32);
    for (int i = 0; i < 70001; ++i)
      ASSERT_EQ(dst.item_f32(i), want.item_f32(i)) << dtype_name(format) << " " << i << " " << v[i];
  }
  Tensor wrong = Tensor::zeros({3}, DType::kF32);
  EXPECT_THROW(copy_rounded(wrong, src, DType::kBF16), Error);
}

TEST(Tensor, LargeStorageIsRecycled) {
  const size_t before = base::cached_bytes();
  void* first = nullptr;
  {
    Tensor t = Tensor::empty({1 << 20}, DType::kF32);  // 4 MiB
    first = t.raw_data();
  }
  EXPECT_GE(base::cached_bytes(), before + (4u << 20));
  Tensor again = Tensor::empty({1 << 20}, DType::kF32);
  EXPECT_EQ(again.raw_data(), first);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(again.raw_data()) % 64, 0u);
}

}  // namespace
}  // namespace tessera
