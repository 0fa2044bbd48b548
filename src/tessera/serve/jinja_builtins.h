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

// Numbers, operators, subscripts (jinja_ops.cc). Integers are 64-bit: to_int fails on a float or an
// unsigned JSON integer above INT64_MAX, and an operator result beyond int64 is an error.
bool is_int(const Value& v);                          // an integer or a bool
int64_t to_int(const Node& n, const Value& v);        // bool or integer, else a one-line error
double num(const Node& n, const Value& v);            // any number or bool as a double
bool equal(const Value& a, const Value& b);           // Python ==
int compare(const Node& n, const Value& a, const Value& b);  // Python <, as -1 / 0 / 1
Value unary_op(const Node& n, const std::string& op, const Value& v);  // + or -
Value binary_op(const Node& n, const std::string& op, const Value& a, const Value& b);

// jinja2's int / float filters: Python's int(s) / float(s), else `dflt`.
Value int_filter(const Node& n, const Value& v, const Value& dflt);
Value float_filter(const Value& v, const Value& dflt);

// A list of the items a for-loop visits: the list itself, a dict's keys, a string's characters.
Value as_list(const Node& n, const Value& v);

// Filters, tests, methods and globals (jinja_builtins.cc); what they build is sized against the
// running render's budget (jinja_budget.h) before it is allocated.
Value get_attr(const Node& n, const Value& obj, const std::string& name);
Value get_item(const Node& n, const Value& obj, const Value& key);
Value slice_value(const Node& n, const Value& obj, const Value& start, const Value& stop, const Value& step);
Value apply_filter(const Node& n, const std::string& name, const Args& args);
bool apply_test(const Node& n, const std::string& name, const Args& args);
Value call_method(const Node& n, const Value& obj, const std::string& name, const Args& args);
Value call_global(const Node& n, const std::string& name, const Args& args);

}  // namespace tessera::serve::jinja
