// Jinja evaluator: walks the tree from jinja_parse.cc with jinja2's scoping (a for-loop body
// is a fresh scope each iteration; `set` inside it does not leak, namespace() attributes do).
#include "tessera/serve/jinja.h"

#include <cmath>
#include <ctime>

#include "tessera/base/error.h"
#include "tessera/serve/jinja_builtins.h"

namespace tessera::serve::jinja {

Template::Template(const std::string& source) : root_(parse_template(source)) {}

namespace {

enum class Flow { Normal, Break, Continue };

class Renderer {
 public:
  explicit Renderer(const Value& globals) {
    frames_.emplace_back();
    if (globals.is_object())
      for (auto it = globals.begin(); it != globals.end(); ++it) frames_[0][it.key()] = it.value();
  }

  Flow exec(const NodeList& nodes, std::string& out) {
    for (const auto& n : nodes) {
      const Flow f = exec_one(*n, out);
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

 private:
  using Frame = std::map<std::string, Value>;

  [[noreturn]] static void fail_at(const Node& n, const std::string& msg) {
    fail("chat template line ", n.line, ": ", msg);
  }

  Flow exec_one(const Node& n, std::string& out) {
    switch (n.kind) {
      case NodeKind::Text: out += n.str; return Flow::Normal;
      case NodeKind::Output: out += to_str(eval(*n.kids[0])); return Flow::Normal;
      case NodeKind::If: return exec(truthy(eval(*n.kids[0])) ? n.body : n.else_body, out);
      case NodeKind::For: return exec_for(n, out);
      case NodeKind::Set: assign(n, eval(*n.kids[0])); return Flow::Normal;
      case NodeKind::SetBlock: {
        std::string s;
        exec(n.body, s);
        assign(n, Value(s));
        return Flow::Normal;
      }
      case NodeKind::Macro: macros_[n.str] = &n; return Flow::Normal;
      case NodeKind::Break: return Flow::Break;
      case NodeKind::Continue: return Flow::Continue;
      default: fail_at(n, "expression used as a statement");
    }
  }

  void assign(const Node& n, const Value& v) {
    if (n.names.size() > 1) {
      if (!v.is_array() || v.size() != n.names.size())
        fail_at(n, "cannot unpack " + std::to_string(n.names.size()) + " values in set");
      for (size_t i = 0; i < n.names.size(); ++i) frames_.back()[n.names[i]] = v[i];
      return;
    }
    const std::string& target = n.names[0];
    const size_t dot = target.find('.');
    if (dot == std::string::npos) {
      frames_.back()[target] = v;
      return;
    }
    Value* obj = find_var(target.substr(0, dot));
    if (!obj || !obj->is_object()) fail_at(n, "cannot assign attribute on non-namespace object '" + target.substr(0, dot) + "'");
    (*obj)[target.substr(dot + 1)] = v;
  }

  Value* find_var(const std::string& name) {
    for (auto f = frames_.rbegin(); f != frames_.rend(); ++f) {
      auto it = f->find(name);
      if (it != f->end()) return &it->second;
    }
    return nullptr;
  }

  Flow exec_for(const Node& n, std::string& out) {
    const Value seq = iterate(*n.kids[0], eval(*n.kids[0]));
    std::vector<const Value*> items;
    for (const auto& item : seq) {
      if (n.kids.size() > 1) {  // `for x in xs if cond`: filtered before loop.* is computed
        frames_.emplace_back();
        bind(n, item);
        const bool keep = truthy(eval(*n.kids[1]));
        frames_.pop_back();
        if (!keep) continue;
      }
      items.push_back(&item);
    }
    if (items.empty()) return exec(n.else_body, out);
    const auto len = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < len; ++i) {
      frames_.emplace_back();
      bind(n, *items[i]);
      Value loop = Value::object();
      loop["index"] = i + 1;
      loop["index0"] = i;
      loop["revindex"] = len - i;
      loop["revindex0"] = len - i - 1;
      loop["first"] = i == 0;
      loop["last"] = i == len - 1;
      loop["length"] = len;
      loop["previtem"] = i > 0 ? *items[i - 1] : undefined();
      loop["nextitem"] = i + 1 < len ? *items[i + 1] : undefined();
      frames_.back()["loop"] = std::move(loop);
      const Flow f = exec(n.body, out);
      frames_.pop_back();
      if (f == Flow::Break) break;
    }
    return Flow::Normal;
  }

  void bind(const Node& n, const Value& item) {
    if (n.names.size() == 1) {
      frames_.back()[n.names[0]] = item;
      return;
    }
    if (!item.is_array() || item.size() != n.names.size())
      fail_at(n, "cannot unpack loop item into " + std::to_string(n.names.size()) + " names");
    for (size_t i = 0; i < n.names.size(); ++i) frames_.back()[n.names[i]] = item[i];
  }

  static Value iterate(const Node& n, const Value& v) {
    if (is_undefined(v)) return Value::array();
    if (v.is_array()) return v;
    if (v.is_object()) {
      Value keys = Value::array();
      for (auto it = v.begin(); it != v.end(); ++it) keys.push_back(it.key());
      return keys;
    }
    if (v.is_string()) {
      Value chars = Value::array();
      for (const char32_t c : utf8_decode(v.get<std::string>())) chars.push_back(utf8_encode(std::u32string(1, c)));
      return chars;
    }
    fail_at(n, "'" + py_repr(v) + "' is not iterable");
  }

  // A pointer into existing data for names and plain subscripts, so `messages[0]['role']`
  // does not copy the conversation; nullptr when the expression must be computed.
  const Value* ref(const Node& n) {
    if (n.kind == NodeKind::Name) return find_var(n.str);
    if (n.kind != NodeKind::Attr && n.kind != NodeKind::Item) return nullptr;
    const Value* base = ref(*n.kids[0]);
    if (!base || is_undefined(*base)) return nullptr;
    if (n.kind == NodeKind::Attr) {
      if (!base->is_object()) return nullptr;
      auto it = base->find(n.str);
      return it == base->end() ? nullptr : &*it;
    }
    if (n.kids[1]->kind != NodeKind::Literal) return nullptr;
    const Value& key = n.kids[1]->value;
    if (base->is_object() && key.is_string()) {
      auto it = base->find(key.get<std::string>());
      return it == base->end() ? nullptr : &*it;
    }
    if (base->is_array() && key.is_number_integer()) {
      int64_t i = key.get<int64_t>();
      if (i < 0) i += static_cast<int64_t>(base->size());
      return i >= 0 && i < static_cast<int64_t>(base->size()) ? &(*base)[i] : nullptr;
    }
    return nullptr;
  }

 public:
  Value eval(const Node& n) {
    if (const Value* r = ref(n)) return *r;
    switch (n.kind) {
      case NodeKind::Literal: return n.value;
      case NodeKind::Name: return undefined();
      case NodeKind::List: {
        Value a = Value::array();
        for (const auto& k : n.kids) a.push_back(eval(*k));
        return a;
      }
      case NodeKind::Dict: {
        Value d = Value::object();
        for (size_t i = 0; i + 1 < n.kids.size(); i += 2) d[to_str(eval(*n.kids[i]))] = eval(*n.kids[i + 1]);
        return d;
      }
      case NodeKind::Attr: return get_attr(n, eval(*n.kids[0]), n.str);
      case NodeKind::Item: return get_item(n, eval(*n.kids[0]), eval(*n.kids[1]));
      case NodeKind::Slice: {
        const Value obj = eval(*n.kids[0]);
        Value parts[3];
        for (int i = 0; i < 3; ++i) parts[i] = n.kids[i + 1] ? eval(*n.kids[i + 1]) : Value(nullptr);
        return slice_value(n, obj, parts[0], parts[1], parts[2]);
      }
      case NodeKind::Call: return call(n);
      case NodeKind::Filter: {
        Args args = eval_args(n);
        return apply_filter(n, n.str, args);
      }
      case NodeKind::Test: {
        Args args = eval_args(n);
        return apply_test(n, n.str, args) != n.negate;
      }
      case NodeKind::Unary: {
        if (n.str == "not") return !truthy(eval(*n.kids[0]));
        const Value v = eval(*n.kids[0]);
        if (!v.is_number()) fail_at(n, "bad operand type for unary " + n.str + ": " + py_repr(v));
        if (n.str == "+") return v;
        return v.is_number_float() ? Value(-v.get<double>()) : Value(-v.get<int64_t>());
      }
      case NodeKind::Binary: {
        if (n.str == "and") {
          Value a = eval(*n.kids[0]);
          return truthy(a) ? eval(*n.kids[1]) : a;
        }
        if (n.str == "or") {
          Value a = eval(*n.kids[0]);
          return truthy(a) ? a : eval(*n.kids[1]);
        }
        return binary_op(n, n.str, eval(*n.kids[0]), eval(*n.kids[1]));
      }
      case NodeKind::Cond:
        if (truthy(eval(*n.kids[0]))) return eval(*n.kids[1]);
        return n.kids.size() > 2 ? eval(*n.kids[2]) : undefined();
      default: fail_at(n, "statement used as an expression");
    }
  }

  // Renders a macro body with its own scope above the template globals.
  Value call_macro(const Node& call_node, const Node& m, const Args& args) {
    Frame frame;
    size_t pos = 0;
    for (size_t i = 0; i < m.names.size(); ++i) frame[m.names[i]] = undefined();
    for (size_t i = 0; i < args.values.size(); ++i) {
      if (args.names[i].empty()) {
        if (pos >= m.names.size()) fail_at(call_node, "macro '" + m.str + "' takes " + std::to_string(m.names.size()) + " arguments");
        frame[m.names[pos++]] = args.values[i];
      } else {
        frame[args.names[i]] = args.values[i];
      }
    }
    std::vector<Frame> saved;
    saved.swap(frames_);
    frames_.push_back(saved[0]);
    for (size_t i = 0; i < m.names.size(); ++i)
      if (is_undefined(frame[m.names[i]]) && m.kids[i]) frame[m.names[i]] = eval(*m.kids[i]);
    frames_.push_back(std::move(frame));
    std::string out;
    exec(m.body, out);
    frames_.swap(saved);
    return out;
  }

 private:
  Args eval_args(const Node& n) {
    Args a;
    for (size_t i = 0; i < n.kids.size(); ++i) {
      a.values.push_back(eval(*n.kids[i]));
      a.names.push_back(i < n.names.size() ? n.names[i] : "");
    }
    return a;
  }

  Value call(const Node& n) {
    const Node& callee = *n.kids[0];
    Args args;
    for (size_t i = 1; i < n.kids.size(); ++i) {
      args.values.push_back(eval(*n.kids[i]));
      args.names.push_back(n.names[i]);
    }
    if (callee.kind == NodeKind::Attr) {
      const Value* obj_ref = ref(*callee.kids[0]);
      const Value obj = obj_ref ? *obj_ref : eval(*callee.kids[0]);
      return call_method(n, obj, callee.str, args);
    }
    if (callee.kind == NodeKind::Name) {
      if (!find_var(callee.str)) {
        auto m = macros_.find(callee.str);
        if (m != macros_.end()) return call_macro(n, *m->second, args);
        return call_global(n, callee.str, args);
      }
    }
    fail_at(n, "object is not callable");
  }

  std::vector<Frame> frames_;
  std::map<std::string, const Node*> macros_;
};

}  // namespace

std::string Template::render(const Value& globals) const {
  Renderer r(globals);
  std::string out;
  r.exec(root_, out);
  return out;
}

}  // namespace tessera::serve::jinja
