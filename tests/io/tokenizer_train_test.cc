// BPE trainer against a naive Python trainer (same merges, same order), and the errors
// for bad corpora, bad sizes, bad tokenizer.json files and bad ids.
#include <gtest/gtest.h>

#include <filesystem>

#include "io_test_util.h"
#include "tessera/base/error.h"
#include "tessera/io/json_file.h"
#include "tessera/io/pretokenize.h"
#include "tessera/io/tokenizer.h"
#include "tokenizer_test_util.h"

namespace tessera::io {
namespace {

using testing::TempDir;
using testing::write_bytes;

using testing::error_of;

BpeTrainOptions quiet(int64_t vocab_size) {
  BpeTrainOptions o;
  o.vocab_size = vocab_size;
  o.progress = false;
  return o;
}

// A small corpus with ties, repeated letters ("aaaa" merges), digits, CJK and specials.
std::string small_corpus() {
  std::string s;
  const char* lines[] = {"the cat sat on the mat; the dog sat on the log.\n",
                         "aaaa aaa aa a bbbb abab baba 1234 12 123 1234567\n",
                         "don't won't can't it's we're   spaces   here\n",
                         "数据训练 数据 训练模型 模型 😀😀 😀\n",
                         "<|endoftext|>Привет мир привет<|im_start|> end\n"};
  for (int r = 0; r < 6; ++r)
    for (const char* l : lines) s += l;
  return s;
}

TEST(BpeTrain, MatchesNaiveReferenceTrainer) {
  TempDir dir;
  write_bytes(dir.file("corpus.txt"), small_corpus());
  auto o = quiet(256 + 90 + 2);
  o.special_tokens = {"<|endoftext|>", "<|im_start|>"};
  const auto tok = train_bpe({dir.file("corpus.txt")}, o);
  testing::run_reference("train " + dir.file("corpus.txt") + " " + std::to_string(o.vocab_size) + " " +
                         dir.file("ref.json") + " --special '<|endoftext|>' --special '<|im_start|>'");
  const auto ref = read_json_file(dir.file("ref.json"));
  const auto j = tok.to_json();
  ASSERT_EQ(j["model"]["merges"].size(), ref["merges"].size());
  for (size_t i = 0; i < ref["merges"].size(); ++i)
    ASSERT_EQ(j["model"]["merges"][i], ref["merges"][i]) << "merge " << i;
  // The reference's vocab includes the specials; ours lists them under added_tokens.
  auto vocab = j["model"]["vocab"];
  for (const auto& a : j["added_tokens"]) vocab[a["content"].get<std::string>()] = a["id"];
  EXPECT_EQ(vocab, ref["vocab"]);
  EXPECT_EQ(tok.vocab_size(), o.vocab_size);
  EXPECT_EQ(tok.token_to_id("<|im_start|>"), o.vocab_size - 1);
  EXPECT_EQ(tok.eos_id(), o.vocab_size - 2);
  EXPECT_TRUE(tok.is_special(tok.eos_id()));
  EXPECT_EQ(tok.token_to_id("!"), 0);  // GPT-2's byte order
}

TEST(BpeTrain, SavedTokenizerLoadsBackAndEncodesTheSame) {
  TempDir dir;
  write_bytes(dir.file("a.txt"), small_corpus());
  write_bytes(dir.file("b.txt"), "second file, more text: the the the cat cat\n");
  const auto tok = train_bpe({dir.file("a.txt"), dir.file("b.txt")}, quiet(330));
  tok.save(dir.file("out"));
  const auto loaded = Tokenizer::load(dir.file("out"));
  const std::string text = small_corpus() + " unseen wörds 999";
  EXPECT_EQ(loaded.encode(text), tok.encode(text));
  EXPECT_EQ(loaded.decode(loaded.encode(text)), text);
  EXPECT_EQ(loaded.vocab_size(), 330);
  const auto cfg = read_json_file(dir.file("out/tokenizer_config.json"));
  EXPECT_EQ(cfg["eos_token"], "<|endoftext|>");
  EXPECT_EQ(cfg["add_bos_token"], false);
  EXPECT_TRUE(cfg.contains("model_max_length"));
  // The special token in the text is one token, never merged into.
  const auto ids = tok.encode("<|endoftext|>");
  ASSERT_EQ(ids.size(), 1u);
  EXPECT_EQ(ids[0], tok.eos_id());
}

TEST(BpeTrain, CustomPatternIsWrittenAsSplitAndUsed) {
  TempDir dir;
  write_bytes(dir.file("c.txt"), small_corpus());
  auto o = quiet(300);
  o.pattern = R"(\p{L}+|\p{N}|[^\p{L}\p{N}]+)";
  const auto tok = train_bpe({dir.file("c.txt")}, o);
  const auto j = tok.to_json();
  EXPECT_EQ(j["pre_tokenizer"]["type"], "Sequence");
  EXPECT_EQ(j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"], o.pattern);
  // Single digits: "1234" can only be four tokens.
  EXPECT_EQ(tok.encode("1234", false).size(), 4u);
}

TEST(BpeTrain, BadInputErrors) {
  TempDir dir;
  write_bytes(dir.file("empty.txt"), "");
  write_bytes(dir.file("specials_only.txt"), "<|endoftext|><|endoftext|>");
  write_bytes(dir.file("ok.txt"), small_corpus());
  write_bytes(dir.file("once.txt"), "abcdefgh");
  write_bytes(dir.file("bad_utf8.txt"), std::string("fine text \xC3\x28 broken", 20));
  EXPECT_ERROR(train_bpe({}, quiet(300)), "no input files");
  EXPECT_ERROR(train_bpe({dir.file("empty.txt")}, quiet(300)), "corpus is empty");
  EXPECT_ERROR(train_bpe({dir.file("specials_only.txt")}, quiet(300)), "corpus is empty");
  EXPECT_ERROR(train_bpe({dir.file("missing.txt")}, quiet(300)), "missing.txt: cannot open");
  EXPECT_ERROR(train_bpe({dir.file("bad_utf8.txt")}, quiet(300)), "bad_utf8.txt: not valid UTF-8 at byte 10");
  EXPECT_ERROR(train_bpe({dir.file("ok.txt")}, quiet(256)), "less than the minimum 257");
  // More merges than the corpus has symbols: refused before training.
  EXPECT_ERROR(train_bpe({dir.file("ok.txt")}, quiet(1000000)), "more than this corpus allows: at most");
  // Symbols left but no pair seen twice (min frequency 2): refused after training.
  EXPECT_ERROR(train_bpe({dir.file("once.txt")}, quiet(260)), "no pair occurs at least 2 times");
  auto o = quiet(300);
  o.special_tokens = {"<a>", "<a>"};
  EXPECT_ERROR(train_bpe({dir.file("ok.txt")}, o), "'<a>' is given twice");
  o = quiet(300);
  o.pattern = "(unclosed";
  EXPECT_ERROR(train_bpe({dir.file("ok.txt")}, o), "cannot compile regex '(unclosed'");
}

// Hugging Face merges the lowest-ranked pair one occurrence at a time, so a merge can make
// a lower-ranked pair that wins over the second occurrence of the same rank; encoder.py's
// "merge every occurrence of the bigram" would give [abc, abc] here instead.
TEST(TokenizerUse, MergeOrderIsLowestRankOneAtATime) {
  TempDir dir;
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[bytes_to_byte_level(std::string(1, static_cast<char>(b)))] = b;
  for (const char* t : {"bc", "abca", "abc", "ab"}) vocab[t] = static_cast<int>(vocab.size());
  const nlohmann::json j = {
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"b c", "abc a", "a bc", "a b"}}}},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}}}};
  write_file_atomic(dir.file("tokenizer.json"), j.dump());
  const auto tok = Tokenizer::load(dir.file("tokenizer.json"));
  const std::vector<int32_t> want = {tok.token_to_id("abca"), tok.token_to_id("bc")};
  EXPECT_EQ(tok.encode("abcabc"), want);
  write_file_atomic(dir.file("req.json"),
                    nlohmann::json({{"tokenizers", {{"t", dir.file("tokenizer.json")}}}, {"texts", {"abcabc"}}}).dump());
  testing::run_reference("encode " + dir.file("req.json") + " " + dir.file("res.json"));
  EXPECT_EQ(read_json_file(dir.file("res.json"))["t"]["ids"][0].get<std::vector<int32_t>>(), want);
}

TEST(TokenizerLoad, ErrorsNameTheKey) {
  TempDir dir;
  write_bytes(dir.file("c.txt"), small_corpus());
  const auto base = train_bpe({dir.file("c.txt")}, quiet(300)).to_json();
  auto edit = [&](const std::function<void(nlohmann::json&)>& f) {
    auto j = base;
    f(j);
    return j;
  };
  EXPECT_ERROR(Tokenizer::load(dir.file("nowhere")), "nowhere");
  std::filesystem::create_directories(dir.file("emptydir"));
  EXPECT_ERROR(Tokenizer::load(dir.file("emptydir")), "no tokenizer.json");
  EXPECT_ERROR(Tokenizer::from_json(edit([](auto& j) { j["model"]["type"] = "WordPiece"; }), "t.json"),
               "t.json: model.type is 'WordPiece'");
  EXPECT_ERROR(Tokenizer::from_json(edit([](auto& j) { j["model"]["merges"][3] = "nothere x"; }), "t.json"),
               "t.json: model.merges[3]: 'nothere' is not in model.vocab");
  EXPECT_ERROR(Tokenizer::from_json(edit([](auto& j) { j["model"]["merges"][0] = "nospace"; }), "t.json"),
               "model.merges[0]: 'nospace' is not \"left right\"");
  EXPECT_ERROR(Tokenizer::from_json(edit([](auto& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; }), "t.json"),
               "unsupported pre-tokenizer 'Whitespace'");
  EXPECT_ERROR(Tokenizer::from_json(edit([](auto& j) { j["pre_tokenizer"] = nullptr; }), "t.json"),
               "t.json: pre_tokenizer: is null");
  EXPECT_ERROR(Tokenizer::from_json(edit([](auto& j) { j["normalizer"] = {{"type", "Lowercase"}}; }), "t.json"),
               "unsupported normalizer 'Lowercase'");
  EXPECT_ERROR(Tokenizer::from_json(edit([](auto& j) { j["model"]["byte_fallback"] = true; }), "t.json"),
               "byte_fallback");
  EXPECT_ERROR(Tokenizer::from_json(edit([](auto& j) { j["added_tokens"][0]["single_word"] = true; }), "t.json"),
               "single_word is not supported");
  EXPECT_ERROR(Tokenizer::from_json(edit([](auto& j) {
                 j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "[a-"}}}, {"behavior", "Isolated"}};
               }), "t.json"),
               "pre_tokenizer.pattern: cannot compile regex '[a-'");
  EXPECT_ERROR(Tokenizer::from_json(base, "t.json", {{"bos_token", "<nope>"}}),
               "bos_token '<nope>' is not in the vocabulary");
}

TEST(TokenizerUse, BadIdsAndBadTextAreErrors) {
  TempDir dir;
  write_bytes(dir.file("c.txt"), small_corpus());
  const auto tok = train_bpe({dir.file("c.txt")}, quiet(300));
  EXPECT_ERROR(tok.decode({1, 2, 300}), "token id 300 is not in the vocabulary");
  EXPECT_ERROR(tok.decode({-5}), "token id -5");
  EXPECT_ERROR(tok.decode_token(1 << 30), "token id 1073741824");
  EXPECT_ERROR(tok.encode(std::string("ok \xFF bad", 8)), "not valid UTF-8 at byte 3");
  EXPECT_ERROR(tok.encode(std::string("\xED\xA0\x80", 3)), "not valid UTF-8 at byte 0");  // a surrogate
}

}  // namespace
}  // namespace tessera::io
