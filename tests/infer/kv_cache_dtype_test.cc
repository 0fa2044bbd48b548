// The paged KV cache in each storage form under the model: a long prompt prefilled in
// chunks through Model::forward_tokens over a bf16, int8 or fp8 pool gives logits within a
// stated tolerance of the same pool in f32 (the dense cache's precision), and a fixed
// memory budget holds the blocks each form's bytes per token allow.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "tessera/infer/kv_pool.h"

namespace tessera::infer {
namespace {

using kernels::KvCacheDtype;

model::Model long_context_model() {
  model::ModelConfig c = model::ModelConfig::named_shape("tiny");
  c.max_position_embeddings = 1024;
  return model::Model::random(c, DType::kF32, 31);
}

// Logits (T, V) of every prompt position, prefilled in chunks of 96 through a pool in `dtype`.
Tensor prefill_logits(const model::Model& m, const std::vector<int32_t>& prompt, KvCacheDtype dtype) {
  const int64_t bs = 16, T = static_cast<int64_t>(prompt.size()), V = m.config().vocab_size;
  KvPool pool = KvPool::create(m.config(), (T + bs - 1) / bs, bs, 0, dtype);
  std::vector<int32_t> table((T + bs - 1) / bs);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(table.size() - 1 - i);
  Tensor all = Tensor::empty({T, V}, DType::kF32);
  for (int64_t t0 = 0; t0 < T; t0 += 96) {
    const int64_t n = std::min<int64_t>(96, T - t0);
    Tensor ids = Tensor::empty({n}, DType::kI32), pos = Tensor::empty({n}, DType::kI32);
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < n; ++i) {
      ids.data<int32_t>()[i] = prompt[t0 + i];
      pos.data<int32_t>()[i] = static_cast<int32_t>(t0 + i);
      rows.push_back(i);
    }
    kernels::PagedSequence s;
    s.q_begin = 0, s.q_len = n, s.context_len = t0 + n, s.block_table = table.data();
    kernels::PagedAttentionParams p;
    p.scale = 1.f / std::sqrt(static_cast<float>(m.config().head_dim));
    PagedKvAttention kv(pool, {s}, p, m.config());
    const Tensor logits = m.forward_tokens(ids, pos, kv, rows);
    std::copy(logits.data<float>(), logits.data<float>() + n * V, all.data<float>() + t0 * V);
  }
  return all;
}

TEST(KvCacheDtype, LongPromptLogitsStayWithinEachFormsTolerance) {
  const model::Model m = long_context_model();
  std::mt19937 rng(5);
  std::vector<int32_t> prompt(900);
  for (auto& t : prompt) t = static_cast<int32_t>(3 + rng() % 250);
  const Tensor ref = prefill_logits(m, prompt, KvCacheDtype::kF32);
  float range = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) range = std::max(range, std::fabs(ref.data<float>()[i]));
  // Tolerances on the largest logit difference over all 900 positions, relative to the
  // logits' magnitude: bf16 2^-8 relative per value, int8 and fp8 coarser.
  const std::pair<KvCacheDtype, float> forms[] = {
      {KvCacheDtype::kBF16, 0.004f}, {KvCacheDtype::kInt8, 0.01f}, {KvCacheDtype::kFp8, 0.04f}};
  for (const auto& [dtype, tol] : forms) {
    const Tensor got = prefill_logits(m, prompt, dtype);
    float worst = 0;
    double sq = 0;
    for (int64_t i = 0; i < ref.numel(); ++i) {
      const float d = std::fabs(got.data<float>()[i] - ref.data<float>()[i]);
      worst = std::max(worst, d);
      sq += static_cast<double>(d) * d;
    }
    std::printf("kv %s: max |logit - f32 cache's| %.3e (%.4f of max |logit| %.3f), rms %.3e\n",
                kernels::kv_cache_dtype_name(dtype), worst, worst / range, range,
                std::sqrt(sq / ref.numel()));
    EXPECT_LE(worst, tol * range) << kernels::kv_cache_dtype_name(dtype);
  }
}

TEST(KvCacheDtype, AFixedBudgetHoldsWhatEachFormsBytesAllow) {
  const auto c = long_context_model().config();  // head_dim 16
  const int64_t bs = 16, budget = 64 << 20;
  const auto blocks = [&](KvCacheDtype d) { return kv_blocks_for_memory(c, bs, budget, 0, d); };
  EXPECT_EQ(KvPool::bytes_per_block(c, bs, 0, KvCacheDtype::kF32),
            2 * KvPool::bytes_per_block(c, bs, 0, KvCacheDtype::kBF16));
  // int8 / fp8: D codes and a 4-byte scale per (token, head) row against bf16's 2 D bytes.
  for (auto d : {KvCacheDtype::kInt8, KvCacheDtype::kFp8}) {
    EXPECT_EQ(KvPool::bytes_per_block(c, bs, 0, d),
              2 * c.num_layers * bs * c.num_kv_heads * (c.head_dim + 4));
    const double ratio = static_cast<double>(blocks(d)) / blocks(KvCacheDtype::kBF16);
    EXPECT_NEAR(ratio, 2.0 * c.head_dim / (c.head_dim + 4), 0.01);
  }
  // At a typical head dim of 128 the scales cost 3%: 1.94x bf16's blocks.
  auto c128 = c;
  c128.head_dim = 128;
  EXPECT_GE(static_cast<double>(kv_blocks_for_memory(c128, bs, budget, 0, KvCacheDtype::kInt8)) /
                kv_blocks_for_memory(c128, bs, budget, 0, KvCacheDtype::kBF16),
            1.93);
  EXPECT_THROW(kv_blocks_for_memory(c, bs, 100, 0, KvCacheDtype::kInt8), std::exception);
}

}  // namespace
}  // namespace tessera::infer

namespace tessera::infer {
namespace {

// One prefill step of `ids` at positions [start, start + n) through `table` of `pool`;
// returns the last position's logits.
std::vector<float> step_logits(const model::Model& m, KvPool& pool, const std::vector<int32_t>& table,
                               const std::vector<int32_t>& ids, int64_t start) {
  const int64_t n = static_cast<int64_t>(ids.size()), V = m.config().vocab_size;
  Tensor t = Tensor::empty({n}, DType::kI32), pos = Tensor::empty({n}, DType::kI32);
  for (int64_t i = 0; i < n; ++i) {
    t.data<int32_t>()[i] = ids[i];
    pos.data<int32_t>()[i] = static_cast<int32_t>(start + i);
  }
  kernels::PagedSequence s;
  s.q_begin = 0, s.q_len = n, s.context_len = start + n, s.block_table = table.data();
  kernels::PagedAttentionParams p;
  p.scale = 1.f / std::sqrt(static_cast<float>(m.config().head_dim));
  PagedKvAttention kv(pool, {s}, p, m.config());
  const Tensor logits = m.forward_tokens(t, pos, kv, {n - 1});
  return std::vector<float>(logits.data<float>(), logits.data<float>() + V);
}

// Blocks moved between pools by their bytes (the unit of the KV tiers and KV transfer)
// hold the same keys and values: a decode over the moved blocks gives the same logits,
// bit for bit, as over the originals, in every storage form.
TEST(KvPoolBlocks, BlocksMovedByTheirBytesDecodeTheSame) {
  model::ModelConfig c = model::ModelConfig::named_shape("tiny");
  const model::Model m = model::Model::random(c, DType::kF32, 7);
  const int64_t bs = 16;
  std::vector<int32_t> prompt(100);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(3 + (i * 37) % 250);
  for (KvCacheDtype d : {KvCacheDtype::kF32, KvCacheDtype::kBF16, KvCacheDtype::kInt8, KvCacheDtype::kFp8}) {
    SCOPED_TRACE(kernels::kv_cache_dtype_name(d));
    KvPool a = KvPool::create(c, 8, bs, 0, d), b = KvPool::create(c, 20, bs, 0, d);
    EXPECT_EQ(a.block_bytes(), KvPool::bytes_per_block(c, bs, 0, d));
    const std::vector<int32_t> ta = {7, 3, 0, 5, 1, 6, 2, 4}, tb = {19, 2, 11, 4, 15, 8, 0, 13};
    step_logits(m, a, ta, prompt, 0);
    std::vector<uint8_t> bytes(static_cast<size_t>(a.block_bytes()));
    for (size_t i = 0; i < 7; ++i) {  // ceil(100 / 16) blocks hold the prompt
      a.read_block(ta[i], bytes.data());
      b.write_block(tb[i], bytes.data());
    }
    EXPECT_EQ(step_logits(m, a, ta, {42}, 100), step_logits(m, b, tb, {42}, 100));
  }
}

}  // namespace
}  // namespace tessera::infer
