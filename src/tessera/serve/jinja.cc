// Jinja evaluator: walks the tree from jinja_parse.cc with jinja2's scoping (a for-loop body
// is a fresh scope each iteration; `set` inside it does not leak, namespace() attributes do),
// under the render's Budget (every nesting level, loop iteration, output byte and built value).
#include "tessera/serve/jinja.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <new>

#include "tessera/base/error.h"
#include "tessera/serve/jinja_budget.h"
#include "tessera/serve/jinja_builtins.h"

namespace tessera::serve::jinja {
namespace {

// The last line of defence at the Template boundary: sizes are bounded before allocating, so
// these should not happen, but a library exception must still reach the caller as one line.
template <typename Fn>
auto guarded(const char* what, Fn&& fn) {
  try {
    return fn();
  } catch (const Error&) {
    throw;
  } catch (const std::bad_alloc&) {
    fail("chat template: out of memory while ", what);
  } catch (const std::exception& e) {
    std::string msg = e.what();
    for (auto& c : msg)
      if (c == '\n' || c == '\r') c = ' ';
    fail("chat template: ", what, " failed: ", msg.substr(0, 200));
  }
}

}  // namespace

Template::Template(const std::string& source)
    : root_(guarded("parsing", [&] { return parse_template(source); })) {}

namespace {

enum class Flow { Normal, Break, Continue };

class Renderer {
 public:
  Renderer(const Value& globals, Budget& budget) : b_(budget) {
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

  // A copy of an existing value, as work: its length (bytes / 64 for strings), not its full size.
  void charge_copy(const Value& v) {
    b_.charge(v.is_string() ? static_cast<int64_t>(v.get_ref<const std::string&>().size() >> 6)
                            : static_cast<int64_t>(v.size()));
  }

  void emit(const Node& n, std::string& out, const std::string& s) {
    b_.check_output(n.line, out.size() + s.size());
    b_.charge_bytes(s.size());
    out += s;
  }

  Flow exec_one(const Node& n, std::string& out) {
    DepthGuard depth(b_, n.line);
    b_.set_line(n.line);
    switch (n.kind) {
      case NodeKind::Text: emit(n, out, n.str); return Flow::Normal;
      case NodeKind::Output: emit(n, out, to_str(eval(*n.kids[0]))); return Flow::Normal;
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
    // The namespace gains one level over `v` (`set ns.a = ns` nests it); its other attributes
    // are bounded already, and their names are fixed by the template.
    b_.check_value(n.line, v, 1);
    (*obj)[target.substr(dot + 1)] = v;
  }

  // Local frames from the top down to floor_ (a macro call sees only its own), then the
  // template's globals and top-level sets in frames_[0].
  Value* find_var(const std::string& name) {
    for (size_t i = frames_.size(); i-- > floor_;) {
      auto it = frames_[i].find(name);
      if (it != frames_[i].end()) return &it->second;
    }
    auto it = frames_[0].find(name);
    return it != frames_[0].end() ? &it->second : nullptr;
  }

  Flow exec_for(const Node& n, std::string& out) {
    const Value seq = iterate(*n.kids[0], eval(*n.kids[0]));
    const bool filtered = n.kids.size() > 1;
    std::vector<const Value*> items;
    for (const auto& item : seq) {
      if (filtered) {  // `for x in xs if cond`: filtered before loop.* is computed
        b_.count_iteration(n.line);  // each item the filter looks at is an iteration
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
    // One frame for the whole loop, emptied each iteration (a fresh scope), keeping the `loop`
    // object's storage: the per-iteration cost is what the iteration limit is measured in.
    const size_t fi = frames_.size();
    frames_.emplace_back();
    Frame::node_type loop_node;
    for (int64_t i = 0; i < len; ++i) {
      if (!filtered) b_.count_iteration(n.line);
      b_.set_line(n.line);
      Frame& frame = frames_[fi];
      if (i > 0) loop_node = frame.extract("loop");
      frame.clear();
      bind(n, *items[i]);
      if (loop_node.empty() || !loop_node.mapped().is_object()) {
        Frame tmp;
        tmp["loop"] = Value::object();
        loop_node = tmp.extract("loop");
      }
      Value& loop = loop_node.mapped();
      loop["index"] = i + 1;
      loop["index0"] = i;
      loop["revindex"] = len - i;
      loop["revindex0"] = len - i - 1;
      loop["first"] = i == 0;
      loop["last"] = i == len - 1;
      loop["length"] = len;
      loop["previtem"] = i > 0 ? *items[i - 1] : undefined();
      loop["nextitem"] = i + 1 < len ? *items[i + 1] : undefined();
      for (int64_t k = std::max<int64_t>(i - 1, 0); k <= i + 1 && k < len; ++k) charge_copy(*items[k]);
      frame.insert(std::move(loop_node));
      const Flow f = exec(n.body, out);
      frames_.resize(fi + 1);
      if (f == Flow::Break) break;
    }
    frames_.pop_back();
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
    if (v.is_array()) return v;
    return as_list(n, v);
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
    DepthGuard depth(b_, n.line);
    b_.set_line(n.line);
    if (const Value* r = ref(n)) {
      charge_copy(*r);
      return *r;
    }
    switch (n.kind) {
      case NodeKind::Literal: return n.value;
      case NodeKind::Name: return undefined();
      case NodeKind::List: {
        Value a = Value::array();
        for (const auto& k : n.kids) a.push_back(eval(*k));
        b_.check_value(n.line, a);
        return a;
      }
      case NodeKind::Dict: {
        Value d = Value::object();
        for (size_t i = 0; i + 1 < n.kids.size(); i += 2) d[to_str(eval(*n.kids[i]))] = eval(*n.kids[i + 1]);
        b_.check_value(n.line, d);
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
        return unary_op(n, n.str, eval(*n.kids[0]));
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
    DepthGuard depth(b_, call_node.line);
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
    // Defaults see only the globals; then the body sees them and its own frame. (An exception
    // abandons the whole render, so the frames need no restoring on that path.)
    const size_t saved_floor = floor_, saved_size = frames_.size();
    floor_ = saved_size;
    for (size_t i = 0; i < m.names.size(); ++i)
      if (is_undefined(frame[m.names[i]]) && m.kids[i]) frame[m.names[i]] = eval(*m.kids[i]);
    frames_.push_back(std::move(frame));
    std::string out;
    exec(m.body, out);
    frames_.resize(saved_size);
    floor_ = saved_floor;
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

  Budget& b_;
  std::vector<Frame> frames_;
  size_t floor_ = 1;  // lowest local frame find_var searches (frames_[0] is always searched)
  std::map<std::string, const Node*> macros_;
};

}  // namespace

std::string Template::render(const Value& globals) const { return render(globals, Limits{}); }

std::string Template::render(const Value& globals, const Limits& limits) const {
  return guarded("rendering", [&] {
    Budget budget(limits);
    BudgetScope scope(budget);
    // Values nest no deeper than the depth limit, so the recursive value code below (repr, tojson,
    // nlohmann's own copy and compare) stays within the stack; built values are checked as built.
    if (measure_value(globals, SIZE_MAX, limits.max_depth).depth > limits.max_depth)
      fail("chat template: variables nested deeper than the depth limit ", limits.max_depth,
           " (--chat-template-limits depth=...)");
    Renderer r(globals, budget);
    std::string out;
    r.exec(root_, out);
    return out;
  });
}

}  // namespace tessera::serve::jinja
