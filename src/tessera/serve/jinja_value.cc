// Value helpers for the Jinja interpreter: Python's str() / repr() / json.dumps spellings, since
// templates are written against jinja2 on Python and their output must match byte for byte.
#include <charconv>
#include <cstdio>

#include "tessera/base/error.h"
#include "tessera/serve/jinja.h"
#include "tessera/serve/jinja_budget.h"

namespace tessera::serve::jinja {

Value undefined() { return Value(Value::value_t::discarded); }
bool is_undefined(const Value& v) { return v.is_discarded(); }

std::u32string utf8_decode(const std::string& s) {
  current_budget().charge_bytes(s.size());
  std::u32string out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (i + len > s.size()) len = 1;
    char32_t cp = len == 1 ? c : len == 2 ? (c & 0x1f) : len == 3 ? (c & 0x0f) : (c & 0x07);
    for (int k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
    out += cp;
    i += len;
  }
  return out;
}

std::string utf8_encode(const std::u32string& s) {
  current_budget().charge_bytes(s.size());
  std::string out;
  for (const char32_t cp : s) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xc0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xe0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    }
  }
  return out;
}

namespace {

// Python's float repr: shortest round-trip digits, scientific below 1e-4 and from 1e16.
std::string float_repr(double v) {
  if (v != v) return "nan";
  if (v == 1.0 / 0.0) return "inf";
  if (v == -1.0 / 0.0) return "-inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
  std::string s(buf, r.ptr);
  const size_t e = s.find('e');
  std::string mant = s.substr(0, e);
  const int exp = std::stoi(s.substr(e + 1));
  const bool neg = mant[0] == '-';
  if (neg) mant = mant.substr(1);
  std::string digits;
  for (const char c : mant)
    if (c != '.') digits += c;
  std::string out;
  if (exp < -4 || exp >= 16) {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out.append(1, '.').append(digits, 1, std::string::npos);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    out += eb;
  } else if (exp < 0) {
    out = "0." + std::string(-exp - 1, '0') + digits;
  } else {
    if (digits.size() <= static_cast<size_t>(exp) + 1) digits += std::string(exp + 1 - digits.size(), '0');
    out = digits.substr(0, exp + 1) + "." + (digits.size() > static_cast<size_t>(exp) + 1 ? digits.substr(exp + 1) : "0");
  }
  return neg ? "-" + out : out;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char b[8];
          std::snprintf(b, sizeof b, "\\u%04x", c);
          out += b;
        } else {
          out += ch;
        }
    }
  }
  return out + "\"";
}

std::string string_repr(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const char q = has_single && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, q);
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (ch == q || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (ch == '\n') {
      out += "\\n";
    } else if (ch == '\r') {
      out += "\\r";
    } else if (ch == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", c);
      out += b;
    } else {
      out += ch;
    }
  }
  return out + q;
}

std::string number_str(const Value& v) {
  if (v.is_number_float()) return float_repr(v.get<double>());
  if (v.is_number_unsigned()) return std::to_string(v.get<uint64_t>());
  return std::to_string(v.get<int64_t>());
}

}  // namespace

namespace {

// Builds repr() / json.dumps() text within the render's string limit, or (brief) cut at `cap`.
// Recursion follows the value's nesting, which the budget bounds for built values and
// Template::render bounds for the globals; the depth check here is a backstop.
class TextOut {
 public:
  explicit TextOut(size_t cap = 0) : b_(current_budget()), cap_(cap) {}
  bool full() const { return cap_ && s_.size() >= cap_; }
  void add(const std::string& x) {
    if (cap_) {
      if (!full()) s_ += x;
      return;
    }
    b_.check_string(b_.line(), s_.size() + x.size());
    b_.charge_bytes(x.size());
    s_ += x;
  }
  void enter(int depth) const {
    if (depth > b_.limits().max_depth)
      fail("chat template line ", b_.line(), ": value nesting depth limit ", b_.limits().max_depth,
           " exceeded (--chat-template-limits depth=...)");
  }
  std::string take() {
    if (cap_ && s_.size() > cap_) s_ = s_.substr(0, cap_) + "...";
    return std::move(s_);
  }

 private:
  Budget& b_;
  size_t cap_;
  std::string s_;
};

void repr_into(TextOut& out, const Value& v, int depth) {
  if (v.is_discarded()) return;
  if (v.is_null()) return out.add("None");
  if (v.is_boolean()) return out.add(v.get<bool>() ? "True" : "False");
  if (v.is_number()) return out.add(number_str(v));
  if (v.is_string()) return out.add(string_repr(v.get_ref<const std::string&>()));
  out.enter(depth);
  const bool arr = v.is_array();
  out.add(arr ? "[" : "{");
  bool first = true;
  for (auto it = v.begin(); it != v.end() && !out.full(); ++it) {
    if (!first) out.add(", ");
    if (!arr) out.add(string_repr(it.key()) + ": ");
    repr_into(out, it.value(), depth + 1);
    first = false;
  }
  out.add(arr ? "]" : "}");
}

void json_into(TextOut& out, const Value& v, int64_t indent, int depth) {
  if (v.is_discarded()) fail("chat template: tojson of an undefined value");
  if (v.is_null()) return out.add("null");
  if (v.is_boolean()) return out.add(v.get<bool>() ? "true" : "false");
  if (v.is_number()) return out.add(number_str(v));
  if (v.is_string()) return out.add(json_string(v.get_ref<const std::string&>()));
  out.enter(depth);
  const bool arr = v.is_array();
  if (v.empty()) return out.add(arr ? "[]" : "{}");
  std::string pad_in, pad_out;  // newline + indentation when pretty-printing
  if (indent >= 0) {
    Budget& b = current_budget();
    b.check_string(b.line(), Budget::saturating_mul(static_cast<size_t>(indent), depth + 1));
    pad_in.assign(1, '\n').append(static_cast<size_t>(indent) * (depth + 1), ' ');
    pad_out.assign(1, '\n').append(static_cast<size_t>(indent) * depth, ' ');
  }
  const std::string sep = indent >= 0 ? "," : ", ";
  out.add(arr ? "[" : "{");
  bool first = true;
  for (auto it = v.begin(); it != v.end(); ++it) {
    out.add(first ? pad_in : sep + pad_in);
    if (!arr) out.add(json_string(it.key()) + ": ");
    json_into(out, it.value(), indent, depth + 1);
    first = false;
  }
  out.add(pad_out + (arr ? "]" : "}"));
}

}  // namespace

std::string to_str(const Value& v) {
  if (v.is_discarded()) return "";
  if (v.is_string()) return v.get<std::string>();
  return py_repr(v);
}

std::string py_repr(const Value& v) {
  TextOut out;
  repr_into(out, v, 1);
  return out.take();
}

std::string brief_repr(const Value& v) {
  TextOut out(80);
  repr_into(out, v, 1);
  return out.take();
}

std::string to_json_py(const Value& v, int64_t indent, int depth) {
  TextOut out;
  json_into(out, v, indent, depth);
  return out.take();
}

bool truthy(const Value& v) {
  if (v.is_discarded() || v.is_null()) return false;
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number_float()) return v.get<double>() != 0.0;
  if (v.is_number()) return v.get<int64_t>() != 0;
  if (v.is_string()) return !v.get<std::string>().empty();
  return !v.empty();
}

}  // namespace tessera::serve::jinja
