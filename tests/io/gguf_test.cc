// GGUF files: every malformation the parser checks is a one-line error naming what is
// wrong (and no truncation of a valid file gets through), and what write_gguf writes reads
// back the same, here and through an independent reader (tests/parity/gguf_blocks_reference.py).
#include "tessera/io/gguf.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "io_test_util.h"
#include "tessera/io/gguf_blocks.h"
#include "tessera/io/json_file.h"
#include "tessera/io/safetensors.h"
#include "test_util/run_command.h"

namespace tessera::io {
namespace {

using testing::TempDir;

// Little-endian bytes of a GGUF file, field by field, so a test can lie in any of them.
struct Bytes {
  std::string s;
  Bytes& u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) s += static_cast<char>(v >> (8 * i));
    return *this;
  }
  Bytes& u64(uint64_t v) {
    for (int i = 0; i < 8; ++i) s += static_cast<char>(v >> (8 * i));
    return *this;
  }
  Bytes& str(const std::string& v) {
    u64(v.size());
    s += v;
    return *this;
  }
  Bytes& head(uint64_t tensors, uint64_t kvs, uint32_t version = 3) {
    s += "GGUF";
    return u32(version).u64(tensors).u64(kvs);
  }
  Bytes& kv_u32(const std::string& key, uint32_t v) { return str(key).u32(4).u32(v); }
  Bytes& tensor(const std::string& name, std::vector<uint64_t> ne, uint32_t type, uint64_t offset) {
    str(name).u32(static_cast<uint32_t>(ne.size()));
    for (uint64_t d : ne) u64(d);
    return u32(type).u64(offset);
  }
  Bytes& pad(size_t align = 32) {
    s.append((align - s.size() % align) % align, '\0');
    return *this;
  }
  Bytes& data(size_t n) {
    s.append(n, '\x11');
    return *this;
  }
};

std::string parse_error(const std::string& bytes) {
  try {
    parse_gguf_header(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "m.gguf");
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

void expect_error(const std::string& bytes, const std::string& needle) {
  const std::string e = parse_error(bytes);
  EXPECT_NE(e.find(needle), std::string::npos) << "wanted '" << needle << "', got: " << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  EXPECT_EQ(e.rfind("m.gguf", 0), 0u) << e;
}

// A valid file: two metadata keys, an F32 (4, 2) and a Q8_0 (32) tensor.
std::string valid_file() {
  Bytes b;
  b.head(2, 2).kv_u32("a.count", 7);
  b.str("a.names").u32(9).u32(8).u64(2).str("x").str("yz");
  b.tensor("w", {4, 2}, 0, 0).tensor("q", {32}, 8, 32).pad().data(32 + 34);
  return b.s;
}

TEST(GgufParse, ValidFileParses) {
  const std::string f = valid_file();
  const GgufHeader h = parse_gguf_header(reinterpret_cast<const uint8_t*>(f.data()), f.size(), "m.gguf");
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.find("a.count")->as_uint("a.count"), 7u);
  EXPECT_EQ(h.find("a.names")->as_strings("a.names"), (std::vector<std::string>{"x", "yz"}));
  EXPECT_EQ(h.tensors[1].nbytes, 34u);
  EXPECT_EQ(h.data_start % 32, 0u);
  EXPECT_EQ(h.data_start + 32 + 34, f.size());
}

TEST(GgufParse, EveryTruncationIsAnError) {
  const std::string f = valid_file();
  for (size_t n = 0; n < f.size(); ++n) {
    const std::string e = parse_error(f.substr(0, n));
    EXPECT_NE(e, "<no error>") << "a prefix of " << n << " of " << f.size() << " bytes parsed";
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

TEST(GgufParse, MagicAndVersion) {
  expect_error("GG", "too small for a GGUF file");
  std::string f = valid_file();
  f[0] = 'X';
  expect_error(f, "not a GGUF file (it starts with 0x58 0x47 0x55 0x46, not \"GGUF\")");
  expect_error(Bytes().head(0, 0, 1).s, "GGUF version 1 is not supported");
  expect_error(Bytes().head(0, 0, 4).s, "GGUF version 4 is not supported");
  expect_error(Bytes().head(0, 0, 0x03000000).s, "big-endian");
  EXPECT_EQ(parse_error(Bytes().head(0, 0, 2).s), "<no error>");
}

TEST(GgufParse, CountsAndLengthsPastTheFile) {
  expect_error(Bytes().head(0, uint64_t{1} << 60).s, "metadata count 1152921504606846976 cannot fit");
  expect_error(Bytes().head(uint64_t{1} << 40, 0).s, "tensor count 1099511627776 cannot fit");
  expect_error(Bytes().head(0, 1).u64(1000).s + std::string(20, 'k'), "has length 1000, past the end");
  Bytes big_string;
  big_string.head(0, 1).str("k").u32(8).u64(~uint64_t{0}).s += std::string(16, 'v');
  expect_error(big_string.s, "length 18446744073709551615, past the end");
  Bytes big_array;
  big_array.head(0, 1).str("k").u32(9).u32(6).u64(uint64_t{1} << 62).s += std::string(16, 'v');
  expect_error(big_array.s, "claims 4611686018427387904 f32 elements");
}

TEST(GgufParse, BadMetadata) {
  expect_error(Bytes().head(0, 1).str("k").u32(13).u32(0).s, "metadata key 'k' has unknown value type 13");
  expect_error(Bytes().head(0, 1).str("k").u32(9).u32(77).u64(0).s, "is an array of unknown value type 77");
  expect_error(Bytes().head(0, 2).kv_u32("x", 1).kv_u32("x", 2).s, "duplicate metadata key 'x'");
  expect_error(Bytes().head(0, 1).str("general.alignment").u32(5).u32(64).s,
               "general.alignment must be a u32, got i32 64");
  expect_error(Bytes().head(0, 1).kv_u32("general.alignment", 48).s, "general.alignment 48 is not a power of two");
  expect_error(Bytes().head(0, 1).kv_u32("general.alignment", 0).s, "general.alignment 0 is not a power of two");
  Bytes deep;
  deep.head(0, 1).str("k").u32(9);
  for (int i = 0; i < 10; ++i) deep.u32(9).u64(1);
  deep.u32(4).u64(0);
  expect_error(deep.s, "nests arrays deeper than 8 levels");
}

TEST(GgufParse, BadTensorInfos) {
  auto one = [](std::vector<uint64_t> ne, uint32_t type, uint64_t offset, size_t data) {
    Bytes b;
    b.head(1, 0).tensor("t", std::move(ne), type, offset).pad().data(data);
    return b.s;
  };
  expect_error(one({}, 0, 0, 0), "tensor 't' has 0 dims (1 to 4 are valid)");
  expect_error(one({1, 1, 1, 1, 1}, 0, 0, 4), "tensor 't' has 5 dims");
  expect_error(one({uint64_t{1} << 63}, 0, 0, 0), "dim 0 = 9223372036854775808 is too large");
  for (uint32_t unknown : {4u, 5u, 31u, 36u, 40u, 1000u})
    expect_error(one({32}, unknown, 0, 64), "tensor 't' has unknown ggml type " + std::to_string(unknown));
  expect_error(one({48, 2}, 2, 0, 64), "row length 48 is not a multiple of Q4_0's block of 32");
  expect_error(one({uint64_t{1} << 40, uint64_t{1} << 40}, 0, 0, 0), "dims [1099511627776, 1099511627776] of F32 overflow");
  expect_error(one({0, uint64_t{1} << 40, uint64_t{1} << 40}, 0, 0, 0), "dims [0, 1099511627776, 1099511627776] of F32 overflow");
  expect_error(one({uint64_t{1} << 62}, 0, 0, 0), "dims [4611686018427387904] of F32 overflow");
  expect_error(one({4}, 0, 8, 64), "data offset 8 is not a multiple of the alignment 32");
  expect_error(one({16}, 0, 0, 63), "data [0, 64) of the data section at byte 64 runs past the end of the file (127 bytes)");
  expect_error(one({16}, 0, uint64_t{1} << 63, 64), "runs past the end of the file");
  Bytes dup;
  dup.head(2, 0).tensor("t", {1}, 0, 0).tensor("t", {1}, 0, 32).pad().data(64);
  expect_error(dup.s, "duplicate tensor name 't'");
  Bytes overlap;
  overlap.head(2, 0).tensor("a", {16}, 0, 32).tensor("b", {32}, 0, 0).pad().data(128);
  expect_error(overlap.s, "tensors 'b' [0, 128) and 'a' [32, 96) overlap");
}

TEST(GgufParse, ValueAccessorsCheckTypes) {
  const GgufValue s = GgufValue::string("llama");
  EXPECT_NE(testing::error_of([&] { s.as_uint("general.x"); }).find("general.x: expected an integer, got string 'llama'"),
            std::string::npos);
  const uint8_t minus_one[4] = {0xff, 0xff, 0xff, 0xff};
  EXPECT_NE(testing::error_of([&] { GgufValue::scalar(GgufType::kI32, minus_one).as_uint("k"); })
                .find("expected a non-negative integer, got i32 -1"),
            std::string::npos);
  EXPECT_EQ(GgufValue::scalar(GgufType::kI32, minus_one).as_int("k"), -1);
  EXPECT_EQ(GgufValue::i32s({3, -4}).int_at(1, "k"), -4);
}

// ---- writer ------------------------------------------------------------------------------

std::string le(GgufType t, double v) {
  std::string b;
  auto put = [&](uint64_t u, int n) {
    for (int i = 0; i < n; ++i) b += static_cast<char>(u >> (8 * i));
  };
  switch (t) {
    case GgufType::kF32: {
      float f = static_cast<float>(v);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      put(u, 4);
      break;
    }
    case GgufType::kF64: {
      uint64_t u;
      std::memcpy(&u, &v, 8);
      put(u, 8);
      break;
    }
    default: {
      const int n = t == GgufType::kU8 || t == GgufType::kI8 || t == GgufType::kBool ? 1
                    : t == GgufType::kU16 || t == GgufType::kI16                      ? 2
                    : t == GgufType::kU64 || t == GgufType::kI64                      ? 8
                                                                                      : 4;
      put(static_cast<uint64_t>(static_cast<int64_t>(v)), n);
    }
  }
  return b;
}

// Metadata of every value type, nested arrays included.
GgufMetadata all_types() {
  GgufMetadata md;
  const std::pair<GgufType, double> scalars[] = {
      {GgufType::kU8, 200},   {GgufType::kI8, -100}, {GgufType::kU16, 60000}, {GgufType::kI16, -30000},
      {GgufType::kU32, 4e9},  {GgufType::kI32, -2e9}, {GgufType::kF32, 0.1},  {GgufType::kBool, 1},
      {GgufType::kU64, 1e18}, {GgufType::kI64, -1e18}, {GgufType::kF64, 1e-300}};
  for (const auto& [t, v] : scalars) {
    const std::string b = le(t, v);
    md.emplace_back(std::string("t.") + gguf_type_name(t), GgufValue::scalar(t, reinterpret_cast<const uint8_t*>(b.data())));
  }
  md.emplace_back("t.string", GgufValue::string("h\xc3\xa9llo"));
  md.emplace_back("t.strings", GgufValue::strings({"a", "", "\xe6\x97\xa5"}));
  md.emplace_back("t.i32s", GgufValue::i32s({1, -2, 3}));
  md.emplace_back("t.f32s", GgufValue::packed_array(GgufType::kF32, 2, le(GgufType::kF32, 1.5) + le(GgufType::kF32, -2)));
  md.emplace_back("t.nested", GgufValue::array_of_arrays({GgufValue::i32s({5}), GgufValue::i32s({6, 7})}));
  return md;
}

// The bytes of a value after its type tag: what must survive a round trip.
std::string encoded(const GgufValue& v) {
  std::string s;
  v.append_to(s);
  return s;
}

TEST(GgufWrite, RoundTripsHereAndThroughTheReferenceReader) {
  TempDir dir;
  const std::string path = dir.file("rt.gguf");
  const GgufMetadata md = all_types();
  std::vector<GgufTensorSpec> specs = {{"f32", {3, 2}, GgmlType::kF32},
                                       {"q8", {64, 2}, GgmlType::kQ8_0},
                                       {"k4", {256}, GgmlType::kQ4_K},
                                       {"bf", {5}, GgmlType::kBF16}};
  std::vector<std::string> bytes;
  for (const auto& s : specs) {
    int64_t rows = 1;
    for (size_t d = 1; d < s.ne.size(); ++d) rows *= s.ne[d];
    std::vector<float> x(static_cast<size_t>(s.ne[0] * rows));
    for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i)) * 0.5f;
    bytes.push_back(quantize_rows(s.type, x.data(), rows, s.ne[0], s.name));
  }
  write_gguf(path, md, specs, [&](size_t i) { return bytes[i]; }, 64);

  const auto f = GgufFile::open(path);
  const GgufHeader& h = f->header();
  EXPECT_EQ(h.alignment, 64u);
  ASSERT_EQ(h.metadata.size(), md.size() + 1);  // + general.alignment
  for (size_t i = 0; i < md.size(); ++i) {
    EXPECT_EQ(h.metadata[i].first, md[i].first);
    EXPECT_EQ(h.metadata[i].second.type(), md[i].second.type()) << md[i].first;
    EXPECT_EQ(encoded(h.metadata[i].second), encoded(md[i].second)) << md[i].first;
  }
  EXPECT_EQ(h.metadata.back().first, "general.alignment");
  ASSERT_EQ(h.tensors.size(), specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(h.tensors[i].name, specs[i].name);
    EXPECT_EQ(h.tensors[i].ne, specs[i].ne);
    EXPECT_EQ(h.tensors[i].type, specs[i].type);
    EXPECT_EQ((h.data_start + h.tensors[i].offset) % 64, 0u);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(f->data(h.tensors[i])), h.tensors[i].nbytes), bytes[i]);
  }

  // The reference reader sees the same metadata, layout and values.
  const auto r = tessera::testing::run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR +
                                               "/tests/parity/gguf_blocks_reference.py read " + path + " " +
                                               dir.file("deq.safetensors") + " " + dir.file("info.json"));
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json info = read_json_file(dir.file("info.json"));
  EXPECT_EQ(info["version"], 3);
  EXPECT_EQ(info["alignment"], 64);
  EXPECT_EQ(info["data_start"], h.data_start);
  const auto& m = info["metadata"];
  EXPECT_EQ(m["t.u8"], nlohmann::json({0, 200}));
  EXPECT_EQ(m["t.i8"], nlohmann::json({1, -100}));
  EXPECT_EQ(m["t.u16"], nlohmann::json({2, 60000}));
  EXPECT_EQ(m["t.i16"], nlohmann::json({3, -30000}));
  EXPECT_EQ(m["t.u32"], nlohmann::json({4, 4000000000u}));
  EXPECT_EQ(m["t.i32"], nlohmann::json({5, -2000000000}));
  EXPECT_EQ(m["t.f32"][0], 6);
  EXPECT_EQ(m["t.f32"][1].get<float>(), 0.1f);
  EXPECT_EQ(m["t.bool"], nlohmann::json({7, true}));
  EXPECT_EQ(m["t.u64"], nlohmann::json({10, 1000000000000000000ull}));
  EXPECT_EQ(m["t.i64"], nlohmann::json({11, -1000000000000000000ll}));
  EXPECT_EQ(m["t.f64"], nlohmann::json({12, 1e-300}));
  EXPECT_EQ(m["t.string"], nlohmann::json({8, "h\xc3\xa9llo"}));
  EXPECT_EQ(m["t.strings"], nlohmann::json::parse(R"([9, [8, ["a", "", "日"]]])"));
  EXPECT_EQ(m["t.i32s"], nlohmann::json::parse("[9, [5, [1, -2, 3]]]"));
  EXPECT_EQ(m["t.f32s"], nlohmann::json::parse("[9, [6, [1.5, -2.0]]]"));
  EXPECT_EQ(m["t.nested"], nlohmann::json::parse("[9, [9, [[5, [5]], [5, [6, 7]]]]]"));
  EXPECT_EQ(m["general.alignment"], nlohmann::json({4, 64}));
  const auto deq = SafetensorsFile::open(dir.file("deq.safetensors"));
  for (size_t i = 0; i < specs.size(); ++i) {
    const GgufTensorInfo& t = h.tensors[i];
    std::vector<float> ours(static_cast<size_t>(t.ne[0] * t.rows()));
    dequantize_rows(t.type, f->data(t), t.rows(), t.ne[0], ours.data(), t.name);
    const Tensor theirs = deq->get(t.name);
    ASSERT_EQ(theirs.numel(), static_cast<int64_t>(ours.size())) << t.name;
    EXPECT_EQ(std::memcmp(theirs.raw_data(), ours.data(), ours.size() * 4), 0) << t.name;
  }
}

TEST(GgufWrite, RefusesWhatLlamaCppCannotRead) {
  TempDir dir;
  const std::string path = dir.file("bad.gguf");
  auto err = [&](std::vector<GgufTensorSpec> specs, const GgufTensorBytes& bytes, uint64_t align = 32) {
    return testing::error_of([&] { write_gguf(path, {}, specs, bytes, align); });
  };
  const auto four = [](size_t) { return std::string(4, '\0'); };
  EXPECT_NE(err({{std::string(64, 'n'), {1}, GgmlType::kF32}}, four).find("names are 1 to 63 bytes"), std::string::npos);
  EXPECT_NE(err({{"a", {1}, GgmlType::kF32}, {"a", {1}, GgmlType::kF32}}, four).find("duplicate tensor name 'a'"),
            std::string::npos);
  EXPECT_NE(err({{"a", {2}, GgmlType::kF32}}, four).find("tensor 'a' came with 4 bytes, its dims and type need 8"),
            std::string::npos);
  EXPECT_NE(err({{"a", {16}, GgmlType::kQ8_0}}, four).find("row length 16 is not a multiple of Q8_0's block of 32"),
            std::string::npos);
  EXPECT_NE(err({}, four, 24).find("alignment 24 is not a power of two"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(GgufFile, OpenNamesTheFile) {
  TempDir dir;
  EXPECT_NE(testing::error_of([&] { GgufFile::open(dir.file("none.gguf")); }).find("none.gguf: cannot open"),
            std::string::npos);
  testing::write_bytes(dir.file("empty.gguf"), "");
  EXPECT_NE(testing::error_of([&] { GgufFile::open(dir.file("empty.gguf")); }).find("empty file"), std::string::npos);
  std::string f = valid_file();
  f.resize(f.size() - 1);
  testing::write_bytes(dir.file("short.gguf"), f);
  EXPECT_NE(testing::error_of([&] { GgufFile::open(dir.file("short.gguf")); }).find("short.gguf: tensor 'q'"),
            std::string::npos);
  EXPECT_TRUE(is_gguf_path(dir.file("short.gguf")));
  testing::write_bytes(dir.file("model.bin"), valid_file());
  EXPECT_TRUE(is_gguf_path(dir.file("model.bin")));
  testing::write_bytes(dir.file("other.bin"), "{}");
  EXPECT_FALSE(is_gguf_path(dir.file("other.bin")));
  EXPECT_FALSE(is_gguf_path(dir.path().string()));
}

// An unchanged file opened again is the same parse; a file written anew at the same path
// (write_gguf renames a new file over it) is read afresh.
TEST(GgufFile, OpeningAgainSharesTheParseUntilTheFileChanges) {
  TempDir dir;
  const std::string path = dir.file("m.gguf");
  auto write = [&](const std::string& arch) {
    write_gguf(path, {{"general.architecture", GgufValue::string(arch)}}, {}, [](size_t) { return std::string(); });
  };
  write("llama");
  const auto a = GgufFile::open(path);
  EXPECT_EQ(GgufFile::open(path), a);
  const GgufFile* held = a.get();
  write("qwen2");
  const auto b = GgufFile::open(path);
  EXPECT_NE(b.get(), held);
  EXPECT_EQ(b->find("general.architecture")->as_string(""), "qwen2");
  EXPECT_EQ(a->find("general.architecture")->as_string(""), "llama");  // the old mapping stays valid
}

}  // namespace
}  // namespace tessera::io
