// Filters, tests, methods, operators and globals for the Jinja interpreter (Python semantics).
#include "tessera/serve/jinja_builtins.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <limits>

#include "tessera/base/error.h"
#include "tessera/serve/jinja_budget.h"

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
  if (!v->is_string()) fail_at(n, "expected a string argument, got " + brief_repr(*v));
  return v->get<std::string>();
}

// out += add, within the render's string limit.
void append(const Node& n, std::string& out, const std::string& add) {
  Budget& b = current_budget();
  b.check_string(n.line, out.size() + add.size());
  b.charge_bytes(add.size());
  out += add;
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

// Python's str.replace (an empty `from` inserts `to` around every character), built within the
// string limit; a negative count means all.
std::string replace_all(const Node& n, const std::string& s, const std::string& from, const std::string& to,
                        int64_t count = -1) {
  std::string out;
  if (from.empty()) {
    const std::u32string chars = utf8_decode(s);
    for (size_t i = 0; i <= chars.size(); ++i) {
      if (count != 0) append(n, out, to), count -= count > 0;
      if (i < chars.size()) append(n, out, utf8_encode(chars.substr(i, 1)));
    }
    return out;
  }
  size_t pos = 0, hit;
  while (count != 0 && (hit = s.find(from, pos)) != std::string::npos) {
    append(n, out, s.substr(pos, hit - pos));
    append(n, out, to);
    pos = hit + from.size();
    count -= count > 0;
  }
  append(n, out, s.substr(pos));
  return out;
}

Value split(const Node& n, const std::string& s, const Value* sep, int64_t maxsplit) {
  Value out = Value::array();
  Budget& b = current_budget();
  b.charge_bytes(s.size());
  auto push = [&](std::string part) {
    b.check_list(n.line, out.size() + 1);
    out.push_back(std::move(part));
  };
  auto may_split = [&] {  // a negative maxsplit means no limit
    if (maxsplit == 0) return false;
    maxsplit -= maxsplit > 0;
    return true;
  };
  if (!sep || sep->is_null()) {  // runs of whitespace, no empty parts
    size_t i = s.find_first_not_of(kSpaces);
    while (i != std::string::npos) {
      size_t e = s.find_first_of(kSpaces, i);
      if (!may_split()) e = std::string::npos, push(strip(s.substr(i), kSpaces, false, true));
      else push(s.substr(i, e == std::string::npos ? e : e - i));
      if (e == std::string::npos) break;
      i = s.find_first_not_of(kSpaces, e);
    }
    return out;
  }
  const std::string d = str_arg(n, sep, "");
  if (d.empty()) fail_at(n, "empty separator");
  size_t i = 0, e;
  while (may_split() && (e = s.find(d, i)) != std::string::npos) {
    push(s.substr(i, e - i));
    i = e + d.size();
  }
  push(s.substr(i));
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

int64_t length(const Node& n, const Value& v) {
  if (is_undefined(v)) return 0;
  if (v.is_string()) return static_cast<int64_t>(utf8_decode(v.get<std::string>()).size());
  if (v.is_array() || v.is_object()) return static_cast<int64_t>(v.size());
  fail_at(n, std::string("object of type ") + v.type_name() + " has no len()");
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

std::string html_escape(const Node& n, const std::string& s) {
  size_t size = s.size();
  for (const char c : s) size += c == '&' ? 4 : c == '<' || c == '>' ? 3 : c == '"' || c == '\'' ? 4 : 0;
  current_budget().check_string(n.line, size);
  current_budget().charge_bytes(size);
  std::string out;
  out.reserve(size);
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

// Python's str.center(width): the extra space goes left when the margin and width are both odd.
std::string center(const Node& n, const std::string& s, int64_t width) {
  const auto len = static_cast<int64_t>(utf8_decode(s).size());
  if (width <= len) return s;
  current_budget().check_string(n.line, s.size() + static_cast<size_t>(width - len));
  const int64_t marg = width - len, left = marg / 2 + (marg & width & 1);
  return std::string(static_cast<size_t>(left), ' ') + s + std::string(static_cast<size_t>(marg - left), ' ');
}

// jinja2's indent filter: `pad` before every line but the first (and blank ones unless `blank`).
// Its lines are (s + "\n").splitlines(), i.e. the pieces of s between newlines.
std::string indent(const Node& n, const std::string& s, const std::string& pad, bool first, bool blank) {
  const auto lines = static_cast<int64_t>(std::count(s.begin(), s.end(), '\n')) + 1;
  current_budget().check_string(n.line, s.size() + Budget::saturating_mul(pad.size(), lines + 1));
  std::string out = first ? pad : "";
  for (size_t b = 0, i = 0;; ++i) {
    const size_t e = std::min(s.find('\n', b), s.size());
    if (i > 0) {
      out += '\n';
      if (e > b || blank) out += pad;
    }
    out.append(s, b, e - b);
    if (e == s.size()) break;
    b = e + 1;
  }
  current_budget().charge_bytes(out.size());
  return out;
}

// Items of a sequence, each charged as work (sort, unique, map, select... visit them all).
Value charged(Value v) {
  current_budget().charge(static_cast<int64_t>(v.size()));
  return v;
}

}  // namespace

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
    return (to_int(n, v) % 2 != 0) == (name == "odd");
  }
  if (name == "divisibleby") return equal(binary_op(n, "%", v, need()), Value(0));  // jinja2: value % num == 0
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
  if (name == "length" || name == "count") return length(n, v);
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
    const int64_t c = count && !count->is_null() ? to_int(n, *count) : -1;
    return replace_all(n, to_str(v), str_arg(n, arg(args, 0, "old"), ""), str_arg(n, arg(args, 1, "new"), ""), c);
  }
  if (name == "e" || name == "escape") return html_escape(n, to_str(v));
  if (name == "tojson") {
    const Value* ind = arg(args, 0, "indent");
    const int64_t width = ind && !ind->is_null() ? std::max<int64_t>(0, to_int(n, *ind)) : -1;
    current_budget().check_string(n.line, static_cast<size_t>(std::max<int64_t>(width, 0)));
    return to_json_py(v, width, 0);
  }
  if (name == "indent") {
    const Value* w = arg(args, 0, "width");
    std::string pad = "    ";
    if (w && w->is_string()) {
      pad = w->get<std::string>();
    } else if (w) {  // " " * width: empty for width <= 0
      const int64_t width = std::max<int64_t>(0, to_int(n, *w));
      current_budget().check_string(n.line, static_cast<size_t>(width));
      pad.assign(static_cast<size_t>(width), ' ');
    }
    const Value* first = arg(args, 1, "first");
    const Value* blank = arg(args, 2, "blank");
    return indent(n, to_str(v), pad, first && truthy(*first), blank && truthy(*blank));
  }
  if (name == "center") {
    const Value* w = arg(args, 0, "width");
    return center(n, to_str(v), w ? to_int(n, *w) : 80);
  }
  if (name == "int") {
    const Value* base = arg(args, 1, "base");
    if (base && !(is_int(*base) && to_int(n, *base) == 10)) fail_at(n, "int filter: only base 10 is supported");
    const Value* d = arg(args, 0, "default");
    return int_filter(n, v, d ? *d : Value(0));
  }
  if (name == "float") {
    const Value* d = arg(args, 0, "default");
    return float_filter(v, d ? *d : Value(0.0));
  }
  if (name == "abs") {
    if (!is_int(v)) return std::fabs(num(n, v));
    const int64_t x = to_int(n, v);
    if (x == std::numeric_limits<int64_t>::min()) fail_at(n, "integer overflow in abs(" + std::to_string(x) + ")");
    return x < 0 ? -x : x;
  }
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
      if (!first) append(n, out, sep);
      append(n, out, to_str(attr ? dotted(n, x, to_str(*attr)) : x));
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
    for (const auto& x : charged(as_list(n, v))) {
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
    for (const auto& x : charged(as_list(n, v))) {
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
      current_budget().charge(static_cast<int64_t>(out.size()));
      for (const auto& y : out) {
        seen = equal(x, y);
        if (seen) break;
      }
      if (!seen) out.push_back(x);
    }
    return out;
  }
  if (name == "sort") {
    Value l = as_list(n, v);
    const Value* rev = arg(args, 0, "reverse");
    const Value* attr = arg(args, 2, "attribute");
    std::stable_sort(l.begin(), l.end(), [&](const Value& x, const Value& y) {
      current_budget().charge(1);
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
      return split(n, s, a(0, "sep"), m ? to_int(n, *m) : -1);
    }
    if (name == "lower") return map_chars(s, ::tolower);
    if (name == "upper") return map_chars(s, ::toupper);
    if (name == "title" || name == "capitalize") {
      Args fa{{obj}, {""}};
      return apply_filter(n, name, fa);
    }
    if (name == "replace") {
      const Value* c = a(2, "count");
      if (!a(0, nullptr) || !a(1, nullptr)) fail_at(n, "replace() needs two arguments");
      return replace_all(n, s, str_arg(n, a(0, nullptr), ""), str_arg(n, a(1, nullptr), ""), c ? to_int(n, *c) : -1);
    }
    if (name == "find") {
      const size_t p = s.find(str_arg(n, a(0, nullptr), ""));
      return p == std::string::npos ? int64_t{-1} : static_cast<int64_t>(utf8_decode(s.substr(0, p)).size());
    }
    if (name == "join") {
      std::string out;
      bool first = true;
      for (const auto& x : as_list(n, a(0, nullptr) ? *a(0, nullptr) : Value::array())) {
        if (!first) append(n, out, s);
        append(n, out, to_str(x));
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
    current_budget().check_value(n.line, ns);
    return ns;
  }
  if (name == "range") {
    std::vector<int64_t> p;
    for (size_t i = 0; i < args.values.size(); ++i) {
      if (!is_int(args.values[i])) fail_at(n, "range() needs integers");
      p.push_back(to_int(n, args.values[i]));
    }
    if (p.empty() || p.size() > 3) fail_at(n, "range() takes 1 to 3 arguments");
    const int64_t start = p.size() > 1 ? p[0] : 0, stop = p.size() > 1 ? p[1] : p[0], step = p.size() > 2 ? p[2] : 1;
    if (step == 0) fail_at(n, "range() step must not be zero");
    // The length first, in 128 bits (stop - start and start + k * step can pass int64).
    const __int128 span = step > 0 ? __int128{stop} - start : __int128{start} - stop;
    const __int128 mag = step > 0 ? __int128{step} : -__int128{step};
    const __int128 count = span <= 0 ? 0 : (span + mag - 1) / mag;
    current_budget().check_list(n.line, count > INT64_MAX ? SIZE_MAX : static_cast<size_t>(count));
    current_budget().charge(static_cast<int64_t>(count));
    Value out = Value::array();
    out.get_ref<Value::array_t&>().reserve(static_cast<size_t>(count));
    for (__int128 k = 0; k < count; ++k) out.push_back(static_cast<int64_t>(start + k * step));
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
