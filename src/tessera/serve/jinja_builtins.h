// Filters, tests, methods, operators and global functions of the Jinja interpreter, with
// Python semantics (what the templates were written and tested against).
#pragma once
#include <string>
#include <vector>

#include "tessera/serve/jinja.h"

namespace tessera::serve::jinja {

// Evaluated call arguments; names[i] is empty for positional ones. For filters and tests
// values[0] is the operand.
struct Args {
  std::vector<Value> values;
  std::vector<std::string> names;
};

Value get_attr(const Node& n, const Value& obj, const std::string& name);
Value get_item(const Node& n, const Value& obj, const Value& key);
Value slice_value(const Node& n, const Value& obj, const Value& start, const Value& stop, const Value& step);
Value binary_op(const Node& n, const std::string& op, const Value& a, const Value& b);
Value apply_filter(const Node& n, const std::string& name, const Args& args);
bool apply_test(const Node& n, const std::string& name, const Args& args);
Value call_method(const Node& n, const Value& obj, const std::string& name, const Args& args);
Value call_global(const Node& n, const std::string& name, const Args& args);

}  // namespace tessera::serve::jinja
