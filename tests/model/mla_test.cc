// Multi-head latent attention (model/mla.h) against PyTorch: DeepSeek-V2's
// DeepseekV2Attention transcribed in tests/parity/mla_reference.py (float64), with and
// without the query compression, v_head_dim unlike the qk dims. The outputs and every
// gradient agree; the absorbed decode over the latent cache (prefill, then a token at a
// time) gives the training forward's outputs; the cache holds kv_lora + rope numbers per
// token.
#include "tessera/model/mla.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>

#include "tessera/io/safetensors.h"
#include "test_util/run_command.h"
#include "test_util/tensor_diff.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using testing::max_rel_diff;

struct MlaSetup {
  model::MlaSpec spec;
  model::MlaWeights w;
  int64_t H = 32;
};

MlaSetup make(int64_t q_lora, uint32_t seed) {
  std::mt19937 rng(seed);
  auto randn = [&](const Shape& s, float sd) { return testing::random_normal(s, rng, sd); };
  MlaSetup st;
  auto& s = st.spec;
  s.heads = 4, s.q_lora_rank = q_lora, s.kv_lora_rank = 12, s.qk_nope = 8, s.qk_rope = 4, s.v_head = 6;
  s.rope_theta = 10000.0, s.norm_eps = 1e-6f;
  const int64_t H = st.H, qk = s.qk_dim();
  if (q_lora > 0) {
    st.w.q_a = randn({q_lora, H}, 0.3f);
    st.w.q_a_norm = randn({q_lora}, 0.2f);
    for (int64_t i = 0; i < q_lora; ++i) st.w.q_a_norm.data<float>()[i] += 1.f;
    st.w.q_b = randn({s.heads * qk, q_lora}, 0.5f);
  } else {
    st.w.q_proj = randn({s.heads * qk, H}, 0.3f);
  }
  st.w.kv_a = randn({s.kv_lora_rank + s.qk_rope, H}, 0.3f);
  st.w.kv_a_norm = randn({s.kv_lora_rank}, 0.2f);
  for (int64_t i = 0; i < s.kv_lora_rank; ++i) st.w.kv_a_norm.data<float>()[i] += 1.f;
  st.w.kv_b = randn({s.heads * (s.qk_nope + s.v_head), s.kv_lora_rank}, 0.5f);
  st.w.o = randn({H, s.heads * s.v_head}, 0.3f);
  return st;
}

Tensor positions_of(int64_t B, int64_t T) {
  Tensor p = Tensor::empty({B * T}, DType::kI32);
  for (int64_t i = 0; i < B * T; ++i) p.data<int32_t>()[i] = static_cast<int32_t>(i % T);
  return p;
}

TEST(Mla, ForwardAndEveryGradientMatchDeepSeekV2Attention) {
  for (int64_t q_lora : {16, 0}) {
    SCOPED_TRACE("q_lora_rank " + std::to_string(q_lora));
    MlaSetup st = make(q_lora, static_cast<uint32_t>(7 + q_lora));
    const auto& s = st.spec;
    const int64_t B = 2, T = 11, N = B * T, H = st.H;
    std::mt19937 rng(99);
    const Tensor x = testing::random_normal({N, H}, rng, 1.f), dout = testing::random_normal({N, H}, rng, 1.f);
    std::vector<std::pair<std::string, Tensor>> in = {{"x", x}, {"dout", dout}, {"kv_a", st.w.kv_a},
                                                      {"kv_a_norm", st.w.kv_a_norm}, {"kv_b", st.w.kv_b},
                                                      {"o", st.w.o}};
    if (q_lora > 0)
      in.insert(in.end(), {{"q_a", st.w.q_a}, {"q_a_norm", st.w.q_a_norm}, {"q_b", st.w.q_b}});
    else
      in.emplace_back("q_proj", st.w.q_proj);
    const fs::path dir = fs::temp_directory_path() / ("tessera_mla_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    const std::string ip = (dir / "in.safetensors").string(), op = (dir / "out.safetensors").string();
    io::save_safetensors(ip, in,
                         {{"B", std::to_string(B)}, {"T", std::to_string(T)}, {"heads", std::to_string(s.heads)},
                          {"q_lora", std::to_string(q_lora)}, {"kv_lora", std::to_string(s.kv_lora_rank)},
                          {"nope", std::to_string(s.qk_nope)}, {"rope", std::to_string(s.qk_rope)},
                          {"v", std::to_string(s.v_head)}, {"theta", "10000"}, {"eps", "1e-6"}});
    const auto r = testing::run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR +
                                        "/tests/parity/mla_reference.py " + ip + " " + op);
    ASSERT_EQ(r.code, 0) << r.out;
    const auto ref = io::SafetensorsFile::open(op);
    const Tensor pos = positions_of(B, T);
    Tensor out = Tensor::empty({N, H}, DType::kF32), dx = Tensor::empty({N, H}, DType::kF32);
    model::MlaSaved saved;
    model::mla_forward(s, st.w, x, pos, B, T, out, &saved);
    EXPECT_LT(max_rel_diff(out, ref->get("out")), 1e-5f);
    model::MlaWeights g = model::mla_zero_grads(st.w);
    model::mla_backward(s, st.w, saved, dout, dx, g);
    EXPECT_LT(max_rel_diff(dx, ref->get("dx")), 1e-5f);
    const std::vector<std::pair<std::string, const Tensor*>> grads = {
        {"dkv_a", &g.kv_a}, {"dkv_a_norm", &g.kv_a_norm}, {"dkv_b", &g.kv_b}, {"do", &g.o},
        {"dq_a", &g.q_a},   {"dq_a_norm", &g.q_a_norm},   {"dq_b", &g.q_b},   {"dq_proj", &g.q_proj}};
    for (const auto& [name, t] : grads) {
      if (!t->defined()) continue;
      EXPECT_LT(max_rel_diff(*t, ref->get(name)), 1e-5f) << name;
    }
    fs::remove_all(dir);
  }
}

TEST(Mla, LatentCacheDecodeEqualsTheTrainingForward) {
  for (int64_t q_lora : {16, 0}) {
    SCOPED_TRACE("q_lora_rank " + std::to_string(q_lora));
    MlaSetup st = make(q_lora, 3);
    const int64_t T = 13, H = st.H;
    std::mt19937 rng(5);
    const Tensor x = testing::random_normal({T, H}, rng, 1.f);
    Tensor want = Tensor::empty({T, H}, DType::kF32);
    model::mla_forward(st.spec, st.w, x, positions_of(1, T), 1, T, want, nullptr);
    // A prefill of 5 tokens, then one at a time.
    model::MlaCache cache = model::MlaCache::create(st.spec, 32);
    Tensor got = Tensor::empty({T, H}, DType::kF32);
    Tensor pre = got.slice(0, 0, 5);
    model::mla_decode(st.spec, st.w, x.slice(0, 0, 5), cache, pre);
    for (int64_t t = 5; t < T; ++t) {
      Tensor row = got.slice(0, t, t + 1);
      model::mla_decode(st.spec, st.w, x.slice(0, t, t + 1), cache, row);
    }
    EXPECT_EQ(cache.length, T);
    EXPECT_LT(max_rel_diff(got, want), 1e-5f);
  }
  // The cache: kv_lora_rank + qk_rope_head_dim per token and layer. DeepSeek-V2's shape
  // (128 heads, kv_lora 512, rope 64, nope 128, v 128) in bf16: 1152 bytes against the
  // 81920 of caching every head's k (192) and v (128): 1.4%.
  model::MlaSpec v2;
  v2.heads = 128, v2.kv_lora_rank = 512, v2.qk_rope = 64, v2.qk_nope = 128, v2.v_head = 128;
  EXPECT_EQ(model::mla_cache_bytes_per_token(v2, 2), 1152);
  EXPECT_EQ(model::mha_cache_bytes_per_token(v2, 2), 81920);
}

}  // namespace
}  // namespace tessera
