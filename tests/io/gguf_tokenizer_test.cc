// Byte-level BPE tokenizers through GGUF metadata (tokenizer.ggml.*): what export writes
// is what llama.cpp's converter writes (token types, "[PAD<id>]" fillers, the pre-tokenizer's
// name), and the tokenizer built back from it encodes and decodes as the original does.
#include "tessera/io/gguf_tokenizer.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "io_test_util.h"

namespace tessera::io {
namespace {

using testing::error_of;
using testing::read_bytes;
using testing::write_bytes;
using testing::TempDir;

// The split patterns of Llama 3's and Qwen2's tokenizer.json files.
const char* kLlama3 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* kQwen2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

const char* kText =
    "The quick brown fox jumps over the lazy dog. It's 2026 and the numbers 12345 split.\n"
    "Caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80  spaces\tand\ttabs.\n";

Tokenizer trained(const TempDir& dir, const std::string& pattern) {
  const std::string corpus = dir.file("corpus.txt");
  {
    std::ofstream out(corpus);
    for (int i = 0; i < 30; ++i) out << kText;
  }
  BpeTrainOptions o;
  o.vocab_size = 290;
  o.special_tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  o.pattern = pattern;
  o.progress = false;
  return train_bpe({corpus}, o);
}

GgufHeader header_of(GgufMetadata md) {
  GgufHeader h;
  h.metadata = std::move(md);
  return h;
}

TEST(GgufTokenizer, RoundTripsEncodingForEachPreTokenizer) {
  TempDir dir;
  const std::string probes[] = {kText, "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n",
                                "   leading spaces and 7 numbers 0123456789!", "<|endoftext|>"};
  for (const auto& [pattern, name] : {std::pair<std::string, std::string>{"", "gpt-2"},
                                      {kLlama3, "llama-bpe"}, {kQwen2, "qwen2"}}) {
    SCOPED_TRACE(name);
    const Tokenizer tok = trained(dir, pattern);
    const int64_t vocab = tok.vocab_size() + 5;  // a model vocabulary padded past the tokenizer's
    const GgufHeader h = header_of(gguf_tokenizer_metadata(tok, vocab));
    EXPECT_EQ(h.find("tokenizer.ggml.model")->as_string(""), "gpt2");
    EXPECT_EQ(h.find("tokenizer.ggml.pre")->as_string(""), name);
    const auto& tokens = h.find("tokenizer.ggml.tokens")->as_strings("");
    ASSERT_EQ(static_cast<int64_t>(tokens.size()), vocab);
    const GgufValue& types = *h.find("tokenizer.ggml.token_type");
    const int32_t eot = tok.token_to_id("<|endoftext|>");
    EXPECT_EQ(tokens[eot], "<|endoftext|>");
    EXPECT_EQ(types.int_at(eot, ""), 3);                      // CONTROL
    EXPECT_EQ(types.int_at(tok.token_to_id("a"), ""), 1);     // NORMAL
    EXPECT_EQ(tokens[vocab - 1], "[PAD" + std::to_string(vocab - 1) + "]");
    EXPECT_EQ(types.int_at(vocab - 1, ""), 5);                // UNUSED
    EXPECT_EQ(h.find("tokenizer.ggml.merges")->size(), tok.to_json()["model"]["merges"].size());
    EXPECT_EQ(h.find("tokenizer.ggml.eos_token_id")->as_uint(""), static_cast<uint64_t>(tok.eos_id()));

    const Tokenizer back = tokenizer_from_gguf(h, "t.gguf");
    EXPECT_EQ(back.eos_id(), tok.eos_id());
    EXPECT_EQ(back.bos_id(), tok.bos_id());
    EXPECT_EQ(back.add_bos(), tok.add_bos());
    for (const std::string& s : probes) {
      EXPECT_EQ(back.encode(s), tok.encode(s)) << s;
      EXPECT_EQ(back.decode(tok.encode(s)), tok.decode(tok.encode(s)));
    }
    // ... and again from a written file, through the model-path lookup.
    const std::string path = dir.file(name + ".gguf");
    write_gguf(path, h.metadata, {}, [](size_t) { return std::string(); });
    const auto again = load_model_tokenizer(path);
    ASSERT_TRUE(again.has_value());
    EXPECT_EQ(again->encode(probes[1]), tok.encode(probes[1]));
  }
}

TEST(GgufTokenizer, CarriesTheChatTemplateAndAddBos) {
  TempDir dir;
  const Tokenizer tok = trained(dir, "");
  nlohmann::json cfg = tok.config_json();
  cfg["chat_template"] = "{{ messages[0]['content'] }}";
  cfg["bos_token"] = "<|im_start|>";
  cfg["add_bos_token"] = true;
  const Tokenizer with = Tokenizer::from_json(tok.to_json(), "tok", cfg);
  const GgufHeader h = header_of(gguf_tokenizer_metadata(with, with.vocab_size()));
  EXPECT_EQ(h.find("tokenizer.chat_template")->as_string(""), "{{ messages[0]['content'] }}");
  EXPECT_TRUE(h.find("tokenizer.ggml.add_bos_token")->as_bool(""));
  const Tokenizer back = tokenizer_from_gguf(h, "t.gguf");
  EXPECT_EQ(back.config_json()["chat_template"], "{{ messages[0]['content'] }}");
  EXPECT_TRUE(back.add_bos());
  EXPECT_EQ(back.encode("hi there"), with.encode("hi there"));
  EXPECT_EQ(back.encode("hi there").front(), with.token_to_id("<|im_start|>"));
}

// A template stored as Hugging Face's list of named templates, or in chat_template.jinja,
// travels too (export used to keep only the plain-string form).
TEST(GgufTokenizer, CarriesListAndJinjaFileTemplates) {
  TempDir dir;
  const Tokenizer tok = trained(dir, "");
  const std::string model = dir.file("model");
  tok.save(model);
  nlohmann::json cfg = tok.config_json();
  cfg["chat_template"] = nlohmann::json::array({{{"name", "tool_use"}, {"template", "TOOLS"}},
                                                {{"name", "default"}, {"template", "DEFAULT {{ bos_token }}"}}});
  write_bytes(model + "/tokenizer_config.json", cfg.dump());
  const Tokenizer listed = Tokenizer::load(model);
  EXPECT_EQ(listed.chat_template(), "DEFAULT {{ bos_token }}");
  EXPECT_EQ(header_of(gguf_tokenizer_metadata(listed, listed.vocab_size())).find("tokenizer.chat_template")->as_string(""),
            "DEFAULT {{ bos_token }}");

  cfg.erase("chat_template");
  write_bytes(model + "/tokenizer_config.json", cfg.dump());
  write_bytes(model + "/chat_template.jinja", "FROM THE FILE");
  const Tokenizer filed = Tokenizer::load(model);
  EXPECT_EQ(filed.chat_template(), "FROM THE FILE");
  EXPECT_EQ(header_of(gguf_tokenizer_metadata(filed, filed.vocab_size())).find("tokenizer.chat_template")->as_string(""),
            "FROM THE FILE");
  // Saved back as the plain string, which every reader understands.
  filed.save(dir.file("again"));
  EXPECT_EQ(nlohmann::json::parse(read_bytes(dir.file("again") + "/tokenizer_config.json"))["chat_template"], "FROM THE FILE");

  // No template anywhere: none is written.
  std::filesystem::remove(model + "/chat_template.jinja");
  const Tokenizer none = Tokenizer::load(model);
  EXPECT_EQ(none.chat_template(), "");
  EXPECT_EQ(header_of(gguf_tokenizer_metadata(none, none.vocab_size())).find("tokenizer.chat_template"), nullptr);

  cfg["chat_template"] = nlohmann::json::array({{{"name", "tool_use"}, {"template", "TOOLS"}}});
  write_bytes(model + "/tokenizer_config.json", cfg.dump());
  EXPECT_NE(error_of([&] { Tokenizer::load(model); }).find("is a list without a \"default\" template"),
            std::string::npos);
}

TEST(GgufTokenizer, UnsupportedTokenizersAreOneLineErrors) {
  TempDir dir;
  const Tokenizer tok = trained(dir, "");
  const GgufMetadata good = gguf_tokenizer_metadata(tok, tok.vocab_size());
  auto with = [&](const std::string& key, GgufValue v) {
    GgufMetadata md = good;
    for (auto& [k, val] : md)
      if (k == key) val = v;
    return error_of([&] { tokenizer_from_gguf(header_of(md), "t.gguf"); });
  };
  EXPECT_NE(with("tokenizer.ggml.model", GgufValue::string("bert")).find("tokenizer.ggml.model is 'bert'"),
            std::string::npos);
  EXPECT_NE(with("tokenizer.ggml.model", GgufValue::string("llama")).find("no metadata key 'tokenizer.ggml.scores'"),
            std::string::npos);
  EXPECT_NE(with("tokenizer.ggml.pre", GgufValue::string("falcon")).find("tokenizer.ggml.pre 'falcon' is not supported"),
            std::string::npos);
  EXPECT_NE(with("tokenizer.ggml.tokens", GgufValue::u32(3)).find("tokenizer.ggml.tokens: expected an array of strings"),
            std::string::npos);
  EXPECT_NE(with("tokenizer.ggml.token_type", GgufValue::i32s({1, 1})).find("has 2 entries for"), std::string::npos);
  EXPECT_NE(with("tokenizer.ggml.eos_token_id", GgufValue::u32(1u << 30)).find("outside the"), std::string::npos);
  GgufMetadata md = good;
  for (auto& [k, v] : md)
    if (k == "tokenizer.ggml.tokens") {
      std::vector<std::string> t = v.as_strings("");
      t[1] = t[0];
      v = GgufValue::strings(t);
    }
  EXPECT_NE(error_of([&] { tokenizer_from_gguf(header_of(md), "t.gguf"); }).find("at ids 0 and 1"), std::string::npos);
  EXPECT_NE(error_of([&] { tokenizer_from_gguf(header_of({}), "t.gguf"); }).find("no metadata key 'tokenizer.ggml.model'"),
            std::string::npos);

  // Export: a split pattern llama.cpp has no name for.
  const Tokenizer custom = trained(dir, R"(\p{L}+|\p{N}|\s+|[^\s\p{L}\p{N}]+)");
  EXPECT_NE(error_of([&] { gguf_tokenizer_metadata(custom, custom.vocab_size()); }).find("llama.cpp has no name for"),
            std::string::npos);
  EXPECT_NE(error_of([&] { gguf_tokenizer_metadata(tok, 10); }).find("more than the model's vocabulary of 10"),
            std::string::npos);
}

// A SentencePiece vocabulary as llama.cpp's converter writes it: <unk> (UNKNOWN), <s> and
// </s> (CONTROL), the 256 <0xNN> BYTE tokens, characters, then merged pieces whose scores
// put them in the order of `kMerged`, a USER_DEFINED token and an UNUSED filler.
const char* const kChars[] = {"\u2581", "h", "e", "l", "o", "w", "r", "d", "i", "\u00e9"};
const char* const kMerged[][2] = {{"\u2581", "h"}, {"e", "l"},     {"\u2581h", "el"}, {"l", "o"},
                                  {"\u2581hel", "lo"}, {"\u2581", "w"}, {"o", "r"},  {"\u2581w", "or"},
                                  {"l", "d"},         {"\u2581wor", "ld"}};
constexpr int32_t kSpH = 269, kSpHello = 273, kSpWorld = 278, kTool = 279;

GgufMetadata spm_metadata() {
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<float> scores = {0, 0, 0};
  std::vector<int32_t> types = {2, 3, 3};
  char name[8];
  for (int b = 0; b < 256; ++b) {
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    tokens.push_back(name);
    scores.push_back(0);
    types.push_back(6);
  }
  for (int i = 0; i < 10; ++i) {
    tokens.push_back(kChars[i]);
    scores.push_back(-1000.0f - i);
    types.push_back(1);
  }
  for (int i = 0; i < 10; ++i) {
    tokens.push_back(std::string(kMerged[i][0]) + kMerged[i][1]);
    scores.push_back(-1.0f - i);
    types.push_back(1);
  }
  tokens.push_back("<|tool|>");
  scores.push_back(0);
  types.push_back(4);
  tokens.push_back("[PAD280]");
  scores.push_back(0);
  types.push_back(5);
  return {{"tokenizer.ggml.model", GgufValue::string("llama")},
          {"tokenizer.ggml.tokens", GgufValue::strings(tokens)},
          {"tokenizer.ggml.scores", GgufValue::f32s(scores)},
          {"tokenizer.ggml.token_type", GgufValue::i32s(types)},
          {"tokenizer.ggml.bos_token_id", GgufValue::u32(1)},
          {"tokenizer.ggml.eos_token_id", GgufValue::u32(2)},
          {"tokenizer.ggml.unknown_token_id", GgufValue::u32(0)}};
}

GgufMetadata with_key(GgufMetadata md, const std::string& key, GgufValue v) {
  for (auto& [k, val] : md)
    if (k == key) {
      val = std::move(v);
      return md;
    }
  md.emplace_back(key, std::move(v));
  return md;
}

TEST(GgufTokenizer, SentencePieceVocabularyMergesByScore) {
  TempDir dir;
  write_gguf(dir.file("spm.gguf"), spm_metadata(), {}, [](size_t) { return std::string(); });
  const auto loaded = load_model_tokenizer(dir.file("spm.gguf"));
  ASSERT_TRUE(loaded.has_value());
  const Tokenizer& tok = *loaded;
  // The merges are the splits of the merged pieces, highest score first.
  nlohmann::json want = nlohmann::json::array();
  for (const auto& m : kMerged) want.push_back({m[0], m[1]});
  EXPECT_EQ(tok.to_json()["model"]["merges"], want);
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_id(), 2);
  EXPECT_TRUE(tok.add_bos());  // llama.cpp's default for SentencePiece
  EXPECT_EQ(tok.encode("hello world"), (std::vector<int32_t>{1, kSpHello, kSpWorld}));
  // Missing characters fall back to their bytes; the decoder puts them back and strips the
  // space the normalizer prepended.
  const auto ids = tok.encode("h\u00f1 hello", false);
  EXPECT_EQ(ids, (std::vector<int32_t>{kSpH, 3 + 0xC3, 3 + 0xB1, kSpHello}));
  EXPECT_EQ(tok.decode(ids), "h\u00f1 hello");
  EXPECT_EQ(tok.decode_token(kSpHello), " hello");
  EXPECT_EQ(tok.encode("<|tool|><s>", false), (std::vector<int32_t>{kTool, 1}));
  EXPECT_FALSE(tok.is_special(kTool));
  EXPECT_TRUE(tok.is_special(1));
  EXPECT_EQ(tok.token_to_id("[PAD280]"), -1);  // UNUSED ids are left out
  // Without byte tokens and with unk: unknown characters become one <unk>.
  GgufMetadata md = spm_metadata();
  auto types = md[3].second;
  std::vector<int32_t> t;
  for (uint64_t i = 0; i < types.size(); ++i) t.push_back(static_cast<int32_t>(types.int_at(i, "")));
  for (int b = 0; b < 256; ++b) t[3 + b] = 5;  // the byte tokens unused
  const Tokenizer no_bytes = tokenizer_from_gguf(header_of(with_key(md, "tokenizer.ggml.token_type", GgufValue::i32s(t))), "t.gguf");
  EXPECT_EQ(no_bytes.encode("h\u00f1\u00f1 hello", false), (std::vector<int32_t>{kSpH, 0, kSpHello}));
}

TEST(GgufTokenizer, SentencePieceFlagsAndErrors) {
  const Tokenizer plain = tokenizer_from_gguf(
      header_of(with_key(with_key(spm_metadata(), "tokenizer.ggml.add_space_prefix", GgufValue::boolean(false)),
                         "tokenizer.ggml.add_bos_token", GgufValue::boolean(false))),
      "t.gguf");
  EXPECT_FALSE(plain.add_bos());
  EXPECT_EQ(plain.encode("hello"), (std::vector<int32_t>{260, 270, 272}));  // h el lo: no "\u2581" prepended
  EXPECT_EQ(plain.decode({kSpHello, kSpWorld}), " hello world");          // and no Strip
  auto error = [](const GgufMetadata& md) { return error_of([&] { tokenizer_from_gguf(header_of(md), "t.gguf"); }); };
  GgufMetadata no_scores = spm_metadata();
  no_scores.erase(no_scores.begin() + 2);
  EXPECT_NE(error(no_scores).find("t.gguf: no metadata key 'tokenizer.ggml.scores'"), std::string::npos);
  EXPECT_NE(error(with_key(spm_metadata(), "tokenizer.ggml.scores", GgufValue::f32s({0, 0, 0})))
                .find("tokenizer.ggml.scores has 3 entries for 281 tokens"),
            std::string::npos);
  EXPECT_NE(error(with_key(spm_metadata(), "tokenizer.ggml.scores", GgufValue::i32s(std::vector<int32_t>(281))))
                .find("tokenizer.ggml.scores: expected an array of floats"),
            std::string::npos);
  // Export writes byte-level tokenizers only.
  const Tokenizer tok = tokenizer_from_gguf(header_of(spm_metadata()), "t.gguf");
  EXPECT_NE(error_of([&] { gguf_tokenizer_metadata(tok, tok.vocab_size()); }).find("SentencePiece-style"),
            std::string::npos);
}

}  // namespace
}  // namespace tessera::io
