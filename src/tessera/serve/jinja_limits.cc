// Render budgets for the Jinja interpreter: the --chat-template-limits parser, the per-render
// counters and their one-line errors, and value size estimates.
#include <charconv>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/serve/jinja_budget.h"

namespace tessera::serve::jinja {
namespace {

thread_local Budget* g_current = nullptr;

[[noreturn]] void fail_limit(int line, const std::string& what, const char* key) {
  if (line > 0) fail("chat template line ", line, ": ", what, " exceeded (--chat-template-limits ", key, "=...)");
  fail("chat template: ", what, " exceeded (--chat-template-limits ", key, "=...)");
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

// A non-negative integer, the whole of `s`; false on anything else (sign, junk, overflow).
bool parse_int(const std::string& s, int64_t& out) {
  const char* end = s.data() + s.size();
  auto r = std::from_chars(s.data(), end, out);
  return !s.empty() && r.ec == std::errc() && r.ptr == end && out >= 0;
}

[[noreturn]] void bad_value(const std::string& spec, const std::string& key, const std::string& value,
                            const char* want) {
  fail("chat template limits '", spec, "': bad value '", value, "' for ", key, " (expected ", want, ")");
}

int64_t parse_count(const std::string& spec, const std::string& key, const std::string& v, int64_t max) {
  int64_t n;
  if (!parse_int(v, n) || n < 1 || n > max)
    bad_value(spec, key, v, ("an integer from 1 to " + std::to_string(max)).c_str());
  return n;
}

// "16M", "512K", "1G", "1000": bytes with binary suffixes.
int64_t parse_size(const std::string& spec, const std::string& key, const std::string& v) {
  std::string digits = v;
  int shift = 0;
  if (!digits.empty()) {
    const char c = digits.back();
    shift = c == 'K' || c == 'k' ? 10 : c == 'M' || c == 'm' ? 20 : c == 'G' || c == 'g' ? 30 : 0;
    if (shift) digits.pop_back();
  }
  int64_t n;
  if (!parse_int(digits, n) || n < 1 || n > (INT64_MAX >> shift)) bad_value(spec, key, v, "a size such as 16M");
  return n << shift;
}

// "5s", "2.5s", "1500ms", "5" (seconds).
std::chrono::milliseconds parse_time(const std::string& spec, const std::string& key, const std::string& v) {
  std::string num = v;
  double scale = 1000;
  if (num.size() > 2 && num.compare(num.size() - 2, 2, "ms") == 0) {
    num.resize(num.size() - 2);
    scale = 1;
  } else if (!num.empty() && num.back() == 's') {
    num.pop_back();
  }
  double x = 0;
  const char* end = num.data() + num.size();
  auto r = std::from_chars(num.data(), end, x);
  const double ms = x * scale;
  if (num.empty() || r.ec != std::errc() || r.ptr != end || !(ms >= 1) || !(ms <= 1e9))
    bad_value(spec, key, v, "a duration from 1ms to 1000000s, such as 5s or 500ms");
  return std::chrono::milliseconds(static_cast<int64_t>(ms));
}

}  // namespace

Limits parse_template_limits(const std::string& spec, const Limits& base) {
  Limits l = base;
  size_t i = 0;
  while (i <= spec.size()) {
    const size_t e = std::min(spec.find(',', i), spec.size());
    const std::string item = trim(spec.substr(i, e - i));
    i = e + 1;
    if (item.empty()) {
      if (e == spec.size()) break;
      fail("chat template limits '", spec, "': empty item");
    }
    const size_t eq = item.find('=');
    if (eq == std::string::npos) fail("chat template limits '", spec, "': expected key=value, got '", item, "'");
    const std::string key = trim(item.substr(0, eq)), value = trim(item.substr(eq + 1));
    if (key == "depth") l.max_depth = static_cast<int>(parse_count(spec, key, value, kMaxRenderDepth));
    else if (key == "iterations") l.max_iterations = parse_count(spec, key, value, INT64_MAX);
    else if (key == "list") l.max_list_items = parse_count(spec, key, value, INT64_MAX);
    else if (key == "output") l.max_output_bytes = parse_size(spec, key, value);
    else if (key == "string") l.max_string_bytes = parse_size(spec, key, value);
    else if (key == "time") l.max_time = parse_time(spec, key, value);
    else
      fail("chat template limits '", spec, "': unknown key '", key,
           "' (known: depth, iterations, output, string, list, time)");
  }
  return l;
}

Budget::Budget(const Limits& limits, bool timed)
    : limits_(limits), timed_(timed), deadline_(std::chrono::steady_clock::now() + limits.max_time) {}

void Budget::check_clock() {
  next_clock_ = fuel_ + kClockEvery;
  if (timed_ && std::chrono::steady_clock::now() > deadline_)
    fail_limit(line_, "render time limit " + std::to_string(limits_.max_time.count()) + " ms", "time");
}

void Budget::count_iteration(int line) {
  if (++iterations_ > limits_.max_iterations)
    fail_limit(line, "loop iteration limit " + std::to_string(limits_.max_iterations), "iterations");
  charge(1);
}

void Budget::check_string(int line, size_t bytes) {
  if (bytes > static_cast<uint64_t>(limits_.max_string_bytes))
    fail_limit(line, "string size limit " + std::to_string(limits_.max_string_bytes) + " bytes", "string");
}

void Budget::check_list(int line, size_t items) {
  if (items > static_cast<uint64_t>(limits_.max_list_items))
    fail_limit(line, "list length limit " + std::to_string(limits_.max_list_items), "list");
}

void Budget::check_output(int line, size_t bytes) {
  if (bytes > static_cast<uint64_t>(limits_.max_output_bytes))
    fail_limit(line, "output size limit " + std::to_string(limits_.max_output_bytes) + " bytes", "output");
}

ValueSize Budget::size_of(const Value& v) {
  const ValueSize s = measure_value(v, static_cast<size_t>(limits_.max_string_bytes), limits_.max_depth);
  charge_bytes(s.bytes);
  return s;
}

void Budget::check_size(int line, size_t bytes, int depth) {
  if (depth > limits_.max_depth)
    fail_limit(line, "value nesting depth limit " + std::to_string(limits_.max_depth), "depth");
  if (bytes > static_cast<uint64_t>(limits_.max_string_bytes))
    fail_limit(line, "string size limit " + std::to_string(limits_.max_string_bytes) + " bytes (by a list or dict)",
               "string");
}

void Budget::check_value(int line, const Value& v, int extra_depth) {
  if (!v.is_structured()) return;  // strings are bounded where they are built
  const ValueSize s = size_of(v);
  check_size(line, s.bytes, s.depth + extra_depth);
}

void Budget::enter(int line) {
  if (depth_ >= limits_.max_depth)
    fail_limit(line, "recursion depth limit " + std::to_string(limits_.max_depth), "depth");
  ++depth_;
  charge(1);
}

size_t Budget::saturating_mul(size_t a, int64_t b) {
  if (b <= 0) return 0;
  size_t r;
  return __builtin_mul_overflow(a, static_cast<uint64_t>(b), &r) ? SIZE_MAX : r;
}

Budget& current_budget() {
  if (g_current) return *g_current;
  thread_local Budget fallback(Limits{}, false);
  return fallback;
}

BudgetScope::BudgetScope(Budget& b) : saved_(g_current) { g_current = &b; }
BudgetScope::~BudgetScope() { g_current = saved_; }

ValueSize measure_value(const Value& v, size_t max_bytes, int max_depth) {
  ValueSize s;
  std::vector<std::pair<const Value*, int>> stack{{&v, 1}};
  while (!stack.empty() && s.bytes <= max_bytes && s.depth <= max_depth) {
    const auto [x, d] = stack.back();
    stack.pop_back();
    s.bytes += sizeof(Value);
    if (x->is_string()) {
      s.bytes += 32 + x->get_ref<const std::string&>().size();
    } else if (x->is_array() || x->is_object()) {
      s.depth = std::max(s.depth, d);
      if (x->is_object()) {
        for (auto it = x->begin(); it != x->end(); ++it) {
          s.bytes += 32 + it.key().size();
          stack.emplace_back(&it.value(), d + 1);
        }
      } else {
        for (const auto& y : *x) stack.emplace_back(&y, d + 1);
      }
    }
  }
  return s;
}

}  // namespace tessera::serve::jinja
