// Filters, tests, methods, operators and globals for the Jinja interpreter (Python semantics).
#include "tessera/serve/jinja_builtins.h"

#include <algorithm>
#include <cmath>
#include <ctime>

#include "tessera/base/error.h"

namespace tessera::serve::jinja {
namespace {

[[noreturn]] void fail_at(const Node& n, const std::string& msg) { fail("chat template line ", n.line, ": ", msg); }

const char* kSpaces = " \t\n\r\f\v";

// Positional argument `pos` (counting from `first`) or keyword `name`; nullptr when absent.
const Value* arg(const Args& a, size_t pos, const char* name, size_t first = 1) {
  size_t k = 0;
  for (size_t i = first; i < a.values.size(); ++i) {
    if (a.names[i].empty()) {
      if (k++ == pos) return &a.values[i];
    } else if (name && a.names[i] == name) {
      return &a.values[i];
    }
  }
  return nullptr;
}

std::string str_arg(const Node& n, const Value* v, const std::string& dflt) {
  if (!v || v->is_null()) return dflt;
  if (!v->is_string()) fail_at(n, "expected a string argument, got " + py_repr(*v));
  return v->get<std::string>();
}

std::string strip(const std::string& s, const std::string& chars, bool left, bool right) {
  size_t b = 0, e = s.size();
  if (left) b = s.find_first_not_of(chars);
  if (b == std::string::npos) return "";
  if (right) e = s.find_last_not_of(chars) + 1;
  return s.substr(b, e - b);
}

std::string map_chars(std::string s, int (*f)(int)) {
  for (auto& c : s)
    if (static_cast<unsigned char>(c) < 0x80) c = static_cast<char>(f(c));
  return s;
}

std::string replace_all(std::string s, const std::string& from, const std::string& to, int64_t count = -1) {
  if (from.empty()) return s;
  size_t pos = 0;
  while (count != 0 && (pos = s.find(from, pos)) != std::string::npos) {
    s.replace(pos, from.size(), to);
    pos += to.size();
    --count;
  }
  return s;
}

Value split(const std::string& s, const Value* sep, int64_t maxsplit) {
  Value out = Value::array();
  if (!sep || sep->is_null()) {  // runs of whitespace, no empty parts
    size_t i = s.find_first_not_of(kSpaces);
    while (i != std::string::npos) {
      size_t e = s.find_first_of(kSpaces, i);
      if (maxsplit-- == 0) e = std::string::npos, out.push_back(strip(s.substr(i), kSpaces, false, true));
      else out.push_back(s.substr(i, e == std::string::npos ? e : e - i));
      if (e == std::string::npos) break;
      i = s.find_first_not_of(kSpaces, e);
    }
    return out;
  }
  const std::string d = sep->get<std::string>();
  size_t i = 0, e;
  while (maxsplit-- != 0 && !d.empty() && (e = s.find(d, i)) != std::string::npos) {
    out.push_back(s.substr(i, e - i));
    i = e + d.size();
  }
  out.push_back(s.substr(i));
  return out;
}

bool prefix_test(const Node& n, const std::string& s, const Value& p, bool starts) {
  if (p.is_array()) {
    for (const auto& x : p)
      if (prefix_test(n, s, x, starts)) return true;
    return false;
  }
  const std::string q = str_arg(n, &p, "");
  if (q.size() > s.size()) return false;
  return starts ? s.compare(0, q.size(), q) == 0 : s.compare(s.size() - q.size(), q.size(), q) == 0;
}

double num(const Node& n, const Value& v) {
  if (v.is_number() || v.is_boolean()) return v.is_boolean() ? v.get<bool>() : v.get<double>();
  fail_at(n, "expected a number, got " + py_repr(v));
}

bool is_int(const Value& v) { return v.is_number_integer() || v.is_boolean(); }
int64_t to_int(const Value& v) { return v.is_boolean() ? v.get<bool>() : v.get<int64_t>(); }

bool equal(const Value& a, const Value& b) {
  if (is_undefined(a) || is_undefined(b)) return is_undefined(a) && is_undefined(b);
  if ((a.is_number() || a.is_boolean()) && (b.is_number() || b.is_boolean()) && (a.is_number() || b.is_number())) {
    if (is_int(a) && is_int(b)) return to_int(a) == to_int(b);
    return (a.is_boolean() ? a.get<bool>() : a.get<double>()) == (b.is_boolean() ? b.get<bool>() : b.get<double>());
  }
  return a == b;
}

int compare(const Node& n, const Value& a, const Value& b) {
  if (a.is_string() && b.is_string()) return a.get<std::string>().compare(b.get<std::string>());
  if ((a.is_number() || a.is_boolean()) && (b.is_number() || b.is_boolean())) {
    const double x = num(n, a), y = num(n, b);
    return x < y ? -1 : x > y ? 1 : 0;
  }
  fail_at(n, "cannot compare " + py_repr(a) + " with " + py_repr(b));
}

int64_t length(const Value& v) {
  if (is_undefined(v)) return 0;
  if (v.is_string()) return static_cast<int64_t>(utf8_decode(v.get<std::string>()).size());
  if (v.is_array() || v.is_object()) return static_cast<int64_t>(v.size());
  fail("chat template: object of type ", v.type_name(), " has no len()");
}

Value as_list(const Node& n, const Value& v) {
  if (is_undefined(v)) return Value::array();
  if (v.is_array()) return v;
  Value out = Value::array();
  if (v.is_object()) {
    for (auto it = v.begin(); it != v.end(); ++it) out.push_back(it.key());
  } else if (v.is_string()) {
    for (const char32_t c : utf8_decode(v.get<std::string>())) out.push_back(utf8_encode(std::u32string(1, c)));
  } else {
    fail_at(n, "'" + py_repr(v) + "' is not iterable");
  }
  return out;
}

// `a.b.c` attribute lookup used by selectattr / map / join(attribute=).
Value dotted(const Node& n, Value v, const std::string& path) {
  size_t i = 0;
  while (i <= path.size()) {
    const size_t e = std::min(path.find('.', i), path.size());
    v = get_attr(n, v, path.substr(i, e - i));
    i = e + 1;
  }
  return v;
}

Value items_of(const Value& v) {
  Value out = Value::array();
  if (v.is_object())
    for (auto it = v.begin(); it != v.end(); ++it) out.push_back(Value::array({it.key(), it.value()}));
  return out;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (const char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

}  // namespace

Value get_attr(const Node& n, const Value& obj, const std::string& name) {
  if (is_undefined(obj)) fail_at(n, "cannot read attribute '" + name + "' of an undefined value");
  if (obj.is_object()) {
    auto it = obj.find(name);
    return it == obj.end() ? undefined() : *it;
  }
  if (obj.is_array() && !name.empty() && std::all_of(name.begin(), name.end(), ::isdigit))
    return get_item(n, obj, Value(std::stoll(name)));
  return undefined();
}

Value get_item(const Node& n, const Value& obj, const Value& key) {
  if (is_undefined(obj)) fail_at(n, "cannot subscript an undefined value with " + py_repr(key));
  if (obj.is_object()) {
    if (!key.is_string()) return undefined();
    auto it = obj.find(key.get<std::string>());
    return it == obj.end() ? undefined() : *it;
  }
  if ((obj.is_array() || obj.is_string()) && is_int(key)) {
    if (obj.is_string()) {
      const std::u32string s = utf8_decode(obj.get<std::string>());
      int64_t i = to_int(key);
      if (i < 0) i += static_cast<int64_t>(s.size());
      return i >= 0 && i < static_cast<int64_t>(s.size()) ? Value(utf8_encode(s.substr(i, 1))) : undefined();
    }
    int64_t i = to_int(key);
    if (i < 0) i += static_cast<int64_t>(obj.size());
    return i >= 0 && i < static_cast<int64_t>(obj.size()) ? obj[i] : undefined();
  }
  return undefined();
}

Value slice_value(const Node& n, const Value& obj, const Value& start, const Value& stop, const Value& step_v) {
  if (!obj.is_array() && !obj.is_string()) fail_at(n, "cannot slice " + py_repr(obj));
  const std::u32string s = obj.is_string() ? utf8_decode(obj.get<std::string>()) : std::u32string();
  const int64_t len = obj.is_string() ? static_cast<int64_t>(s.size()) : static_cast<int64_t>(obj.size());
  const int64_t step = step_v.is_null() ? 1 : to_int(step_v);
  if (step == 0) fail_at(n, "slice step cannot be zero");
  auto clamp = [&](const Value& v, int64_t dflt) {
    if (v.is_null()) return dflt;
    int64_t i = to_int(v);
    if (i < 0) i += len;
    if (i < 0) return step < 0 ? int64_t{-1} : int64_t{0};
    if (i >= len) return step < 0 ? len - 1 : len;
    return i;
  };
  const int64_t b = clamp(start, step > 0 ? 0 : len - 1), e = clamp(stop, step > 0 ? len : -1);
  Value out = Value::array();
  std::u32string str;
  for (int64_t i = b; step > 0 ? i < e : i > e; i += step) {
    if (obj.is_string()) str += s[i];
    else out.push_back(obj[i]);
  }
  return obj.is_string() ? Value(utf8_encode(str)) : out;
}

Value binary_op(const Node& n, const std::string& op, const Value& a, const Value& b) {
  if (op == "==") return equal(a, b);
  if (op == "!=") return !equal(a, b);
  if (op == "~") return to_str(a) + to_str(b);
  if (op == "in" || op == "not in") {
    bool found = false;
    if (b.is_string()) {
      if (!a.is_string()) fail_at(n, "'in <string>' requires a string as left operand, not " + py_repr(a));
      found = b.get<std::string>().find(a.get<std::string>()) != std::string::npos;
    } else if (b.is_array()) {
      for (const auto& x : b) found = found || equal(a, x);
    } else if (b.is_object()) {
      found = a.is_string() && b.contains(a.get<std::string>());
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
  if (op == "+") {
    if (a.is_string() && b.is_string()) return a.get<std::string>() + b.get<std::string>();
    if (a.is_array() && b.is_array()) {
      Value out = a;
      for (const auto& x : b) out.push_back(x);
      return out;
    }
  }
  if (op == "*" && (a.is_string() || a.is_array() || b.is_string() || b.is_array())) {
    const Value& seq = a.is_string() || a.is_array() ? a : b;
    const Value& times = &seq == &a ? b : a;
    if (!is_int(times)) fail_at(n, "can't multiply sequence by " + py_repr(times));
    Value out = seq.is_string() ? Value("") : Value::array();
    for (int64_t i = 0; i < to_int(times); ++i) {
      if (seq.is_string()) out = out.get<std::string>() + seq.get<std::string>();
      else for (const auto& x : seq) out.push_back(x);
    }
    return out;
  }
  const bool num_ok = (a.is_number() || a.is_boolean()) && (b.is_number() || b.is_boolean());
  if (!num_ok) fail_at(n, "unsupported operand types for " + op + ": " + py_repr(a) + " and " + py_repr(b));
  const bool ints = is_int(a) && is_int(b);
  if (ints && op != "/" && op != "**") {
    const int64_t x = to_int(a), y = to_int(b);
    if (op == "+") return x + y;
    if (op == "-") return x - y;
    if (op == "*") return x * y;
    if (y == 0) fail_at(n, "integer division or modulo by zero");
    int64_t q = x / y, r = x % y;
    if (r != 0 && ((r < 0) != (y < 0))) {
      --q;
      r += y;
    }
    return op == "//" ? q : r;
  }
  const double x = num(n, a), y = num(n, b);
  if (op == "+") return x + y;
  if (op == "-") return x - y;
  if (op == "*") return x * y;
  if (op == "**") {
    if (ints && to_int(b) >= 0) return static_cast<int64_t>(std::llround(std::pow(x, y)));
    return std::pow(x, y);
  }
  if (y == 0) fail_at(n, "division by zero");
  if (op == "/") return x / y;
  if (op == "//") return std::floor(x / y);
  return x - y * std::floor(x / y);
}

bool apply_test(const Node& n, const std::string& name, const Args& args) {
  const Value& v = args.values[0];
  const Value* a1 = arg(args, 0, nullptr);
  auto need = [&]() -> const Value& {
    if (!a1) fail_at(n, "test '" + name + "' needs an argument");
    return *a1;
  };
  if (name == "defined") return !is_undefined(v);
  if (name == "undefined") return is_undefined(v);
  if (name == "none") return v.is_null();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_object();
  if (name == "iterable") return v.is_array() || v.is_object() || v.is_string() || is_undefined(v);
  if (name == "sequence") return v.is_array() || v.is_object() || v.is_string() || is_undefined(v);
  if (name == "number") return v.is_number() || v.is_boolean();
  if (name == "integer") return v.is_number_integer();
  if (name == "float") return v.is_number_float();
  if (name == "boolean") return v.is_boolean();
  if (name == "true") return v.is_boolean() && v.get<bool>();
  if (name == "false") return v.is_boolean() && !v.get<bool>();
  if (name == "callable") return false;
  if (name == "equalto" || name == "eq" || name == "==" || name == "sameas") return equal(v, need());
  if (name == "ne" || name == "!=") return !equal(v, need());
  if (name == "lt" || name == "lessthan") return compare(n, v, need()) < 0;
  if (name == "le") return compare(n, v, need()) <= 0;
  if (name == "gt" || name == "greaterthan") return compare(n, v, need()) > 0;
  if (name == "ge") return compare(n, v, need()) >= 0;
  if (name == "in") return binary_op(n, "in", v, need()).get<bool>();
  if (name == "odd" || name == "even") {
    if (!is_int(v)) fail_at(n, "test '" + name + "' needs an integer");
    return (to_int(v) % 2 != 0) == (name == "odd");
  }
  if (name == "divisibleby") return is_int(v) && is_int(need()) && to_int(need()) != 0 && to_int(v) % to_int(need()) == 0;
  if (name == "lower" || name == "upper") {
    if (!v.is_string()) return false;
    const std::string s = v.get<std::string>();
    return s == map_chars(s, name == "lower" ? ::tolower : ::toupper);
  }
  fail_at(n, "unknown test '" + name + "'");
}

Value apply_filter(const Node& n, const std::string& name, const Args& args) {
  const Value& v = args.values[0];
  if (name == "default" || name == "d") {
    const Value* boolean = arg(args, 1, "boolean");
    const bool use_default = is_undefined(v) || (boolean && truthy(*boolean) && !truthy(v));
    if (!use_default) return v;
    const Value* d = arg(args, 0, "default_value");
    return d ? *d : Value("");
  }
  if (name == "safe") return v;
  if (name == "length" || name == "count") return length(v);
  if (name == "string") return to_str(v);
  if (name == "trim") return strip(to_str(v), str_arg(n, arg(args, 0, "chars"), kSpaces), true, true);
  if (name == "upper") return map_chars(to_str(v), ::toupper);
  if (name == "lower") return map_chars(to_str(v), ::tolower);
  if (name == "capitalize") {
    std::string s = map_chars(to_str(v), ::tolower);
    if (!s.empty()) s[0] = static_cast<char>(::toupper(s[0]));
    return s;
  }
  if (name == "title") {
    std::string s = to_str(v);
    bool start = true;
    for (auto& c : s) {
      const bool alpha = std::isalnum(static_cast<unsigned char>(c));
      if (alpha) c = static_cast<char>(start ? ::toupper(c) : ::tolower(c));
      start = !alpha && c != '\'';
    }
    return s;
  }
  if (name == "replace") {
    const Value* count = arg(args, 2, "count");
    return replace_all(to_str(v), str_arg(n, arg(args, 0, "old"), ""), str_arg(n, arg(args, 1, "new"), ""),
                       count ? to_int(*count) : -1);
  }
  if (name == "e" || name == "escape") return html_escape(to_str(v));
  if (name == "tojson") {
    const Value* indent = arg(args, 0, "indent");
    return to_json_py(v, indent && !indent->is_null() ? static_cast<int>(to_int(*indent)) : 0, 0);
  }
  if (name == "indent") {
    const Value* w = arg(args, 0, "width");
    const std::string pad = w && w->is_string() ? w->get<std::string>() : std::string(w ? to_int(*w) : 4, ' ');
    const Value* first = arg(args, 1, "first");
    const Value* blank = arg(args, 2, "blank");
    const Value newline("\n");
    Value lines = split(to_str(v) + "\n", &newline, -1);
    lines.erase(lines.size() - 1);  // splitlines() drops the part after the final newline
    std::string out;
    for (size_t i = 0; i < lines.size(); ++i) {
      const std::string line = lines[i].get<std::string>();
      if (i > 0) out += "\n";
      out += (i > 0 && (!line.empty() || (blank && truthy(*blank)))) ? pad + line : line;
    }
    return (first && truthy(*first) ? pad : "") + out;
  }
  if (name == "int") {
    if (v.is_string()) {
      try {
        return std::stoll(strip(v.get<std::string>(), kSpaces, true, true));
      } catch (...) {
        return int64_t{0};
      }
    }
    return v.is_number() || v.is_boolean() ? Value(static_cast<int64_t>(num(n, v))) : Value(0);
  }
  if (name == "float") return v.is_number() || v.is_boolean() ? num(n, v) : 0.0;
  if (name == "abs") return is_int(v) ? Value(std::llabs(to_int(v))) : Value(std::fabs(num(n, v)));
  if (name == "items") return items_of(v);
  if (name == "list") return as_list(n, v);
  if (name == "first" || name == "last") {
    const Value l = as_list(n, v);
    if (l.empty()) return undefined();
    return name == "first" ? l.front() : l.back();
  }
  if (name == "reverse") {
    if (v.is_string()) return slice_value(n, v, nullptr, nullptr, -1);
    Value l = as_list(n, v);
    std::reverse(l.begin(), l.end());
    return l;
  }
  if (name == "join") {
    const std::string sep = str_arg(n, arg(args, 0, "d"), "");
    const Value* attr = arg(args, 1, "attribute");
    std::string out;
    bool first = true;
    for (const auto& x : as_list(n, v)) {
      out += (first ? "" : sep) + to_str(attr ? dotted(n, x, to_str(*attr)) : x);
      first = false;
    }
    return out;
  }
  if (name == "selectattr" || name == "rejectattr" || name == "select" || name == "reject") {
    const bool by_attr = name == "selectattr" || name == "rejectattr";
    const bool keep_if = name == "selectattr" || name == "select";
    const Value* attr = by_attr ? arg(args, 0, nullptr) : nullptr;
    if (by_attr && !attr) fail_at(n, name + " needs an attribute name");
    const Value* test = arg(args, by_attr ? 1 : 0, nullptr);
    Value out = Value::array();
    for (const auto& x : as_list(n, v)) {
      const Value val = attr ? dotted(n, x, to_str(*attr)) : x;
      bool ok;
      if (test) {
        Args targs;
        targs.values.push_back(val);
        targs.names.emplace_back();
        size_t skip = by_attr ? 2 : 1, k = 0;
        for (size_t i = 1; i < args.values.size(); ++i)
          if (!args.names[i].empty() || k++ >= skip) targs.values.push_back(args.values[i]), targs.names.push_back(args.names[i]);
        ok = apply_test(n, to_str(*test), targs);
      } else {
        ok = truthy(val);
      }
      if (ok == keep_if) out.push_back(x);
    }
    return out;
  }
  if (name == "map") {
    const Value* attr = arg(args, 99, "attribute");
    Value out = Value::array();
    for (const auto& x : as_list(n, v)) {
      if (attr) {
        Value r = dotted(n, x, to_str(*attr));
        const Value* d = arg(args, 99, "default");
        out.push_back(is_undefined(r) && d ? *d : r);
      } else {
        const Value* f = arg(args, 0, nullptr);
        if (!f) fail_at(n, "map needs a filter name or attribute=");
        Args fargs;
        fargs.values.push_back(x);
        fargs.names.emplace_back();
        for (size_t i = 2; i < args.values.size(); ++i) fargs.values.push_back(args.values[i]), fargs.names.push_back(args.names[i]);
        out.push_back(apply_filter(n, to_str(*f), fargs));
      }
    }
    return out;
  }
  if (name == "unique") {
    Value out = Value::array();
    for (const auto& x : as_list(n, v)) {
      bool seen = false;
      for (const auto& y : out) seen = seen || equal(x, y);
      if (!seen) out.push_back(x);
    }
    return out;
  }
  if (name == "sort") {
    Value l = as_list(n, v);
    const Value* rev = arg(args, 0, "reverse");
    const Value* attr = arg(args, 2, "attribute");
    std::stable_sort(l.begin(), l.end(), [&](const Value& x, const Value& y) {
      return compare(n, attr ? dotted(n, x, to_str(*attr)) : x, attr ? dotted(n, y, to_str(*attr)) : y) < 0;
    });
    if (rev && truthy(*rev)) std::reverse(l.begin(), l.end());
    return l;
  }
  fail_at(n, "unknown filter '" + name + "'");
}

Value call_method(const Node& n, const Value& obj, const std::string& name, const Args& args) {
  auto a = [&](size_t pos, const char* kw) { return arg(args, pos, kw, 0); };
  if (obj.is_string()) {
    const std::string s = obj.get<std::string>();
    if (name == "strip" || name == "lstrip" || name == "rstrip")
      return strip(s, str_arg(n, a(0, "chars"), kSpaces), name != "rstrip", name != "lstrip");
    if (name == "startswith" || name == "endswith") {
      if (!a(0, nullptr)) fail_at(n, name + "() needs an argument");
      return prefix_test(n, s, *a(0, nullptr), name == "startswith");
    }
    if (name == "split") {
      const Value* m = a(1, "maxsplit");
      return split(s, a(0, "sep"), m ? to_int(*m) : -1);
    }
    if (name == "lower") return map_chars(s, ::tolower);
    if (name == "upper") return map_chars(s, ::toupper);
    if (name == "title" || name == "capitalize") {
      Args fa{{obj}, {""}};
      return apply_filter(n, name, fa);
    }
    if (name == "replace") {
      const Value* c = a(2, "count");
      return replace_all(s, str_arg(n, a(0, nullptr), ""), str_arg(n, a(1, nullptr), ""), c ? to_int(*c) : -1);
    }
    if (name == "find") {
      const size_t p = s.find(str_arg(n, a(0, nullptr), ""));
      return p == std::string::npos ? int64_t{-1} : static_cast<int64_t>(utf8_decode(s.substr(0, p)).size());
    }
    if (name == "join") {
      std::string out;
      bool first = true;
      for (const auto& x : as_list(n, a(0, nullptr) ? *a(0, nullptr) : Value::array())) {
        out += (first ? "" : s) + to_str(x);
        first = false;
      }
      return out;
    }
  }
  if (obj.is_object()) {
    if (name == "items") return items_of(obj);
    if (name == "keys") return as_list(n, obj);
    if (name == "values") {
      Value out = Value::array();
      for (const auto& x : obj) out.push_back(x);
      return out;
    }
    if (name == "get") {
      const Value* k = a(0, nullptr);
      if (!k) fail_at(n, "get() needs a key");
      const Value r = get_item(n, obj, *k);
      if (!is_undefined(r)) return r;
      return a(1, nullptr) ? *a(1, nullptr) : Value(nullptr);
    }
  }
  if (is_undefined(obj)) fail_at(n, "cannot call method '" + name + "' of an undefined value");
  fail_at(n, "unknown method '" + name + "' on " + std::string(obj.type_name()));
}

Value call_global(const Node& n, const std::string& name, const Args& args) {
  auto a = [&](size_t pos, const char* kw) { return arg(args, pos, kw, 0); };
  if (name == "raise_exception") {
    fail("chat template: ", a(0, nullptr) ? to_str(*a(0, nullptr)) : std::string("raise_exception called"));
  }
  if (name == "namespace" || name == "dict") {
    Value ns = Value::object();
    for (size_t i = 0; i < args.values.size(); ++i) {
      if (args.names[i].empty() && args.values[i].is_object()) ns.update(args.values[i]);
      else if (!args.names[i].empty()) ns[args.names[i]] = args.values[i];
    }
    return ns;
  }
  if (name == "range") {
    std::vector<int64_t> p;
    for (size_t i = 0; i < args.values.size(); ++i) {
      if (!is_int(args.values[i])) fail_at(n, "range() needs integers");
      p.push_back(to_int(args.values[i]));
    }
    if (p.empty() || p.size() > 3) fail_at(n, "range() takes 1 to 3 arguments");
    const int64_t start = p.size() > 1 ? p[0] : 0, stop = p.size() > 1 ? p[1] : p[0], step = p.size() > 2 ? p[2] : 1;
    if (step == 0) fail_at(n, "range() step must not be zero");
    Value out = Value::array();
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.push_back(i);
    return out;
  }
  if (name == "strftime_now") {
    const std::time_t t = std::time(nullptr);
    std::tm tm{};
    localtime_r(&t, &tm);
    char buf[256];
    const size_t len = std::strftime(buf, sizeof buf, str_arg(n, a(0, nullptr), "").c_str(), &tm);
    return std::string(buf, len);
  }
  fail_at(n, "'" + name + "' is undefined");
}

}  // namespace tessera::serve::jinja
