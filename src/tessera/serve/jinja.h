// A small Jinja2 interpreter for chat templates: the subset Hugging Face templates use, with
// jinja2's whitespace rules (trim_blocks, lstrip_blocks, `-` control) so output is byte-exact.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace tessera::serve::jinja {

// Values are ordered JSON (dict order matters for tojson / items); `discarded` means undefined.
using Value = nlohmann::ordered_json;
Value undefined();
bool is_undefined(const Value& v);

struct Node;
using NodePtr = std::shared_ptr<Node>;
using NodeList = std::vector<NodePtr>;

enum class NodeKind {
  // statements
  Text, Output, If, For, Set, SetBlock, Macro, Break, Continue,
  // expressions
  Literal, Name, List, Dict, Attr, Item, Slice, Call, Filter, Test, Unary, Binary, Cond,
};

struct Node {
  NodeKind kind;
  int line = 0;
  std::string str;                 // text, name, operator, attribute, filter / test name
  Value value;                     // literal
  NodeList kids;                   // operands / args / list items / dict k,v pairs
  std::vector<std::string> names;  // kwarg names for Call/Filter/Test (parallel to tail of kids),
                                   // loop targets (For), macro params (Macro), set targets (Set)
  NodeList body, else_body;        // If: cond in kids; elif chains nest in else_body
  bool negate = false;             // `is not`
};

// A parsed template; render() throws tessera::Error with one line on any failure.
class Template {
 public:
  explicit Template(const std::string& source);  // throws on syntax errors
  std::string render(const Value& globals) const;

 private:
  NodeList root_;
};

// Lexing (jinja_lex.cc) and parsing (jinja_parse.cc).
enum class Tok { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, End };

struct Token {
  Tok kind;
  std::string text;
  int line;
};
std::vector<Token> lex_template(const std::string& source);
NodeList parse_template(const std::string& source);

// Value helpers shared by the evaluator (jinja_value.cc).
std::string to_str(const Value& v);                              // Python str()
std::string py_repr(const Value& v);                             // Python repr()
std::string to_json_py(const Value& v, int indent, int depth);   // json.dumps(ensure_ascii=False)
bool truthy(const Value& v);
std::u32string utf8_decode(const std::string& s);
std::string utf8_encode(const std::u32string& s);

}  // namespace tessera::serve::jinja
