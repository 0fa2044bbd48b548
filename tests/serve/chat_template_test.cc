// Chat templates rendered by tessera::serve::ChatTemplate against jinja2 itself (Debian's
// python3-jinja2), set up the way transformers' apply_chat_template sets it up.
#include "tessera/serve/chat_template.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "tessera/base/error.h"
#include "test_util/chat_templates.h"
#include "test_util/jinja2_reference.h"
#include "test_util/run_command.h"

namespace tessera::serve {
namespace {

using nlohmann::json;
using tessera::testing::kLlama3;
using tessera::testing::kQwen2;



class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            ("tessera_serve_" + std::to_string(::getpid()) + "_" + info->name());
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string dir() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

json conversation_with_system() {
  return json::array({
      {{"role", "system"}, {"content", "You are a terse assistant. Answer in one line."}},
      {{"role", "user"}, {"content", "  Hello! What's 2+2?\n"}},
      {{"role", "assistant"}, {"content", "4, \"of course\"."}},
      {{"role", "user"}, {"content", "And in Fran\u00e7ais? \u2713 {{ not a tag }}"}},
  });
}

json conversation_without_system() {
  json c = conversation_with_system();
  c.erase(c.begin());
  return c;
}

json non_alternating() {
  return json::array({
      {{"role", "user"}, {"content", "one"}},
      {{"role", "user"}, {"content", "two"}},
  });
}

// One render input: the variables transformers passes (messages, add_generation_prompt and
// the special tokens).
json make_case(const json& messages, bool add_generation_prompt, const std::string& bos, const std::string& eos) {
  return {{"messages", messages}, {"add_generation_prompt", add_generation_prompt}, {"bos_token", bos},
          {"eos_token", eos}};
}

// Renders every case with jinja2 and with ChatTemplate; outputs (or errors) must match exactly.
// Returns how many cases jinja2 rendered without an error.
int check_against_jinja2(const std::string& source, const json& cases) {
  TempDir dir;
  std::string log;
  const json expected = tessera::testing::render_with_jinja2(source, cases.dump(), dir.dir(), &log);
  EXPECT_FALSE(expected.is_null()) << log;
  if (expected.is_null()) return 0;
  EXPECT_EQ(expected.size(), cases.size());
  int ok = 0;
  for (size_t i = 0; i < cases.size() && i < expected.size(); ++i) {
    const json& c = cases[i];
    const ChatTemplate t(source, c["bos_token"].get<std::string>(), c["eos_token"].get<std::string>());
    if (expected[i].contains("ok")) {
      ++ok;
      std::string got;
      try {
        got = t.render(c["messages"], c["add_generation_prompt"].get<bool>());
      } catch (const Error& e) {
        ADD_FAILURE() << "case " << i << " threw: " << e.what();
        continue;
      }
      EXPECT_EQ(got, expected[i]["ok"].get<std::string>()) << "case " << i;
    } else {
      const std::string want = expected[i]["error"].get<std::string>();
      try {
        t.render(c["messages"], c["add_generation_prompt"].get<bool>());
        ADD_FAILURE() << "case " << i << " rendered, jinja2 raised: " << want;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what() << " vs " << want;
        EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "one-line message";
      }
    }
  }
  return ok;
}

// mistralai/Mistral-7B-Instruct-v0.1 tokenizer_config.json (quoted with its source URL in
// llama-cpp-python's llama_chat_format.py): no system role, strict alternation.
const char* kMistralV01 =
    R"TPL({{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %})TPL";

// The later Mistral-7B-Instruct-v0.2/v0.3 and Mixtral-8x7B-Instruct-v0.1 template (optional
// system message folded into the first [INST]), multi-line with `-` whitespace control.
const char* kMistralV02 = R"TPL({%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
)TPL";

// GPT-style ChatML as shipped by OpenAI-format fine-tunes (teknium/OpenHermes-2.5-Mistral-7B
// tokenizer_config.json, quoted in llama-cpp-python); also transformers' old default.
const char* kChatML =
    R"TPL({% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %})TPL";

json standard_cases(const std::string& bos, const std::string& eos) {
  json cases = json::array();
  for (const bool gen : {false, true}) {
    cases.push_back(make_case(conversation_with_system(), gen, bos, eos));
    cases.push_back(make_case(conversation_without_system(), gen, bos, eos));
  }
  cases.push_back(make_case(non_alternating(), true, bos, eos));
  return cases;
}

TEST(ChatTemplate, Llama3MatchesJinja2) {
  EXPECT_EQ(check_against_jinja2(kLlama3, standard_cases("<|begin_of_text|>", "<|eot_id|>")), 5);
  // A fixed point the reference must agree with, so a broken reference cannot pass silently.
  const std::string got = ChatTemplate(kLlama3, "<|begin_of_text|>", "<|eot_id|>")
                              .render(json::array({{{"role", "user"}, {"content", " hi "}}}), true);
  EXPECT_EQ(got,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatTemplate, Qwen2MatchesJinja2) {
  EXPECT_EQ(check_against_jinja2(kQwen2, standard_cases("", "<|im_end|>")), 5);
}

TEST(ChatTemplate, MistralV01MatchesJinja2AndRejectsSystemAndAlternation) {
  // With a system message and with two user turns in a row this template raises.
  EXPECT_EQ(check_against_jinja2(kMistralV01, standard_cases("<s>", "</s>")), 2);
  const ChatTemplate t(kMistralV01, "<s>", "</s>");
  try {
    t.render(non_alternating(), true);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "chat template: Conversation roles must alternate user/assistant/user/assistant/...");
  }
}

TEST(ChatTemplate, MistralV02MatchesJinja2) {
  EXPECT_EQ(check_against_jinja2(kMistralV02, standard_cases("<s>", "</s>")), 4);
}

TEST(ChatTemplate, ChatMLMatchesJinja2AndIsTheDefault) {
  EXPECT_EQ(check_against_jinja2(kChatML, standard_cases("<s>", "<|im_end|>")), 5);
  EXPECT_EQ(ChatTemplate::chatml().render(conversation_with_system(), true),
            ChatTemplate(kChatML).render(conversation_with_system(), true));
}

// Features real templates use (Qwen2.5 / Llama 3.1 tool templates, Hermes, Phi): namespace
// objects, filters, tests, slices, macros, loop variables, tojson, whitespace in every mode.
const char* kFeatures = R"TPL({# comment #}
{%- set ns = namespace(count=0, sys='') -%}
{% macro render_role(role, upper=false) %}{{ role | upper if upper else role }}{% endmacro %}
{% for m in messages %}
    {% if m.role == 'system' %}
        {% set ns.sys = m['content'] | trim %}
    {% else %}
        {% set ns.count = ns.count + 1 %}
    {% endif %}
{% endfor %}
sys={{ ns.sys }} count={{ ns.count }} n={{ messages | length }}
{% for m in messages if m.role != 'system' %}
  [{{ loop.index }}/{{ loop.length }} {{ loop.index0 }} first={{ loop.first }} last={{ loop.last }}] {{ render_role(m.role, upper=loop.first) }}: {{ m.content[:10] }}|{{ m.content[::-1][:5] }}|{{ m.content.strip().split(' ') | join(',') }}
{% else %}
  none
{% endfor %}
{{- messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | list | length }} users
{{ messages | rejectattr('role', 'equalto', 'user') | list | tojson }}
{{ messages[-1] | tojson(indent=2) }}
{% set d = {'b': 1, 'a': [1, 2.5, none, true, 'x"y']} %}{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}
{{ d.get('zz', 'dflt') }} {{ d.missing | default('dd') }} {{ d.b is defined }} {{ d.zz is defined }} {{ none is none }} {{ 'x' is string }} {{ d is mapping }} {{ d.a is iterable }}
{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1 + 2 * 3 }} {{ 'a' ~ 1 ~ none }} {{ 3 in [1, 2, 3] }} {{ 'q' not in 'abc' }} {{ [1, 2] + [3] }}
{{ 'Hello'.startswith('He') }} {{ 'Hello'.endswith(('x', 'lo')) }} {{ 'a-b-c'.replace('-', '+') }} {{ 'MiXed'.lower() }}{{ 'MiXed'.upper() }} {{ '  pad  '.strip() }}|{{ 'x,y,,z'.split(',') }}
{{ messages | first | tojson }} {{ (messages | last).role }} {{ 'abc' | first }} {{ [3, 1, 2] | sort | join('') }} {{ 'text' | string | length }}
{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}
{% for m in messages %}{% set leaked = m.role %}{% endfor %}{{ leaked is defined }} {% set blk %}B{{ 1 + 1 }}{% endset %}{{ blk }} {{ 0.1 + 0.2 }} {{ 1e20 * 1.0 }}

    {%+ if true %}kept-indent{% endif %}
{{ "a" if messages | length > 100 else "b" }} {{ "c" if false }}.
{% if add_generation_prompt -%}
    GEN
{%- endif %}
)TPL";

TEST(ChatTemplate, InterpreterFeaturesMatchJinja2) {
  json cases = json::array();
  for (const bool gen : {false, true}) cases.push_back(make_case(conversation_with_system(), gen, "", ""));
  cases.push_back(make_case(conversation_without_system(), false, "", ""));
  EXPECT_EQ(check_against_jinja2(kFeatures, cases), 3);
}

TEST(ChatTemplate, LoadsFromTokenizerConfig) {
  TempDir dir;
  // No tokenizer_config.json at all: ChatML.
  EXPECT_EQ(ChatTemplate::from_tokenizer_config(dir.dir()).source(), ChatTemplate::chatml().source());
  json cfg = {{"chat_template", kLlama3},
              {"bos_token", {{"__type", "AddedToken"}, {"content", "<|begin_of_text|>"}}},
              {"eos_token", "<|eot_id|>"}};
  write_file(dir.file("tokenizer_config.json"), cfg.dump());
  ChatTemplate t = ChatTemplate::from_tokenizer_config(dir.dir());
  EXPECT_EQ(t.bos_token(), "<|begin_of_text|>");
  EXPECT_EQ(t.eos_token(), "<|eot_id|>");
  EXPECT_EQ(t.render(json::array({{{"role", "user"}, {"content", "x"}}}), false),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nx<|eot_id|>");
  // HF's list of named templates: "default" is used.
  cfg["chat_template"] = json::array({{{"name", "tool_use"}, {"template", "TOOLS"}}, {{"name", "default"}, {"template", kQwen2}}});
  write_file(dir.file("tokenizer_config.json"), cfg.dump());
  EXPECT_EQ(ChatTemplate::from_tokenizer_config(dir.dir()).source(), kQwen2);
  // Present but without a template: ChatML.
  cfg.erase("chat_template");
  write_file(dir.file("tokenizer_config.json"), cfg.dump());
  EXPECT_EQ(ChatTemplate::from_tokenizer_config(dir.dir()).source(), ChatTemplate::chatml().source());
}

TEST(ChatTemplate, ErrorsAreOneLineTesseraErrors) {
  auto error_of = [](const std::function<void()>& fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return e.what();
    }
    return "<no error>";
  };
  EXPECT_NE(error_of([] { ChatTemplate("{% for m in messages %}x"); }).find("expected 'endfor'"), std::string::npos);
  EXPECT_NE(error_of([] { ChatTemplate("a\n{{ 1 + }}"); }).find("line 2"), std::string::npos);
  EXPECT_NE(error_of([] { ChatTemplate("{% frobnicate %}"); }).find("unknown tag 'frobnicate'"), std::string::npos);
  EXPECT_NE(error_of([] { ChatTemplate("{{ x | nosuchfilter }}").render(json::array(), false); }).find("unknown filter"),
            std::string::npos);
  EXPECT_NE(error_of([] { ChatTemplate("{{ messages[0].content }}").render(json::array(), false); })
                .find("undefined"),
            std::string::npos);
  EXPECT_NE(error_of([] { ChatTemplate("{{ 'a' + 1 }}").render(json::array(), false); }).find("unsupported operand"),
            std::string::npos);
  EXPECT_EQ(error_of([] { ChatTemplate("{{ raise_exception('bad role: ' + messages[0].role) }}")
                              .render(json::array({{{"role", "tool"}, {"content", ""}}}), false); }),
            "chat template: bad role: tool");
}

}  // namespace
}  // namespace tessera::serve
