// Jinja parser: tokens from jinja_lex.cc -> statement / expression tree, with jinja2's
// operator precedence (filters bind tighter than arithmetic, `is` tests after filters).
#include <algorithm>
#include <charconv>
#include <limits>
#include <set>

#include "tessera/base/error.h"
#include "tessera/serve/jinja.h"

namespace tessera::serve::jinja {
namespace {

NodePtr make(NodeKind k, int line) {
  auto n = std::make_shared<Node>();
  n->kind = k;
  n->line = line;
  return n;
}

// A float literal too large or too small for a double: its first significant digit's
// decimal exponent decides between inf and 0.0 (what Python's float() gives).
bool float_literal_overflows(const std::string& t) {
  const size_t e = std::min(t.find_first_of("eE"), t.size());
  int64_t exp = 0;
  bool neg = false;
  for (size_t i = e + 1; i < t.size(); ++i) {
    if (t[i] == '-') neg = true;
    else if (t[i] >= '0' && t[i] <= '9') exp = std::min<int64_t>(exp * 10 + (t[i] - '0'), 1000000);
  }
  if (neg) exp = -exp;
  const std::string mant = t.substr(0, e);
  const size_t dot = std::min(mant.find('.'), mant.size());
  const size_t first = mant.find_first_not_of("0.");
  if (first == std::string::npos) return false;
  const int64_t lead = first < dot ? static_cast<int64_t>(dot - first) - 1 : -static_cast<int64_t>(first - dot);
  return lead + exp > 0;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : t_(std::move(toks)) {}

  NodeList parse_all() {
    std::string found;
    NodeList out = parse_until({}, &found);
    return out;
  }

 private:
  const Token& cur() const { return t_[p_]; }
  const Token& peek(int k = 1) const { return t_[std::min(p_ + k, t_.size() - 1)]; }
  bool is_op(const char* op) const { return cur().kind == Tok::Op && cur().text == op; }
  bool is_name(const char* name) const { return cur().kind == Tok::Name && cur().text == name; }
  [[noreturn]] void error(const std::string& msg) const { error_at(cur(), msg); }
  [[noreturn]] static void error_at(const Token& t, const std::string& msg) {
    fail("chat template line ", t.line, ", column ", t.col, ": ", msg);
  }

  // Bounds the parser's recursion (nested parentheses, unary operators, blocks).
  class Nest {
   public:
    explicit Nest(Parser& p) : p_(p) {
      if (++p_.nesting_ > kMaxParseNesting) {
        --p_.nesting_;
        p_.error("nesting deeper than " + std::to_string(kMaxParseNesting) + " levels");
      }
    }
    ~Nest() { --p_.nesting_; }
    Nest(const Nest&) = delete;
    Nest& operator=(const Nest&) = delete;

   private:
    Parser& p_;
  };
  // Records a finished node's height and bounds it: operator and filter chains build deep trees
  // without deep recursion here, but evaluating and destroying them recurses.
  NodePtr seal(NodePtr n) const {
    int h = 0;
    for (const NodeList* l : {&n->kids, &n->body, &n->else_body})
      for (const auto& k : *l)
        if (k) h = std::max(h, k->height);
    n->height = h + 1;
    if (n->height > kMaxParseNesting)
      error("expression or blocks nested deeper than " + std::to_string(kMaxParseNesting) + " levels");
    return n;
  }
  void expect_op(const char* op) {
    if (!is_op(op)) error(std::string("expected '") + op + "', got '" + describe() + "'");
    ++p_;
  }
  void expect_name(const char* name) {
    if (!is_name(name)) error(std::string("expected '") + name + "', got '" + describe() + "'");
    ++p_;
  }
  void expect_block_end() {
    if (cur().kind != Tok::BlockEnd) error("expected end of statement block, got '" + describe() + "'");
    ++p_;
  }
  std::string describe() const {
    switch (cur().kind) {
      case Tok::End: return "end of template";
      case Tok::BlockEnd: return "%}";
      case Tok::VarEnd: return "}}";
      case Tok::Text: return "text";
      default: return cur().text;
    }
  }
  std::string take_name() {
    if (cur().kind != Tok::Name) error("expected a name, got '" + describe() + "'");
    return t_[p_++].text;
  }

  // Statements until `{% <one of ends> ...`; consumes `{%` and the end name.
  NodeList parse_until(const std::set<std::string>& ends, std::string* found) {
    NodeList out;
    for (;;) {
      const Token& tk = cur();
      if (tk.kind == Tok::End) {
        if (!ends.empty()) error("unexpected end of template, expected '" + *ends.rbegin() + "'");
        return out;
      }
      if (tk.kind == Tok::Text) {
        auto n = make(NodeKind::Text, tk.line);
        n->str = tk.text;
        out.push_back(n);
        ++p_;
      } else if (tk.kind == Tok::VarBegin) {
        ++p_;
        auto n = make(NodeKind::Output, tk.line);
        n->kids.push_back(parse_expr());
        if (cur().kind != Tok::VarEnd) error("expected '}}', got '" + describe() + "'");
        ++p_;
        out.push_back(seal(n));
      } else if (tk.kind == Tok::BlockBegin) {
        ++p_;
        const std::string name = take_name();
        if (ends.count(name)) {
          *found = name;
          return out;
        }
        out.push_back(seal(parse_statement(name, tk.line)));
      } else {
        error("unexpected '" + describe() + "'");
      }
    }
  }

  NodePtr parse_statement(const std::string& name, int line) {
    Nest nest(*this);
    std::string found;
    if (name == "if" || name == "elif") {
      auto n = make(NodeKind::If, line);
      n->kids.push_back(parse_expr());
      expect_block_end();
      n->body = parse_until({"elif", "else", "endif"}, &found);
      if (found == "elif") {
        n->else_body.push_back(seal(parse_statement("elif", cur().line)));
        return n;  // the nested elif consumed endif
      }
      if (found == "else") {
        expect_block_end();
        n->else_body = parse_until({"endif"}, &found);
      }
      expect_block_end();
      return n;
    }
    if (name == "for") {
      auto n = make(NodeKind::For, line);
      n->names.push_back(take_name());
      while (is_op(",")) {
        ++p_;
        n->names.push_back(take_name());
      }
      expect_name("in");
      n->kids.push_back(parse_or());
      if (is_name("if")) {
        ++p_;
        n->kids.push_back(parse_expr());
      }
      if (is_name("recursive")) error("recursive for loops are not supported");
      expect_block_end();
      n->body = parse_until({"else", "endfor"}, &found);
      if (found == "else") {
        expect_block_end();
        n->else_body = parse_until({"endfor"}, &found);
      }
      expect_block_end();
      return n;
    }
    if (name == "set") {
      std::string target = take_name();
      if (is_op(".")) {
        ++p_;
        target += "." + take_name();
      }
      std::vector<std::string> targets{target};
      while (is_op(",")) {
        ++p_;
        targets.push_back(take_name());
      }
      if (cur().kind == Tok::BlockEnd) {
        ++p_;
        auto n = make(NodeKind::SetBlock, line);
        n->names = targets;
        n->body = parse_until({"endset"}, &found);
        expect_block_end();
        return n;
      }
      auto n = make(NodeKind::Set, line);
      n->names = targets;
      expect_op("=");
      n->kids.push_back(parse_tuple_or_expr());
      expect_block_end();
      return n;
    }
    if (name == "macro") {
      auto n = make(NodeKind::Macro, line);
      n->str = take_name();
      expect_op("(");
      while (!is_op(")")) {
        n->names.push_back(take_name());
        if (is_op("=")) {
          ++p_;
          n->kids.push_back(parse_expr());
        } else {
          n->kids.push_back(nullptr);
        }
        if (!is_op(")")) expect_op(",");
      }
      ++p_;
      expect_block_end();
      n->body = parse_until({"endmacro"}, &found);
      expect_block_end();
      return n;
    }
    if (name == "break" || name == "continue") {
      expect_block_end();
      return make(name == "break" ? NodeKind::Break : NodeKind::Continue, line);
    }
    if (name == "generation") {  // transformers' assistant-mask extension: renders its body
      expect_block_end();
      auto n = make(NodeKind::If, line);
      auto t = make(NodeKind::Literal, line);
      t->value = true;
      n->kids.push_back(t);
      n->body = parse_until({"endgeneration"}, &found);
      expect_block_end();
      return n;
    }
    fail("chat template line ", line, ": unknown tag '", name, "'");
  }

  // `a, b` without brackets (a tuple, rendered as a list).
  NodePtr parse_tuple_or_expr() {
    NodePtr first = parse_expr();
    if (!is_op(",")) return first;
    auto n = make(NodeKind::List, first->line);
    n->kids.push_back(first);
    while (is_op(",")) {
      ++p_;
      n->kids.push_back(parse_expr());
    }
    return seal(n);
  }

  NodePtr parse_expr() {
    Nest nest(*this);
    NodePtr n = parse_or();
    if (is_name("if")) {
      ++p_;
      auto c = make(NodeKind::Cond, n->line);
      c->kids.push_back(parse_or());
      c->kids.push_back(n);
      if (is_name("else")) {
        ++p_;
        c->kids.push_back(parse_expr());
      }
      return seal(c);
    }
    return n;
  }
  NodePtr binary(const std::string& op, NodePtr a, NodePtr b) {
    auto n = make(NodeKind::Binary, a->line);
    n->str = op;
    n->kids = {std::move(a), std::move(b)};
    return seal(n);
  }
  NodePtr parse_or() {
    NodePtr n = parse_and();
    while (is_name("or")) {
      ++p_;
      n = binary("or", n, parse_and());
    }
    return n;
  }
  NodePtr parse_and() {
    NodePtr n = parse_not();
    while (is_name("and")) {
      ++p_;
      n = binary("and", n, parse_not());
    }
    return n;
  }
  NodePtr parse_not() {
    if (is_name("not")) {
      Nest nest(*this);
      auto n = make(NodeKind::Unary, cur().line);
      ++p_;
      n->str = "not";
      n->kids.push_back(parse_not());
      return seal(n);
    }
    return parse_compare();
  }
  NodePtr parse_compare() {
    NodePtr n = parse_math1();
    for (;;) {
      if (cur().kind == Tok::Op && (cur().text == "==" || cur().text == "!=" || cur().text == "<" ||
                                    cur().text == "<=" || cur().text == ">" || cur().text == ">=")) {
        const std::string op = t_[p_++].text;
        n = binary(op, n, parse_math1());
      } else if (is_name("in")) {
        ++p_;
        n = binary("in", n, parse_math1());
      } else if (is_name("not") && peek().kind == Tok::Name && peek().text == "in") {
        p_ += 2;
        n = binary("not in", n, parse_math1());
      } else {
        return n;
      }
    }
  }
  NodePtr parse_math1() {
    NodePtr n = parse_concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = t_[p_++].text;
      n = binary(op, n, parse_concat());
    }
    return n;
  }
  NodePtr parse_concat() {
    NodePtr n = parse_math2();
    while (is_op("~")) {
      ++p_;
      n = binary("~", n, parse_math2());
    }
    return n;
  }
  NodePtr parse_math2() {
    NodePtr n = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = t_[p_++].text;
      n = binary(op, n, parse_pow());
    }
    return n;
  }
  NodePtr parse_pow() {
    NodePtr n = parse_unary(true);
    while (is_op("**")) {
      ++p_;
      n = binary("**", n, parse_unary(true));
    }
    return n;
  }
  NodePtr parse_unary(bool with_filter) {
    NodePtr n;
    if (is_op("-") || is_op("+")) {
      Nest nest(*this);
      n = make(NodeKind::Unary, cur().line);
      n->str = t_[p_++].text;
      n->kids.push_back(parse_unary(false));
      n = seal(n);
    } else {
      n = parse_postfix(parse_primary());
    }
    return with_filter ? parse_filters(n) : n;
  }

  NodePtr parse_primary() {
    const Token tk = cur();
    ++p_;
    if (tk.kind == Tok::Name) {
      auto n = make(NodeKind::Literal, tk.line);
      if (tk.text == "true" || tk.text == "True") n->value = true;
      else if (tk.text == "false" || tk.text == "False") n->value = false;
      else if (tk.text == "none" || tk.text == "None") n->value = nullptr;
      else {
        n->kind = NodeKind::Name;
        n->str = tk.text;
      }
      return n;
    }
    if (tk.kind == Tok::String) {
      auto n = make(NodeKind::Literal, tk.line);
      std::string s = tk.text;
      while (cur().kind == Tok::String) s += t_[p_++].text;  // adjacent literals concatenate
      n->value = s;
      return n;
    }
    if (tk.kind == Tok::Int || tk.kind == Tok::Float) {
      auto n = make(NodeKind::Literal, tk.line);
      n->value = number_literal(tk);
      return n;
    }
    if (tk.kind == Tok::Op && tk.text == "(") {
      if (is_op(")")) {
        ++p_;
        return make(NodeKind::List, tk.line);
      }
      NodePtr n = parse_tuple_or_expr();
      expect_op(")");
      return n;
    }
    if (tk.kind == Tok::Op && tk.text == "[") {
      auto n = make(NodeKind::List, tk.line);
      while (!is_op("]")) {
        n->kids.push_back(parse_expr());
        if (!is_op("]")) expect_op(",");
      }
      ++p_;
      return seal(n);
    }
    if (tk.kind == Tok::Op && tk.text == "{") {
      auto n = make(NodeKind::Dict, tk.line);
      while (!is_op("}")) {
        n->kids.push_back(parse_expr());
        expect_op(":");
        n->kids.push_back(parse_expr());
        if (!is_op("}")) expect_op(",");
      }
      ++p_;
      return seal(n);
    }
    --p_;
    error("unexpected '" + describe() + "'");
  }

  // Integers are 64-bit: a literal beyond that is an error (Python's would be exact, and a
  // float stand-in would print differently). Floats follow Python: too large is inf.
  static Value number_literal(const Token& tk) {
    const char* b = tk.text.data();
    const char* e = b + tk.text.size();
    if (tk.kind == Tok::Int) {
      int64_t v = 0;
      const auto r = std::from_chars(b, e, v);
      if (r.ec != std::errc() || r.ptr != e)
        error_at(tk, "integer literal " + tk.text.substr(0, 40) + (tk.text.size() > 40 ? "..." : "") +
                         " is out of range (integers are 64-bit)");
      return v;
    }
    double v = 0;
    const auto r = std::from_chars(b, e, v);
    if (r.ec == std::errc::result_out_of_range)
      return float_literal_overflows(tk.text) ? std::numeric_limits<double>::infinity() : 0.0;
    if (r.ec != std::errc() || r.ptr != e) error_at(tk, "bad float literal " + tk.text.substr(0, 40));
    return v;
  }

  // Call arguments after '(' up to and including ')': positional then name=value.
  void parse_args(const NodePtr& n) {
    expect_op("(");
    while (!is_op(")")) {
      if (cur().kind == Tok::Name && peek().kind == Tok::Op && peek().text == "=") {
        n->names.push_back(t_[p_].text);
        p_ += 2;
      } else {
        n->names.emplace_back();
      }
      n->kids.push_back(parse_expr());
      if (!is_op(")")) expect_op(",");
    }
    ++p_;
  }

  NodePtr parse_postfix(NodePtr n) {
    for (;;) {
      if (is_op(".")) {
        ++p_;
        auto a = make(NodeKind::Attr, cur().line);
        if (cur().kind == Tok::Int) a->str = t_[p_++].text;
        else a->str = take_name();
        a->kids.push_back(n);
        n = seal(a);
      } else if (is_op("[")) {
        ++p_;
        n = parse_subscript(n);
      } else if (is_op("(")) {
        auto c = make(NodeKind::Call, cur().line);
        c->kids.push_back(n);
        c->names.emplace_back();
        parse_args(c);
        n = seal(c);
      } else {
        return n;
      }
    }
  }

  NodePtr parse_subscript(NodePtr target) {
    const int line = cur().line;
    NodeList parts(3);
    bool is_slice = false;
    for (int i = 0; i < 3; ++i) {
      if (!is_op(":") && !is_op("]")) parts[i] = parse_expr();
      if (is_op(":") && i < 2) {
        ++p_;
        is_slice = true;
      } else {
        break;
      }
    }
    if (!is_slice && !parts[0]) error("expected a subscript expression, got '" + describe() + "'");
    expect_op("]");
    auto n = make(is_slice ? NodeKind::Slice : NodeKind::Item, line);
    n->kids.push_back(target);
    if (is_slice) n->kids.insert(n->kids.end(), parts.begin(), parts.end());
    else n->kids.push_back(parts[0]);
    return seal(n);
  }

  NodePtr parse_filters(NodePtr n) {
    for (;;) {
      if (is_op("|")) {
        ++p_;
        auto f = make(NodeKind::Filter, cur().line);
        f->str = take_name();
        f->kids.push_back(n);
        f->names.emplace_back();
        if (is_op("(")) parse_args(f);
        n = seal(f);
      } else if (is_name("is")) {
        ++p_;
        auto t = make(NodeKind::Test, cur().line);
        if (is_name("not")) {
          ++p_;
          t->negate = true;
        }
        t->str = take_name();
        t->kids.push_back(n);
        t->names.emplace_back();
        if (is_op("(")) {
          parse_args(t);
        } else if ((cur().kind == Tok::Name || cur().kind == Tok::String || cur().kind == Tok::Int ||
                    cur().kind == Tok::Float || is_op("[") || is_op("{")) &&
                   !(is_name("else") || is_name("or") || is_name("and") || is_name("if"))) {
          t->kids.push_back(parse_postfix(parse_primary()));
          t->names.emplace_back();
        }
        n = seal(t);
      } else if (is_op("(")) {
        n = parse_postfix(n);
      } else {
        return n;
      }
    }
  }

  std::vector<Token> t_;
  size_t p_ = 0;
  int nesting_ = 0;
};

}  // namespace

NodeList parse_template(const std::string& source) {
  return Parser(lex_template(source)).parse_all();
}

}  // namespace tessera::serve::jinja
