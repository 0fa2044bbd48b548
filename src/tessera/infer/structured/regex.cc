// Regular expressions as GBNF: a recursive-descent parse into a small AST (alternation,
// concatenation, repetition, code-point classes), then GBNF text. In json_string mode the
// characters a JSON string cannot hold raw (", \, controls) are written as their escapes.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <memory>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/infer/structured/convert.h"

namespace tessera::infer::structured {
namespace {

using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;

struct Node {
  enum Kind { kAlt, kCat, kRepeat, kClass } kind;
  std::vector<std::unique_ptr<Node>> kids{};
  int64_t lo = 0, hi = -1;  // kRepeat; hi < 0: unbounded
  Ranges ranges{};          // kClass: sorted, merged code point ranges
};
using NodeP = std::unique_ptr<Node>;

constexpr uint32_t kMax = 0x10FFFF;

Ranges merge(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges m;
  for (auto p : r) {
    if (!m.empty() && p.first <= m.back().second + 1) m.back().second = std::max(m.back().second, p.second);
    else m.push_back(p);
  }
  return m;
}

Ranges negate(const Ranges& r) {
  Ranges out;
  uint32_t next = 0;
  for (auto [lo, hi] : merge(r)) {
    if (lo > next) out.push_back({next, lo - 1});
    next = hi + 1;
  }
  if (next <= kMax) out.push_back({next, kMax});
  return out;
}

const Ranges kDigit = {{'0', '9'}};
const Ranges kWord = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
const Ranges kSpace = {{'\t', '\r'}, {' ', ' '}};

class RegexParser {
 public:
  explicit RegexParser(std::string_view s) : s_(s) {}

  NodeP parse() {
    if (at('^')) ++i_;
    NodeP n = parse_alt();
    if (i_ < s_.size()) err("unbalanced ')'");
    return n;
  }

 private:
  template <typename... Args>
  [[noreturn]] void err(Args&&... args) const {
    fail("regex: at offset ", i_, ": ", std::forward<Args>(args)...);
  }
  bool at(char c) const { return i_ < s_.size() && s_[i_] == c; }

  static NodeP cls(Ranges r) {
    auto n = std::make_unique<Node>(Node{Node::kClass, {}});
    n->ranges = merge(std::move(r));
    return n;
  }

  NodeP parse_alt() {
    auto alt = std::make_unique<Node>(Node{Node::kAlt, {}});
    alt->kids.push_back(parse_cat());
    while (at('|')) {
      ++i_;
      alt->kids.push_back(parse_cat());
    }
    return alt->kids.size() == 1 ? std::move(alt->kids[0]) : std::move(alt);
  }

  NodeP parse_cat() {
    auto cat = std::make_unique<Node>(Node{Node::kCat, {}});
    while (i_ < s_.size() && !at('|') && !at(')')) {
      if (at('$')) {
        if (i_ + 1 == s_.size() || s_[i_ + 1] == ')' || s_[i_ + 1] == '|') {
          if (depth_ > 0 || i_ + 1 != s_.size()) err("'$' is supported only at the end of the pattern");
          ++i_;
          continue;
        }
        err("'$' is supported only at the end of the pattern");
      }
      if (at('^')) err("'^' is supported only at the start of the pattern");
      NodeP atom = parse_atom();
      cat->kids.push_back(parse_quantifiers(std::move(atom)));
    }
    return cat;
  }

  NodeP parse_quantifiers(NodeP atom) {
    while (i_ < s_.size()) {
      int64_t lo, hi;
      const char c = s_[i_];
      if (c == '*') { lo = 0; hi = -1; ++i_; }
      else if (c == '+') { lo = 1; hi = -1; ++i_; }
      else if (c == '?') { lo = 0; hi = 1; ++i_; }
      else if (c == '{' && parse_braces(lo, hi)) {}
      else break;
      if (at('?')) ++i_;  // lazy: the same language
      else if (at('+')) err("possessive quantifiers are not supported");
      auto r = std::make_unique<Node>(Node{Node::kRepeat, {}});
      r->lo = lo;
      r->hi = hi;
      r->kids.push_back(std::move(atom));
      atom = std::move(r);
    }
    return atom;
  }

  // {m}, {m,}, {m,n}; false (nothing consumed) when '{' does not start one (a literal '{').
  bool parse_braces(int64_t& lo, int64_t& hi) {
    size_t j = i_ + 1;
    auto num = [&](int64_t& v) {
      const size_t b = j;
      v = 0;
      while (j < s_.size() && std::isdigit(static_cast<unsigned char>(s_[j]))) {
        v = v * 10 + (s_[j++] - '0');
        if (v > 10000) err("repetition bound above 10000");
      }
      return j > b;
    };
    if (!num(lo)) return false;
    hi = lo;
    if (j < s_.size() && s_[j] == ',') {
      ++j;
      if (!num(hi)) hi = -1;
    }
    if (j >= s_.size() || s_[j] != '}') return false;
    if (hi >= 0 && hi < lo) err("{m,n} with n < m");
    i_ = j + 1;
    return true;
  }

  uint32_t parse_utf8() {
    const auto c = static_cast<unsigned char>(s_[i_]);
    const int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || i_ + len > s_.size()) err("invalid UTF-8");
    uint32_t cp = len == 1 ? c : c & (0x7F >> len);
    for (int k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s_[i_ + k]) & 0x3F);
    i_ += len;
    return cp;
  }

  uint32_t hex(int n) {
    uint32_t v = 0;
    for (int k = 0; k < n; ++k, ++i_) {
      if (i_ >= s_.size() || !std::isxdigit(static_cast<unsigned char>(s_[i_]))) err("expected ", n, " hex digits");
      const char h = static_cast<char>(std::tolower(static_cast<unsigned char>(s_[i_])));
      v = v * 16 + (h <= '9' ? h - '0' : h - 'a' + 10);
    }
    if (v > kMax) err("escape beyond U+10FFFF");
    return v;
  }

  // An escape after '\': a class (\d ...) or one code point.
  Ranges parse_escape(bool in_class) {
    if (i_ >= s_.size()) err("pattern ends with '\\'");
    const char e = s_[i_++];
    switch (e) {
      case 'd': return kDigit;
      case 'D': return negate(kDigit);
      case 'w': return kWord;
      case 'W': return negate(kWord);
      case 's': return kSpace;
      case 'S': return negate(kSpace);
      case 'n': return {{'\n', '\n'}};
      case 'r': return {{'\r', '\r'}};
      case 't': return {{'\t', '\t'}};
      case 'f': return {{'\f', '\f'}};
      case 'v': return {{'\v', '\v'}};
      case '0': return {{0, 0}};
      case 'x': { const uint32_t v = hex(2); return {{v, v}}; }
      case 'u': { const uint32_t v = hex(4); return {{v, v}}; }
      case 'b':
        if (in_class) return {{'\b', '\b'}};
        err("\\b (word boundary) is not supported");
      case 'B': case 'A': case 'Z': case 'z': case 'G':
        err("the anchor \\", e, " is not supported");
      default:
        if (std::isalnum(static_cast<unsigned char>(e))) err(std::isdigit(static_cast<unsigned char>(e))
                                                              ? "backreferences are not supported"
                                                              : "unknown escape");
        --i_;
        const uint32_t cp = parse_utf8();
        return {{cp, cp}};
    }
  }

  NodeP parse_class() {
    ++i_;  // '['
    const bool neg = at('^');
    if (neg) ++i_;
    Ranges r;
    bool first = true;
    while (first || !at(']')) {
      if (i_ >= s_.size()) err("unterminated character class");
      first = false;
      Ranges item;
      if (at('\\')) {
        ++i_;
        item = parse_escape(true);
      } else {
        if (at('[') && i_ + 1 < s_.size() && s_[i_ + 1] == ':') err("POSIX classes [:name:] are not supported");
        const uint32_t cp = parse_utf8();
        item = {{cp, cp}};
      }
      if (item.size() == 1 && item[0].first == item[0].second && at('-') && i_ + 1 < s_.size() && s_[i_ + 1] != ']') {
        ++i_;
        Ranges hi_item;
        if (at('\\')) {
          ++i_;
          hi_item = parse_escape(true);
        } else {
          const uint32_t cp = parse_utf8();
          hi_item = {{cp, cp}};
        }
        if (hi_item.size() != 1 || hi_item[0].first != hi_item[0].second) err("a class range ends in a class");
        if (hi_item[0].first < item[0].first) err("character range out of order");
        item[0].second = hi_item[0].first;
      }
      r.insert(r.end(), item.begin(), item.end());
    }
    ++i_;
    if (neg) r = negate(r);
    if (r.empty()) err("the character class matches nothing");
    return cls(std::move(r));
  }

  NodeP parse_atom() {
    const char c = s_[i_];
    if (c == '(') {
      ++i_;
      if (at('?')) {
        if (i_ + 1 < s_.size() && s_[i_ + 1] == ':') {
          i_ += 2;
        } else if (i_ + 1 < s_.size() && s_[i_ + 1] == 'P' && i_ + 2 < s_.size() && s_[i_ + 2] == '<') {
          const size_t close = s_.find('>', i_);
          if (close == std::string_view::npos) err("unterminated group name");
          i_ = close + 1;
        } else if (i_ + 1 < s_.size() && s_[i_ + 1] == '<' && i_ + 2 < s_.size() && s_[i_ + 2] != '=' &&
                   s_[i_ + 2] != '!') {
          const size_t close = s_.find('>', i_);
          if (close == std::string_view::npos) err("unterminated group name");
          i_ = close + 1;
        } else {
          err("lookaround, flags and other (?...) groups are not supported");
        }
      }
      if (++depth_ > 256) err("groups nest deeper than 256");
      NodeP n = parse_alt();
      --depth_;
      if (!at(')')) err("missing ')'");
      ++i_;
      return n;
    }
    if (c == '[') return parse_class();
    if (c == '.') {
      ++i_;
      return cls(negate({{'\n', '\n'}}));
    }
    if (c == '\\') {
      ++i_;
      return cls(parse_escape(false));
    }
    if (c == '*' || c == '+' || c == '?') err("nothing to repeat before '", c, "'");
    const uint32_t cp = parse_utf8();
    return cls({{cp, cp}});
  }

  std::string_view s_;
  size_t i_ = 0;
  int depth_ = 0;
};

std::string hex_escape(uint32_t cp) {
  char buf[16];
  std::snprintf(buf, sizeof buf, cp <= 0xFFFF ? "\\u%04X" : "\\U%08X", cp);
  return buf;
}

std::string class_text(const Ranges& r) {
  std::string s = "[";
  for (auto [lo, hi] : r) {
    s += hex_escape(lo);
    if (hi != lo) s += "-" + hex_escape(hi);
  }
  return s + "]";
}

// A class as GBNF; in json_string mode what a JSON string cannot hold raw becomes escapes.
std::string class_gbnf(const Ranges& r, bool json_string) {
  if (!json_string) return class_text(r);
  Ranges raw;
  std::vector<std::string> escaped;
  for (auto [lo, hi] : r) {
    for (uint32_t c = lo; c <= std::min<uint32_t>(hi, 0x1F); ++c) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      escaped.push_back(gbnf_literal(buf));
    }
    uint32_t a = std::max<uint32_t>(lo, 0x20);
    while (a <= hi) {  // cut out '"' (0x22) and '\' (0x5C)
      const uint32_t cut = a <= 0x22 && hi >= 0x22 ? 0x22 : a <= 0x5C && hi >= 0x5C ? 0x5C : 0xFFFFFFFF;
      if (cut == 0xFFFFFFFF) {
        raw.push_back({a, hi});
        break;
      }
      if (cut > a) raw.push_back({a, cut - 1});
      escaped.push_back(cut == 0x22 ? gbnf_literal("\\\"") : gbnf_literal("\\\\"));
      a = cut + 1;
    }
  }
  std::vector<std::string> alts;
  if (!raw.empty()) alts.push_back(class_text(raw));
  alts.insert(alts.end(), escaped.begin(), escaped.end());
  if (alts.size() == 1) return alts[0];
  std::string s = "(";
  for (size_t k = 0; k < alts.size(); ++k) s += (k ? " | " : "") + alts[k];
  return s + ")";
}

std::string emit(const Node& n, bool json_string) {
  switch (n.kind) {
    case Node::kClass:
      return class_gbnf(n.ranges, json_string);
    case Node::kCat: {
      if (n.kids.empty()) return "\"\"";
      std::string s;
      for (const auto& k : n.kids) s += (s.empty() ? "" : " ") + emit(*k, json_string);
      return n.kids.size() == 1 ? s : "(" + s + ")";
    }
    case Node::kAlt: {
      std::string s = "(";
      for (size_t k = 0; k < n.kids.size(); ++k) s += (k ? " | " : "") + emit(*n.kids[k], json_string);
      return s + ")";
    }
    case Node::kRepeat: {
      const std::string x = "(" + emit(*n.kids[0], json_string) + ")";
      if (n.lo == 0 && n.hi < 0) return x + "*";
      if (n.lo == 1 && n.hi < 0) return x + "+";
      if (n.lo == 0 && n.hi == 1) return x + "?";
      if (n.hi < 0) return x + "{" + std::to_string(n.lo) + ",}";
      if (n.hi == n.lo) return x + "{" + std::to_string(n.lo) + "}";
      return x + "{" + std::to_string(n.lo) + "," + std::to_string(n.hi) + "}";
    }
  }
  return "";
}

}  // namespace

std::string gbnf_literal(std::string_view bytes) {
  std::string s = "\"";
  for (unsigned char c : bytes) {
    if (c == '"') s += "\\\"";
    else if (c == '\\') s += "\\\\";
    else if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02X", c);
      s += buf;
    } else {
      s += static_cast<char>(c);
    }
  }
  return s + "\"";
}

void regex_rules(std::string_view regex, bool json_string, const std::string& rule, std::string& out) {
  const NodeP n = RegexParser(regex).parse();
  out += rule + " ::= " + emit(*n, json_string) + "\n";
}

std::string regex_to_gbnf(std::string_view regex, bool json_string, const std::string& rule) {
  std::string out;
  regex_rules(regex, json_string, rule, out);
  return out;
}

}  // namespace tessera::infer::structured
