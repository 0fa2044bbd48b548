// Operators and conversions of the Jinja interpreter with Python's semantics: floor division and
// modulo take the divisor's sign, every integer input has a defined result or a one-line error (no
// UB, no SIGFPE), sequence + / * / ~ are sized against the render budget before they allocate;
// also subscripts, slices and the int / float filters.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>

#include "tessera/base/error.h"
#include "tessera/serve/jinja_budget.h"
#include "tessera/serve/jinja_builtins.h"

namespace tessera::serve::jinja {
namespace {

[[noreturn]] void fail_at(const Node& n, const std::string& msg) { fail("chat template line ", n.line, ": ", msg); }

// Python ints are unbounded and Tessera's are 64-bit. A result outside int64 is an error, not a
// float approximation: only a hostile or broken template gets there, and a float would print
// differently from jinja2 anyway ("1e+20" where Python prints all 21 digits).
[[noreturn]] void overflow(const Node& n, const std::string& what) {
  fail_at(n, "integer overflow in " + what + " (integers are 64-bit)");
}

std::string show(int64_t x, const std::string& op, int64_t y) {
  return std::to_string(x) + " " + op + " " + std::to_string(y);
}

[[noreturn]] void division_by_zero(const Node& n) { fail_at(n, "division by zero"); }

std::string trim_spaces(const std::string& s) {
  const char* kSpaces = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(kSpaces);
  return b == std::string::npos ? "" : s.substr(b, s.find_last_not_of(kSpaces) - b + 1);
}

Value int_arith(const Node& n, const std::string& op, int64_t x, int64_t y) {
  int64_t r = 0;
  if (op == "+") {
    if (__builtin_add_overflow(x, y, &r)) overflow(n, show(x, op, y));
    return r;
  }
  if (op == "-") {
    if (__builtin_sub_overflow(x, y, &r)) overflow(n, show(x, op, y));
    return r;
  }
  if (op == "*") {
    if (__builtin_mul_overflow(x, y, &r)) overflow(n, show(x, op, y));
    return r;
  }
  if (op == "/") {
    if (y == 0) division_by_zero(n);
    return static_cast<double>(x) / static_cast<double>(y);
  }
  if (op == "//" || op == "%") {
    if (y == 0) division_by_zero(n);
    if (y == -1) {  // x / -1 traps for INT64_MIN; x % -1 is always 0
      if (op == "%") return int64_t{0};
      if (x == std::numeric_limits<int64_t>::min()) overflow(n, show(x, op, y));
      return -x;
    }
    int64_t q = x / y, m = x % y;
    if (m != 0 && ((m < 0) != (y < 0))) {  // C truncates toward zero; Python floors
      --q;
      m += y;
    }
    return op == "//" ? q : m;
  }
  // "**": exact by squaring; a negative exponent gives a float, as in Python.
  if (y < 0) {
    if (x == 0) fail_at(n, "0.0 cannot be raised to a negative power");
    return std::pow(static_cast<double>(x), static_cast<double>(y));
  }
  int64_t base = x;
  r = 1;
  for (uint64_t e = static_cast<uint64_t>(y); e; e >>= 1) {
    if ((e & 1) && __builtin_mul_overflow(r, base, &r)) overflow(n, show(x, "**", y));
    // With bits left, a base whose square overflows makes the result overflow too (|r| >= 1).
    if (e > 1 && __builtin_mul_overflow(base, base, &base)) overflow(n, show(x, "**", y));
  }
  return r;
}

// Python's float_divmod / float_pow: floor division and modulo by the divisor's sign, and the
// errors Python raises where C would return inf, nan or a complex result.
Value float_arith(const Node& n, const std::string& op, double x, double y) {
  if (op == "+") return x + y;
  if (op == "-") return x - y;
  if (op == "*") return x * y;
  if (op == "**") {
    if (x == 0 && y < 0) fail_at(n, "0.0 cannot be raised to a negative power");
    if (x < 0 && std::isfinite(y) && y != std::floor(y))
      fail_at(n, "a negative number cannot be raised to a fractional power");
    const double r = std::pow(x, y);
    if (std::isinf(r) && std::isfinite(x) && std::isfinite(y)) fail_at(n, "float power result too large");
    return r;
  }
  if (y == 0) division_by_zero(n);
  if (op == "/") return x / y;
  double mod = std::fmod(x, y);
  double div = (x - mod) / y;
  if (mod != 0) {
    if ((y < 0) != (mod < 0)) {
      mod += y;
      div -= 1.0;
    }
  } else {
    mod = std::copysign(0.0, y);
  }
  if (op == "%") return mod;
  double floordiv;
  if (div != 0) {
    floordiv = std::floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
  } else {
    floordiv = std::copysign(0.0, x / y);
  }
  return floordiv;
}

Value concat(const Node& n, const Value& a, const Value& b) {
  Budget& bud = current_budget();
  if (a.is_string() && b.is_string()) {
    const auto& x = a.get_ref<const std::string&>();
    const auto& y = b.get_ref<const std::string&>();
    bud.check_string(n.line, x.size() + y.size());
    bud.charge_bytes(x.size() + y.size());
    return x + y;
  }
  bud.check_list(n.line, a.size() + b.size());
  const ValueSize sa = bud.size_of(a), sb = bud.size_of(b);
  bud.check_size(n.line, sa.bytes + sb.bytes, std::max(sa.depth, sb.depth));
  Value out = a;
  for (const auto& x : b) out.push_back(x);
  return out;
}

Value repeat(const Node& n, const Value& seq, const Value& times_v) {
  if (!is_int(times_v)) fail_at(n, "can't multiply sequence by non-int " + brief_repr(times_v));
  const int64_t times = to_int(n, times_v);
  Budget& bud = current_budget();
  if (seq.is_string()) {
    const auto& s = seq.get_ref<const std::string&>();
    if (times <= 0 || s.empty()) return "";
    bud.check_string(n.line, Budget::saturating_mul(s.size(), times));
    std::string out;
    out.reserve(s.size() * static_cast<size_t>(times));
    for (int64_t i = 0; i < times; ++i) out += s;
    bud.charge_bytes(out.size());
    return out;
  }
  Value out = Value::array();
  if (times <= 0 || seq.empty()) return out;
  bud.check_list(n.line, Budget::saturating_mul(seq.size(), times));
  const ValueSize s = bud.size_of(seq);
  bud.check_size(n.line, Budget::saturating_mul(s.bytes, times), s.depth);
  out.get_ref<Value::array_t&>().reserve(seq.size() * static_cast<size_t>(times));
  for (int64_t i = 0; i < times; ++i)
    for (const auto& x : seq) out.push_back(x);
  bud.charge(static_cast<int64_t>(out.size()));
  return out;
}

}  // namespace

// jinja2's int filter: int(s), else int(float(s)), else the default; Python would give a big int
// where Tessera's 64 bits end, which is an error here.
Value int_filter(const Node& n, const Value& v, const Value& dflt) {
  auto from_double = [&](double d) -> Value {
    if (std::isnan(d)) return dflt;
    const double t = std::trunc(d);
    if (!(t >= -0x1p63 && t < 0x1p63)) fail_at(n, "int() of " + brief_repr(Value(d)) + " is out of range (integers are 64-bit)");
    return static_cast<int64_t>(t);
  };
  if (v.is_boolean() || v.is_number_integer()) return to_int(n, v);
  if (v.is_number_float()) return from_double(v.get<double>());
  if (!v.is_string()) return dflt;
  std::string t = trim_spaces(v.get<std::string>());
  if (!t.empty() && t[0] == '+') t.erase(0, 1);
  std::string digits;
  for (size_t i = 0; i < t.size(); ++i)  // Python allows single underscores between digits
    if (!(t[i] == '_' && i > 0 && i + 1 < t.size() && std::isdigit(static_cast<unsigned char>(t[i - 1])) &&
          std::isdigit(static_cast<unsigned char>(t[i + 1]))))
      digits += t[i];
  int64_t i = 0;
  const char* e = digits.data() + digits.size();
  auto r = std::from_chars(digits.data(), e, i);
  if (!digits.empty() && r.ptr == e && r.ec == std::errc()) return i;
  if (r.ptr == e && r.ec == std::errc::result_out_of_range)
    fail_at(n, "int() of '" + t.substr(0, 40) + "' is out of range (integers are 64-bit)");
  double d = 0;
  auto rf = std::from_chars(digits.data(), e, d);
  if (digits.empty() || rf.ptr != e) return dflt;
  if (rf.ec == std::errc::result_out_of_range) fail_at(n, "int() of '" + t.substr(0, 40) + "' is out of range");
  return from_double(d);
}

// jinja2's float filter: float(s), else the default.
Value float_filter(const Value& v, const Value& dflt) {
  if (v.is_number() || v.is_boolean()) return v.is_boolean() ? (v.get<bool>() ? 1.0 : 0.0) : v.get<double>();
  if (!v.is_string()) return dflt;
  std::string t = trim_spaces(v.get<std::string>());
  if (!t.empty() && t[0] == '+') t.erase(0, 1);
  double d = 0;
  const char* e = t.data() + t.size();
  auto r = std::from_chars(t.data(), e, d);
  if (t.empty() || r.ptr != e) return dflt;
  if (r.ec == std::errc::result_out_of_range) {  // Python: inf, or 0.0 for a negative exponent
    const size_t exp = t.find_first_of("eE");
    const bool tiny = exp != std::string::npos && exp + 1 < t.size() && t[exp + 1] == '-';
    return std::copysign(tiny ? 0.0 : std::numeric_limits<double>::infinity(), t[0] == '-' ? -1.0 : 1.0);
  }
  return d;
}

bool is_int(const Value& v) { return v.is_number_integer() || v.is_boolean(); }

int64_t to_int(const Node& n, const Value& v) {
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail_at(n, "integer " + std::to_string(u) + " is out of range (integers are 64-bit)");
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  fail_at(n, "expected an integer, got " + brief_repr(v));
}

double num(const Node& n, const Value& v) {
  if (v.is_number() || v.is_boolean()) return v.is_boolean() ? v.get<bool>() : v.get<double>();
  fail_at(n, "expected a number, got " + brief_repr(v));
}

bool equal(const Value& a, const Value& b) {
  if (is_undefined(a) || is_undefined(b)) return is_undefined(a) && is_undefined(b);
  if ((a.is_number() || a.is_boolean()) && (b.is_number() || b.is_boolean()) && (a.is_number() || b.is_number())) {
    if (is_int(a) && is_int(b)) {
      // Unsigned values (JSON integers above INT64_MAX) equal only each other.
      constexpr auto kMax = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
      const bool big_a = a.is_number_unsigned() && a.get<uint64_t>() > kMax;
      const bool big_b = b.is_number_unsigned() && b.get<uint64_t>() > kMax;
      if (big_a || big_b) return big_a && big_b && a.get<uint64_t>() == b.get<uint64_t>();
      return (a.is_boolean() ? a.get<bool>() : a.get<int64_t>()) == (b.is_boolean() ? b.get<bool>() : b.get<int64_t>());
    }
    return (a.is_boolean() ? a.get<bool>() : a.get<double>()) == (b.is_boolean() ? b.get<bool>() : b.get<double>());
  }
  current_budget().charge(static_cast<int64_t>(a.is_string() ? a.get_ref<const std::string&>().size() >> 6 : a.size()));
  return a == b;
}

int compare(const Node& n, const Value& a, const Value& b) {
  if (a.is_string() && b.is_string()) return a.get_ref<const std::string&>().compare(b.get_ref<const std::string&>());
  if (is_int(a) && is_int(b)) {
    const int64_t x = to_int(n, a), y = to_int(n, b);
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if ((a.is_number() || a.is_boolean()) && (b.is_number() || b.is_boolean())) {
    const double x = num(n, a), y = num(n, b);
    return x < y ? -1 : x > y ? 1 : 0;
  }
  fail_at(n, "cannot compare " + brief_repr(a) + " with " + brief_repr(b));
}

Value unary_op(const Node& n, const std::string& op, const Value& v) {
  if (!v.is_number() && !v.is_boolean()) fail_at(n, "bad operand type for unary " + op + ": " + brief_repr(v));
  if (v.is_number_float()) return op == "-" ? Value(-v.get<double>()) : v;
  const int64_t x = to_int(n, v);
  if (op == "+") return x;
  if (x == std::numeric_limits<int64_t>::min()) overflow(n, "-(" + std::to_string(x) + ")");
  return -x;
}

Value binary_op(const Node& n, const std::string& op, const Value& a, const Value& b) {
  if (op == "==") return equal(a, b);
  if (op == "!=") return !equal(a, b);
  if (op == "~") {
    const std::string x = to_str(a), y = to_str(b);
    current_budget().check_string(n.line, x.size() + y.size());
    return x + y;
  }
  if (op == "in" || op == "not in") {
    bool found = false;
    if (b.is_string()) {
      if (!a.is_string()) fail_at(n, "'in <string>' requires a string as left operand, not " + brief_repr(a));
      current_budget().charge_bytes(b.get_ref<const std::string&>().size());
      found = b.get_ref<const std::string&>().find(a.get_ref<const std::string&>()) != std::string::npos;
    } else if (b.is_array()) {
      for (const auto& x : b) {
        found = equal(a, x);
        if (found) break;
      }
      current_budget().charge(static_cast<int64_t>(b.size()));
    } else if (b.is_object()) {
      found = a.is_string() && b.contains(a.get_ref<const std::string&>());
    } else {
      fail_at(n, "argument of type " + std::string(b.type_name()) + " is not iterable");
    }
    return found == (op == "in");
  }
  if (op == "<") return compare(n, a, b) < 0;
  if (op == "<=") return compare(n, a, b) <= 0;
  if (op == ">") return compare(n, a, b) > 0;
  if (op == ">=") return compare(n, a, b) >= 0;
  if (is_undefined(a) || is_undefined(b)) fail_at(n, "undefined value used with operator " + op);
  if (op == "+" && ((a.is_string() && b.is_string()) || (a.is_array() && b.is_array()))) return concat(n, a, b);
  if (op == "*" && (a.is_string() || a.is_array())) return repeat(n, a, b);
  if (op == "*" && (b.is_string() || b.is_array())) return repeat(n, b, a);
  const bool num_ok = (a.is_number() || a.is_boolean()) && (b.is_number() || b.is_boolean());
  if (!num_ok) fail_at(n, "unsupported operand types for " + op + ": " + brief_repr(a) + " and " + brief_repr(b));
  if (is_int(a) && is_int(b)) return int_arith(n, op, to_int(n, a), to_int(n, b));
  return float_arith(n, op, num(n, a), num(n, b));
}

Value as_list(const Node& n, const Value& v) {
  if (is_undefined(v)) return Value::array();
  if (v.is_array()) return v;
  Value out = Value::array();
  if (v.is_object()) {
    for (auto it = v.begin(); it != v.end(); ++it) out.push_back(it.key());
  } else if (v.is_string()) {
    const std::u32string chars = utf8_decode(v.get_ref<const std::string&>());
    current_budget().check_list(n.line, chars.size());
    for (const char32_t c : chars) out.push_back(utf8_encode(std::u32string(1, c)));
  } else {
    fail_at(n, "'" + brief_repr(v) + "' is not iterable");
  }
  return out;
}

Value get_attr(const Node& n, const Value& obj, const std::string& name) {
  if (is_undefined(obj)) fail_at(n, "cannot read attribute '" + name + "' of an undefined value");
  if (obj.is_object()) {
    auto it = obj.find(name);
    return it == obj.end() ? undefined() : *it;
  }
  if (obj.is_array() && !name.empty() && std::all_of(name.begin(), name.end(), ::isdigit)) {
    int64_t i = 0;
    const auto r = std::from_chars(name.data(), name.data() + name.size(), i);
    return r.ec == std::errc() ? get_item(n, obj, Value(i)) : undefined();
  }
  return undefined();
}

Value get_item(const Node& n, const Value& obj, const Value& key) {
  if (is_undefined(obj)) fail_at(n, "cannot subscript an undefined value with " + brief_repr(key));
  if (obj.is_object()) {
    if (!key.is_string()) return undefined();
    auto it = obj.find(key.get<std::string>());
    return it == obj.end() ? undefined() : *it;
  }
  if ((obj.is_array() || obj.is_string()) && is_int(key)) {
    if (obj.is_string()) {
      const std::u32string s = utf8_decode(obj.get<std::string>());
      int64_t i = to_int(n, key);
      if (i < 0) i += static_cast<int64_t>(s.size());
      return i >= 0 && i < static_cast<int64_t>(s.size()) ? Value(utf8_encode(s.substr(i, 1))) : undefined();
    }
    int64_t i = to_int(n, key);
    if (i < 0) i += static_cast<int64_t>(obj.size());
    return i >= 0 && i < static_cast<int64_t>(obj.size()) ? obj[i] : undefined();
  }
  return undefined();
}

Value slice_value(const Node& n, const Value& obj, const Value& start, const Value& stop, const Value& step_v) {
  if (!obj.is_array() && !obj.is_string()) fail_at(n, "cannot slice " + brief_repr(obj));
  const std::u32string s = obj.is_string() ? utf8_decode(obj.get<std::string>()) : std::u32string();
  const int64_t len = obj.is_string() ? static_cast<int64_t>(s.size()) : static_cast<int64_t>(obj.size());
  const int64_t step = step_v.is_null() ? 1 : to_int(n, step_v);
  if (step == 0) fail_at(n, "slice step cannot be zero");
  auto clamp = [&](const Value& v, int64_t dflt) {
    if (v.is_null()) return dflt;
    int64_t i = to_int(n, v);
    if (i < 0) i += len;
    if (i < 0) return step < 0 ? int64_t{-1} : int64_t{0};
    if (i >= len) return step < 0 ? len - 1 : len;
    return i;
  };
  const int64_t b = clamp(start, step > 0 ? 0 : len - 1), e = clamp(stop, step > 0 ? len : -1);
  Value out = Value::array();
  std::u32string str;
  current_budget().charge(len);
  for (__int128 i = b; step > 0 ? i < e : i > e; i += step) {  // 128 bits: i + step may pass int64
    const auto k = static_cast<size_t>(i);
    if (obj.is_string()) str += s[k];
    else out.push_back(obj[k]);
  }
  return obj.is_string() ? Value(utf8_encode(str)) : out;
}

}  // namespace tessera::serve::jinja
