// Validating parser for the safetensors header. It depends only on nlohmann-json and
// tensor/dtype.cc so the libFuzzer target (tests/fuzz) can build it on its own.
// Rules follow the reference library (safetensors/src/tensor.rs: read_metadata and
// Metadata::validate); we add duplicate-name and exact-field checks it leaves to serde.
#include <algorithm>
#include <cstring>
#include <limits>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/io/safetensors.h"

namespace tessera::io {

using nlohmann::json;

const char* safetensors_dtype_name(DType dt) {
  switch (dt) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kI8: return "I8";
    case DType::kU8: return "U8";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
    case DType::kF8E4M3: return "F8_E4M3";
  }
  return "?";
}

namespace {

constexpr const char* kMetadataKey = "__metadata__";

// Every dtype the format defines; those we cannot represent are "unsupported", anything
// else is "unknown" (most likely a corrupt or foreign file).
bool is_known_safetensors_dtype(const std::string& s) {
  static const char* const kAll[] = {"BOOL", "F4",  "F6_E2M3", "F6_E3M2", "U8",  "I8",
                                     "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16",
                                     "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"};
  for (const char* k : kAll)
    if (s == k) return true;
  return false;
}

bool dtype_from_safetensors(const std::string& s, DType* out) {
  static const std::pair<const char*, DType> kMap[] = {
      {"F32", DType::kF32}, {"BF16", DType::kBF16}, {"F16", DType::kF16}, {"I8", DType::kI8},
      {"U8", DType::kU8},   {"I32", DType::kI32},   {"I64", DType::kI64}, {"F8_E4M3", DType::kF8E4M3}};
  for (const auto& [name, dt] : kMap) {
    if (s == name) {
      *out = dt;
      return true;
    }
  }
  return false;
}

// A JSON value for an error message, cut short so a hostile header cannot make the
// message itself huge.
std::string brief(const json& v) {
  std::string s = v.dump(-1, ' ', true, json::error_handler_t::replace);
  if (s.size() > 64) s = s.substr(0, 61) + "...";
  return s;
}

std::string quote_name(const std::string& s) {
  std::string q = s.size() > 200 ? s.substr(0, 197) + "..." : s;
  return "'" + q + "'";
}

std::string list_str(const Shape& s) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << ']';
  return os.str();
}

std::string offsets_str(uint64_t b, uint64_t e) {
  std::ostringstream os;
  os << '[' << b << ", " << e << ']';
  return os.str();
}

// Records the first duplicate key at any nesting level while nlohmann parses (its DOM
// keeps only the last value of a repeated key, so duplicates must be caught here).
struct DuplicateFinder {
  std::vector<std::set<std::string>> open_objects;
  std::string top_key;  // the current key of the root object
  bool found = false;
  size_t found_level = 0;  // 1: root object, 2: inside a tensor entry / __metadata__
  std::string found_key, found_parent;

  bool operator()(int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        open_objects.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case json::parse_event_t::key: {
        if (open_objects.empty() || !parsed.is_string()) break;
        const std::string& k = parsed.get_ref<const std::string&>();
        if (open_objects.size() == 1) top_key = k;
        if (!open_objects.back().insert(k).second && !found) {
          found = true;
          found_level = open_objects.size();
          found_key = k;
          found_parent = top_key;
        }
        break;
      }
      default:
        break;
    }
    return true;
  }
};

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

// Parses one tensor entry; `where` is "SOURCE: tensor 'NAME'".
TensorInfo parse_entry(const std::string& name, const json& e, const std::string& where) {
  TESSERA_CHECK(e.is_object(), where, ": expected an object with dtype, shape and "
                "data_offsets, got ", e.type_name(), " ", brief(e));
  for (const auto& [k, v] : e.items()) {
    TESSERA_CHECK(k == "dtype" || k == "shape" || k == "data_offsets", where,
                  ": unexpected field ", quote_name(k), " (expected dtype, shape, data_offsets)");
  }
  for (const char* k : {"dtype", "shape", "data_offsets"})
    TESSERA_CHECK(e.contains(k), where, ": missing field '", k, "'");

  TensorInfo info;
  info.name = name;
  const json& jd = e["dtype"];
  TESSERA_CHECK(jd.is_string(), where, ": dtype must be a string, got ", brief(jd));
  const std::string& ds = jd.get_ref<const std::string&>();
  if (!dtype_from_safetensors(ds, &info.dtype)) {
    if (is_known_safetensors_dtype(ds))
      fail(where, ": unsupported dtype ", quote_name(ds),
           " (Tessera reads F32, BF16, F16, I8, U8, I32, I64)");
    fail(where, ": unknown dtype ", quote_name(ds));
  }

  const json& js = e["shape"];
  TESSERA_CHECK(js.is_array(), where, ": shape must be an array, got ", brief(js));
  for (const json& d : js) {
    TESSERA_CHECK(d.is_number_unsigned(), where, ": shape ", brief(js),
                  " has an entry that is not a non-negative integer: ", brief(d));
    const uint64_t v = d.get<uint64_t>();
    TESSERA_CHECK(v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), where,
                  ": shape ", brief(js), " has a dimension too large: ", v);
    info.shape.push_back(static_cast<int64_t>(v));
  }
  // Byte count without overflow. The library checks numel * itemsize in 64 bits; we also
  // keep the product of the non-zero dims in int64 so Tensor strides cannot overflow.
  const uint64_t item = dtype_size(info.dtype);
  const uint64_t kMax = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  uint64_t span = item;
  bool has_zero = false;
  for (int64_t d : info.shape) {
    if (d == 0) {
      has_zero = true;
      continue;
    }
    TESSERA_CHECK(span <= kMax / static_cast<uint64_t>(d), where, ": shape ",
                  list_str(info.shape), " x ", dtype_name(info.dtype),
                  " overflows a 64-bit byte count");
    span *= static_cast<uint64_t>(d);
  }
  const uint64_t nbytes = has_zero ? 0 : span;

  const json& jo = e["data_offsets"];
  TESSERA_CHECK(jo.is_array() && jo.size() == 2 && jo[0].is_number_unsigned() &&
                    jo[1].is_number_unsigned(),
                where, ": data_offsets must be [begin, end] with non-negative integers, got ",
                brief(jo));
  info.begin = jo[0].get<uint64_t>();
  info.end = jo[1].get<uint64_t>();
  TESSERA_CHECK(info.end >= info.begin, where, ": data_offsets ",
                offsets_str(info.begin, info.end), " end before they begin");
  TESSERA_CHECK(info.end - info.begin == nbytes, where, ": data_offsets ",
                offsets_str(info.begin, info.end), " do not match shape ",
                list_str(info.shape), " x ", dtype_name(info.dtype), " (", nbytes, " bytes)");
  return info;
}

}  // namespace

SafetensorsHeader parse_safetensors_header(const uint8_t* data, size_t size,
                                           const std::string& source) {
  TESSERA_CHECK(size >= 8, source, ": file is ", size,
                " bytes, too small for a safetensors header (needs at least 8)");
  const uint64_t n = read_u64_le(data);
  TESSERA_CHECK(n <= kMaxSafetensorsHeaderBytes, source, ": header length ", n,
                " exceeds the safetensors limit of ", kMaxSafetensorsHeaderBytes, " bytes");
  TESSERA_CHECK(n <= size - 8, source, ": header length ", n, " runs past the end of the ",
                size, "-byte file (truncated or not a safetensors file)");

  const char* text = reinterpret_cast<const char*>(data + 8);
  // nlohmann stops at a NUL as if the input ended; the library's serde_json rejects it.
  if (const void* nul = std::memchr(text, '\0', n)) {
    fail(source, ": header is not valid JSON (byte ", static_cast<const char*>(nul) - text,
         " of ", n, " is a NUL)");
  }
  DuplicateFinder dups;
  json root;
  try {
    root = json::parse(text, text + n, std::ref(dups));
  } catch (const json::parse_error& e) {
    std::string msg = e.what();
    size_t p = msg.find("parse error");
    if (p != std::string::npos && msg.find(": ", p) != std::string::npos)
      msg = msg.substr(msg.find(": ", p) + 2);
    fail(source, ": header is not valid JSON (byte ", e.byte, " of ", n, "): ", msg);
  } catch (const json::exception& e) {
    fail(source, ": header is not valid JSON: ", e.what());
  }
  TESSERA_CHECK(root.is_object(), source, ": header must be a JSON object, got ",
                root.type_name());
  if (dups.found) {
    if (dups.found_level == 1) fail(source, ": duplicate tensor name ", quote_name(dups.found_key));
    if (dups.found_parent == kMetadataKey)
      fail(source, ": __metadata__ has duplicate key ", quote_name(dups.found_key));
    fail(source, ": tensor ", quote_name(dups.found_parent), ": duplicate field ",
         quote_name(dups.found_key));
  }

  SafetensorsHeader h;
  h.data_start = 8 + n;
  const uint64_t buffer_bytes = size - 8 - n;
  for (const auto& [name, value] : root.items()) {
    if (name == kMetadataKey) {
      if (value.is_null()) continue;  // the library reads it as Option<HashMap>
      TESSERA_CHECK(value.is_object(), source, ": __metadata__ must be an object of strings, got ",
                    brief(value));
      for (const auto& [k, v] : value.items()) {
        TESSERA_CHECK(v.is_string(), source, ": __metadata__ value for ", quote_name(k),
                      " must be a string, got ", brief(v));
        h.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string where = source + ": tensor " + quote_name(name);
    TensorInfo info = parse_entry(name, value, where);
    TESSERA_CHECK(info.end <= buffer_bytes, where, ": data_offsets ",
                  offsets_str(info.begin, info.end), " extend past the end of the ",
                  buffer_bytes, "-byte data buffer");
    h.tensors.push_back(std::move(info));
  }

  // Like the library: order by offsets, then every tensor must start where the previous
  // one ended and the last must end at the end of the file.
  std::stable_sort(h.tensors.begin(), h.tensors.end(),
                   [](const TensorInfo& a, const TensorInfo& b) {
                     return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
                   });
  uint64_t pos = 0;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& t : h.tensors) {
    if (t.begin < pos) {
      fail(source, ": tensor ", quote_name(t.name), ": data_offsets ", offsets_str(t.begin, t.end),
           " overlap tensor ", quote_name(prev->name), " at ", offsets_str(prev->begin, prev->end));
    }
    if (t.begin > pos) {
      fail(source, ": tensor ", quote_name(t.name), ": data_offsets ", offsets_str(t.begin, t.end),
           " leave a hole: bytes [", pos, ", ", t.begin, ")",
           " of the data buffer belong to no tensor");
    }
    pos = t.end;
    prev = &t;
  }
  TESSERA_CHECK(pos == buffer_bytes, source, ": tensors cover ", pos,
                " bytes but the data buffer holds ", buffer_bytes,
                " (incomplete metadata or trailing bytes)");
  return h;
}

}  // namespace tessera::io
