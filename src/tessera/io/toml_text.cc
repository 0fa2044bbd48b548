// TOML text -> toml::table through toml++ 3.3.0, after a scan that turns away the input on
// which that version's parser reaches an assertion or undefined behaviour.
//
// What goes wrong in toml++ 3.3.0 (found by building it header-only with assertions and
// -fsanitize=address,undefined and feeding it malformed configs and fuzzed input):
//  1. is_non_ascii_horizontal_whitespace() reaches TOML_UNREACHABLE (__builtin_unreachable
//     in a release build) for most code points in U+00A1..U+0499, U+2C8E..U+3087 and
//     U+FB26..U+FEFE (upstream marzer/tomlplusplus#190, fixed after 3.3.0). The parser asks
//     it about any character outside strings and comments that follows a key, a value or
//     a blank ("a = 1é", "[é]", "a é"), about the character after a backslash in a
//     """string""", and about the first character after a line-ending backslash
//     ("s = \"\"\"\\\n§\"\"\"", the upstream report).
//  2. parse_key() assumes (TOML_ASSERT_ASSUME: an assert, or __builtin_assume under clang)
//     that a table header's '[' or '[[' is followed by a key character or a quote; "[&",
//     "[#", "[\n" break that.
//  3. parse_value() assumes it is not looking at a value terminator, but an array's element
//     loop calls it on '}': "a = [}", "a = [1, }".
//  4. parse_value() picks a scalar's parser from the traits of its characters, and the
//     parser then assumes the rest: "t = 1979-05-27T'07:32:00" fails parse_time's
//     TOML_ASSERT_ASSUME(is_decimal_digit). So bare values must be TOML 1.0 scalars.
//  5. Its walks over the parsed tree recurse once per level, so "a.a.a ... = 1" with 300000
//     parts overflows the stack: a crash in the release build too.
// We validate the text up front rather than rely on the release build's behaviour: the
// scan below rejects each of these with a one-line error naming source:line:col before
// toml++ runs, so those paths are unreachable. All it rejects is invalid TOML 1.0, except
// text beyond its size / depth limits and a non-ASCII character right after a
// (line-ending) backslash in a """string""", for which the message gives the \u escape.
// toml++ reports every other malformed input as a parse_error (its own nesting limit
// of 256 included), turned into the same kind of line below.
#include "tessera/io/toml_text.h"

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/base/error.h"

namespace tessera::io {
namespace {

bool is_blank(char c) { return c == ' ' || c == '\t'; }
bool is_ascii(char c) { return static_cast<unsigned char>(c) < 0x80; }
bool is_key_char(char c) {  // TOML 1.0 bare keys (toml++'s default: no unicode keys)
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
         c == '_' || c == '-';
}

// Length of the valid UTF-8 sequence at t[i] (1 for ASCII), 0 if it is not one.
size_t utf8_length(const std::string& t, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(t[k]); };
  const unsigned char c = byte(i);
  if (c < 0x80) return 1;
  size_t n;
  uint32_t cp, min;
  if ((c & 0xE0) == 0xC0) n = 2, cp = c & 0x1F, min = 0x80;
  else if ((c & 0xF0) == 0xE0) n = 3, cp = c & 0x0F, min = 0x800;
  else if ((c & 0xF8) == 0xF0) n = 4, cp = c & 0x07, min = 0x10000;
  else return 0;
  if (i + n > t.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    cp = cp << 6 | (byte(i + k) & 0x3F);
  }
  const bool ok = cp >= min && cp <= 0x10FFFF && (cp < 0xD800 || cp > 0xDFFF);
  return ok ? n : 0;
}

// "U+00E9" for the (valid UTF-8) character at t[i].
std::string code_point_name(const std::string& t, size_t i) {
  const size_t n = utf8_length(t, i);
  uint32_t cp = static_cast<unsigned char>(t[i]) & (n == 1 ? 0x7F : n == 2 ? 0x1F : n == 3 ? 0x0F : 0x07);
  for (size_t k = 1; k < n; ++k) cp = cp << 6 | (static_cast<unsigned char>(t[i + k]) & 0x3F);
  char buf[16];
  std::snprintf(buf, sizeof buf, "U+%04X", static_cast<unsigned>(cp));
  return buf;
}

bool is_dec(char c) { return c >= '0' && c <= '9'; }
bool is_hex(char c) { return is_dec(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }
bool is_oct(char c) { return c >= '0' && c <= '7'; }
bool is_bin(char c) { return c == '0' || c == '1'; }
// toml++'s is_value_terminator() for ASCII: where a bare value ends.
bool ends_value(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f' || c == ',' ||
         c == ']' || c == '}' || c == '#';
}

// d *( d / "_" d ) at s[i], advancing i.
bool underscored(std::string_view s, size_t& i, bool (*is)(char)) {
  if (i >= s.size() || !is(s[i])) return false;
  for (++i; i < s.size();) {
    if (is(s[i])) ++i;
    else if (s[i] == '_' && i + 1 < s.size() && is(s[i + 1])) i += 2;
    else break;
  }
  return true;
}

bool fixed_digits(std::string_view s, size_t& i, size_t n) {
  for (size_t k = 0; k < n; ++k, ++i)
    if (i >= s.size() || !is_dec(s[i])) return false;
  return true;
}

bool eat(std::string_view s, size_t& i, char c) {
  if (i >= s.size() || s[i] != c) return false;
  ++i;
  return true;
}

// TOML 1.0 integers and floats (hex / octal / binary, underscores, inf, nan).
bool is_toml_number(std::string_view s) {
  if (s.empty()) return false;
  size_t i = 2;
  if (s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'o' || s[1] == 'b'))
    return underscored(s, i, s[1] == 'x' ? is_hex : s[1] == 'o' ? is_oct : is_bin) && i == s.size();
  i = s[0] == '+' || s[0] == '-';
  if (s.substr(i) == "inf" || s.substr(i) == "nan") return true;
  if (i < s.size() && s[i] == '0') ++i;  // no leading zeros
  else if (!underscored(s, i, is_dec)) return false;
  if (eat(s, i, '.') && !underscored(s, i, is_dec)) return false;
  if (eat(s, i, 'e') || eat(s, i, 'E')) {
    i += i < s.size() && (s[i] == '+' || s[i] == '-');
    if (!underscored(s, i, is_dec)) return false;
  }
  return i == s.size();
}

// HH:MM:SS[.frac] at s[i].
bool is_toml_time(std::string_view s, size_t& i) {
  if (!(fixed_digits(s, i, 2) && eat(s, i, ':') && fixed_digits(s, i, 2) && eat(s, i, ':') &&
        fixed_digits(s, i, 2)))
    return false;
  if (eat(s, i, '.')) {
    const size_t start = i;
    while (i < s.size() && is_dec(s[i])) ++i;
    return i > start;
  }
  return true;
}

// TOML 1.0 local time, local date, local or offset date-time.
bool is_toml_date_time(std::string_view s) {
  size_t i = 0;
  if (s.size() > 2 && s[2] == ':') return is_toml_time(s, i) && i == s.size();
  if (!(fixed_digits(s, i, 4) && eat(s, i, '-') && fixed_digits(s, i, 2) && eat(s, i, '-') &&
        fixed_digits(s, i, 2)))
    return false;
  if (i == s.size()) return true;
  if (!(eat(s, i, 'T') || eat(s, i, 't') || eat(s, i, ' ')) || !is_toml_time(s, i)) return false;
  if (i == s.size() || eat(s, i, 'Z') || eat(s, i, 'z')) return i == s.size();
  if (!(eat(s, i, '+') || eat(s, i, '-'))) return false;
  return fixed_digits(s, i, 2) && eat(s, i, ':') && fixed_digits(s, i, 2) && i == s.size();
}

// 1-based line and column of byte offset `pos` of `t`; columns count code points, as
// toml++'s do.
std::pair<size_t, size_t> location(const std::string& t, size_t pos) {
  size_t line = 1, col = 1;
  for (size_t k = 0; k < pos && k < t.size(); ++k) {
    if (t[k] == '\n') ++line, col = 1;
    else if ((static_cast<unsigned char>(t[k]) & 0xC0) != 0x80) ++col;
  }
  return {line, col};
}

// The first thing the checks reject: its message ("source:line:col: invalid TOML: ..."),
// its offset, and `cut`, the start of the key, value or header it is in. The text before
// the cut passed the checks, so toml++ may parse it (npos: no such prefix).
struct TextFault {
  size_t pos, cut;
  std::string message;
};

template <typename... Args>
TextFault make_fault(const std::string& t, const std::string& source, size_t cut, size_t pos,
                     Args&&... args) {
  const auto [line, col] = location(t, pos);
  return {pos, cut, detail::concat(source, ":", line, ":", col, ": invalid TOML: ",
                                   std::forward<Args>(args)...)};
}

// Walks the text as TOML's grammar does, as far as needed to know, at each character,
// whether it is in a string or comment, in a key or a value, and how deeply nested. The
// state is exact on valid TOML; past the first syntax error toml++ stops reading, so what
// the scan makes of the rest only decides which of two errors is reported.
class Scan {
 public:
  Scan(const std::string& text, const std::string& source) : t_(text), source_(source) {}

  void run() {
    size_t i = t_.compare(0, 3, "\xEF\xBB\xBF") == 0 ? 3 : 0;  // toml++ skips a BOM too
    while (i < t_.size()) {
      const char c = t_[i];
      if (c == '\n') {
        if (stack_.empty()) line_start_ = top_key_ = true, header_ = false, parts_ = 1;
        ++i;
        continue;
      }
      if (is_blank(c) || c == '\r') {
        ++i;
        continue;
      }
      if (c == '#') {  // a comment: anything up to the line break
        while (i < t_.size() && t_[i] != '\n') ++i;
        continue;
      }
      if (!is_ascii(c))
        fail_at(i, i, "non-ASCII character ", code_point_name(t_, i), " outside a string or comment");
      const bool line_start = line_start_;
      line_start_ = false;
      if (c == '"' || c == '\'') {
        i = skip_string(i);
        continue;
      }
      if (!in_key() && !header_ && c != '[' && c != '{' && c != ']' && c != '}' && c != ',') {
        i = check_bare_value(i);
        continue;
      }
      if (c == '[' && stack_.empty() && line_start) {
        i = check_header(i);
        header_ = top_key_ = true, parts_ = 1;
        continue;
      }
      switch (c) {
        case '[':
        case '{':
          if (in_key()) break;  // not a value: toml++ reports it
          stack_.push_back({c, c == '{'});
          parts_ = 1;
          if (stack_.size() > static_cast<size_t>(kMaxTomlNesting))
            fail_at(i, i, "arrays and inline tables nested more than ", kMaxTomlNesting, " deep");
          break;
        case ']':
        case '}':
          if (stack_.empty()) {
            if (header_) header_ = top_key_ = false;  // the end of a table name
            break;
          }
          if (stack_.back().kind != (c == ']' ? '[' : '{'))  // toml++ asserts on "[}"
            fail_at(i, i, "'", c, "' inside ", stack_.back().kind == '[' ? "an array" : "an inline table",
                    " (expected a value, ',' or '", stack_.back().kind == '[' ? ']' : '}', "')");
          stack_.pop_back();
          break;
        case '=':
          if (!in_key() || header_) break;
          if (stack_.empty()) top_key_ = false;
          else stack_.back().key = false;
          break;
        case ',':
          if (!stack_.empty() && stack_.back().kind == '{') stack_.back().key = true, parts_ = 1;
          break;
        case '.':
          if (in_key() && ++parts_ > kMaxTomlKeyParts)
            fail_at(i, i, "a dotted key or table name of more than ", kMaxTomlKeyParts, " parts");
          break;
        default:
          break;
      }
      ++i;
    }
  }

 private:
  struct Frame {
    char kind;  // '[' array, '{' inline table
    bool key;   // inline table: reading a key (before its '=')
  };

  // Throws a TextFault at `pos`, in the key / value / header starting at `cut`.
  template <typename... Args>
  [[noreturn]] void fail_at(size_t cut, size_t pos, Args&&... args) const {
    throw make_fault(t_, source_, cut, pos, std::forward<Args>(args)...);
  }

  bool in_key() const {
    return stack_.empty() ? top_key_ : stack_.back().kind == '{' && stack_.back().key;
  }

  // t_[i] is a table header's '['; returns where its name starts.
  size_t check_header(size_t i) const {
    size_t j = i + 1;
    const bool array = j < t_.size() && t_[j] == '[';  // [[array of tables]]
    j += array;
    while (j < t_.size() && is_blank(t_[j])) ++j;
    if (j == t_.size()) return j;  // toml++: "encountered end-of-file"
    const char c = t_[j];
    if (is_key_char(c) || c == '"' || c == '\'' || c == ']') return j;
    std::string saw;  // (appended, not "a" + b: GCC 12 warns -Wrestrict on that here)
    if (c == '\n' || c == '\r') saw = "the end of the line";
    else if (!is_ascii(c)) saw = code_point_name(t_, j);
    else if (c < 0x20 || c == 0x7F) saw.append("control character ").append(code_point_name(t_, j));
    else saw.append(1, '\'').append(1, c).append(1, '\'');
    fail_at(i, j, "expected a table name after '", array ? "[[" : "[", "', saw ", saw);
  }

  // t_[i] starts a value that is not a string, array or inline table; returns where it
  // ends. toml++ picks its parser from a few characters' traits and then assumes the rest
  // ("1979-05-27T" + a non-digit fails parse_time's TOML_ASSERT_ASSUME), so the whole
  // value must be TOML 1.0: a boolean, number, date or time.
  size_t check_bare_value(size_t i) const {
    size_t j = i;
    auto scan = [&] {
      for (; j < t_.size() && !ends_value(t_[j]); ++j)
        if (!is_ascii(t_[j]))
          fail_at(i, j, "non-ASCII character ", code_point_name(t_, j), " outside a string or comment");
    };
    scan();
    // "1979-05-27 07:32:00" is one value, as toml++ reads it: a date, a space, a digit.
    if (j - i == 10 && j + 1 < t_.size() && t_[j] == ' ' && is_dec(t_[j + 1]) &&
        is_toml_date_time(std::string_view(t_).substr(i, 10))) {
      ++j;
      scan();
    }
    const std::string_view v = std::string_view(t_).substr(i, j - i);
    if (v == "true" || v == "false" || is_toml_number(v) || is_toml_date_time(v)) return j;
    const std::string shown(v.substr(0, 40));
    fail_at(i, i, "invalid value '", shown, v.size() > 40 ? "...'" : "'",
            " (expected a string, number, true / false, date, time, array or inline table)");
  }

  // t_[i] opens a string; returns the index after it (or of the line break that ends an
  // unterminated one-line string).
  size_t skip_string(size_t i) const {
    const char q = t_[i];
    const size_t n = t_.size();
    if (t_.compare(i, 3, std::string(3, q)) != 0) {  // "basic" or 'literal', one line
      size_t j = i + 1;
      while (j < n && t_[j] != q && t_[j] != '\n') {
        if (q == '"' && t_[j] == '\\' && j + 1 < n && t_[j + 1] != '\n') ++j;
        ++j;
      }
      return j < n && t_[j] == q ? j + 1 : j;
    }
    size_t j = i + 3;
    while (j < n) {
      if (t_[j] == q) {  // three to five quotes end it (up to two belong to the text)
        size_t run = 0;
        while (j < n && t_[j] == q) ++j, ++run;
        if (run >= 3) return j;
        continue;
      }
      if (q == '"' && t_[j] == '\\') {
        size_t k = j + 1;
        if (k == n) return k;
        if (!is_ascii(t_[k]))
          fail_at(i, k, "non-ASCII character ", code_point_name(t_, k),
                  " after a backslash in a \"\"\"string\"\"\"");
        if (is_blank(t_[k]) || t_[k] == '\r' || t_[k] == '\n') {  // line-ending backslash
          while (k < n && (is_blank(t_[k]) || t_[k] == '\r' || t_[k] == '\n')) ++k;
          if (k < n && !is_ascii(t_[k]))
            fail_at(i, k, "non-ASCII character ", code_point_name(t_, k),
                    " first after a line-ending backslash (toml++ 3.3.0 misreads it there; "
                    "write it as \\u", code_point_name(t_, k).substr(2), " or on the line before)");
          j = k;
          continue;
        }
        j = k + 1;  // an escape: the escaped character is not a quote or backslash of ours
        continue;
      }
      ++j;
    }
    return j;
  }

  const std::string& t_;
  const std::string& source_;
  std::vector<Frame> stack_;
  bool line_start_ = true;  // nesting level 0, nothing but blanks yet on this line
  bool top_key_ = true;     // nesting level 0: in a key (or table name), not a value
  bool header_ = false;     // in a [table] / [[table]] name
  int parts_ = 1;           // parts of the key being read
};

std::optional<TextFault> find_fault(const std::string& text, const std::string& source) {
  if (text.size() > kMaxTomlBytes)
    return TextFault{0, std::string::npos,
                     detail::concat(source, ": invalid TOML: ", text.size(),
                                    " bytes, more than the limit of ", kMaxTomlBytes)};
  size_t bad = 0;  // the first NUL or invalid UTF-8 byte
  while (bad < text.size() && text[bad] != '\0' && utf8_length(text, bad) > 0)
    bad += utf8_length(text, bad);
  std::optional<TextFault> fault;
  try {
    Scan(text, source).run();  // safe on invalid UTF-8; only its first fault counts
  } catch (TextFault& f) {
    fault = std::move(f);
  }
  if (bad < text.size() && (!fault || bad <= fault->pos)) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02X", static_cast<unsigned char>(text[bad]));
    return text[bad] == '\0' ? make_fault(text, source, std::string::npos, bad, "NUL byte")
                              : make_fault(text, source, std::string::npos, bad,
                                           "invalid UTF-8 (byte ", hex, ")");
  }
  return fault;
}

[[noreturn]] void fail_parse_error(const toml::parse_error& e, const std::string& source) {
  const auto& b = e.source().begin;
  fail(source, ":", b.line, ":", b.column, ": invalid TOML: ", e.description());
}

}  // namespace

void check_toml_text(const std::string& text, const std::string& source) {
  if (const auto fault = find_fault(text, source)) fail(fault->message);
}

toml::table parse_toml_text(const std::string& text, const std::string& source) {
  // See the top of this file: toml++ sees no text the checks reject.
  if (const auto fault = find_fault(text, source)) {
    // The first error wins: toml++ may find one before the fault in the text before it
    // ("= x": a missing key before the value). One caused by the text ending there
    // ("end-of-file", "EOF") or at / past the cut is not the user's.
    if (fault->cut != std::string::npos) {
      try {
        (void)toml::parse(std::string_view(text).substr(0, fault->cut), source);
      } catch (const toml::parse_error& e) {
        const auto [line, col] = location(text, fault->cut);
        const auto& b = e.source().begin;
        const std::string_view d = e.description();
        const bool at_end = d.find("end-of-file") != d.npos || d.find("EOF") != d.npos;
        if (!at_end && (b.line < line || (b.line == line && b.column < col))) fail_parse_error(e, source);
      }
    }
    fail(fault->message);
  }
  try {
    return toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    fail_parse_error(e, source);
  }
}

}  // namespace tessera::io
