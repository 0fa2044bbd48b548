// Gemma 2 beyond the PyTorch parity of parity_test.cc (the gemma2 fixture): what config.json
// turns on, and the norm weights held as 1 + w inside (Gemma2RMSNorm multiplies by 1 + weight)
// written back as the offsets the checkpoint holds, loading back to the same logits.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "model/parity_fixture.h"
#include "tessera/io/safetensors.h"
#include "tessera/model/model.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using testing::relative_error;

TEST(Gemma2, ConfigTurnsOnEveryPiece) {
  const std::string dir = testing::parity_dir("gemma2");
  ASSERT_FALSE(dir.empty());
  const auto c = model::ModelConfig::load(dir);
  EXPECT_TRUE(c.gelu_mlp && c.norm_offset && c.sandwich_norms && c.embed_scale);
  EXPECT_EQ(c.head_dim, 24);
  EXPECT_FLOAT_EQ(c.attention_scale(), 1.f / std::sqrt(20.f));  // query_pre_attn_scalar, not head_dim
  EXPECT_EQ(c.attn_softcap, 2.f);
  EXPECT_EQ(c.final_softcap, 3.f);
  EXPECT_EQ(c.layer_window(0), 5);  // even layers local, odd ones global
  EXPECT_EQ(c.layer_window(1), 0);
  EXPECT_FALSE(c.all_layers_windowed());
  const auto again = model::ModelConfig::from_json(c.to_json(), "to_json");
  EXPECT_EQ(again.to_json(), c.to_json());
}

TEST(Gemma2, NormWeightsRoundTripAsOffsetsAndLogitsReload) {
  const std::string src = testing::parity_dir("gemma2");
  ASSERT_FALSE(src.empty());
  const auto m = model::Model::load(src, DType::kF32);
  // Inside: 1 + the file's value.
  const auto file = io::SafetensorsFile::open(src + "/model.safetensors");
  const Tensor w = file->get("model.layers.0.pre_feedforward_layernorm.weight").to(DType::kF32);
  const Tensor& held = m.weights().layers[0].norm2_w;
  for (int64_t i = 0; i < w.numel(); ++i) EXPECT_FLOAT_EQ(held.data<float>()[i], 1.f + w.data<float>()[i]);
  const std::string dir = (fs::temp_directory_path() / ("tessera_gemma2_" + std::to_string(::getpid()))).string();
  fs::remove_all(dir);
  m.save(dir);
  const auto saved = io::SafetensorsFile::open(dir + "/model.safetensors");
  for (const char* name : {"model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
                           "model.layers.1.post_feedforward_layernorm.weight", "model.norm.weight"}) {
    const Tensor a = saved->get(name).to(DType::kF32), b = file->get(name).to(DType::kF32);
    for (int64_t i = 0; i < a.numel(); ++i)  // (1 + w) - 1 in f32: within an ulp of 1
      EXPECT_NEAR(a.data<float>()[i], b.data<float>()[i], 2e-7) << name;
  }
  const Tensor ids = Tensor::from_vector(std::vector<int32_t>{5, 17, 3, 90, 44, 2, 61}, {1, 7});
  const auto back = model::Model::load(dir, DType::kF32);
  EXPECT_LT(relative_error(back.forward_batch(ids), m.forward_batch(ids)), 1e-6);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tessera
