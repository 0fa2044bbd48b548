// Jinja lexer: template text -> tokens. Whitespace handling mirrors jinja2's lexer with
// trim_blocks=True, lstrip_blocks=True (what Hugging Face sets) and `-` / `+` tag markers.
#include <cctype>

#include "tessera/base/error.h"
#include "tessera/serve/jinja.h"

namespace tessera::serve::jinja {
namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// Python's unicode-escape for the escapes templates use.
std::string unescape(const std::string& s, int line) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) {
      out += s[i];
      continue;
    }
    const char c = s[++i];
    switch (c) {
      case 'n': out += '\n'; break;
      case 't': out += '\t'; break;
      case 'r': out += '\r'; break;
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case '\n': break;
      case 'u':
      case 'x': {
        const size_t len = c == 'u' ? 4 : 2;
        TESSERA_CHECK(i + len < s.size(), "chat template line ", line,
                      ": bad \\", c, " escape");
        const uint32_t cp = static_cast<uint32_t>(std::stoul(s.substr(i + 1, len), nullptr, 16));
        out += utf8_encode(std::u32string(1, static_cast<char32_t>(cp)));
        i += len;
        break;
      }
      default: out += '\\'; out += c;
    }
  }
  return out;
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
        emit(Tok::Text, src_.substr(pos_));
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
      if (!text.empty()) emit(Tok::Text, text);
      line_ += count_newlines(pos_, idx);
      pos_ = idx + 2 + (sign ? 1 : 0);
      if (kind == '#') {
        const size_t e = src_.find("#}", pos_);
        TESSERA_CHECK(e != std::string::npos, "chat template line ", line_, ": missing end of comment tag");
        const char end_sign = e > pos_ ? src_[e - 1] : 0;
        line_ += count_newlines(pos_, e);
        pos_ = e + 2;
        finish_tag(end_sign, true);
      } else {
        emit(kind == '{' ? Tok::VarBegin : Tok::BlockBegin, "");
        lex_tag(kind == '{');
      }
      line_starting = pos_ > 0 && src_[pos_ - 1] == '\n';
    }
    emit(Tok::End, "");
    return std::move(toks_);
  }

 private:
  void emit(Tok k, std::string text) { toks_.push_back({k, std::move(text), line_}); }
  int count_newlines(size_t a, size_t b) {
    int n = 0;
    for (size_t i = a; i < b && i < src_.size(); ++i) n += src_[i] == '\n';
    return n;
  }
  // After a tag's closing delimiter: `-` eats all whitespace, trim_blocks one newline.
  void finish_tag(char end_sign, bool is_block) {
    if (end_sign == '-') {
      while (pos_ < src_.size() && is_space(src_[pos_])) line_ += src_[pos_++] == '\n';
    } else if (end_sign != '+' && is_block && pos_ < src_.size() && src_[pos_] == '\n') {
      ++pos_;
      ++line_;
    }
  }

  void lex_tag(bool is_var) {
    const std::string close = is_var ? "}}" : "%}";
    std::vector<char> balance;
    for (;;) {
      while (pos_ < src_.size() && is_space(src_[pos_])) line_ += src_[pos_++] == '\n';
      TESSERA_CHECK(pos_ < src_.size(), "chat template line ", line_, ": unexpected end of template inside a tag");
      if (balance.empty()) {
        for (const char s : {'-', '+', '\0'}) {
          if (s == '+' && is_var) continue;
          const std::string end = s ? std::string(1, s) + close : close;
          if (src_.compare(pos_, end.size(), end) == 0) {
            pos_ += end.size();
            emit(is_var ? Tok::VarEnd : Tok::BlockEnd, "");
            finish_tag(s, !is_var);
            return;
          }
        }
      }
      const char c = src_[pos_];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = pos_;
        while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        emit(Tok::Name, src_.substr(pos_, e - pos_));
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
        emit(is_float ? Tok::Float : Tok::Int, num);
        pos_ = e;
      } else if (c == '\'' || c == '"') {
        size_t e = pos_ + 1;
        while (e < src_.size() && src_[e] != c) e += src_[e] == '\\' ? 2 : 1;
        TESSERA_CHECK(e < src_.size(), "chat template line ", line_, ": unterminated string literal");
        emit(Tok::String, unescape(src_.substr(pos_ + 1, e - pos_ - 1), line_));
        line_ += count_newlines(pos_, e);
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
        TESSERA_CHECK(!op.empty(), "chat template line ", line_, ": unexpected character '", c, "'");
        if (op == "(" || op == "[" || op == "{") balance.push_back(op == "(" ? ')' : op == "[" ? ']' : '}');
        if (op == ")" || op == "]" || op == "}") {
          TESSERA_CHECK(!balance.empty() && balance.back() == op[0], "chat template line ", line_,
                        ": unexpected '", op, "'");
          balance.pop_back();
        }
        emit(Tok::Op, op);
        pos_ += op.size();
      }
    }
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
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
