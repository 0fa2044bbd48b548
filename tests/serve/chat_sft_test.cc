// SFT rendering: the loss mask against hand-written renderings of Llama 3, Qwen2 and ChatML
// conversations, the errors for bad messages and templates, and the JSONL reader.
#include "tessera/serve/chat_sft.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/io/pretokenize.h"
#include "test_util/chat_templates.h"
#include "test_util/throws.h"

namespace tessera::serve {
namespace {

using nlohmann::json;
using tessera::testing::kLlama3;
using tessera::testing::kQwen2;
using tessera::testing::throws_error;

// A byte-level BPE tokenizer (GPT-2's pre-tokenizer) with a few merges and the special tokens
// of ChatML and Llama 3, so the templates' markers encode as one token each.
const io::Tokenizer& test_tokenizer() {
  static const io::Tokenizer tok = [] {
    json vocab = json::object();
    for (int b = 0; b < 256; ++b) vocab[io::bytes_to_byte_level(std::string(1, static_cast<char>(b)))] = b;
    // "\xC4\x8A" is "\n", "\xC4\xA0" is " ".
    const char* const merges[][2] = {{"\xC4\x8A", "\xC4\x8A"}, {"l", "l"}, {"e", "ll"}, {"H", "ell"},
                                     {"\xC4\xA0", "t"},         {"h", "e"}, {"r", "e"},  {"\xC4\xA0t", "he"},
                                     {"\xC4\xA0the", "re"},     {"a", "s"}, {"s", "i"},  {"as", "si"}};
    json merge_list = json::array();
    int next = 256;
    for (const auto& m : merges) {
      merge_list.push_back(std::string(m[0]) + " " + m[1]);
      vocab[std::string(m[0]) + m[1]] = next++;
    }
    json added = json::array();
    next = 1000;
    for (const char* t : {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                          "<|im_start|>", "<|im_end|>", "<|endoftext|>"})
      added.push_back({{"id", next++}, {"content", t}, {"single_word", false}, {"lstrip", false},
                       {"rstrip", false}, {"normalized", false}, {"special", true}});
    const json j = {
        {"added_tokens", added},
        {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
        {"decoder", {{"type", "ByteLevel"}}},
        {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}}}};
    return io::Tokenizer::from_json(j, "test_tokenizer()");
  }();
  return tok;
}

json msg(const std::string& role, const json& content) { return {{"role", role}, {"content", content}}; }

// system, user, assistant, user, assistant.
json five_turns(const std::string& first_reply = "Hello there!", const std::string& second_reply = "4.") {
  return json::array({msg("system", "You are terse."), msg("user", "Hi!"), msg("assistant", first_reply),
                      msg("user", "What is 2+2?"), msg("assistant", second_reply)});
}

// One literal piece of the expected rendering and whether it is trained on.
struct Part {
  std::string text;
  bool trained;
};

// `ex` must be exactly the parts: the rendering is their concatenation, the tokens are each part
// encoded alone, and the runs of equal mask decode to the parts one by one (parts alternate).
void expect_parts(const ChatTemplate& tmpl, const json& messages, const std::vector<Part>& parts) {
  const io::Tokenizer& tok = test_tokenizer();
  std::string rendering;
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  for (const Part& p : parts) {
    rendering += p.text;
    const auto ids = tok.encode(p.text, false);
    tokens.insert(tokens.end(), ids.begin(), ids.end());
    mask.insert(mask.end(), ids.size(), p.trained);
  }
  // The hand-written parts are the template's rendering (so the mask below is checked against it).
  ASSERT_EQ(tmpl.render(messages, false), rendering);

  const SftExample ex = render_sft_example(tmpl, tok, messages);
  ASSERT_EQ(ex.tokens.size(), ex.mask.size());
  EXPECT_EQ(ex.tokens, tokens);
  EXPECT_EQ(ex.mask, mask);
  EXPECT_EQ(tok.decode(ex.tokens), rendering);

  std::vector<Part> runs;
  for (size_t i = 0; i < ex.tokens.size();) {
    size_t j = i;
    while (j < ex.tokens.size() && ex.mask[j] == ex.mask[i]) ++j;
    runs.push_back({tok.decode(std::vector<int32_t>(ex.tokens.begin() + i, ex.tokens.begin() + j)), ex.mask[i] == 1});
    i = j;
  }
  ASSERT_EQ(runs.size(), parts.size());
  for (size_t k = 0; k < parts.size(); ++k) {
    EXPECT_EQ(runs[k].text, parts[k].text) << "part " << k;
    EXPECT_EQ(runs[k].trained, parts[k].trained) << "part " << k;
  }
}

TEST(ChatSft, ChatMLMasksEachAssistantTurnWithItsEndMarker) {
  const ChatTemplate t = ChatTemplate::chatml();
  expect_parts(t, five_turns(),
               {{"<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                 "<|im_start|>assistant\n",
                 false},
                {"Hello there!<|im_end|>\n", true},
                {"<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", false},
                {"4.<|im_end|>\n", true}});
  // A tool message is prompt; a trailing user message is untrained text.
  json m = json::array({msg("user", "Weather?"), msg("assistant", "Calling."), msg("tool", "{\"t\": 21}"),
                        msg("assistant", "21 C."), msg("user", "Thanks")});
  expect_parts(t, m,
               {{"<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n", false},
                {"Calling.<|im_end|>\n", true},
                {"<|im_start|>tool\n{\"t\": 21}<|im_end|>\n<|im_start|>assistant\n", false},
                {"21 C.<|im_end|>\n", true},
                {"<|im_start|>user\nThanks<|im_end|>\n", false}});
}

TEST(ChatSft, Qwen2MasksAssistantTurnsAndKeepsTheDefaultSystemPromptUntrained) {
  const ChatTemplate t(kQwen2, "", "<|im_end|>");
  expect_parts(t, five_turns(),
               {{"<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                 "<|im_start|>assistant\n",
                 false},
                {"Hello there!<|im_end|>\n", true},
                {"<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", false},
                {"4.<|im_end|>\n", true}});
  json no_system = five_turns();
  no_system.erase(no_system.begin());
  expect_parts(t, no_system,
               {{"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                 "<|im_start|>assistant\n",
                 false},
                {"Hello there!<|im_end|>\n", true},
                {"<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", false},
                {"4.<|im_end|>\n", true}});
}

TEST(ChatSft, Llama3MasksTheTrimmedReplyAndEotAndMatchesBosAsASpecialToken) {
  const ChatTemplate t(kLlama3, "<|begin_of_text|>", "<|eot_id|>");
  // The template trims content: the trained text is what the template wrote, not the raw content.
  const json m = five_turns(" Hello there!\n", "  4.\n");
  expect_parts(t, m,
               {{"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n",
                 false},
                {"Hello there!<|eot_id|>", true},
                {"<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n",
                 false},
                {"4.<|eot_id|>", true}});
  const io::Tokenizer& tok = test_tokenizer();
  const SftExample ex = render_sft_example(t, tok, m);
  EXPECT_EQ(ex.tokens.front(), tok.token_to_id("<|begin_of_text|>"));
  EXPECT_EQ(std::count(ex.tokens.begin(), ex.tokens.end(), tok.token_to_id("<|eot_id|>")), 5);  // one per message
  // The prompt is encoded alone, as at inference: "\n\n" before the reply is one token, where
  // encoding the whole text would split it ("\n" "\n" before "Hello", GPT-2's \s+(?!\S)).
  const int32_t nn = tok.token_to_id("\xC4\x8A\xC4\x8A");
  ASSERT_GE(nn, 0);
  const size_t first_trained = std::find(ex.mask.begin(), ex.mask.end(), 1) - ex.mask.begin();
  ASSERT_GT(first_trained, 0u);
  EXPECT_EQ(ex.tokens[first_trained - 1], nn);
  EXPECT_NE(ex.tokens, tok.encode(t.render(m, false), false));
}

TEST(ChatSft, TextPartsAreJoinedOtherPartsRejected) {
  const ChatTemplate t = ChatTemplate::chatml();
  const io::Tokenizer& tok = test_tokenizer();
  json parts = five_turns();
  parts[2]["content"] = json::array({{{"type", "text"}, {"text", "Hello "}}, {{"type", "text"}, {"text", "there!"}}});
  parts[1]["content"] = json::array({{{"type", "text"}, {"text", "Hi!"}}});
  const SftExample a = render_sft_example(t, tok, parts), b = render_sft_example(t, tok, five_turns());
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.mask, b.mask);
  parts[1]["content"] = json::array({{{"type", "image_url"}, {"image_url", {{"url", "x"}}}}});
  EXPECT_TRUE(throws_error([&] { render_sft_example(t, tok, parts); },
                           {"messages[1].content[0] must be {\"type\": \"text\"", "not supported"}, true));
}

TEST(ChatSft, BadMessagesAreOneLineErrorsNamingTheMessage) {
  const ChatTemplate t = ChatTemplate::chatml();
  const io::Tokenizer& tok = test_tokenizer();
  auto err = [&](const json& m, std::initializer_list<const char*> needles) {
    return throws_error([&] { render_sft_example(t, tok, m); }, needles, true);
  };
  EXPECT_TRUE(err(json::object({{"messages", five_turns()}}), {"messages must be a JSON array", "an object"}));
  EXPECT_TRUE(err(json::array({msg("user", "Hi"), "hello"}), {"messages[1] must be an object"}));
  EXPECT_TRUE(err(json::array({msg("user", "Hi"), {{"content", "x"}}}), {"messages[1] has no role"}));
  EXPECT_TRUE(err(json::array({msg("user", "Hi"), msg("bot", "x")}), {"messages[1].role \"bot\" is not one of"}));
  EXPECT_TRUE(err(json::array({{{"role", 3}, {"content", "x"}}}), {"messages[0].role must be a string, got 3"}));
  EXPECT_TRUE(err(json::array({{{"role", "user"}}}), {"messages[0] has no content"}));
  EXPECT_TRUE(err(json::array({msg("user", "Hi"), msg("assistant", 42)}),
                  {"messages[1].content must be a string or a list of text parts, got 42"}));
  EXPECT_TRUE(err(json::array({msg("user", "Hi"), msg("assistant", nullptr)}), {"messages[1].content must be"}));
  EXPECT_TRUE(err(json::array({msg("system", "S"), msg("user", "Hi")}), {"no assistant message"}));
  EXPECT_TRUE(err(json::array(), {"no assistant message"}));
}

TEST(ChatSft, TemplatesThatAreNotPrefixStableAreErrorsNamingTheTurn) {
  const io::Tokenizer& tok = test_tokenizer();
  const json m = five_turns();
  auto err = [&](const char* source, std::initializer_list<const char*> needles) {
    return throws_error([&] { render_sft_example(ChatTemplate(source), tok, m); }, needles, true);
  };
  // The last message is rendered differently ([role:content] instead of role:content;).
  EXPECT_TRUE(err("{% for m in messages %}{% if loop.last %}[{{ m.role }}:{{ m.content }}]{% else %}"
                  "{{ m.role }}:{{ m.content }};{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}",
                  {"not prefix-stable at messages[2] (assistant)", "they part at byte"}));
  // The generation prompt opens a think block that the rendered turn does not have (Qwen3-style).
  EXPECT_TRUE(err("{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
                  "{% if add_generation_prompt %}<assistant><think>\n{% endif %}",
                  {"not prefix-stable at messages[2] (assistant)", "\"<think>\\n\""}));
  // Earlier assistant turns are rewritten once later messages follow (reasoning stripped).
  EXPECT_TRUE(err("{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}<a>(hidden)</s>"
                  "{% else %}<{{ m.role }}>{{ m.content }}</s>{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}",
                  {"renders messages[2] (assistant) differently once later messages follow"}));
  // A template that drops assistant messages leaves nothing to train on.
  EXPECT_TRUE(err("{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }};{% endif %}{% endfor %}",
                  {"renders no text for messages[2] (assistant)"}));
  // Template errors name the render that raised them.
  EXPECT_TRUE(err("{% if messages | length > 3 %}{{ raise_exception('too long') }}{% endif %}x",
                  {"rendering messages[:5]: chat template: too long"}));
}

class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            ("tessera_sft_" + std::to_string(::getpid()) + "_" + info->name());
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string write(const std::string& name, const std::string& bytes) const {
    const std::string p = (path_ / name).string();
    std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
    return p;
  }

 private:
  std::filesystem::path path_;
};

TEST(ChatSft, JsonlFileIsRenderedLineByLineAndErrorsNameFileAndLine) {
  TempDir dir;
  const ChatTemplate t = ChatTemplate::chatml();
  const io::Tokenizer& tok = test_tokenizer();
  const json a = five_turns(), b = json::array({msg("user", "Q"), msg("assistant", "A")});
  const std::string good = dir.write(
      "good.jsonl", json({{"messages", a}}).dump() + "\n\n  \r\n" + json({{"messages", b}, {"id", 7}}).dump() + "\r\n");
  const std::vector<SftExample> got = render_sft_file(good, t, tok);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].tokens, render_sft_example(t, tok, a).tokens);
  EXPECT_EQ(got[0].mask, render_sft_example(t, tok, a).mask);
  EXPECT_EQ(got[1].tokens, render_sft_example(t, tok, b).tokens);
  EXPECT_EQ(got[1].mask, render_sft_example(t, tok, b).mask);

  const std::string ok_line = json({{"messages", b}}).dump();
  auto err = [&](const std::string& name, const std::string& text, std::initializer_list<const char*> needles) {
    const std::string p = dir.write(name, text);
    return throws_error([&] { render_sft_file(p, t, tok); }, needles, true);
  };
  EXPECT_TRUE(err("chats.jsonl", ok_line + "\n\n" + ok_line + "\n{\"messages\": [}\n",
                  {"chats.jsonl:4:15: invalid JSON: "}));
  EXPECT_TRUE(err("none.jsonl", ok_line + "\n" + json({{"messages", json::array({msg("user", "Q")})}}).dump(),
                  {"none.jsonl:2: no assistant message"}));
  EXPECT_TRUE(err("nokey.jsonl", "{\"msgs\": []}\n", {"nokey.jsonl:1: expected an object {\"messages\": [...]}"}));
  EXPECT_TRUE(err("role.jsonl", "\n\n" + json({{"messages", json::array({msg("robot", "x")})}}).dump(),
                  {"role.jsonl:3: messages[0].role \"robot\" is not one of"}));
  EXPECT_TRUE(err("array.jsonl", "[1, 2]\n", {"array.jsonl:1: expected an object", "an array of 2 items"}));
  EXPECT_TRUE(throws_error([&] { render_sft_file(dir.write("x", "") + ".missing", t, tok); },
                           {"x.missing: cannot open"}, true));
  EXPECT_TRUE(render_sft_file(dir.write("empty.jsonl", "\n\n"), t, tok).empty());
}

}  // namespace
}  // namespace tessera::serve
