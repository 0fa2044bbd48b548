// A small Jinja2 interpreter for chat templates: the subset Hugging Face templates use, with
// jinja2's whitespace rules (trim_blocks, lstrip_blocks, `-` control) so output is byte-exact.
#pragma once
#include <chrono>
#include <cstdint>
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

// Bounds on one render. Templates come from untrusted tokenizer_config.json files, so every
// way a template can spend stack, memory or time is capped, and breaking a cap throws a one-line
// tessera::Error naming the cap and the template line. The defaults sit far above what real chat
// templates use (a tool-calling template with a recursive schema macro needs depth 32, loops run
// once per message, prompts are a few MiB at most) and far below what hurts a server: the
// deepest allowed render needs ~0.5 MiB of stack, and a render stops within ~2 s and a few
// copies of the 16 MiB string bound.
struct Limits {
  int max_depth = 512;                        // nested statements + expressions + macro calls,
                                              // and nesting of values built by the template
  int64_t max_iterations = 1000000;           // for-loop iterations per render, all loops together
  int64_t max_output_bytes = int64_t{16} << 20;  // rendered text (and any macro / set-block buffer)
  int64_t max_string_bytes = int64_t{16} << 20;  // a string one operation builds; also the estimated
                                                 // bytes of a list or dict one operation builds
  int64_t max_list_items = 1000000;           // a list one operation builds (range, *, +, split, ...)
  std::chrono::milliseconds max_time{2000};   // wall time per render, checked every few microseconds
};
// The largest max_depth parse_template_limits accepts: a render that deep needs about 1 MiB of
// stack (4 MiB under ASan), well inside the 8 MiB a thread gets by default.
inline constexpr int kMaxRenderDepth = 2048;
// Parse-time nesting bound (parentheses, blocks, operator chains; the parsed tree's height), so the
// recursive-descent parser, the evaluator and the tree's destructor stay far from the stack's end.
inline constexpr int kMaxParseNesting = 256;

// A user override over `base`: comma-separated key=value, any subset in any order, e.g.
// "depth=512,iterations=2000000,output=32M,string=16M,list=1000000,time=5s". Sizes take K/M/G
// (binary) suffixes, time takes s or ms (bare numbers are seconds); counts are plain integers.
// Throws a one-line tessera::Error on an unknown key or a bad number. (The CLI's
// --chat-template-limits flag passes its value here.)
Limits parse_template_limits(const std::string& spec, const Limits& base = {});

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
  int height = 1;                  // of this subtree; the parser keeps it <= kMaxParseNesting
  std::string str;                 // text, name, operator, attribute, filter / test name
  Value value;                     // literal
  NodeList kids;                   // operands / args / list items / dict k,v pairs
  std::vector<std::string> names;  // kwarg names for Call/Filter/Test (parallel to tail of kids),
                                   // loop targets (For), macro params (Macro), set targets (Set)
  NodeList body, else_body;        // If: cond in kids; elif chains nest in else_body
  bool negate = false;             // `is not`
};

// A parsed template; render() throws tessera::Error with one line on any failure, including a
// broken Limits bound (never a crash or another exception type).
class Template {
 public:
  explicit Template(const std::string& source);  // throws on syntax errors
  std::string render(const Value& globals) const;  // under default Limits
  std::string render(const Value& globals, const Limits& limits) const;

 private:
  NodeList root_;
};

// Lexing (jinja_lex.cc) and parsing (jinja_parse.cc).
enum class Tok { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, End };

struct Token {
  Tok kind;
  std::string text;
  int line;
  int col;  // 1-based, in bytes
};
std::vector<Token> lex_template(const std::string& source);
NodeList parse_template(const std::string& source);

// Value helpers shared by the evaluator (jinja_value.cc).
// Those that build strings check the running render's string limit as they go (jinja_budget.h).
std::string to_str(const Value& v);                              // Python str()
std::string py_repr(const Value& v);                             // Python repr()
std::string brief_repr(const Value& v);                          // repr() cut to ~80 bytes, for errors
// json.dumps(ensure_ascii=False, indent=None if indent < 0 else indent)
std::string to_json_py(const Value& v, int64_t indent, int depth);
bool truthy(const Value& v);
std::u32string utf8_decode(const std::string& s);
std::string utf8_encode(const std::u32string& s);

}  // namespace tessera::serve::jinja
