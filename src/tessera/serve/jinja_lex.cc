// Jinja lexer: template text -> tokens. Whitespace handling mirrors jinja2's lexer with
// trim_blocks=True, lstrip_blocks=True (what Hugging Face sets) and `-` / `+` tag markers.
#include <cctype>

#include "tessera/base/error.h"
#include "tessera/serve/jinja.h"

namespace tessera::serve::jinja {
namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

class Lexer {
 public:
  explicit Lexer(std::string src) : src_(std::move(src)) {}

  std::vector<Token> run() {
    bool line_starting = true;
    while (pos_ < src_.size()) {
      size_t idx = pos_;
      while ((idx = src_.find('{', idx)) != std::string::npos) {
        if (idx + 1 < src_.size() && (src_[idx + 1] == '{' || src_[idx + 1] == '%' || src_[idx + 1] == '#')) break;
        ++idx;
      }
      if (idx == std::string::npos) {
        emit(Tok::Text, src_.substr(pos_), pos_);
        break;
      }
      std::string text = src_.substr(pos_, idx - pos_);
      const char kind = src_[idx + 1];
      const char sign = idx + 2 < src_.size() && (src_[idx + 2] == '-' || src_[idx + 2] == '+') ? src_[idx + 2] : 0;
      if (sign == '-') {
        size_t e = text.size();
        while (e > 0 && is_space(text[e - 1])) --e;
        text.resize(e);
      } else if (sign != '+' && kind != '{') {  // lstrip_blocks
        const size_t l_pos = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
        if ((l_pos > 0 || line_starting) && l_pos < text.size()) {
          bool all_ws = true;
          for (size_t i = l_pos; i < text.size(); ++i) all_ws = all_ws && is_space(text[i]);
          if (all_ws) text.resize(l_pos);
        }
      }
      if (!text.empty()) emit(Tok::Text, text, pos_);
      pos_ = idx + 2 + (sign ? 1 : 0);
      if (kind == '#') {
        const size_t e = src_.find("#}", pos_);
        if (e == std::string::npos) error_at(idx, "missing end of comment tag");
        const char end_sign = e > pos_ ? src_[e - 1] : 0;
        pos_ = e + 2;
        finish_tag(end_sign, true);
      } else {
        emit(kind == '{' ? Tok::VarBegin : Tok::BlockBegin, "", idx);
        lex_tag(kind == '{', idx);
      }
      line_starting = pos_ > 0 && src_[pos_ - 1] == '\n';
    }
    emit(Tok::End, "", src_.size());
    return std::move(toks_);
  }

 private:
  struct Loc {
    int line, col;
  };
  // Line and column of a byte offset. Tokens come in source order, so the scan only moves
  // forward (linear in the template); an earlier offset (errors only) rescans from the start.
  Loc loc(size_t pos) {
    if (pos < scanned_) scanned_ = 0, scan_line_ = 1, line_start_ = 0;
    for (; scanned_ < pos && scanned_ < src_.size(); ++scanned_)
      if (src_[scanned_] == '\n') ++scan_line_, line_start_ = scanned_ + 1;
    return {scan_line_, static_cast<int>(pos - line_start_) + 1};
  }
  [[noreturn]] void error_at(size_t pos, const std::string& msg) {
    const Loc l = loc(pos);
    fail("chat template line ", l.line, ", column ", l.col, ": ", msg);
  }
  void emit(Tok k, std::string text, size_t pos) {
    const Loc l = loc(pos);
    toks_.push_back({k, std::move(text), l.line, l.col});
  }
  // After a tag's closing delimiter: `-` eats all whitespace, trim_blocks one newline.
  void finish_tag(char end_sign, bool is_block) {
    if (end_sign == '-') {
      while (pos_ < src_.size() && is_space(src_[pos_])) ++pos_;
    } else if (end_sign != '+' && is_block && pos_ < src_.size() && src_[pos_] == '\n') {
      ++pos_;
    }
  }

  // `n` hex digits at src_[i..]; -1 when one is missing or not hex.
  int64_t hex_at(size_t i, size_t n, size_t end) const {
    int64_t v = 0;
    for (size_t k = 0; k < n; ++k) {
      if (i + k >= end) return -1;
      const int d = hex_digit(src_[i + k]);
      if (d < 0) return -1;
      v = v * 16 + d;
    }
    return v;
  }

  // Python's unicode-escape decoding (what jinja2 applies to string literals) of src_[b, e).
  std::string unescape(size_t b, size_t e) {
    std::string out;
    for (size_t i = b; i < e; ++i) {
      if (src_[i] != '\\' || i + 1 == e) {
        out += src_[i];
        continue;
      }
      const size_t at = i;
      const char c = src_[++i];
      switch (c) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'a': out += '\a'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'v': out += '\v'; break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case '\n': break;
        case 'x':
        case 'u':
        case 'U': {
          const size_t len = c == 'x' ? 2 : c == 'u' ? 4 : 8;
          const int64_t cp = hex_at(i + 1, len, e);
          if (cp < 0) error_at(at, std::string("bad \\") + c + " escape: expected " + std::to_string(len) + " hex digits");
          if (cp > 0x10ffff) error_at(at, "bad \\U escape: code point above U+10FFFF");
          if (cp >= 0xd800 && cp <= 0xdfff) error_at(at, "bad escape: lone surrogate code points are not supported");
          out += utf8_encode(std::u32string(1, static_cast<char32_t>(cp)));
          i += len;
          break;
        }
        case 'N': error_at(at, "\\N{...} escapes are not supported");
        default:
          if (c >= '0' && c <= '7') {  // up to three octal digits
            uint32_t cp = 0;
            size_t k = 0;
            for (; k < 3 && i + k < e && src_[i + k] >= '0' && src_[i + k] <= '7'; ++k) cp = cp * 8 + (src_[i + k] - '0');
            out += utf8_encode(std::u32string(1, static_cast<char32_t>(cp)));
            i += k - 1;
          } else {
            out += '\\';
            out += c;
          }
      }
    }
    return out;
  }

  void lex_tag(bool is_var, size_t tag_start) {
    const std::string close = is_var ? "}}" : "%}";
    std::vector<char> balance;
    for (;;) {
      while (pos_ < src_.size() && is_space(src_[pos_])) ++pos_;
      if (pos_ >= src_.size()) error_at(tag_start, "unexpected end of template inside this tag");
      if (balance.empty()) {
        for (const char s : {'-', '+', '\0'}) {
          if (s == '+' && is_var) continue;
          const std::string end = s ? std::string(1, s) + close : close;
          if (src_.compare(pos_, end.size(), end) == 0) {
            emit(is_var ? Tok::VarEnd : Tok::BlockEnd, "", pos_);
            pos_ += end.size();
            finish_tag(s, !is_var);
            return;
          }
        }
      }
      const char c = src_[pos_];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = pos_;
        while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        emit(Tok::Name, src_.substr(pos_, e - pos_), pos_);
        pos_ = e;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t e = pos_;
        while (e < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        bool is_float = false;
        if (e + 1 < src_.size() && src_[e] == '.' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
          is_float = true;
          ++e;
          while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
        }
        if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
          size_t f = e + 1;
          if (f < src_.size() && (src_[f] == '+' || src_[f] == '-')) ++f;
          if (f < src_.size() && std::isdigit(static_cast<unsigned char>(src_[f]))) {
            is_float = true;
            e = f;
            while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
          }
        }
        std::string num;
        for (size_t i = pos_; i < e; ++i)
          if (src_[i] != '_') num += src_[i];
        emit(is_float ? Tok::Float : Tok::Int, num, pos_);
        pos_ = e;
      } else if (c == '\'' || c == '"') {
        size_t e = pos_ + 1;
        while (e < src_.size() && src_[e] != c) e += src_[e] == '\\' ? 2 : 1;
        if (e >= src_.size()) error_at(pos_, "unterminated string literal");
        emit(Tok::String, unescape(pos_ + 1, e), pos_);
        pos_ = e + 1;
      } else {
        static const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<",
                                     ">",  "=",  "(",  ")",  "[",  "]",  "{", "}", ",", ".", ":", "|"};
        std::string op;
        for (const char* o : kOps)
          if (src_.compare(pos_, std::string(o).size(), o) == 0) {
            op = o;
            break;
          }
        if (op.empty()) {
          if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f)
            error_at(pos_, "unexpected byte " + std::to_string(static_cast<unsigned char>(c)));
          error_at(pos_, std::string("unexpected character '") + c + "'");
        }
        if (op == "(" || op == "[" || op == "{") balance.push_back(op == "(" ? ')' : op == "[" ? ']' : '}');
        if (op == ")" || op == "]" || op == "}") {
          if (balance.empty() || balance.back() != op[0]) error_at(pos_, "unexpected '" + op + "'");
          balance.pop_back();
        }
        emit(Tok::Op, op, pos_);
        pos_ += op.size();
      }
    }
  }

  std::string src_;
  size_t pos_ = 0;
  size_t scanned_ = 0, line_start_ = 0;
  int scan_line_ = 1;
  std::vector<Token> toks_;
};

}  // namespace

std::vector<Token> lex_template(const std::string& source) {
  // jinja2 turns \r\n and \r into \n and drops one trailing newline (keep_trailing_newline=False).
  std::string src;
  src.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      src += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      src += source[i];
    }
  }
  if (!src.empty() && src.back() == '\n') src.pop_back();
  return Lexer(std::move(src)).run();
}

}  // namespace tessera::serve::jinja
