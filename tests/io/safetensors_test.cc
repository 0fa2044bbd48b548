// Safetensors writing and reading: byte layout against the reference library's own test
// vectors, round trips of every dtype, zero-copy views, and sharded checkpoints.
#include "tessera/io/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "io_test_util.h"
#include "tessera/base/error.h"
#include "tessera/io/json_file.h"

namespace tessera::io {
namespace {

namespace fs = std::filesystem;
using testing::read_bytes;
using testing::TempDir;
using testing::write_bytes;

using Named = std::vector<std::pair<std::string, Tensor>>;

using testing::error_of;

// A tensor of `dt` filled with distinct pseudo-random bytes.
Tensor random_tensor(const Shape& shape, DType dt, uint32_t seed) {
  Tensor t = Tensor::empty(shape, dt);
  std::mt19937 rng(seed);
  auto* p = static_cast<uint8_t*>(t.raw_data());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<uint8_t>(rng());
  return t;
}

void expect_same_bytes(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  ASSERT_EQ(a.shape(), b.shape()) << what;
  Tensor ca = a.contiguous(), cb = b.contiguous();
  ASSERT_EQ(ca.nbytes(), cb.nbytes()) << what;
  if (ca.nbytes() > 0) {
    EXPECT_EQ(std::memcmp(ca.raw_data(), cb.raw_data(), ca.nbytes()), 0) << what;
  }
}

std::string f32_bytes(std::initializer_list<float> v) {
  std::string s;
  for (float f : v) s.append(reinterpret_cast<const char*>(&f), 4);
  return s;
}

// safetensors/src/tensor.rs test_serialization: the exact bytes the library writes.
TEST(Safetensors, WritesLibraryByteLayout) {
  TempDir dir;
  const std::string p = dir.file("a.safetensors");
  save_safetensors(p, {{"attn.0", Tensor::from_vector<float>({0, 1, 2, 3, 4, 5}, {1, 2, 3})}});
  const std::string header = R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";
  std::string expected = std::string("\x40\0\0\0\0\0\0\0", 8) + header + f32_bytes({0, 1, 2, 3, 4, 5});
  EXPECT_EQ(read_bytes(p), expected);

  // test_serialization_forced_alignement: a 65-byte header is padded with 7 spaces.
  save_safetensors(p, {{"attn0", Tensor::from_vector<float>({0, 1, 2, 3, 4, 5}, {1, 1, 2, 3})}});
  const std::string header2 =
      R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})" + std::string(7, ' ');
  expected = std::string("\x48\0\0\0\0\0\0\0", 8) + header2 + f32_bytes({0, 1, 2, 3, 4, 5});
  EXPECT_EQ(read_bytes(p), expected);
  EXPECT_FALSE(fs::exists(p + ".tmp"));
}

// safetensors/src/tensor.rs test_empty.
TEST(Safetensors, WritesLibraryEmptyLayout) {
  TempDir dir;
  const std::string p = dir.file("e.safetensors");
  save_safetensors(p, {});
  EXPECT_EQ(read_bytes(p), std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
  save_safetensors(p, {}, {{"framework", "pt"}});
  EXPECT_EQ(read_bytes(p), std::string("\x28\0\0\0\0\0\0\0", 8) +
                               R"({"__metadata__":{"framework":"pt"}})" + std::string(5, ' '));
  auto f = SafetensorsFile::open(p);
  EXPECT_EQ(f->header().metadata.at("framework"), "pt");
  EXPECT_TRUE(f->header().tensors.empty());
}

TEST(Safetensors, RoundTripAllDtypes) {
  TempDir dir;
  const std::string p = dir.file("all.safetensors");
  Named in;
  const DType dts[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kI8,
                       DType::kU8,  DType::kI32,  DType::kI64};
  uint32_t seed = 1;
  for (DType dt : dts) {
    const std::string base = std::string("layers.") + dtype_name(dt);
    in.emplace_back(base + ".w", random_tensor({7, 129}, dt, seed++));
    in.emplace_back(base + ".v", random_tensor({1}, dt, seed++));
    in.emplace_back(base + ".scalar", random_tensor({}, dt, seed++));
    in.emplace_back(base + ".empty", random_tensor({0, 3}, dt, seed++));
  }
  save_safetensors(p, in, {{"format", "pt"}, {"note", "ünïcode ok"}});

  auto f = SafetensorsFile::open(p);
  EXPECT_EQ(f->header().tensors.size(), in.size());
  EXPECT_EQ(f->header().data_start % 8, 0u);
  EXPECT_EQ(f->header().metadata.at("note"), "ünïcode ok");
  // Written in the given order.
  for (size_t i = 0; i < in.size(); ++i) EXPECT_EQ(f->header().tensors[i].name, in[i].first);
  for (const auto& [name, t] : in) {
    ASSERT_TRUE(f->has(name)) << name;
    expect_same_bytes(f->get(name), t, name);
    EXPECT_EQ(f->info(name).dtype, t.dtype());
  }
  SafetensorsModel m = SafetensorsModel::open(p);
  EXPECT_EQ(m.names().size(), in.size());
  for (const auto& [name, t] : in) expect_same_bytes(m.get(name), t, name);
}

TEST(Safetensors, NonContiguousTensorsAreSavedContiguously) {
  TempDir dir;
  const std::string p = dir.file("t.safetensors");
  Tensor a = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor at = a.transpose(0, 1);  // (3, 2) view
  ASSERT_FALSE(at.is_contiguous());
  Tensor s = a.slice(1, 1, 3);  // (2, 2) view with row stride 3
  save_safetensors(p, {{"at", at}, {"s", s}});
  auto f = SafetensorsFile::open(p);
  EXPECT_EQ(f->get("at").to_f32_vector(), (std::vector<float>{1, 4, 2, 5, 3, 6}));
  EXPECT_EQ(f->get("s").to_f32_vector(), (std::vector<float>{2, 3, 5, 6}));
  EXPECT_EQ(f->get("at").shape(), (Shape{3, 2}));
}

TEST(Safetensors, ViewsAreZeroCopyAndOutliveTheFileHandle) {
  TempDir dir;
  const std::string p = dir.file("z.safetensors");
  save_safetensors(p, {{"w", Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2})}});
  auto f = SafetensorsFile::open(p);
  Tensor a = f->get("w"), b = f->get("w");
  EXPECT_EQ(a.raw_data(), b.raw_data());  // both view the mapping
  f.reset();                               // the views keep it alive
  EXPECT_EQ(a.to_f32_vector(), (std::vector<float>{1, 2, 3, 4}));
  // Writes go to private copy-on-write pages, never to the file.
  a.data<float>()[0] = 42.0f;
  EXPECT_EQ(b.data<float>()[0], 42.0f);
  EXPECT_EQ(SafetensorsFile::open(p)->get("w").to_f32_vector(),
            (std::vector<float>{1, 2, 3, 4}));
}

TEST(Safetensors, MisalignedDataIsCopied) {
  // Hand-made file whose 1-byte header-padding shortfall puts f32 data at an odd offset.
  TempDir dir;
  const std::string p = dir.file("m.safetensors");
  const std::string header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";  // 55 bytes
  std::string n(8, '\0');
  n[0] = static_cast<char>(header.size());
  write_bytes(p, n + header + f32_bytes({1.5f, -2.0f}));
  auto f = SafetensorsFile::open(p);
  Tensor w = f->get("w");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(w.raw_data()) % 4, 0u);
  EXPECT_EQ(w.to_f32_vector(), (std::vector<float>{1.5f, -2.0f}));
}

TEST(Safetensors, WriterRejectsBadInput) {
  TempDir dir;
  const std::string p = dir.file("bad.safetensors");
  Tensor t = Tensor::zeros({2}, DType::kF32);
  EXPECT_NE(error_of([&] { save_safetensors(p, {{"x", t}, {"x", t}}); }).find("duplicate tensor name 'x'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { save_safetensors(p, {{"__metadata__", t}}); }).find("reserved"),
            std::string::npos);
  EXPECT_NE(error_of([&] { save_safetensors(p, {{"u", Tensor()}}); }).find("'u' is undefined"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(p));
  EXPECT_FALSE(fs::exists(p + ".tmp"));
}

TEST(Safetensors, MissingTensorNamesTensorAndFile) {
  TempDir dir;
  const std::string p = dir.file("model.safetensors");
  save_safetensors(p, {{"a", Tensor::zeros({1}, DType::kF32)}});
  auto f = SafetensorsFile::open(p);
  std::string msg = error_of([&] { f->get("model.embed_tokens.weight"); });
  EXPECT_NE(msg.find(p), std::string::npos) << msg;
  EXPECT_NE(msg.find("'model.embed_tokens.weight'"), std::string::npos) << msg;
  SafetensorsModel m = SafetensorsModel::open(dir.path().string());
  msg = error_of([&] { m.get("lm_head.weight"); });
  EXPECT_NE(msg.find(dir.path().string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("'lm_head.weight'"), std::string::npos) << msg;
}

Named sharding_inputs() {
  Named in;
  for (int i = 0; i < 7; ++i)
    in.emplace_back("model.layers." + std::to_string(i) + ".weight",
                    random_tensor({16, 8}, i % 2 ? DType::kBF16 : DType::kF32, 100 + i));
  in.emplace_back("model.big", random_tensor({300}, DType::kF32, 7));  // 1200 B > limit
  in.emplace_back("model.norm", random_tensor({5}, DType::kF16, 8));
  return in;
}

TEST(Safetensors, ShardedRoundTrip) {
  TempDir dir;
  Named in = sharding_inputs();
  uint64_t total = 0;
  for (const auto& nt : in) total += nt.second.nbytes();
  // f32 (16,8) = 512 B, bf16 = 256 B; limit 1000 B: [512 256] [512 256] [512 256] [512] [1200] [10]
  save_safetensors_sharded(dir.path().string(), in, 1000, {{"format", "pt"}});
  const std::string index_path = dir.file("model.safetensors.index.json");
  ASSERT_TRUE(fs::exists(index_path));
  EXPECT_FALSE(fs::exists(dir.file("model.safetensors")));
  nlohmann::json idx = read_json_file(index_path);
  EXPECT_EQ(idx["metadata"]["total_size"].get<uint64_t>(), total);
  EXPECT_EQ(idx["weight_map"].size(), in.size());
  EXPECT_EQ(idx["weight_map"]["model.layers.0.weight"], "model-00001-of-00006.safetensors");
  EXPECT_EQ(idx["weight_map"]["model.layers.6.weight"], "model-00004-of-00006.safetensors");
  EXPECT_EQ(idx["weight_map"]["model.big"], "model-00005-of-00006.safetensors");
  EXPECT_EQ(idx["weight_map"]["model.norm"], "model-00006-of-00006.safetensors");
  auto shard = SafetensorsFile::open(dir.file("model-00002-of-00006.safetensors"));
  EXPECT_EQ(shard->header().metadata.at("format"), "pt");
  EXPECT_EQ(shard->header().tensors.size(), 2u);

  for (const std::string& where : {dir.path().string(), index_path}) {
    SafetensorsModel m = SafetensorsModel::open(where);
    EXPECT_EQ(m.files().size(), 6u);
    const std::vector<std::string> names = m.names();
    ASSERT_EQ(names.size(), in.size());
    EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
    for (const auto& [name, t] : in) {
      expect_same_bytes(m.get(name), t, name);
      EXPECT_EQ(m.info(name).shape, t.shape());
    }
  }

  // Saving again as one file removes the stale shards and index.
  save_safetensors_sharded(dir.path().string(), in, 1 << 20);
  EXPECT_TRUE(fs::exists(dir.file("model.safetensors")));
  EXPECT_FALSE(fs::exists(index_path));
  EXPECT_FALSE(fs::exists(dir.file("model-00001-of-00006.safetensors")));
  SafetensorsModel m = SafetensorsModel::open(dir.path().string());
  for (const auto& [name, t] : in) expect_same_bytes(m.get(name), t, name);
}

// Writes two shard files and an index whose weight_map is the given JSON text.
std::string sharded_with_index(const TempDir& dir, const std::string& weight_map) {
  save_safetensors(dir.file("s1.safetensors"), {{"a", Tensor::zeros({2}, DType::kF32)},
                                                {"extra", Tensor::zeros({1}, DType::kU8)}});
  save_safetensors(dir.file("s2.safetensors"), {{"b", Tensor::zeros({3}, DType::kBF16)}});
  write_bytes(dir.file("model.safetensors.index.json"),
              R"({"metadata": {"total_size": 14}, "weight_map": )" + weight_map + "}");
  return dir.file("model.safetensors.index.json");
}

TEST(Safetensors, ShardTensorsNotInWeightMapAreIgnored) {
  TempDir dir;
  sharded_with_index(dir, R"({"a": "s1.safetensors", "b": "s2.safetensors"})");
  SafetensorsModel m = SafetensorsModel::open(dir.path().string());
  EXPECT_EQ(m.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_FALSE(m.has("extra"));
  EXPECT_EQ(m.get("b").shape(), (Shape{3}));
}

TEST(Safetensors, MissingShardFile) {
  TempDir dir;
  const std::string idx =
      sharded_with_index(dir, R"({"a": "s1.safetensors", "b": "s3.safetensors"})");
  std::string msg = error_of([&] { SafetensorsModel::open(dir.path().string()); });
  EXPECT_NE(msg.find(idx), std::string::npos) << msg;
  EXPECT_NE(msg.find("shard 's3.safetensors'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tensor 'b'"), std::string::npos) << msg;
}

TEST(Safetensors, IndexNamesTensorAbsentFromShard) {
  TempDir dir;
  const std::string idx =
      sharded_with_index(dir, R"({"a": "s1.safetensors", "b": "s1.safetensors"})");
  std::string msg = error_of([&] { SafetensorsModel::open(dir.path().string()); });
  EXPECT_NE(msg.find(idx), std::string::npos) << msg;
  EXPECT_NE(msg.find("tensor 'b' in s1.safetensors"), std::string::npos) << msg;
}

TEST(Safetensors, BadIndexFiles) {
  TempDir dir;
  std::string msg;
  sharded_with_index(dir, R"({"a": "../s1.safetensors"})");
  msg = error_of([&] { SafetensorsModel::open(dir.path().string()); });
  EXPECT_NE(msg.find("not a file name inside the model directory"), std::string::npos) << msg;
  sharded_with_index(dir, R"({"a": "/etc/passwd"})");
  msg = error_of([&] { SafetensorsModel::open(dir.path().string()); });
  EXPECT_NE(msg.find("not a file name inside"), std::string::npos) << msg;
  sharded_with_index(dir, R"({"a": 3})");
  msg = error_of([&] { SafetensorsModel::open(dir.path().string()); });
  EXPECT_NE(msg.find("tensor 'a' must be a file name string"), std::string::npos) << msg;
  sharded_with_index(dir, R"([1])");
  msg = error_of([&] { SafetensorsModel::open(dir.path().string()); });
  EXPECT_NE(msg.find("missing object 'weight_map'"), std::string::npos) << msg;
  write_bytes(dir.file("model.safetensors.index.json"), "{\"weight_map\": {");
  msg = error_of([&] { SafetensorsModel::open(dir.path().string()); });
  EXPECT_NE(msg.find("invalid JSON"), std::string::npos) << msg;
}

TEST(Safetensors, DirectoryWithoutWeights) {
  TempDir dir;
  std::string msg = error_of([&] { SafetensorsModel::open(dir.path().string()); });
  EXPECT_NE(msg.find(dir.path().string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("no model.safetensors"), std::string::npos) << msg;
}

}  // namespace
}  // namespace tessera::io
