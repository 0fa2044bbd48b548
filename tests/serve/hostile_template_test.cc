// Hostile chat templates (tokenizer_config.json is untrusted) against a real `tessera serve`:
// a template that breaks a render limit or does undefined arithmetic is a 400 for that
// request while the server keeps serving; one that cannot be parsed is a one-line start-up
// error naming the file and the template line. Never a signal.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "serve/server_process.h"
#include "test_util/run_command.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::ServerProcess;

const std::string kModel = TESSERA_SERVE_MODEL;

// A copy of the serve model whose tokenizer_config.json carries `chat_template`.
std::string model_with_template(const std::string& name, const std::string& chat_template) {
  const fs::path dir = fs::temp_directory_path() / ("tessera_tmpl_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(kModel))
    if (e.path().filename() != "tokenizer_config.json") fs::create_symlink(fs::absolute(e.path()), dir / e.path().filename());
  std::ifstream in(kModel + "/tokenizer_config.json");
  json cfg = json::parse(in);
  cfg["chat_template"] = chat_template;
  std::ofstream(dir / "tokenizer_config.json") << cfg.dump();
  return dir.string();
}

httplib::Result chat(const ServerProcess& s, int turns = 1) {
  json messages = json::array();
  for (int i = 0; i < turns; ++i) messages.push_back({{"role", i % 2 ? "assistant" : "user"}, {"content", "hi"}});
  auto c = s.client(60);
  return c.Post("/v1/chat/completions", json({{"messages", messages}, {"max_tokens", 2}}).dump(), "application/json");
}

// 400 with the OpenAI error shape whose message contains `fragment`.
void expect_400(const httplib::Result& r, const std::string& fragment) {
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400) << r->body;
  const json e = json::parse(r->body, nullptr, false);
  ASSERT_TRUE(e.contains("error")) << r->body;
  EXPECT_EQ(e["error"]["param"], "messages") << r->body;
  EXPECT_NE(e["error"]["message"].get<std::string>().find(fragment), std::string::npos) << r->body;
}

TEST(ServeHostileTemplate, RenderFailuresAre400sAndTheServerLives) {
  struct Case {
    std::string name, tmpl, fragment;
  };
  const std::vector<Case> cases = {
      {"intmin_floordiv", "{{ (-9223372036854775807 - 1) // -1 }}", "integer overflow"},
      {"intmin_mod", "{{ (-9223372036854775807 - 1) % 0 }}", "division by zero"},
      {"divisibleby", "{% if (-9223372036854775807 - 1) is divisibleby(-1) %}x{% endif %}{{ 1 // 0 }}",
       "division by zero"},
      {"recursion", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "depth"},
      {"range", "{% for i in range(200000000) %}x{% endfor %}", "limit"},
      {"list_repeat", "{{ ([1] * 300000000) | length }}", "limit"},
      {"string_repeat", "{{ 'x' * 100000000 }}", "limit"},
      {"slow", "{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}{% endfor %}"
               "{% endfor %}{% endfor %}",
       "limit"},
  };
  for (const auto& k : cases) {
    SCOPED_TRACE(k.name);
    const std::string dir = model_with_template(k.name, k.tmpl);
    ServerProcess s({"--model", dir});
    expect_400(chat(s), k.fragment);
    // Still serving: a completion needs no template.
    auto c = s.client();
    auto ok = c.Post("/v1/completions", R"({"prompt": "hi", "max_tokens": 2})", "application/json");
    ASSERT_TRUE(ok);
    EXPECT_EQ(ok->status, 200);
    s.signal(SIGTERM);
    EXPECT_EQ(s.wait(30), 0) << s.stderr_text();
    fs::remove_all(dir);
  }
}

TEST(ServeHostileTemplate, UnparsableTemplatesAreOneLineStartupErrors) {
  struct Case {
    std::string name, tmpl;
    std::vector<std::string> fragments;
  };
  const std::vector<Case> cases = {
      {"parens", "{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}", {"line 1", "nest"}},
      {"bad_escape", "line one\n{{ 'a\\uZZZZ' }}", {"line 2"}},
      {"big_literal", "{{ 123456789012345678901 }}", {"line 1"}},
      {"unterminated", "{% for m in messages %}{{ m.content", {"line 1"}},
  };
  for (const auto& k : cases) {
    SCOPED_TRACE(k.name);
    const std::string dir = model_with_template(k.name, k.tmpl);
    const auto r = testing::run_command(std::string(TESSERA_CLI_PATH) + " serve --port 0 --model " + dir +
                                        " 2>&1 >/dev/null", /*merge_stderr=*/false);
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out.substr(0, 2000);
    EXPECT_EQ(r.out.rfind("tessera: error: ", 0), 0u) << r.out;
    EXPECT_NE(r.out.find("tokenizer_config.json"), std::string::npos) << r.out;
    for (const auto& f : k.fragments) EXPECT_NE(r.out.find(f), std::string::npos) << f << " in " << r.out;
    EXPECT_EQ(r.out.find("stoul"), std::string::npos) << r.out;
    fs::remove_all(dir);
  }
}

// --chat-template-limits tightens (or loosens) the budget; a bad spec fails at start.
TEST(ServeHostileTemplate, ChatTemplateLimitsFlag) {
  ServerProcess s({"--model", kModel, "--chat-template-limits", "iterations=4"});
  auto short_chat = chat(s, 1);
  ASSERT_TRUE(short_chat);
  EXPECT_EQ(short_chat->status, 200) << short_chat->body;
  expect_400(chat(s, 9), "iteration limit 4");
  s.signal(SIGTERM);
  EXPECT_EQ(s.wait(30), 0);
  const auto bad = testing::run_command(std::string(TESSERA_CLI_PATH) + " serve --port 0 --model " + kModel +
                                            " --chat-template-limits iterations=many,color=red 2>&1 >/dev/null",
                                        /*merge_stderr=*/false);
  EXPECT_EQ(bad.code, 1) << bad.out;
  EXPECT_EQ(std::count(bad.out.begin(), bad.out.end(), '\n'), 1) << bad.out;
  EXPECT_NE(bad.out.find("--chat-template-limits"), std::string::npos) << bad.out;
}

}  // namespace
}  // namespace tessera
