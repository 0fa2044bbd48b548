// Tests for JSON file reading errors and the atomic file writer.
#include "tessera/io/json_file.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "io_test_util.h"
#include "tessera/base/error.h"

namespace tessera::io {
namespace {

using testing::TempDir;
using testing::write_bytes;

using testing::error_of;

TEST(JsonFile, ReadsValidFile) {
  TempDir dir;
  write_bytes(dir.file("config.json"), R"({"hidden_size": 64, "names": ["a", "b"]})");
  nlohmann::json j = read_json_file(dir.file("config.json"));
  EXPECT_EQ(j["hidden_size"].get<int>(), 64);
  EXPECT_EQ(j["names"][1].get<std::string>(), "b");
}

TEST(JsonFile, MissingFileNamesPath) {
  TempDir dir;
  const std::string p = dir.file("nope.json");
  std::string msg = error_of([&] { read_json_file(p); });
  EXPECT_NE(msg.find(p), std::string::npos) << msg;
  EXPECT_NE(msg.find("No such file"), std::string::npos) << msg;
}

TEST(JsonFile, DirectoryIsRejected) {
  TempDir dir;
  std::string msg = error_of([&] { read_json_file(dir.path().string()); });
  EXPECT_NE(msg.find(dir.path().string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("directory"), std::string::npos) << msg;
}

TEST(JsonFile, UnreadableFileNamesPath) {
  if (::geteuid() == 0) GTEST_SKIP() << "root can read any file";
  TempDir dir;
  const std::string p = dir.file("secret.json");
  write_bytes(p, "{}");
  std::filesystem::permissions(p, std::filesystem::perms::none);
  std::string msg = error_of([&] { read_json_file(p); });
  EXPECT_NE(msg.find(p), std::string::npos) << msg;
  EXPECT_NE(msg.find("Permission denied"), std::string::npos) << msg;
}

TEST(JsonFile, ParseErrorGivesLineColumnAndByte) {
  TempDir dir;
  const std::string p = dir.file("bad.json");
  // The error is the '}' on line 3, column 13 (byte 24 counting from 0).
  write_bytes(p, "{\n  \"a\": 1,\n  \"b\": [1, 2}\n}\n");
  std::string msg = error_of([&] { read_json_file(p); });
  EXPECT_NE(msg.find(p + ":3:13 (byte 24)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("invalid JSON"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("json.exception"), std::string::npos) << msg;
}

TEST(JsonFile, EmptyFileIsAParseError) {
  TempDir dir;
  const std::string p = dir.file("empty.json");
  write_bytes(p, "");
  std::string msg = error_of([&] { read_json_file(p); });
  EXPECT_NE(msg.find(p + ":1:1"), std::string::npos) << msg;
}

TEST(JsonFile, NulByteIsAnError) {
  // nlohmann alone would stop at the NUL and accept "{}".
  std::string msg = error_of([] { parse_json_text(std::string("{}\n\0junk", 8), "x.json"); });
  EXPECT_EQ(msg, "x.json:2:1 (byte 3): invalid JSON: NUL byte");
}

// Both bounds hold whatever the parser stored the number as (a parsed 0 is unsigned).
TEST(JsonFile, IntInRangeChecksBothBounds) {
  const auto in = [](const char* text, int64_t lo, int64_t hi) { return json_int_in(nlohmann::json::parse(text), lo, hi); };
  EXPECT_FALSE(in("0", 1, 10));
  EXPECT_TRUE(in("1", 1, 10));
  EXPECT_TRUE(in("10", 1, 10));
  EXPECT_FALSE(in("11", 1, 10));
  EXPECT_FALSE(in("-1", 0, 10));
  EXPECT_TRUE(in("-1", -5, 10));
  EXPECT_FALSE(in("1.5", 0, 10));
  EXPECT_FALSE(in("18446744073709551615", 0, int64_t{1} << 62));
}

TEST(JsonFile, ParseTextNamesSource) {
  std::string msg = error_of([] { parse_json_text("[1, 2", "request body"); });
  EXPECT_EQ(msg.rfind("request body:1:6", 0), 0u) << msg;
}

TEST(JsonFile, WriteFileAtomicReplacesAndLeavesNoTemp) {
  TempDir dir;
  const std::string p = dir.file("out.json");
  write_file_atomic(p, "old");
  write_file_atomic(p, "{\"x\": 1}");
  EXPECT_EQ(read_json_file(p)["x"].get<int>(), 1);
  EXPECT_FALSE(std::filesystem::exists(p + ".tmp"));
  std::string msg = error_of([&] { write_file_atomic(dir.file("no/such/dir/f"), "x"); });
  EXPECT_NE(msg.find("no/such/dir/f.tmp"), std::string::npos) << msg;
}

// The O_DIRECT writer: exact bytes for sizes around the block size (the last block is
// written padded and truncated), on the disk's file system and on tmpfs (which may
// refuse O_DIRECT and be written the buffered way), replacing an older file.
TEST(JsonFile, WriteFileAtomicDirectWritesExactBytes) {
  TempDir dir;
  std::vector<std::string> roots = {dir.path().string()};
  if (std::filesystem::is_directory("/dev/shm")) roots.push_back("/dev/shm");
  const size_t kMax = 3 * kDirectIoAlignment + 1;
  void* raw = std::aligned_alloc(kDirectIoAlignment, 4 * kDirectIoAlignment);
  ASSERT_NE(raw, nullptr);
  std::unique_ptr<char, decltype(&std::free)> buf(static_cast<char*>(raw), &std::free);
  for (size_t i = 0; i < 4 * kDirectIoAlignment; ++i) buf.get()[i] = static_cast<char>(i * 7 + 3);
  for (const std::string& root : roots) {
    const std::string p = root + "/tessera_direct_" + std::to_string(::getpid()) + ".bin";
    write_file_atomic(p, std::string(100000, 'x'));  // an older, longer file is replaced
    for (size_t n : {size_t{0}, size_t{1}, size_t{511}, kDirectIoAlignment - 1,
                     kDirectIoAlignment, kDirectIoAlignment + 1, kMax}) {
      write_file_atomic_direct(p, buf.get(), n);
      EXPECT_EQ(read_file_bytes(p), std::string(buf.get(), n)) << p << " size " << n;
      EXPECT_FALSE(std::filesystem::exists(p + ".tmp"));
    }
    std::filesystem::remove(p);
  }
  std::string msg = error_of([&] { write_file_atomic_direct(dir.file("f"), buf.get() + 1, 10); });
  EXPECT_NE(msg.find("aligned"), std::string::npos) << msg;
  msg = error_of([&] { write_file_atomic_direct(dir.file("no/such/dir/f"), buf.get(), 10); });
  EXPECT_NE(msg.find("no/such/dir/f.tmp"), std::string::npos) << msg;
}

// Nesting is refused before any DOM is built, with the position of the first bracket too
// deep; the scan knows strings, so brackets inside them do not count.
TEST(JsonFile, NestingDeeperThanTheLimitIsRefusedWithItsPosition) {
  const std::string deep = "{\"a\": 1,\n \"x\": " + std::string(200000, '[') + std::string(200000, ']') + "}";
  std::string msg = error_of([&] { parse_json_text(deep, "tok.json"); });
  EXPECT_NE(msg.find("tok.json:2:134 (byte 142): invalid JSON: nested deeper than 128 levels"), std::string::npos)
      << msg;
  const std::string at_limit = std::string(127, '[') + "{}" + std::string(127, ']');
  EXPECT_NO_THROW(parse_json_text(at_limit, "ok.json"));
  EXPECT_NE(error_of([&] { parse_json_text("[" + at_limit + "]", "f"); }).find("deeper than 128"), std::string::npos);
  const std::string in_string = "{\"s\": \"" + std::string(1000, '[') + "\\\"" + std::string(1000, '{') + "\"}";
  EXPECT_EQ(parse_json_text(in_string, "s.json")["s"].get<std::string>().size(), 2001u);
  JsonLimits tight;
  tight.max_depth = 2;
  EXPECT_NE(error_of([&] { parse_json_text("[[[1]]]", "f", tight); }).find("f:1:3 (byte 2)"), std::string::npos);
}

TEST(JsonFile, SizeLimitIsCheckedBeforeReading) {
  TempDir dir;
  write_bytes(dir.file("big.json"), "[" + std::string(5000, ' ') + "]");
  JsonLimits small;
  small.max_bytes = 1000;
  const std::string msg = error_of([&] { read_json_file(dir.file("big.json"), small); });
  EXPECT_NE(msg.find("big.json: 5002 bytes exceed the limit of 1000"), std::string::npos) << msg;
  EXPECT_NE(error_of([&] { parse_json_text(std::string(2000, ' '), "body", small); }).find("body: 2000 bytes"),
            std::string::npos);
}

TEST(JsonFile, BriefDescriptionsAndTypedKeysNameTheKey) {
  EXPECT_EQ(json_brief(nlohmann::json::parse("[[1],[2],[3]]")), "an array of 3 items");
  EXPECT_EQ(json_brief(nlohmann::json::parse("{\"a\": {}}")), "an object");
  EXPECT_EQ(json_brief(nlohmann::json(std::string(100, 'x'))), "\"" + std::string(40, 'x') + "\"...");
  EXPECT_EQ(json_brief(nlohmann::json(12)), "12");
  const auto j = nlohmann::json::parse(R"({"flag": "yes", "name": 3, "ok": true})");
  EXPECT_EQ(error_of([&] { json_bool(j, "flag", false, "f.json: pre_tokenizer"); }),
            "f.json: pre_tokenizer.flag: expected true or false, got \"yes\"");
  EXPECT_EQ(error_of([&] { json_string(j, "name", "", "f.json: model"); }),
            "f.json: model.name: expected a string, got 3");
  EXPECT_TRUE(json_bool(j, "ok", false, "f"));
  EXPECT_EQ(json_string(j, "missing", "BPE", "f"), "BPE");
}

}  // namespace
}  // namespace tessera::io
