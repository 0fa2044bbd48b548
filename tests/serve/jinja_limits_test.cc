// The Jinja interpreter under hostile chat templates: every sample from the audit ends in a
// one-line tessera::Error naming the broken limit and the template line (never a crash or
// another exception), arithmetic follows Python (checked against jinja2 itself), and real
// templates still render byte-exactly under the default limits.
#include <gtest/gtest.h>
#include <pthread.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/serve/chat_template.h"
#include "tessera/serve/jinja.h"
#include "test_util/run_command.h"

namespace tessera::serve {
namespace {

using jinja::Limits;
using nlohmann::json;

std::string render(const std::string& src, const json& vars = json::object(), const Limits& limits = {}) {
  const jinja::Template t(src);
  return t.render(jinja::Value::parse(vars.dump()), limits);
}

// The message of the tessera::Error `fn` throws; any other exception fails the test.
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "one-line message: " << msg;
    return msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a tessera::Error: " << e.what();
    return "";
  }
  return "<no error>";
}

// Default limits but a wall-clock limit no test reaches, for tests of the other limits: slow
// builds (sanitizers) would otherwise meet the 2 s render time limit first.
Limits untimed() {
  Limits l;
  l.max_time = std::chrono::minutes(10);
  return l;
}

std::string render_error(const std::string& src, const Limits& limits = untimed(), const json& vars = json::object()) {
  return error_of([&] { render(src, vars, limits); });
}

#define EXPECT_HAS(haystack, needle) EXPECT_NE((haystack).find(needle), std::string::npos) << (haystack)

// jinja2 (Debian's python3-jinja2) in transformers' sandboxed setup renders `src`.
std::string jinja2_render(const std::string& src) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const auto dir = std::filesystem::temp_directory_path() /
                   ("tessera_jinja_limits_" + std::to_string(::getpid()) + "_" + info->name());
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir / "t.jinja", std::ios::binary);
    f << src;
  }
  const std::string script =
      "import json, sys\n"
      "from jinja2.sandbox import ImmutableSandboxedEnvironment\n"
      "env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)\n"
      "env.filters['tojson'] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)\n"
      "src = open(sys.argv[1], encoding='utf-8', newline='').read()\n"
      "sys.stdout.write(env.from_string(src).render())\n";
  {
    std::ofstream f(dir / "ref.py");
    f << script;
  }
  const auto r = tessera::testing::run_command(std::string(TESSERA_PYTHON) + " " + (dir / "ref.py").string() + " " +
                                               (dir / "t.jinja").string(), false);
  std::filesystem::remove_all(dir);
  EXPECT_EQ(r.code, 0) << r.out;
  return r.out;
}

// ---- arithmetic -----------------------------------------------------------------------------

TEST(JinjaArithmetic, FloorDivisionAndModuloMatchJinja2) {
  std::string src;
  for (const char* x : {"7", "-7", "0", "9223372036854775807", "-9223372036854775807", "7.5", "-7.5", "-0.0"})
    for (const char* y : {"2", "-2", "3", "-3", "1", "-1", "2.5", "-2.5", "9223372036854775807"})
      src += std::string("{{ (") + x + ") // (" + y + ") }} {{ (" + x + ") % (" + y + ") }} {{ (" + x + ") / (" + y +
             ") }} {{ (" + x + ") is divisibleby (" + y + ") }}\n";
  src += "{{ -9223372036854775807 - 1 }} {{ (-9223372036854775807 - 1) % -1 }} {{ (-9223372036854775807 - 1) is divisibleby(-1) }}\n";
  src += "{{ 2 ** 62 }} {{ (-2) ** 63 }} {{ 2 ** -2 }} {{ (-3) ** 3 }} {{ 1 ** 9223372036854775807 }} {{ (-1) ** 9223372036854775807 }} {{ 0 ** 0 }}\n";
  src += "{{ 2.0 ** 0.5 }} {{ -7 | abs }} {{ -(3) }} {{ -True }} {{ 1 + True }} {{ 3 * 0.1 }}\n";
  src += "{{ '42.7' | int }} {{ ' 12abc' | int }} {{ 'nan' | int }} {{ -3.9 | int }} {{ '1_000' | int }} {{ '+5' | int }} {{ 'x' | int(7) }} {{ '2.5' | float }} {{ 'x' | float }}\n";
  src += "{{ 9223372036854775807 > 9223372036854775806 }} {{ 9223372036854775807 == 9223372036854775806 }}";
  const std::string want = jinja2_render(src);
  ASSERT_FALSE(want.empty());
  EXPECT_EQ(render(src), want);
  // Fixed points, so a broken reference cannot pass silently.
  EXPECT_EQ(render("{{ -7 // 2 }} {{ -7 % 2 }} {{ 7 % -2 }} {{ -7.5 // 2 }} {{ 7.5 % -2 }}"), "-4 1 -1 -4.0 -0.5");
}

TEST(JinjaArithmetic, Int64MinByMinusOneIsAnErrorNotSigfpe) {
  EXPECT_HAS(render_error("{{ (-9223372036854775807 - 1) // -1 }}"), "chat template line 1: integer overflow");
  EXPECT_EQ(render("{{ (-9223372036854775807 - 1) % -1 }}"), "0");
  EXPECT_EQ(render("{{ x is divisibleby(-1) }}", {{"x", INT64_MIN}}), "True");
  EXPECT_EQ(render("{{ x % -1 }} {{ x // 1 }}", {{"x", INT64_MIN}}), "0 -9223372036854775808");
}

TEST(JinjaArithmetic, DivisionByZeroIsAnError) {
  for (const char* src : {"{{ 1 // 0 }}", "{{ 1 % 0 }}", "{{ 1 / 0 }}", "{{ 1.5 // 0 }}", "{{ 1.5 % 0.0 }}",
                          "{{ 1 / 0.0 }}", "{{ 4 is divisibleby 0 }}", "{{ 0 ** -1 }}"}) {
    const std::string e = render_error(std::string("\n") + src);
    EXPECT_HAS(e, "chat template line 2: ");
    EXPECT_TRUE(e.find("division by zero") != std::string::npos || e.find("negative power") != std::string::npos) << e;
  }
}

TEST(JinjaArithmetic, OverflowIsAnErrorNotAWrap) {
  for (const char* src : {"{{ 9223372036854775807 + 1 }}", "{{ -9223372036854775807 - 2 }}",
                          "{{ 3037000500 * 3037000500 }}", "{{ -(-9223372036854775807 - 1) }}", "{{ 2 ** 63 }}",
                          "{{ 3 ** 99999999999999 }}", "{{ (-9223372036854775807 - 1) | abs }}",
                          "{{ 9223372036854775807 * -2 }}"})
    EXPECT_HAS(render_error(src), "integer overflow");
  EXPECT_HAS(render_error("{{ 2.0 ** 100000 }}"), "too large");
  EXPECT_HAS(render_error("{{ 1e300 | int }}"), "out of range");
  EXPECT_HAS(render_error("{{ big + 1 }}", untimed(), {{"big", UINT64_MAX}}), "out of range");
  EXPECT_EQ(render("{{ big }}", {{"big", UINT64_MAX}}), "18446744073709551615");
  EXPECT_HAS(render_error("{{ 'abc'[1.5:] }}"), "expected an integer");
  // Slice steps at the ends of int64 (i + step would overflow a 64-bit index).
  EXPECT_EQ(render("{{ 'abc'[1::9223372036854775807] }} {{ [1, 2, 3][2::-9223372036854775807 - 1] }} "
                   "{{ 'abc'[-9223372036854775807 - 1:9223372036854775807] }}"),
            "b [3] abc");
}

// ---- recursion ------------------------------------------------------------------------------

TEST(JinjaLimits, SelfRecursiveMacroHitsTheDepthLimit) {
  const std::string src = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}\n\n{{ f(0) }}";
  const std::string e = render_error(src);
  EXPECT_HAS(e, "recursion depth limit 512 exceeded (--chat-template-limits depth=...)");
  EXPECT_HAS(e, "chat template line 1:");
  // Bounded recursion (a schema renderer, say) is fine, and the limit is the user's to move.
  const std::string bounded =
      "{% macro f(n) %}{% if n > 0 %}({{ f(n - 1) }}){% endif %}{% endmacro %}{{ f(20) }}";
  EXPECT_EQ(render(bounded), std::string(20, '(') + std::string(20, ')'));
  Limits shallow;
  shallow.max_depth = 30;
  EXPECT_HAS(render_error(bounded, shallow), "recursion depth limit 30 exceeded");
}

TEST(JinjaLimits, DeepNestingIsAParseErrorWithLineAndColumn) {
  const std::string parens = "x\n{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}";
  std::string e = error_of([&] { jinja::Template t(parens); });
  EXPECT_HAS(e, "chat template line 2, column ");
  EXPECT_HAS(e, "nesting deeper than 256 levels");
  // Chains build deep trees without deep parser recursion; they are bounded too.
  std::string plus = "{{ 1";
  for (int i = 0; i < 100000; ++i) plus += " + 1";
  plus += " }}";
  EXPECT_HAS(error_of([&] { jinja::Template t(plus); }), "nested deeper than 256 levels");
  std::string filters = "{{ 'x'";
  for (int i = 0; i < 20000; ++i) filters += " | trim";
  EXPECT_HAS(error_of([&] { jinja::Template t(filters + " }}"); }), "nested deeper than 256 levels");
  for (const auto& [open, close] : std::vector<std::pair<std::string, std::string>>{
           {"not ", ""}, {"- ", ""}, {"[", "]"}, {"{'a': ", "}"}, {"f(", ")"}, {"x[", "]"}, {"1 if 1 else ", ""}}) {
    std::string s = "{{ ";
    for (int i = 0; i < 5000; ++i) s += open;
    s += "1";
    for (int i = 0; i < 5000; ++i) s += close;
    EXPECT_HAS(error_of([&] { jinja::Template t(s + " }}"); }), "nest") << open;
  }
  std::string ifs, elifs = "{% if x == 0 %}0";
  for (int i = 0; i < 3000; ++i) ifs += "{% if true %}", elifs += "{% elif x == " + std::to_string(i + 1) + " %}";
  EXPECT_HAS(error_of([&] { jinja::Template t(ifs); }), "nesting deeper than 256 levels");
  EXPECT_HAS(error_of([&] { jinja::Template t(elifs + "{% endif %}"); }), "nest");
  // Just inside the bound still parses and renders.
  EXPECT_EQ(render("{{ " + std::string(200, '(') + "7" + std::string(200, ')') + " }}"), "7");
}

TEST(JinjaLimits, ValuesNestedByALoopHitTheDepthLimit) {
  const std::string src =
      "{% set ns = namespace(x=[]) %}\n{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x }}";
  const std::string e = render_error(src);
  EXPECT_HAS(e, "chat template line 2: value nesting depth limit 512 exceeded");
  EXPECT_HAS(render_error("{% set ns = namespace(a=1) %}{% for i in range(100000) %}{% set ns.a = ns %}{% endfor %}"),
             "value nesting depth limit");
  // Deep request data is refused before anything recurses over it.
  json deep = json::array();  // built and moved without recursion (nlohmann frees it iteratively)
  for (int i = 0; i < 100000; ++i) {
    json outer = json::array();
    outer.push_back(std::move(deep));
    deep = std::move(outer);
  }
  json message = json::object();
  message["role"] = "user";
  message["content"] = std::move(deep);
  json messages = json::array();
  messages.push_back(std::move(message));
  EXPECT_HAS(error_of([&] { ChatTemplate::chatml().render(messages, true); }), "nested deeper than 512 levels");
}

// The deepest render and parse the defaults allow fit in a thread with half the default 8 MiB
// stack (they need about 0.5 MiB in Release and 2 MiB under ASan).
TEST(JinjaLimits, DeepestAllowedRenderFitsASmallStack) {
  struct Job {
    std::string result;
  } job;
  auto body = [](void* p) -> void* {
    auto* j = static_cast<Job*>(p);
    j->result = error_of([] {
      render("{% macro f(n) %}{% for i in [n] %}{% if i >= 0 %}{{ f(i + 1) ~ (1 + (2 * (3 - (4)))) }}{% endif %}"
             "{% endfor %}{% endmacro %}{{ f(0) }}");
    });
    const std::string parse = error_of([] { jinja::Template t("{{ " + std::string(255, '(') + "1" + std::string(255, ')') + " }}"); });
    j->result.append("|").append(parse);
    return nullptr;
  };
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 4 << 20);
  pthread_t th;
  ASSERT_EQ(pthread_create(&th, &attr, body, &job), 0);
  pthread_join(th, nullptr);
  pthread_attr_destroy(&attr);
  EXPECT_HAS(job.result, "recursion depth limit 512 exceeded");
  EXPECT_HAS(job.result, "|<no error>");
}

// ---- sizes ----------------------------------------------------------------------------------

TEST(JinjaLimits, HugeListsAreRefusedBeforeAllocating) {
  EXPECT_HAS(render_error("\n{{ range(200000000) | length }}"),
             "chat template line 2: list length limit 1000000 exceeded (--chat-template-limits list=...)");
  EXPECT_HAS(render_error("{{ [1] * 300000000 }}"), "list length limit 1000000 exceeded");
  EXPECT_HAS(render_error("{{ [1] * 3e8 }}"), "can't multiply sequence by non-int");
  EXPECT_HAS(render_error("{{ [1, 2] * 9223372036854775807 }}"), "list length limit");
  EXPECT_HAS(render_error("{{ range(-9223372036854775807 - 1, 9223372036854775807) | length }}"), "list length limit");
  // Steps that would overflow a naive `i += step` end the range instead.
  EXPECT_EQ(render("{{ range(9223372036854775806, 9223372036854775807, 9223372036854775807) | list }}"),
            "[9223372036854775806]");
  EXPECT_EQ(render("{{ range(9223372036854775800, 9223372036854775807, 3) | list }}"),
            "[9223372036854775800, 9223372036854775803, 9223372036854775806]");
  EXPECT_EQ(render("{{ range(0, 10, -9223372036854775807 - 1) | list }} {{ range(5, -9223372036854775807 - 1, -9223372036854775807 - 1) | list }}"),
            "[] [5, -9223372036854775803]");
  // A list of big strings is bounded by bytes, not only by items.
  EXPECT_HAS(render_error("{{ (['x' * 1000000] * 100) | length }}"), "string size limit 16777216 bytes (by a list or dict) exceeded");
  EXPECT_HAS(render_error("{% set ns = namespace(l=['x' * 1000000]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}"),
             "string size limit");
  EXPECT_HAS(render_error("{{ ('a ' * 3000000).split() | length }}"), "list length limit");
  EXPECT_HAS(render_error("{% for c in 'x' * 2000000 %}{% endfor %}"), "list length limit");
}

TEST(JinjaLimits, HugeStringsAreRefusedBeforeAllocating) {
  const std::string limit = "string size limit 16777216 bytes exceeded (--chat-template-limits string=...)";
  EXPECT_HAS(render_error("{{ 'x' * 100000000 }}"), "chat template line 1: " + limit);
  EXPECT_HAS(render_error("{{ 'ab' * 9223372036854775807 }}"), limit);
  EXPECT_HAS(render_error("{% set s = 'x' * 10000000 %}{{ s ~ s }}"), limit);
  EXPECT_HAS(render_error("{% set s = 'x' * 10000000 %}{{ s + s }}"), limit);
  EXPECT_HAS(render_error("{% set l = ['x' * 1000000] * 10 %}{{ l | join(l[0]) }}"), limit);
  EXPECT_HAS(render_error("{% set l = ['x' * 1000000] * 10 %}{{ l[0].join(l) }}"), limit);
  EXPECT_HAS(render_error("{{ ('a' * 1000000) | replace('a', 'bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb') }}"), limit);
  EXPECT_HAS(render_error("{{ ('a' * 1000000).replace('', 'bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb') }}"), limit);
  EXPECT_HAS(render_error("{{ 'x' | center(1000000000) }}"), limit);
  EXPECT_HAS(render_error("{{ ('a\\n' * 1000000) | indent(100) }}"), limit);
  EXPECT_HAS(render_error("{{ 'a\\nb' | indent(9223372036854775807) }}"), limit);
  EXPECT_HAS(render_error("{{ [[1]] | tojson(indent=100000000) }}"), limit);
  EXPECT_HAS(render_error("{{ ('<' * 10000000) | e }}"), limit);
  EXPECT_HAS(render_error("{{ (['\\x01' * 1000000] * 10) | string }}"), limit);  // repr escapes grow 4x
  // Python's answers for the small cases.
  EXPECT_EQ(render("{{ 'ab' * -3 }}|{{ 'abc' | center(8) }}|{{ 'ab' | center(7) }}|{{ 'a\\nb' | indent(-1, true) }}|"
                   "{{ 'abc' | replace('', '-') }}|{{ 'abc'.replace('', '-', 2) }}|{{ [1, 2] | tojson(indent=0) }}"),
            "|  abc   |   ab  |a\nb|-a-b-c-|-a-bc|[\n1,\n2\n]");
}

TEST(JinjaLimits, OutputAndIterationsAreBounded) {
  EXPECT_HAS(render_error("{% for i in range(1000000) %}{{ 'x' * 100 }}{% endfor %}"),
             "chat template line 1: output size limit 16777216 bytes exceeded (--chat-template-limits output=...)");
  EXPECT_HAS(render_error("{% for i in range(2000) %}\n{% for j in range(2000) %}{% endfor %}{% endfor %}"),
             "chat template line 2: loop iteration limit 1000000 exceeded (--chat-template-limits iterations=...)");
  EXPECT_HAS(render_error("{% for i in range(2000) %}{% for j in range(2000) if j > 5 %}{% endfor %}{% endfor %}"),
             "loop iteration limit 1000000 exceeded");
}

TEST(JinjaLimits, SlowRendersHitTheTimeLimit) {
  Limits quick;
  quick.max_time = std::chrono::milliseconds(20);
  // Within every size limit, but quadratic.
  EXPECT_HAS(render_error("{{ range(100000) | unique | length }}", quick),
             "render time limit 20 ms exceeded (--chat-template-limits time=...)");
  EXPECT_HAS(render_error("{% for i in range(1000) %}{% for j in range(1000) %}{{ j in range(1000) }}{% endfor %}{% endfor %}", quick),
             "render time limit 20 ms exceeded");
  // `~` in a loop copies the growing string every iteration: bounded by time or by size.
  const std::string grow =
      "{% set ns = namespace(s='') %}{% for i in range(1000000) %}{% set ns.s = ns.s ~ 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' %}"
      "{% endfor %}{{ ns.s | length }}";
  EXPECT_HAS(render_error(grow, Limits{}), "limit");
  Limits small_strings;
  small_strings.max_string_bytes = 64 << 10;
  small_strings.max_time = untimed().max_time;
  EXPECT_HAS(render_error(grow, small_strings), "string size limit 65536 bytes exceeded");
}

TEST(JinjaLimits, TinyLimitsFailWhereDefaultsPass) {
  const std::string src = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}";
  json messages = json::array();
  for (int i = 0; i < 20; ++i) messages.push_back({{"role", "user"}, {"content", std::to_string(i)}});
  const Limits tiny = jinja::parse_template_limits("iterations=10");
  EXPECT_HAS(render_error(src, tiny, {{"messages", messages}}), "loop iteration limit 10 exceeded");
  EXPECT_HAS(render(src, {{"messages", messages}}), "user:19;");
  // Through ChatTemplate: the constructor argument and the setter.
  ChatTemplate t(src, "", "", tiny);
  EXPECT_HAS(error_of([&] { t.render(messages, false); }), "loop iteration limit 10 exceeded");
  t.set_limits(Limits{});
  EXPECT_HAS(t.render(messages, false), "user:19;");
  EXPECT_EQ(t.limits().max_iterations, 1000000);
}

// ---- lexer ----------------------------------------------------------------------------------

TEST(JinjaLexer, BadLiteralsAreOneLineErrorsWithLineAndColumn) {
  EXPECT_HAS(error_of([] { jinja::Template t("ab\n  {{ 'x\\uZZZZ' }}"); }), "chat template line 2, column 8: bad \\u escape");
  EXPECT_HAS(error_of([] { jinja::Template t("{{ '\\x4' }}"); }), "column 5: bad \\x escape");
  EXPECT_HAS(error_of([] { jinja::Template t("{{ '\\ud800' }}"); }), "surrogate");
  EXPECT_HAS(error_of([] { jinja::Template t("{{ '\\U00110000' }}"); }), "above U+10FFFF");
  EXPECT_HAS(error_of([] { jinja::Template t("\n\n{{ 1 + 99999999999999999999 }}"); }),
             "chat template line 3, column 8: integer literal 99999999999999999999 is out of range");
  EXPECT_HAS(error_of([] { jinja::Template t("x\n{{ 'abc }}"); }), "chat template line 2, column 4: unterminated string literal");
  EXPECT_HAS(error_of([] { jinja::Template t("x\n {% if true "); }), "chat template line 2, column 2: unexpected end of template");
  EXPECT_HAS(error_of([] { jinja::Template t("{# never closed"); }), "chat template line 1, column 1: missing end of comment tag");
  EXPECT_HAS(error_of([] { jinja::Template t("{{ a ) }}"); }), "column 6: unexpected ')'");
  EXPECT_HAS(error_of([] { jinja::Template t("{{ 1 + }}"); }), "chat template line 1, column 8:");
  EXPECT_HAS(error_of([] { jinja::Template t("{%if s[]%}{%endif%}"); }), "column 8: expected a subscript expression");
  // The escapes Python's unicode-escape knows, and float literals past the double range.
  EXPECT_EQ(render("{{ '\\101\\x41\\u0041\\U0001F600\\a\\q\\'' }} {{ 1e999 }} {{ 1e-999 }} {{ 1_000 }}"),
            "AAA\xF0\x9F\x98\x80\a\\q' inf 0.0 1000");
  EXPECT_EQ(render("{{ '\\101\\x41\\u0041\\U0001F600\\a\\q\\'' }} {{ 1e999 }} {{ 1e-999 }} {{ 1_000 }}"),
            jinja2_render("{{ '\\101\\x41\\u0041\\U0001F600\\a\\q\\'' }} {{ 1e999 }} {{ 1e-999 }} {{ 1_000 }}"));
}

TEST(JinjaLexer, ChatTemplateFromConfigNamesTheFileAndLine) {
  const auto dir = std::filesystem::temp_directory_path() / ("tessera_jinja_cfg_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir / "tokenizer_config.json");
    f << json{{"chat_template", "{% for m in messages %}\n{{ '\\uZZZZ' }}{% endfor %}"}}.dump();
  }
  const std::string e = error_of([&] { ChatTemplate::from_tokenizer_config(dir.string()); });
  std::filesystem::remove_all(dir);
  EXPECT_HAS(e, "tokenizer_config.json: chat template line 2, column 5: bad \\u escape");
}

// ---- limits spec ----------------------------------------------------------------------------

TEST(JinjaLimitsSpec, ParsesEveryKey) {
  const Limits l = jinja::parse_template_limits("depth=512,iterations=2000000,output=32M,string=16M,list=1000000,time=5s");
  EXPECT_EQ(l.max_depth, 512);
  EXPECT_EQ(l.max_iterations, 2000000);
  EXPECT_EQ(l.max_output_bytes, int64_t{32} << 20);
  EXPECT_EQ(l.max_string_bytes, int64_t{16} << 20);
  EXPECT_EQ(l.max_list_items, 1000000);
  EXPECT_EQ(l.max_time.count(), 5000);
  const Limits m = jinja::parse_template_limits(" time=250ms , output=512K,string=1G,depth=64 ");
  EXPECT_EQ(m.max_time.count(), 250);
  EXPECT_EQ(m.max_output_bytes, 512 << 10);
  EXPECT_EQ(m.max_string_bytes, int64_t{1} << 30);
  EXPECT_EQ(m.max_depth, 64);
  EXPECT_EQ(m.max_iterations, Limits{}.max_iterations);  // untouched keys keep their defaults
  EXPECT_EQ(jinja::parse_template_limits("time=1.5").max_time.count(), 1500);
  EXPECT_EQ(jinja::parse_template_limits("").max_depth, Limits{}.max_depth);
}

TEST(JinjaLimitsSpec, BadSpecsAreOneLineErrors) {
  auto err = [](const std::string& spec) { return error_of([&] { jinja::parse_template_limits(spec); }); };
  EXPECT_HAS(err("depht=5"), "unknown key 'depht'");
  EXPECT_HAS(err("iterations=lots"), "bad value 'lots' for iterations");
  EXPECT_HAS(err("iterations=-1"), "bad value '-1'");
  EXPECT_HAS(err("depth=0"), "bad value '0' for depth");
  EXPECT_HAS(err("depth=100000"), "from 1 to 2048");
  EXPECT_HAS(err("output=12X"), "bad value '12X' for output");
  EXPECT_HAS(err("string=99999999999G"), "bad value");
  EXPECT_HAS(err("time=5h"), "bad value '5h' for time");
  EXPECT_HAS(err("time=0s"), "bad value");
  EXPECT_HAS(err("depth"), "expected key=value");
  EXPECT_HAS(err("depth=5,,list=3"), "empty item");
  EXPECT_HAS(err("list=99999999999999999999"), "bad value");
}

// ---- real templates -------------------------------------------------------------------------

// Tool-calling template in the style of Qwen2.5 / Hermes (namespaces, tojson, macros that
// recurse over a JSON schema, loop filters), rendered by jinja2 and by Tessera.
const char* kToolTemplate = R"TPL({%- macro render_schema(s, depth) -%}
{%- if s is mapping -%}
{ {%- for k, v in s.items() -%}{{ k }}: {{ render_schema(v, depth + 1) }}{% if not loop.last %}, {% endif %}{%- endfor -%} }
{%- elif s is iterable and s is not string -%}[{{ s | map('string') | join(', ') }}]
{%- else -%}{{ s | string | indent(depth * 2) }}{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(n=0, last_user=-1) -%}
{%- macro bump() -%}{%- set ns.n = ns.n + 1 -%}{%- endmacro -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{{ bump() }}{%- endfor -%}
<|system|>{{ tools | length }} tools, {{ ns.n }} messages, last user {{ ns.last_user }}
{% for t in tools %}{{ render_schema(t, 0) }}
{{ t | tojson }}
{% endfor -%}
{%- for m in messages if m.content is defined -%}
<|{{ m.role }}|>{{ m.content | trim }}{{ '\n' if not loop.last }}
{%- endfor %}
{{ (7 // 2) ~ ' ' ~ (-7 // 2) ~ ' ' ~ (-7 % 3) ~ ' ' ~ (2 ** 10) ~ ' ' ~ (10 / 4) }} {{ range(3) | list }} {{ 'abc' | center(9) }}|)TPL";

TEST(JinjaLimits, RealTemplatesStillRenderByteExactly) {
  const json tools = json::array(
      {{{"name", "get_weather"},
        {"parameters", {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}, {"days", {{"type", "integer"}}}}}}},
        {"required", json::array({"city"})}},
       {{"name", "noop"}, {"parameters", json::object()}}});
  const json messages = json::array({{{"role", "system"}, {"content", " Be brief. "}},
                                     {{"role", "user"}, {"content", "Weather in Paris?\n"}},
                                     {{"role", "assistant"}, {"content", "Calling get_weather."}},
                                     {{"role", "user"}, {"content", "Thanks \u2713"}}});
  std::string src = std::string("{% set tools = ") + tools.dump() + " %}{% set messages = " + messages.dump() + " %}" +
                    kToolTemplate;
  const std::string want = jinja2_render(src);
  ASSERT_FALSE(want.empty());
  EXPECT_EQ(render(src), want);
  EXPECT_HAS(want, "4 messages, last user 3");  // the namespace set inside a macro persists
}

TEST(JinjaLimits, OtherLibraryExceptionsBecomeTesseraErrors) {
  EXPECT_HAS(render_error("{{ 'a b'.split(1) }}"), "expected a string argument");
  EXPECT_HAS(render_error("{{ 'a b'.split('') }}"), "empty separator");
  EXPECT_HAS(render_error("{{ 'abc'.replace('a') }}"), "needs two arguments");
  EXPECT_EQ(render("{{ [1, 2].99999999999999999999999 }}"), "");  // undefined, as in jinja2
}

}  // namespace
}  // namespace tessera::serve
