// shift_kv_window against a reference built from rope_apply: each moved key is un-rotated at
// its old cache position and rotated at its new one (the kernel instead composes one
// rotation by -delta), over f32 / bf16 / int8 / fp8 caches, a partial rotary dimension,
// scattered block tables and sinks that end mid-block; value rows move byte for byte.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "tessera/kernels/kv_shift.h"
#include "tessera/kernels/paged_attention.h"
#include "tessera/kernels/rope.h"
#include "test_util/throws.h"

namespace tessera::kernels {
namespace {

// Rows of a (num_blocks, bs, H, D) cache for cache positions [0, len) of `table`, widened.
std::vector<float> read_rows(const Tensor& cache, const std::vector<int32_t>& table, int64_t len) {
  const int64_t H = cache.size(2), D = kv_cache_head_dim(cache);
  PagedSequence s;
  s.context_len = len;
  s.block_table = table.data();
  Tensor out = Tensor::empty({len, H, D}, DType::kF32);
  read_kv_rows(cache, s, out);
  return {out.data<float>(), out.data<float>() + out.numel()};
}

TEST(KvShift, MovesAndReRotatesTheWindowInEveryDtype) {
  const int64_t nb = 12, bs = 8, H = 2, D = 16, rotary = 12, sinks = 3, len = 45, delta = 8;
  const RopeFreqs f = rope_default_freqs(rotary, 10000.f);
  const std::vector<int32_t> table = {9, 2, 7, 0, 11, 4};  // ceil(45 / 8) = 6 blocks
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  // Keys as the model writes them: random rows rotated at their cache positions.
  Tensor k = Tensor::empty({len, H * D}, DType::kF32), v = Tensor::empty({len, H, D}, DType::kF32);
  for (int64_t i = 0; i < k.numel(); ++i) k.data<float>()[i] = nd(rng), v.data<float>()[i] = nd(rng);
  Tensor pos = Tensor::empty({len}, DType::kI32);
  for (int64_t i = 0; i < len; ++i) pos.data<int32_t>()[i] = static_cast<int32_t>(i);
  rope_apply(k, D, pos, f);
  // Reference: rows [sinks + delta, len) un-rotated at t + delta, rotated at t, moved to t.
  const int64_t moved = len - sinks - delta;
  Tensor ref = k.slice(0, sinks + delta, len).clone();
  Tensor old_pos = Tensor::empty({moved}, DType::kI32), new_pos = Tensor::empty({moved}, DType::kI32);
  for (int64_t i = 0; i < moved; ++i) {
    old_pos.data<int32_t>()[i] = static_cast<int32_t>(sinks + delta + i);
    new_pos.data<int32_t>()[i] = static_cast<int32_t>(sinks + i);
  }
  rope_apply(ref, D, old_pos, f, true);
  rope_apply(ref, D, new_pos, f);

  const std::pair<KvCacheDtype, float> forms[] = {
      {KvCacheDtype::kF32, 5e-5f}, {KvCacheDtype::kBF16, 2e-2f}, {KvCacheDtype::kInt8, 4e-2f}, {KvCacheDtype::kFp8, 0.5f}};
  for (const auto& [dtype, tol] : forms) {
    Tensor kc = make_kv_cache(nb, bs, H, D, dtype), vc = make_kv_cache(nb, bs, H, D, dtype);
    std::vector<PagedSequence> seqs(1);
    seqs[0].q_len = len;
    seqs[0].context_len = len;
    seqs[0].block_table = table.data();
    write_kv_cache(k.view({len, H, D}), v, seqs, kc, vc);
    const std::vector<float> k_before = read_rows(kc, table, len);
    // Value rows' stored bytes before the shift.
    const int64_t row = kv_cache_row_bytes(dtype, D);
    auto vrow = [&](int64_t t, int64_t h) {
      return static_cast<const uint8_t*>(vc.raw_data()) + ((table[t / bs] * bs + t % bs) * H + h) * row;
    };
    std::vector<std::vector<uint8_t>> v_before;
    for (int64_t t = 0; t < len; ++t)
      for (int64_t h = 0; h < H; ++h) v_before.emplace_back(vrow(t, h), vrow(t, h) + row);

    shift_kv_window(kc, vc, {{table.data(), sinks, len, delta}}, f);
    const std::vector<float> got = read_rows(kc, table, len - delta);
    float worst = 0;
    for (int64_t t = 0; t < len - delta; ++t)
      for (int64_t e = 0; e < H * D; ++e) {
        const float g = got[static_cast<size_t>(t * H * D + e)];
        if (t < sinks) {  // sinks untouched, bit for bit
          ASSERT_EQ(g, k_before[static_cast<size_t>(t * H * D + e)]) << kv_cache_dtype_name(dtype);
          continue;
        }
        worst = std::max(worst, std::fabs(g - ref.data<float>()[(t - sinks) * H * D + e]));
      }
    EXPECT_LE(worst, tol) << kv_cache_dtype_name(dtype);
    for (int64_t t = sinks; t < len - delta; ++t)
      for (int64_t h = 0; h < H; ++h)
        ASSERT_EQ(0, std::memcmp(vrow(t, h), v_before[static_cast<size_t>((t + delta) * H + h)].data(), row))
            << kv_cache_dtype_name(dtype) << " value row " << t;
  }
}

TEST(KvShift, RefusesBadShifts) {
  const RopeFreqs f = rope_default_freqs(16, 10000.f);
  Tensor kc = make_kv_cache(4, 8, 2, 16, KvCacheDtype::kF32), vc = make_kv_cache(4, 8, 2, 16, KvCacheDtype::kF32);
  const std::vector<int32_t> t1 = {0, 1, 2}, t2 = {1, 3};
  EXPECT_TRUE(testing::throws_error([&] { shift_kv_window(kc, vc, {{t1.data(), 4, 20, 17}}, f); },
                                    {"needs 0 < delta <= length - sinks"}, true));
  EXPECT_TRUE(testing::throws_error([&] { shift_kv_window(kc, vc, {{t1.data(), 4, 20, 8}, {t2.data(), 2, 16, 8}}, f); },
                                    {"two shifts write block 1"}, true));
  const std::vector<int32_t> bad = {0, 9};
  EXPECT_TRUE(testing::throws_error([&] { shift_kv_window(kc, vc, {{bad.data(), 0, 16, 8}}, f); },
                                    {"block_table[1] = 9"}, true));
}

}  // namespace
}  // namespace tessera::kernels
