// GBNF parser into the byte-level grammar IR: quantifiers desugared into rules as
// llama.cpp does (x* as R ::= x R | ε, right-recursive so the matcher's tail calls keep
// its stacks flat), character classes split into UTF-8 byte sequences, left recursion refused.
#include "tessera/infer/structured/grammar.h"

#include <algorithm>
#include <functional>
#include <map>
#include <unordered_map>

#include "tessera/base/error.h"

namespace tessera::infer::structured {
namespace {

constexpr uint32_t kMaxCodePoint = 0x10FFFF;
constexpr int64_t kMaxRepeat = 10000;    // {m,n} bounds
constexpr size_t kMaxElems = 4u << 20;   // grammar size after desugaring

struct Sym {
  Grammar::Kind kind;
  uint32_t arg;
};
using Seq = std::vector<Sym>;

void encode_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

class Parser {
 public:
  explicit Parser(std::string_view text) : s_(text) {}

  Grammar parse() {
    skip(true);
    while (i_ < s_.size()) {
      const std::string name = parse_name();
      skip(false);
      if (s_.substr(i_, 3) != "::=") err("expected '::=' after rule name '", name, "'");
      i_ += 3;
      skip(true);
      const uint32_t id = rule_id(name);
      if (defined_[id]) err("rule '", name, "' is defined twice");
      defined_[id] = true;
      alts_[id] = parse_alternates(false, name);
      skip(true);
    }
    const auto root = ids_.find("root");
    if (root == ids_.end()) fail("grammar: no 'root' rule");
    for (size_t r = 0; r < names_.size(); ++r)
      if (!defined_[r]) fail("grammar: rule '", names_[r], "' is used but never defined");
    return flatten(root->second);
  }

 private:
  template <typename... Args>
  [[noreturn]] void err(Args&&... args) const {
    const int64_t line = 1 + std::count(s_.begin(), s_.begin() + std::min(i_, s_.size()), '\n');
    fail("grammar: line ", line, ": ", std::forward<Args>(args)...);
  }

  bool at(char c) const { return i_ < s_.size() && s_[i_] == c; }

  // Spaces, tabs and comments; newlines too when `newlines` (inside groups, after ::=).
  void skip(bool newlines) {
    while (i_ < s_.size()) {
      const char c = s_[i_];
      if (c == ' ' || c == '\t' || c == '\r' || (newlines && c == '\n')) {
        ++i_;
      } else if (c == '#') {
        while (i_ < s_.size() && s_[i_] != '\n') ++i_;
      } else {
        break;
      }
    }
  }

  static bool name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  }

  std::string parse_name() {
    const size_t b = i_;
    while (i_ < s_.size() && name_char(s_[i_])) ++i_;
    if (b == i_) err("expected a rule name at '", s_.substr(i_, 10), "'");
    return std::string(s_.substr(b, i_ - b));
  }

  uint32_t rule_id(const std::string& name) {
    auto [it, added] = ids_.emplace(name, static_cast<uint32_t>(names_.size()));
    if (added) {
      names_.push_back(name);
      alts_.emplace_back();
      defined_.push_back(false);
    }
    return it->second;
  }

  uint32_t new_rule(const std::string& base, std::vector<Seq> alts) {
    std::string name;
    do name = base + "_" + std::to_string(++anon_); while (ids_.count(name));
    const uint32_t id = rule_id(name);
    defined_[id] = true;
    alts_[id] = std::move(alts);
    return id;
  }

  uint32_t byte_set(const ByteSet& s) {
    auto [it, added] = set_ids_.emplace(s, static_cast<uint32_t>(sets_.size()));
    if (added) sets_.push_back(s);
    return it->second;
  }
  Sym byte_sym(uint8_t lo, uint8_t hi) {
    ByteSet s{};
    for (unsigned b = lo; b <= hi; ++b) s[b >> 6] |= uint64_t{1} << (b & 63);
    return {Grammar::kBytes, byte_set(s)};
  }

  // One code point of the source text (UTF-8), or an escape when `escapes`.
  uint32_t parse_char() {
    if (i_ >= s_.size()) err("unexpected end of the grammar");
    const auto c = static_cast<unsigned char>(s_[i_]);
    if (c == '\\') {
      if (++i_ >= s_.size()) err("unexpected end after '\\'");
      const char e = s_[i_++];
      switch (e) {
        case 'n': return '\n';
        case 'r': return '\r';
        case 't': return '\t';
        case 'f': return '\f';
        case 'v': return '\v';
        case '0': return 0;
        case 'x': return parse_hex(2);
        case 'u': return parse_hex(4);
        case 'U': return parse_hex(8);
        case '\\': case '"': case '[': case ']': case '-': case '^': case '\'': case '/': case '.':
          return static_cast<unsigned char>(e);
        default: err("unknown escape '\\", e, "'");
      }
    }
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || i_ + len > s_.size()) err("invalid UTF-8 in the grammar");
    uint32_t cp = len == 1 ? c : c & (0x7F >> len);
    for (int k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s_[i_ + k]) & 0x3F);
    i_ += len;
    return cp;
  }
  uint32_t parse_hex(int n) {
    uint32_t v = 0;
    for (int k = 0; k < n; ++k, ++i_) {
      if (i_ >= s_.size() || !std::isxdigit(static_cast<unsigned char>(s_[i_]))) err("expected ", n, " hex digits in an escape");
      const char h = static_cast<char>(std::tolower(static_cast<unsigned char>(s_[i_])));
      v = v * 16 + (h <= '9' ? h - '0' : h - 'a' + 10);
    }
    if (v > kMaxCodePoint) err("escape beyond U+10FFFF");
    return v;
  }

  // Code point ranges (sorted, merged) as a symbol sequence: one byte set for the one-byte
  // characters, an anonymous rule of alternatives when longer sequences are needed.
  Seq class_seq(std::vector<std::pair<uint32_t, uint32_t>> ranges, const std::string& rule) {
    std::vector<Seq> alts;
    ByteSet ascii{};
    bool any_ascii = false;
    for (auto [lo, hi] : ranges)
      for (const auto& seq : utf8_sequences(lo, hi)) {
        if (seq.size() == 1) {
          for (unsigned b = seq[0].first; b <= seq[0].second; ++b) ascii[b >> 6] |= uint64_t{1} << (b & 63);
          any_ascii = true;
          continue;
        }
        Seq s;
        for (auto [a, b] : seq) s.push_back(byte_sym(a, b));
        alts.push_back(std::move(s));
      }
    if (any_ascii) alts.insert(alts.begin(), Seq{{Grammar::kBytes, byte_set(ascii)}});
    if (alts.empty()) err("the character class matches nothing");
    if (alts.size() == 1) return alts[0];
    return {{Grammar::kRule, new_rule(rule + "_char", std::move(alts))}};
  }

  static std::vector<std::pair<uint32_t, uint32_t>> normalize(std::vector<std::pair<uint32_t, uint32_t>> r,
                                                              bool negate) {
    std::sort(r.begin(), r.end());
    std::vector<std::pair<uint32_t, uint32_t>> m;
    for (auto p : r) {
      if (!m.empty() && p.first <= m.back().second + 1) m.back().second = std::max(m.back().second, p.second);
      else m.push_back(p);
    }
    if (!negate) return m;
    std::vector<std::pair<uint32_t, uint32_t>> out;
    uint32_t next = 0;
    for (auto [lo, hi] : m) {
      if (lo > next) out.push_back({next, lo - 1});
      next = hi + 1;
    }
    if (next <= kMaxCodePoint) out.push_back({next, kMaxCodePoint});
    return out;
  }

  Seq parse_class(const std::string& rule) {
    ++i_;  // '['
    const bool negate = at('^');
    if (negate) ++i_;
    std::vector<std::pair<uint32_t, uint32_t>> ranges;
    while (!at(']')) {
      if (i_ >= s_.size()) err("unterminated character class");
      const uint32_t lo = parse_char();
      uint32_t hi = lo;
      if (at('-') && i_ + 1 < s_.size() && s_[i_ + 1] != ']') {
        ++i_;
        hi = parse_char();
        if (hi < lo) err("character range out of order in a class");
      }
      ranges.push_back({lo, hi});
    }
    ++i_;
    return class_seq(normalize(std::move(ranges), negate), rule);
  }

  int64_t parse_int() {
    const size_t b = i_;
    int64_t v = 0;
    while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) {
      v = v * 10 + (s_[i_++] - '0');
      if (v > kMaxRepeat) err("repetition bound above ", kMaxRepeat);
    }
    if (b == i_) err("expected a number in '{m,n}'");
    return v;
  }

  // Replaces the last item (symbols from `start`) by its repetition {lo, hi} (hi < 0: unbounded).
  void repeat(Seq& seq, size_t start, int64_t lo, int64_t hi, const std::string& rule) {
    Seq item(seq.begin() + static_cast<std::ptrdiff_t>(start), seq.end());
    seq.resize(start);
    if (item.empty()) err("a repetition operator needs something before it");
    const Sym x = item.size() == 1 ? item[0] : Sym{Grammar::kRule, new_rule(rule, {item})};
    for (int64_t k = 0; k < lo; ++k) seq.push_back(x);
    if (hi < 0) {  // R ::= x R | ε
      const uint32_t r = rule_id_anon(rule);
      alts_[r] = {{x, {Grammar::kRule, r}}, {}};
      seq.push_back({Grammar::kRule, r});
    } else if (hi > lo) {  // O_k ::= x O_{k-1} | ε, O_1 ::= x | ε
      uint32_t prev = new_rule(rule, {{x}, {}});
      for (int64_t k = 1; k < hi - lo; ++k) prev = new_rule(rule, {{x, {Grammar::kRule, prev}}, {}});
      seq.push_back({Grammar::kRule, prev});
    }
    size_ += seq.size();
    if (size_ > kMaxElems) err("the grammar is too large after expanding repetitions");
  }
  uint32_t rule_id_anon(const std::string& base) { return new_rule(base, {}); }

  Seq parse_sequence(bool nested, const std::string& rule) {
    Seq seq;
    size_t last = 0;  // where the last item starts
    bool have_item = false;
    while (true) {
      skip(nested);
      if (i_ >= s_.size()) break;
      const char c = s_[i_];
      if (c == '|' || c == '\n' || (c == ')' && nested)) break;
      const size_t start = seq.size();
      if (c == '"') {
        ++i_;
        std::string bytes;
        while (!at('"')) {
          if (i_ >= s_.size() || s_[i_] == '\n') err("unterminated string literal");
          encode_utf8(parse_char(), bytes);
        }
        ++i_;
        for (unsigned char b : bytes) seq.push_back(byte_sym(b, b));
      } else if (c == '[') {
        const Seq cls = parse_class(rule);
        seq.insert(seq.end(), cls.begin(), cls.end());
      } else if (c == '.') {
        ++i_;
        const Seq any = class_seq({{0, kMaxCodePoint}}, rule);
        seq.insert(seq.end(), any.begin(), any.end());
      } else if (c == '(') {
        ++i_;
        auto alts = parse_alternates(true, rule);
        skip(true);
        if (!at(')')) err("expected ')'");
        ++i_;
        seq.push_back({Grammar::kRule, new_rule(rule, std::move(alts))});
      } else if (name_char(c)) {
        const size_t save = i_;
        const std::string name = parse_name();
        skip(false);
        if (s_.substr(i_, 3) == "::=") {  // the next rule starts (a rule continued after a newline)
          if (nested) err("expected ')' before rule '", name, "'");
          i_ = save;
          break;
        }
        seq.push_back({Grammar::kRule, rule_id(name)});
      } else if (c == '*' || c == '+' || c == '?' || c == '{') {
        if (!have_item) err("'", c, "' must follow an item");
        ++i_;
        int64_t lo = 0, hi = -1;
        if (c == '+') lo = 1;
        if (c == '?') hi = 1;
        if (c == '{') {
          skip(false);
          lo = parse_int();
          skip(false);
          if (at(',')) {
            ++i_;
            skip(false);
            if (!at('}')) {
              hi = parse_int();
              if (hi < lo) err("{m,n} with n < m");
            }
          } else {
            hi = lo;
          }
          skip(false);
          if (!at('}')) err("expected '}'");
          ++i_;
        }
        repeat(seq, last, lo, hi, rule);
        have_item = false;  // x** is refused: ambiguous and pointless
        continue;
      } else {
        err("unexpected character '", c, "'");
      }
      last = start;
      have_item = true;
      size_ += seq.size() - start;
      if (size_ > kMaxElems) err("the grammar is too large");
    }
    return seq;
  }

  std::vector<Seq> parse_alternates(bool nested, const std::string& rule) {
    std::vector<Seq> alts;
    alts.push_back(parse_sequence(nested, rule));
    while (true) {
      if (!nested) {  // a line that starts with '|' continues the rule
        const size_t save = i_;
        skip(true);
        if (!at('|')) {
          i_ = save;
          break;
        }
      }
      if (!at('|')) break;
      ++i_;
      skip(true);
      alts.push_back(parse_sequence(nested, rule));
    }
    return alts;
  }

  Grammar flatten(uint32_t root) {
    Grammar g;
    g.names = names_;
    g.sets = sets_;
    g.root = root;
    g.rules.resize(names_.size());
    for (size_t r = 0; r < names_.size(); ++r)
      for (const Seq& alt : alts_[r]) {
        g.rules[r].push_back(static_cast<uint32_t>(g.elems.size()));
        for (const Sym& s : alt) g.elems.push_back({s.kind, s.arg});
        g.elems.push_back({Grammar::kEnd, 0});
      }
    check_left_recursion(g);
    return g;
  }

  // A rule that reaches itself through nullable prefixes would make the matcher's
  // expansion loop forever: refused, naming it (llama.cpp does the same).
  static void check_left_recursion(const Grammar& g) {
    const size_t n = g.rules.size();
    std::vector<char> nullable(n, 0);
    for (bool changed = true; changed;) {
      changed = false;
      for (size_t r = 0; r < n; ++r) {
        if (nullable[r]) continue;
        for (uint32_t a : g.rules[r]) {
          size_t p = a;
          while (g.elems[p].kind == Grammar::kRule && nullable[g.elems[p].arg]) ++p;
          if (g.elems[p].kind == Grammar::kEnd) {
            nullable[r] = changed = true;
            break;
          }
        }
      }
    }
    std::vector<std::vector<uint32_t>> left(n);  // rules reachable at the left edge
    for (size_t r = 0; r < n; ++r)
      for (uint32_t a : g.rules[r])
        for (size_t p = a; g.elems[p].kind == Grammar::kRule; ++p) {
          left[r].push_back(g.elems[p].arg);
          if (!nullable[g.elems[p].arg]) break;
        }
    std::vector<char> color(n, 0);  // 0 new, 1 on the path, 2 done
    std::function<void(uint32_t)> dfs = [&](uint32_t r) {
      color[r] = 1;
      for (uint32_t t : left[r]) {
        if (color[t] == 1) fail("grammar: rule '", g.names[t], "' is left-recursive (directly or through empty-matching items)");
        if (color[t] == 0) dfs(t);
      }
      color[r] = 2;
    };
    for (uint32_t r = 0; r < n; ++r)
      if (color[r] == 0) dfs(r);
  }

  std::string_view s_;
  size_t i_ = 0;
  size_t size_ = 0;
  int anon_ = 0;
  std::unordered_map<std::string, uint32_t> ids_;
  std::vector<std::string> names_;
  std::vector<std::vector<Seq>> alts_;
  std::vector<bool> defined_;
  std::vector<ByteSet> sets_;
  std::map<ByteSet, uint32_t> set_ids_;
};

}  // namespace

std::vector<std::vector<std::pair<uint8_t, uint8_t>>> utf8_sequences(uint32_t lo, uint32_t hi) {
  std::vector<std::vector<std::pair<uint8_t, uint8_t>>> out;
  std::function<void(uint32_t, uint32_t)> split = [&](uint32_t a, uint32_t b) {
    if (a > b) return;
    if (a <= 0xDFFF && b >= 0xD800) {  // surrogates are not characters
      if (a < 0xD800) split(a, 0xD7FF);
      if (b > 0xDFFF) split(0xE000, b);
      return;
    }
    for (uint32_t edge : {0x7Fu, 0x7FFu, 0xFFFFu})
      if (a <= edge && edge < b) {
        split(a, edge);
        split(edge + 1, b);
        return;
      }
    if (b <= 0x7F) {
      out.push_back({{static_cast<uint8_t>(a), static_cast<uint8_t>(b)}});
      return;
    }
    const int len = b <= 0x7FF ? 2 : b <= 0xFFFF ? 3 : 4;
    for (int k = 1; k < len; ++k) {
      const uint32_t m = (1u << (6 * k)) - 1;
      if ((a & ~m) != (b & ~m)) {
        if ((a & m) != 0) {
          split(a, a | m);
          split((a | m) + 1, b);
          return;
        }
        if ((b & m) != m) {
          split(a, (b & ~m) - 1);
          split(b & ~m, b);
          return;
        }
      }
    }
    std::string ea, eb;
    encode_utf8(a, ea);
    encode_utf8(b, eb);
    std::vector<std::pair<uint8_t, uint8_t>> seq;
    for (size_t k = 0; k < ea.size(); ++k)
      seq.push_back({static_cast<uint8_t>(ea[k]), static_cast<uint8_t>(eb[k])});
    out.push_back(std::move(seq));
  };
  split(lo, std::min(hi, kMaxCodePoint));
  return out;
}

Grammar parse_gbnf(std::string_view text) { return Parser(text).parse(); }

}  // namespace tessera::infer::structured
