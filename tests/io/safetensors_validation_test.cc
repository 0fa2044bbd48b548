// Hand-crafted malformed safetensors files: each must fail with one tessera::Error line
// naming the file (and the tensor where there is one), never crash or read out of bounds.
#include <gtest/gtest.h>

#include <cstring>
#include <initializer_list>

#include "io_test_util.h"
#include "tessera/base/error.h"
#include "tessera/io/safetensors.h"

namespace tessera::io {
namespace {

using testing::TempDir;
using testing::write_bytes;

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// 8-byte length + header text + `data_bytes` zero bytes.
std::string craft(const std::string& header, size_t data_bytes) {
  return le64(header.size()) + header + std::string(data_bytes, '\0');
}

std::string parse_error(const std::string& bytes) {
  try {
    parse_safetensors_header(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                             "model.safetensors");
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_EQ(m.find('\n'), std::string::npos) << "error must be one line: " << m;
    EXPECT_EQ(m.rfind("model.safetensors: ", 0), 0u) << "error must start with the file: " << m;
    return m;
  }
  ADD_FAILURE() << "no error for header: " << bytes.substr(8, 200);
  return "";
}

void expect_contains(const std::string& msg, std::initializer_list<const char*> parts) {
  for (const char* p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p
                                                                          << "' in: " << msg;
}

// One valid tensor entry, for building bigger headers.
std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  uint64_t b, uint64_t e) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
         ",\"data_offsets\":[" + std::to_string(b) + "," + std::to_string(e) + "]}";
}

TEST(SafetensorsValidation, ValidMinimalFileParses) {
  std::string bytes = craft(std::string("{") + entry("a", "F32", "[2]", 0, 8) + "," +
                                entry("b", "BF16", "[1,3]", 8, 14) + "}",
                            14);
  SafetensorsHeader h = parse_safetensors_header(
      reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "x");
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.tensors[1].name, "b");
  EXPECT_EQ(h.tensors[1].dtype, DType::kBF16);
  EXPECT_EQ(h.tensors[1].shape, (Shape{1, 3}));
  EXPECT_EQ(h.data_start, 8 + bytes.size() - 8 - 14);
}

TEST(SafetensorsValidation, FileSmallerThanLengthField) {
  expect_contains(parse_error(std::string(5, '\0')), {"5 bytes", "too small"});
  expect_contains(parse_error(""), {"0 bytes"});
}

TEST(SafetensorsValidation, HeaderLongerThanLimit) {
  std::string bytes = le64(100'000'001) + "{}";
  expect_contains(parse_error(bytes), {"header length 100000001", "limit"});
  expect_contains(parse_error(le64(~0ull) + "{}"), {"header length 18446744073709551615"});
}

TEST(SafetensorsValidation, TruncatedHeader) {
  std::string full = craft(std::string("{") + entry("w", "F32", "[4]", 0, 16) + "}", 16);
  expect_contains(parse_error(full.substr(0, 20)), {"runs past the end", "20-byte file"});
}

TEST(SafetensorsValidation, BadJson) {
  expect_contains(parse_error(craft("{\"w\": {\"dtype\": \"F32\",", 0)),
                  {"not valid JSON", "byte"});
  expect_contains(parse_error(craft("{} garbage", 0)), {"not valid JSON"});
  std::string bad_utf8 = craft("{\"w\xff\": 1}", 0);
  expect_contains(parse_error(bad_utf8), {"not valid JSON"});
  expect_contains(parse_error(craft(std::string("{}\0\0", 4), 0)), {"not valid JSON"});
}

TEST(SafetensorsValidation, HeaderNotAnObject) {
  expect_contains(parse_error(craft("[]", 0)), {"must be a JSON object", "array"});
  expect_contains(parse_error(craft("7", 0)), {"must be a JSON object", "number"});
}

TEST(SafetensorsValidation, EntryNotAnObjectOrWrongFields) {
  expect_contains(parse_error(craft("{\"w\": 5}", 0)), {"tensor 'w'", "expected an object"});
  expect_contains(parse_error(craft("{\"w\":{\"dtype\":\"F32\",\"shape\":[0]}}", 0)),
                  {"tensor 'w'", "missing field 'data_offsets'"});
  expect_contains(
      parse_error(craft("{\"w\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0],"
                        "\"extra\":1}}",
                        0)),
      {"tensor 'w'", "unexpected field 'extra'"});
  expect_contains(parse_error(craft("{\"w\":{\"dtype\":3,\"shape\":[0],\"data_offsets\":[0,0]}}", 0)),
                  {"tensor 'w'", "dtype must be a string"});
  expect_contains(parse_error(craft("{\"w\":{\"dtype\":\"F32\",\"shape\":4,\"data_offsets\":[0,0]}}", 0)),
                  {"tensor 'w'", "shape must be an array"});
  expect_contains(parse_error(craft("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 8)),
                  {"tensor 'w'", "data_offsets must be [begin, end]"});
  expect_contains(parse_error(craft("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,-4]}}", 4)),
                  {"tensor 'w'", "data_offsets must be"});
}

TEST(SafetensorsValidation, UnknownDtype) {
  expect_contains(parse_error(craft(std::string("{") + entry("w", "F33", "[1]", 0, 4) + "}", 4)),
                  {"tensor 'w'", "unknown dtype 'F33'"});
}

TEST(SafetensorsValidation, UnsupportedDtypeNamesTensor) {
  for (const char* dt : {"F64", "BOOL", "F8_E5M2", "U16", "C64"}) {
    expect_contains(parse_error(craft(std::string("{") + entry("lm_head.weight", dt, "[1]", 0, 8) + "}", 8)),
                    {"tensor 'lm_head.weight'", "unsupported dtype", dt});
  }
}

TEST(SafetensorsValidation, NegativeOrNonIntegerShape) {
  expect_contains(parse_error(craft(std::string("{") + entry("w", "F32", "[2,-1]", 0, 0) + "}", 0)),
                  {"tensor 'w'", "not a non-negative integer: -1"});
  expect_contains(parse_error(craft(std::string("{") + entry("w", "F32", "[2.0]", 0, 8) + "}", 8)),
                  {"tensor 'w'", "not a non-negative integer"});
  expect_contains(parse_error(craft(std::string("{") + entry("w", "F32", "[\"2\"]", 0, 8) + "}", 8)),
                  {"tensor 'w'", "not a non-negative integer"});
}

TEST(SafetensorsValidation, ShapeOverflow) {
  // 2^32 * 2^32 elements overflows 64 bits (the library's ValidationOverflow).
  expect_contains(parse_error(craft(std::string("{") + entry("w", "F32", "[4294967296,4294967296]", 0, 0) +
                                        "}",
                                    0)),
                  {"tensor 'w'", "overflows"});
  expect_contains(parse_error(craft(std::string("{") + entry("w", "I64", "[2305843009213693952]", 0, 0) + "}", 0)),
                  {"tensor 'w'", "overflows"});
  expect_contains(parse_error(craft(std::string("{") + entry("w", "U8", "[18446744073709551615]", 0, 0) + "}", 0)),
                  {"tensor 'w'", "too large"});
  // A zero dim makes the byte count 0, which is valid.
  std::string ok = craft(std::string("{") + entry("w", "F32", "[0,1048576]", 0, 0) + "}", 0);
  EXPECT_NO_THROW(parse_safetensors_header(reinterpret_cast<const uint8_t*>(ok.data()),
                                           ok.size(), "x"));
}

TEST(SafetensorsValidation, SizeMismatchMessage) {
  std::string msg =
      parse_error(craft(std::string("{") + entry("model.norm.weight", "BF16", "[4]", 0, 12) + "}", 12));
  EXPECT_EQ(msg,
            "model.safetensors: tensor 'model.norm.weight': data_offsets [0, 12] do not match "
            "shape [4] x bf16 (8 bytes)");
}

TEST(SafetensorsValidation, OffsetsOutOfBounds) {
  expect_contains(parse_error(craft(std::string("{") + entry("w", "F32", "[16]", 0, 64) + "}", 16)),
                  {"tensor 'w'", "data_offsets [0, 64]", "past the end of the 16-byte"});
  expect_contains(parse_error(craft(std::string("{") + entry("w", "U8", "[1]", 1ull << 62, (1ull << 62) + 1) +
                                        "}",
                                    4)),
                  {"tensor 'w'", "past the end"});
}

TEST(SafetensorsValidation, EndBeforeBegin) {
  expect_contains(parse_error(craft(std::string("{") + entry("w", "F32", "[0]", 8, 4) + "}", 8)),
                  {"tensor 'w'", "data_offsets [8, 4] end before they begin"});
}

TEST(SafetensorsValidation, Overlap) {
  std::string h = std::string("{") + entry("a", "F32", "[2]", 0, 8) + "," + entry("b", "F32", "[2]", 4, 12) +
                  "}";
  expect_contains(parse_error(craft(h, 12)), {"tensor 'b'", "overlap tensor 'a'", "[0, 8]"});
  // Same offsets twice is an overlap too.
  h = std::string("{") + entry("a", "F32", "[1]", 0, 4) + "," + entry("b", "F32", "[1]", 0, 4) + "}";
  expect_contains(parse_error(craft(h, 4)), {"overlap"});
}

TEST(SafetensorsValidation, Hole) {
  std::string h = std::string("{") + entry("a", "F32", "[1]", 0, 4) + "," + entry("b", "F32", "[1]", 8, 12) +
                  "}";
  expect_contains(parse_error(craft(h, 12)), {"tensor 'b'", "hole", "bytes [4, 8)"});
  h = std::string("{") + entry("a", "F32", "[1]", 4, 8) + "}";
  expect_contains(parse_error(craft(h, 8)), {"tensor 'a'", "hole", "bytes [0, 4)"});
}

TEST(SafetensorsValidation, TrailingBytesNotCovered) {
  std::string h = std::string("{") + entry("a", "F32", "[1]", 0, 4) + "}";
  expect_contains(parse_error(craft(h, 6)), {"cover 4 bytes", "holds 6"});
  expect_contains(parse_error(craft("{}", 1)), {"cover 0 bytes", "holds 1"});
}

TEST(SafetensorsValidation, HeaderOrderNeedNotMatchOffsetOrder) {
  // The library sorts entries by offsets before validating; so do we.
  std::string h = std::string("{") + entry("a", "F32", "[1]", 4, 8) + "," + entry("b", "F32", "[1]", 0, 4) +
                  "}";
  std::string bytes = craft(h, 8);
  SafetensorsHeader hdr = parse_safetensors_header(
      reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "x");
  ASSERT_EQ(hdr.tensors.size(), 2u);
  EXPECT_EQ(hdr.tensors[0].name, "b");
  EXPECT_EQ(hdr.tensors[1].name, "a");
}

TEST(SafetensorsValidation, DuplicateNames) {
  std::string h = std::string("{") + entry("w", "F32", "[1]", 0, 4) + "," + entry("w", "F32", "[1]", 4, 8) +
                  "}";
  expect_contains(parse_error(craft(h, 8)), {"duplicate tensor name 'w'"});
  expect_contains(
      parse_error(craft("{\"w\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],"
                        "\"data_offsets\":[0,4]}}",
                        4)),
      {"tensor 'w'", "duplicate field 'dtype'"});
  expect_contains(parse_error(craft("{\"__metadata__\":{\"k\":\"a\",\"k\":\"b\"}}", 0)),
                  {"__metadata__ has duplicate key 'k'"});
}

TEST(SafetensorsValidation, MetadataMustBeStrings) {
  expect_contains(parse_error(craft("{\"__metadata__\":{\"k\":1}}", 0)),
                  {"__metadata__ value for 'k' must be a string"});
  expect_contains(parse_error(craft("{\"__metadata__\":[1]}", 0)),
                  {"__metadata__ must be an object"});
  std::string ok = craft("{\"__metadata__\":{\"format\":\"pt\"}}", 0);
  SafetensorsHeader h =
      parse_safetensors_header(reinterpret_cast<const uint8_t*>(ok.data()), ok.size(), "x");
  EXPECT_EQ(h.metadata.at("format"), "pt");
  EXPECT_TRUE(h.tensors.empty());
}

TEST(SafetensorsValidation, FileErrorsNameThePath) {
  TempDir dir;
  const std::string p = dir.file("model.safetensors");
  write_bytes(p, craft(std::string("{") + entry("model.norm.weight", "BF16", "[4]", 0, 12) + "}", 12));
  try {
    SafetensorsFile::open(p);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    expect_contains(e.what(), {p.c_str(), "tensor 'model.norm.weight'", "do not match"});
  }
  write_bytes(p, "");
  try {
    SafetensorsFile::open(p);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    expect_contains(e.what(), {p.c_str(), "too small"});
  }
  EXPECT_THROW(SafetensorsFile::open(dir.file("missing.safetensors")), Error);
  EXPECT_THROW(SafetensorsFile::open(dir.path().string()), Error);
}

// Cheap deterministic mutation sweep: every truncation and every single-byte corruption
// of a valid file must either parse or throw tessera::Error (ASan builds catch overreads).
TEST(SafetensorsValidation, TruncationsAndByteFlipsNeverCrash) {
  std::string good = craft("{\"__metadata__\":{\"format\":\"pt\"}," +
                               entry("a", "F16", "[3]", 0, 6) + "," +
                               entry("b", "I64", "[1,1]", 6, 14) + "}",
                           14);
  int errors = 0;
  auto attempt = [&](const std::string& bytes) {
    try {
      parse_safetensors_header(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "x");
    } catch (const Error&) {
      ++errors;
    }
  };
  for (size_t n = 0; n < good.size(); ++n) attempt(good.substr(0, n));
  EXPECT_EQ(errors, static_cast<int>(good.size()));
  for (size_t i = 0; i < good.size(); ++i) {
    for (uint8_t v : {0x00, 0x22, 0x5b, 0x7d, 0xff}) {
      std::string b = good;
      b[i] = static_cast<char>(v);
      attempt(b);
    }
  }
}

}  // namespace
}  // namespace tessera::io
