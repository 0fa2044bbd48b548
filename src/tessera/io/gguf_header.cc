// The GGUF header: ggml's type table, metadata values and the validating parser. It depends
// only on base/error.h so the libFuzzer target (tests/fuzz) can build it on its own.
// Rules follow llama.cpp's reader (ggml/src/gguf.cpp) except that tensor data need not be
// packed back to back: any aligned, disjoint placement inside the file is accepted.
#include <algorithm>
#include <cstring>
#include <limits>
#include <sstream>
#include <unordered_set>

#include "tessera/base/error.h"
#include "tessera/io/gguf.h"

namespace tessera::io {

namespace {

struct TypeEntry {
  uint32_t id;
  GgmlTypeTraits traits;
};

// ggml.c's type_traits: block size and bytes per block.
constexpr TypeEntry kTypes[] = {
    {0, {"F32", 1, 4}},          {1, {"F16", 1, 2}},          {2, {"Q4_0", 32, 18}},
    {3, {"Q4_1", 32, 20}},       {6, {"Q5_0", 32, 22}},       {7, {"Q5_1", 32, 24}},
    {8, {"Q8_0", 32, 34}},       {9, {"Q8_1", 32, 36}},       {10, {"Q2_K", 256, 84}},
    {11, {"Q3_K", 256, 110}},    {12, {"Q4_K", 256, 144}},    {13, {"Q5_K", 256, 176}},
    {14, {"Q6_K", 256, 210}},    {15, {"Q8_K", 256, 292}},    {16, {"IQ2_XXS", 256, 66}},
    {17, {"IQ2_XS", 256, 74}},   {18, {"IQ3_XXS", 256, 98}},  {19, {"IQ1_S", 256, 50}},
    {20, {"IQ4_NL", 32, 18}},    {21, {"IQ3_S", 256, 110}},   {22, {"IQ2_S", 256, 82}},
    {23, {"IQ4_XS", 256, 136}},  {24, {"I8", 1, 1}},          {25, {"I16", 1, 2}},
    {26, {"I32", 1, 4}},         {27, {"I64", 1, 8}},         {28, {"F64", 1, 8}},
    {29, {"IQ1_M", 256, 56}},    {30, {"BF16", 1, 2}},        {34, {"TQ1_0", 256, 54}},
    {35, {"TQ2_0", 256, 66}},    {39, {"MXFP4", 32, 17}},
};

// Bytes of one scalar of a numeric (or bool) metadata type; 0 for string / array / unknown.
size_t scalar_bytes(GgufType t) {
  switch (t) {
    case GgufType::kU8: case GgufType::kI8: case GgufType::kBool: return 1;
    case GgufType::kU16: case GgufType::kI16: return 2;
    case GgufType::kU32: case GgufType::kI32: case GgufType::kF32: return 4;
    case GgufType::kU64: case GgufType::kI64: case GgufType::kF64: return 8;
    default: return 0;
  }
}

bool known_value_type(uint32_t t) { return t <= static_cast<uint32_t>(GgufType::kF64); }

bool is_signed(GgufType t) {
  return t == GgufType::kI8 || t == GgufType::kI16 || t == GgufType::kI32 || t == GgufType::kI64;
}

// Little-endian integer of `n` bytes, sign-extended when `sign`.
uint64_t read_le(const uint8_t* p, size_t n, bool sign) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  if (sign && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);
  return v;
}

std::string put_le(uint64_t v, size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(v >> (8 * i));
  return s;
}

std::string quote(const std::string& s) {
  std::string q = s.size() > 80 ? s.substr(0, 77) + "..." : s;
  for (char& c : q)
    if (static_cast<unsigned char>(c) < 0x20) c = '?';
  return "'" + q + "'";
}

std::string dims_str(const std::vector<int64_t>& ne) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < ne.size(); ++i) os << (i ? ", " : "") << ne[i];
  os << ']';
  return os.str();
}

}  // namespace

// ---- type table ------------------------------------------------------------------------

const GgmlTypeTraits* ggml_type_traits(uint32_t type) {
  for (const TypeEntry& e : kTypes)
    if (e.id == type) return &e.traits;
  return nullptr;
}

const char* ggml_type_name(GgmlType t) {
  const GgmlTypeTraits* tr = ggml_type_traits(static_cast<uint32_t>(t));
  return tr ? tr->name : "?";
}

int64_t ggml_row_bytes(GgmlType t, int64_t n, const std::string& what) {
  const GgmlTypeTraits* tr = ggml_type_traits(static_cast<uint32_t>(t));
  TESSERA_CHECK(tr, what, ": unknown ggml type ", static_cast<uint32_t>(t));
  TESSERA_CHECK(n >= 0 && n % tr->block == 0, what, ": row length ", n, " is not a multiple of ",
                tr->name, "'s block of ", tr->block);
  return n / tr->block * tr->bytes;
}

const char* gguf_type_name(GgufType t) {
  static const char* const kNames[] = {"u8",  "i8",     "u16",   "i16", "u32", "i32", "f32",
                                       "bool", "string", "array", "u64", "i64", "f64"};
  const auto i = static_cast<uint32_t>(t);
  return i < sizeof kNames / sizeof kNames[0] ? kNames[i] : "?";
}

// ---- GgufValue -------------------------------------------------------------------------

GgufValue GgufValue::scalar(GgufType t, const uint8_t* bytes) {
  GgufValue v;
  v.type_ = t;
  v.bytes_.assign(reinterpret_cast<const char*>(bytes), scalar_bytes(t));
  return v;
}

GgufValue GgufValue::u32(uint32_t x) {
  const std::string b = put_le(x, 4);
  return scalar(GgufType::kU32, reinterpret_cast<const uint8_t*>(b.data()));
}

GgufValue GgufValue::f32(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const std::string b = put_le(u, 4);
  return scalar(GgufType::kF32, reinterpret_cast<const uint8_t*>(b.data()));
}

GgufValue GgufValue::boolean(bool x) {
  const uint8_t b = x ? 1 : 0;
  return scalar(GgufType::kBool, &b);
}

GgufValue GgufValue::string(std::string x) {
  GgufValue v;
  v.type_ = GgufType::kString;
  v.bytes_ = std::move(x);
  return v;
}

GgufValue GgufValue::strings(std::vector<std::string> x) {
  GgufValue v;
  v.type_ = GgufType::kArray;
  v.elem_ = GgufType::kString;
  v.count_ = x.size();
  v.strings_ = std::move(x);
  return v;
}

GgufValue GgufValue::i32s(const std::vector<int32_t>& x) {
  std::string b;
  b.reserve(x.size() * 4);
  for (int32_t e : x) b += put_le(static_cast<uint32_t>(e), 4);
  return packed_array(GgufType::kI32, x.size(), std::move(b));
}

GgufValue GgufValue::f32s(const std::vector<float>& x) {
  std::string b;
  b.reserve(x.size() * 4);
  for (float e : x) {
    uint32_t u;
    std::memcpy(&u, &e, 4);
    b += put_le(u, 4);
  }
  return packed_array(GgufType::kF32, x.size(), std::move(b));
}

GgufValue GgufValue::packed_array(GgufType elem, uint64_t count, std::string bytes) {
  TESSERA_CHECK(scalar_bytes(elem) > 0 && bytes.size() == count * scalar_bytes(elem),
                "GGUF array of ", count, " ", gguf_type_name(elem), " needs ",
                count * scalar_bytes(elem), " bytes, got ", bytes.size());
  GgufValue v;
  v.type_ = GgufType::kArray;
  v.elem_ = elem;
  v.count_ = count;
  v.bytes_ = std::move(bytes);
  return v;
}

GgufValue GgufValue::array_of_arrays(std::vector<GgufValue> items) {
  GgufValue v;
  v.type_ = GgufType::kArray;
  v.elem_ = GgufType::kArray;
  v.count_ = items.size();
  v.arrays_ = std::move(items);
  return v;
}

uint64_t GgufValue::size() const { return type_ == GgufType::kArray ? count_ : 0; }

bool GgufValue::is_integer() const {
  return scalar_bytes(type_) > 0 && type_ != GgufType::kBool && type_ != GgufType::kF32 &&
         type_ != GgufType::kF64;
}

uint64_t GgufValue::as_uint(const std::string& what) const {
  TESSERA_CHECK(is_integer(), what, ": expected an integer, got ", describe());
  const uint64_t v = read_le(reinterpret_cast<const uint8_t*>(bytes_.data()), bytes_.size(),
                             is_signed(type_));
  TESSERA_CHECK(!is_signed(type_) || static_cast<int64_t>(v) >= 0, what,
                ": expected a non-negative integer, got ", describe());
  return v;
}

int64_t GgufValue::as_int(const std::string& what) const {
  TESSERA_CHECK(is_integer(), what, ": expected an integer, got ", describe());
  const uint64_t v = read_le(reinterpret_cast<const uint8_t*>(bytes_.data()), bytes_.size(),
                             is_signed(type_));
  TESSERA_CHECK(is_signed(type_) || v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                what, ": ", describe(), " does not fit in a 64-bit signed integer");
  return static_cast<int64_t>(v);
}

double GgufValue::as_float(const std::string& what) const {
  if (type_ == GgufType::kF32) {
    const uint32_t u = static_cast<uint32_t>(read_le(reinterpret_cast<const uint8_t*>(bytes_.data()), 4, false));
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  TESSERA_CHECK(type_ == GgufType::kF64, what, ": expected a float, got ", describe());
  const uint64_t u = read_le(reinterpret_cast<const uint8_t*>(bytes_.data()), 8, false);
  double d;
  std::memcpy(&d, &u, 8);
  return d;
}

bool GgufValue::as_bool(const std::string& what) const {
  TESSERA_CHECK(type_ == GgufType::kBool, what, ": expected a bool, got ", describe());
  return bytes_[0] != 0;
}

const std::string& GgufValue::as_string(const std::string& what) const {
  TESSERA_CHECK(type_ == GgufType::kString, what, ": expected a string, got ", describe());
  return bytes_;
}

const std::vector<std::string>& GgufValue::as_strings(const std::string& what) const {
  TESSERA_CHECK(type_ == GgufType::kArray && elem_ == GgufType::kString, what,
                ": expected an array of strings, got ", describe());
  return strings_;
}

int64_t GgufValue::int_at(uint64_t i, const std::string& what) const {
  const size_t n = scalar_bytes(elem_);
  TESSERA_CHECK(type_ == GgufType::kArray && n > 0 && elem_ != GgufType::kBool &&
                    elem_ != GgufType::kF32 && elem_ != GgufType::kF64,
                what, ": expected an array of integers, got ", describe());
  TESSERA_CHECK(i < count_, what, ": index ", i, " past the ", count_, " elements");
  const uint64_t v = read_le(reinterpret_cast<const uint8_t*>(bytes_.data()) + i * n, n, is_signed(elem_));
  TESSERA_CHECK(is_signed(elem_) || v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                what, ": element ", i, " (", v, ") does not fit in a 64-bit signed integer");
  return static_cast<int64_t>(v);
}

double GgufValue::float_at(uint64_t i, const std::string& what) const {
  TESSERA_CHECK(type_ == GgufType::kArray && (elem_ == GgufType::kF32 || elem_ == GgufType::kF64), what,
                ": expected an array of floats, got ", describe());
  TESSERA_CHECK(i < count_, what, ": index ", i, " past the ", count_, " elements");
  const size_t n = scalar_bytes(elem_);
  const uint64_t u = read_le(reinterpret_cast<const uint8_t*>(bytes_.data()) + i * n, n, false);
  if (n == 4) {
    float f;
    const uint32_t u32 = static_cast<uint32_t>(u);
    std::memcpy(&f, &u32, 4);
    return f;
  }
  double d;
  std::memcpy(&d, &u, 8);
  return d;
}

void GgufValue::append_to(std::string& out) const {
  if (type_ == GgufType::kString) {
    out += put_le(bytes_.size(), 8);
    out += bytes_;
    return;
  }
  if (type_ != GgufType::kArray) {
    out += bytes_;
    return;
  }
  out += put_le(static_cast<uint32_t>(elem_), 4);
  out += put_le(count_, 8);
  if (elem_ == GgufType::kString) {
    for (const std::string& s : strings_) {
      out += put_le(s.size(), 8);
      out += s;
    }
  } else if (elem_ == GgufType::kArray) {
    for (const GgufValue& a : arrays_) a.append_to(out);
  } else {
    out += bytes_;
  }
}

std::string GgufValue::describe() const {
  std::ostringstream os;
  os << gguf_type_name(type_);
  if (type_ == GgufType::kString) {
    os << ' ' << quote(bytes_);
  } else if (type_ == GgufType::kArray) {
    os << " of " << count_ << ' ' << gguf_type_name(elem_);
  } else if (type_ == GgufType::kBool) {
    os << ' ' << (bytes_[0] ? "true" : "false");
  } else if (type_ == GgufType::kF32 || type_ == GgufType::kF64) {
    os << ' ' << as_float("");
  } else if (is_signed(type_)) {
    os << ' ' << static_cast<int64_t>(read_le(reinterpret_cast<const uint8_t*>(bytes_.data()), bytes_.size(), true));
  } else {
    os << ' ' << read_le(reinterpret_cast<const uint8_t*>(bytes_.data()), bytes_.size(), false);
  }
  return os.str();
}

int64_t GgufTensorInfo::rows() const {
  int64_t r = 1;
  for (size_t i = 1; i < ne.size(); ++i) r *= ne[i];
  return r;
}

const GgufValue* GgufHeader::find(const std::string& key) const {
  for (const auto& [k, v] : metadata)
    if (k == key) return &v;
  return nullptr;
}

// ---- parser ----------------------------------------------------------------------------

namespace {

// Arrays nest at most this deep, and hold at most this many arrays in all: GGUF allows
// arrays of arrays but no known file uses them, and each costs far more in memory than
// its 12 bytes on disk.
constexpr int kMaxArrayDepth = 8;
constexpr uint64_t kMaxNestedArrays = uint64_t{1} << 20;

class Reader {
 public:
  Reader(const uint8_t* data, size_t size, const std::string& source)
      : data_(data), size_(size), source_(source) {}

  size_t pos() const { return pos_; }
  uint64_t left() const { return size_ - pos_; }

  const uint8_t* take(uint64_t n, const std::string& what) {
    if (n > left())
      fail(source_, ": ", what, " at byte ", pos_, " needs ", n, " bytes, but the file ends at byte ", size_);
    const uint8_t* p = data_ + pos_;
    pos_ += static_cast<size_t>(n);
    return p;
  }
  uint32_t u32(const std::string& what) { return static_cast<uint32_t>(read_le(take(4, what), 4, false)); }
  uint64_t u64(const std::string& what) { return read_le(take(8, what), 8, false); }
  // A string: u64 length, then its bytes. index >= 0 names element `index` of array `what`;
  // the label is built only for an error (a tokenizer's arrays hold ~10^5 strings).
  std::string str(const std::string& what, int64_t index = -1) {
    const auto label = [&] { return index < 0 ? what : what + "[" + std::to_string(index) + "]"; };
    const size_t at = pos_;
    if (left() < 8)
      fail(source_, ": ", label(), " length at byte ", pos_, " needs 8 bytes, but the file ends at byte ", size_);
    const uint64_t n = read_le(data_ + pos_, 8, false);
    pos_ += 8;
    if (n > left())
      fail(source_, ": ", label(), " at byte ", at, " has length ", n, ", past the end of the file (",
           left(), " bytes left)");
    const char* p = reinterpret_cast<const char*>(data_ + pos_);
    pos_ += static_cast<size_t>(n);
    return std::string(p, static_cast<size_t>(n));
  }

  GgufValue value(GgufType t, const std::string& what, int depth, uint64_t& nested_budget) {
    if (t == GgufType::kString) return GgufValue::string(str(what));
    if (t != GgufType::kArray) return GgufValue::scalar(t, take(scalar_bytes(t), what));
    const size_t at = pos_;
    const uint32_t et = u32(what + " element type");
    if (!known_value_type(et)) fail(source_, ": ", what, " is an array of unknown value type ", et);
    const auto elem = static_cast<GgufType>(et);
    const uint64_t count = u64(what + " element count");
    // The least each element takes on disk: a count past what is left cannot be real.
    const uint64_t least = elem == GgufType::kString ? 8 : elem == GgufType::kArray ? 12 : scalar_bytes(elem);
    if (count > left() / least)
      fail(source_, ": ", what, " at byte ", at, " claims ", count, " ", gguf_type_name(elem),
           " elements, more than the ", left(), " bytes left in the file can hold");
    if (elem == GgufType::kString) {
      std::vector<std::string> items;
      items.reserve(static_cast<size_t>(count));
      for (uint64_t i = 0; i < count; ++i) items.push_back(str(what, static_cast<int64_t>(i)));
      return GgufValue::strings(std::move(items));
    }
    if (elem == GgufType::kArray) {
      if (depth >= kMaxArrayDepth) fail(source_, ": ", what, " nests arrays deeper than ", kMaxArrayDepth, " levels");
      if (count > nested_budget) fail(source_, ": ", what, ": more than ", kMaxNestedArrays, " nested arrays in the metadata");
      nested_budget -= count;
      std::vector<GgufValue> items;
      items.reserve(static_cast<size_t>(count));
      for (uint64_t i = 0; i < count; ++i)
        items.push_back(value(GgufType::kArray, what + "[" + std::to_string(i) + "]", depth + 1, nested_budget));
      return GgufValue::array_of_arrays(std::move(items));
    }
    const uint8_t* p = take(count * scalar_bytes(elem), what);
    return GgufValue::packed_array(elem, count, std::string(reinterpret_cast<const char*>(p),
                                                            static_cast<size_t>(count * scalar_bytes(elem))));
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& source_;
};

}  // namespace

GgufHeader parse_gguf_header(const uint8_t* data, size_t size, const std::string& source) {
  TESSERA_CHECK(size >= 4, source, ": ", size, " bytes is too small for a GGUF file");
  if (std::memcmp(data, "GGUF", 4) != 0) {
    std::ostringstream os;
    os << std::hex;
    for (int i = 0; i < 4; ++i) os << (i ? " " : "") << "0x" << static_cast<int>(data[i]);
    fail(source, ": not a GGUF file (it starts with ", os.str(), ", not \"GGUF\")");
  }
  Reader r(data, size, source);
  r.take(4, "magic");
  GgufHeader h;
  h.version = r.u32("version");
  if (h.version != 2 && h.version != 3) {
    const bool swapped = h.version == 0x02000000u || h.version == 0x03000000u;
    fail(source, ": GGUF version ", h.version, " is not supported (Tessera reads versions 2 and 3",
         swapped ? "; this looks like a big-endian file" : "", ")");
  }
  const uint64_t n_tensors = r.u64("tensor count");
  const uint64_t n_kv = r.u64("metadata count");
  // A metadata entry takes at least 13 bytes (key length, type, a one-byte value), a tensor
  // info at least 24 (name length, n_dims, type, offset).
  TESSERA_CHECK(n_kv <= r.left() / 13, source, ": metadata count ", n_kv, " cannot fit in the ",
                r.left(), " bytes after the header");
  TESSERA_CHECK(n_tensors <= r.left() / 24, source, ": tensor count ", n_tensors,
                " cannot fit in the ", r.left(), " bytes after the header");

  std::unordered_set<std::string> keys;
  uint64_t nested_budget = kMaxNestedArrays;
  h.metadata.reserve(static_cast<size_t>(n_kv));
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = r.str("metadata key " + std::to_string(i));
    const std::string what = "metadata key " + quote(key);
    TESSERA_CHECK(keys.insert(key).second, source, ": duplicate ", what);
    const uint32_t t = r.u32(what + " value type");
    TESSERA_CHECK(known_value_type(t), source, ": ", what, " has unknown value type ", t);
    GgufValue v = r.value(static_cast<GgufType>(t), what, 0, nested_budget);
    h.metadata.emplace_back(std::move(key), std::move(v));
  }
  if (const GgufValue* a = h.find("general.alignment")) {
    TESSERA_CHECK(a->type() == GgufType::kU32, source, ": general.alignment must be a u32, got ",
                  a->describe());
    h.alignment = a->as_uint("general.alignment");
    TESSERA_CHECK(h.alignment > 0 && (h.alignment & (h.alignment - 1)) == 0, source,
                  ": general.alignment ", h.alignment, " is not a power of two");
  }

  constexpr uint64_t kMaxI64 = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  std::unordered_set<std::string> names;
  h.tensors.reserve(static_cast<size_t>(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo t;
    t.name = r.str("tensor " + std::to_string(i) + " name");
    const std::string what = source + ": tensor " + quote(t.name);
    TESSERA_CHECK(names.insert(t.name).second, source, ": duplicate tensor name ", quote(t.name));
    const uint32_t nd = r.u32("tensor " + quote(t.name) + " n_dims");
    TESSERA_CHECK(nd >= 1 && nd <= kGgufMaxDims, what, " has ", nd, " dims (1 to ", kGgufMaxDims, " are valid)");
    for (uint32_t d = 0; d < nd; ++d) {
      const uint64_t v = r.u64("tensor " + quote(t.name) + " dim");
      TESSERA_CHECK(v <= kMaxI64, what, ": dim ", d, " = ", v, " is too large");
      t.ne.push_back(static_cast<int64_t>(v));
    }
    const uint32_t ty = r.u32("tensor " + quote(t.name) + " type");
    const GgmlTypeTraits* tr = ggml_type_traits(ty);
    TESSERA_CHECK(tr, what, " has unknown ggml type ", ty);
    t.type = static_cast<GgmlType>(ty);
    t.offset = r.u64("tensor " + quote(t.name) + " offset");
    TESSERA_CHECK(t.ne[0] % tr->block == 0, what, ": row length ", t.ne[0], " is not a multiple of ",
                  tr->name, "'s block of ", tr->block);
    // Rows, elements and bytes in int64, as ggml keeps them (ggml_nrows, ggml_nelements,
    // ggml_nbytes); rows are multiplied out on their own so that a zero row length does not
    // hide an overflowing product of the other dims.
    int64_t rows = 1, numel = 0, row_bytes = 0, nbytes = 0;
    bool overflow = false;
    for (size_t d = 1; d < t.ne.size(); ++d) overflow = overflow || __builtin_mul_overflow(rows, t.ne[d], &rows);
    overflow = overflow || __builtin_mul_overflow(t.ne[0], rows, &numel) ||
               __builtin_mul_overflow(t.ne[0] / tr->block, tr->bytes, &row_bytes) ||
               __builtin_mul_overflow(row_bytes, rows, &nbytes);
    TESSERA_CHECK(!overflow, what, ": dims ", dims_str(t.ne), " of ", tr->name, " overflow a 64-bit size");
    t.nbytes = static_cast<uint64_t>(nbytes);
    h.tensors.push_back(std::move(t));
  }

  const uint64_t a = h.alignment;
  TESSERA_CHECK(r.pos() <= std::numeric_limits<uint64_t>::max() - a, source, ": header too large");
  h.data_start = (r.pos() + a - 1) / a * a;
  for (const GgufTensorInfo& t : h.tensors) {
    const std::string what = source + ": tensor " + quote(t.name);
    TESSERA_CHECK(t.offset % a == 0, what, ": data offset ", t.offset, " is not a multiple of the alignment ", a);
    const bool inside = h.data_start <= size && t.offset <= size - h.data_start &&
                        t.nbytes <= size - h.data_start - t.offset;
    TESSERA_CHECK(inside, what, ": data [", t.offset, ", ", t.offset + t.nbytes, ") of the data section at byte ",
                  h.data_start, " runs past the end of the file (", size, " bytes)");
  }
  std::vector<const GgufTensorInfo*> by_offset;
  for (const GgufTensorInfo& t : h.tensors)
    if (t.nbytes > 0) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const GgufTensorInfo* x, const GgufTensorInfo* y) { return x->offset < y->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const GgufTensorInfo& p = *by_offset[i - 1];
    const GgufTensorInfo& q = *by_offset[i];
    TESSERA_CHECK(p.offset + p.nbytes <= q.offset, source, ": tensors ", quote(p.name), " [", p.offset, ", ",
                  p.offset + p.nbytes, ") and ", quote(q.name), " [", q.offset, ", ", q.offset + q.nbytes,
                  ") overlap");
  }
  return h;
}

}  // namespace tessera::io
