// Model::save of a model above the shard limit writes transformers' sharded layout
// (model-0000k-of-0000n.safetensors + model.safetensors.index.json with total_size and
// weight_map) and loads back to the same weights; a later unsharded save removes it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <map>

#include "tessera/io/json_file.h"
#include "tessera/model/model.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

TEST(ModelSave, BigModelsAreShardedWithAnIndexAndLoadBack) {
  const std::string dir = (fs::temp_directory_path() / ("tessera_model_save_" + std::to_string(::getpid()))).string();
  fs::remove_all(dir);
  model::ModelConfig c = model::ModelConfig::named_shape("tiny");
  c.num_layers = 3;
  const model::Model m = model::Model::random(c, DType::kF32, 9);
  m.save(dir, 128 << 10);  // 128 KiB shards: the ~0.6 MB model takes several
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
  const auto index = io::read_json_file(dir + "/model.safetensors.index.json");
  std::map<std::string, int> files;
  int64_t total = 0;
  for (const auto& [name, file] : index.at("weight_map").items()) ++files[file.get<std::string>()];
  for (auto& [name, t] : m.weights().named(c)) {
    EXPECT_TRUE(index.at("weight_map").contains(name)) << name;
    total += static_cast<int64_t>(t.nbytes());
  }
  EXPECT_EQ(index.at("metadata").at("total_size").get<int64_t>(), total);
  EXPECT_GE(files.size(), 4u) << "shards";
  const std::string n = std::to_string(files.size());
  EXPECT_TRUE(files.count("model-00001-of-" + std::string(5 - n.size(), '0') + n + ".safetensors"));
  const model::Model back = model::Model::load(dir);
  const auto want = m.weights().named(c);
  const auto got = back.weights().named(c);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i].first, want[i].first);
    for (int64_t k = 0; k < want[i].second.numel(); ++k)
      ASSERT_EQ(got[i].second.data<float>()[k], want[i].second.data<float>()[k]) << want[i].first;
  }
  m.save(dir);  // under the default 5 GB: one file, the shards and index gone
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir + "/model-00001-of-" + std::string(5 - n.size(), '0') + n + ".safetensors"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tessera
