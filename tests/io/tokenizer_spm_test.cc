// SentencePiece-style BPE (Llama 2 / Mistral / Gemma tokenizer.json) on a hand-made
// tokenizer: byte fallback, fuse_unk, Metaspace prepend schemes and splits, the decoders
// (Replace, ByteFallback, Fuse, Strip, Metaspace), streaming bytes, the Split behaviors,
// save/load, and one-line errors for what is not supported. Parity with Hugging Face on real
// files is tests/js/tokenizer_parity.test.mjs.
#include <gtest/gtest.h>

#include <deque>
#include <functional>

#include "io_test_util.h"
#include "tessera/io/pretokenize.h"
#include "tessera/io/tokenizer.h"

namespace tessera::io {
namespace {

using nlohmann::json;
using testing::error_of;
using testing::TempDir;

constexpr int32_t kByte0 = 3;  // "<0x00>"; "<0xNN>" is 3 + NN
// ids of the vocabulary below
constexpr int32_t kSpace = 259, kH = 260, kE = 261, kL = 262, kO = 263, kW = 264, kR = 265, kD = 266, kI = 267,
                  kEAcute = 268, kSpH = 269, kEl = 270, kSpHel = 271, kLo = 272, kSpHello = 273, kSpWorld = 278;

// Llama 2's shape: Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer, byte fallback,
// fuse_unk, the Replace / ByteFallback / Fuse / Strip decoder and a <s> template.
json llama2_shape() {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  static const char kHex[] = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) vocab[std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">"] = kByte0 + b;
  const char* chars[] = {"▁", "h", "e", "l", "o", "w", "r", "d", "i", "é"};
  for (int i = 0; i < 10; ++i) vocab[chars[i]] = 259 + i;
  const char* merged[] = {"▁h", "el", "▁hel", "lo", "▁hello", "▁w", "or", "▁wor", "ld", "▁world"};
  for (int i = 0; i < 10; ++i) vocab[merged[i]] = 269 + i;
  const json merges = {"▁ h", "e l", "▁h el", "l o", "▁hel lo", "▁ w", "o r", "▁w or", "l d", "▁wor ld"};
  json added = json::array();
  for (int id = 0; id < 3; ++id)
    added.push_back({{"id", id}, {"content", id == 0 ? "<unk>" : id == 1 ? "<s>" : "</s>"}, {"single_word", false},
                     {"lstrip", false}, {"rstrip", false}, {"normalized", false}, {"special", true}});
  return {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer",
       {{"type", "Sequence"},
        {"normalizers",
         {{{"type", "Prepend"}, {"prepend", "▁"}},
          {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "▁"}}}}}},
      {"pre_tokenizer", nullptr},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         {{{"type", "Replace"}, {"pattern", {{"String", "▁"}}}, {"content", " "}},
          {{"type", "ByteFallback"}},
          {{"type", "Fuse"}},
          {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", "<unk>"}, {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr}, {"fuse_unk", true}, {"byte_fallback", true}, {"ignore_merges", false},
        {"vocab", vocab}, {"merges", merges}}}};
}

json edited(const std::function<void(json&)>& f) {
  json j = llama2_shape();
  f(j);
  return j;
}

json metaspace(const std::string& scheme, bool split) {
  return {{"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", scheme}, {"split", split}};
}

std::vector<std::string> pieces(const PreTokenizer& pre, std::string_view text, bool at_start = true) {
  std::vector<std::string_view> out;
  std::deque<std::string> arena;
  pre.split(text, &out, &arena, at_start);
  return {out.begin(), out.end()};
}

using Ids = std::vector<int32_t>;

TEST(TokenizerSentencePiece, EncodesWithPrependReplaceAndTemplate) {
  const auto tok = Tokenizer::from_json(llama2_shape(), "t.json");
  EXPECT_EQ(tok.encode("hello"), (Ids{1, kSpHello}));
  EXPECT_EQ(tok.encode("hello world", false), (Ids{kSpHello, kSpWorld}));
  // Prepend always adds one "▁": a leading space becomes a second one.
  EXPECT_EQ(tok.encode(" hello", false), (Ids{kSpace, kSpHello}));
  // Each piece between special tokens is normalized on its own, so it gets a "▁" too.
  EXPECT_EQ(tok.encode("hello<s>hello", false), (Ids{kSpHello, 1, kSpHello}));
  EXPECT_EQ(tok.encode("hé", false), (Ids{kSpH, kEAcute}));
  EXPECT_EQ(tok.encode("", true), (Ids{1}));
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_TRUE(tok.add_bos());
}

TEST(TokenizerSentencePiece, ByteFallbackAndUnk) {
  const auto tok = Tokenizer::from_json(llama2_shape(), "t.json");
  // "ñ" (C3 B1) and "€" (E2 82 AC) are not in the vocabulary: their UTF-8 bytes as <0xNN>.
  EXPECT_EQ(tok.encode("hñ", false), (Ids{kSpH, kByte0 + 0xC3, kByte0 + 0xB1}));
  EXPECT_EQ(tok.encode("€", false), (Ids{kSpace, kByte0 + 0xE2, kByte0 + 0x82, kByte0 + 0xAC}));
  // Without byte fallback: unk, consecutive unknown chars fused into one with fuse_unk.
  const auto unk = Tokenizer::from_json(edited([](json& j) { j["model"]["byte_fallback"] = false; }), "t.json");
  EXPECT_EQ(unk.encode("hññe", false), (Ids{kSpH, 0, kE}));
  const auto no_fuse = Tokenizer::from_json(edited([](json& j) {
                                              j["model"]["byte_fallback"] = false;
                                              j["model"]["fuse_unk"] = false;
                                            }),
                                            "t.json");
  EXPECT_EQ(no_fuse.encode("hññe", false), (Ids{kSpH, 0, 0, kE}));
  // Without unk either, an unknown char is dropped (as Hugging Face does).
  const auto drop = Tokenizer::from_json(edited([](json& j) {
                                           j["model"]["byte_fallback"] = false;
                                           j["model"]["unk_token"] = nullptr;
                                         }),
                                         "t.json");
  EXPECT_EQ(drop.encode("hñe", false), (Ids{kSpH, kE}));
}

TEST(TokenizerSentencePiece, DecodesLikeTheDecoderChain) {
  const auto tok = Tokenizer::from_json(llama2_shape(), "t.json");
  for (const std::string text : {"hello world", "  hello", "hñ€é", "<s>", "a\tb\n"}) {
    EXPECT_EQ(tok.decode(tok.encode(text, false)), text) << text;
  }
  // Strip takes one leading space off the whole text, after Fuse.
  EXPECT_EQ(tok.decode({kSpHello, kSpWorld}), "hello world");
  EXPECT_EQ(tok.decode({kSpace, kSpace, kSpHello}), "  hello");  // one of three spaces
  EXPECT_EQ(tok.decode({1, kSpHello}), "<s> hello");
  EXPECT_EQ(tok.decode({1, kSpHello}, true), "hello");
  // A run of byte tokens that is not UTF-8 becomes one U+FFFD per token (ByteFallback's
  // rule, not one per maximal subpart).
  EXPECT_EQ(tok.decode({kByte0 + 0xC3, kByte0 + 0xB1}), "ñ");
  EXPECT_EQ(tok.decode({kByte0 + 0xE4, kByte0 + 0xBD, kH}), "\uFFFD\uFFFDh");
  EXPECT_EQ(tok.decode({kByte0 + 0xC3, kByte0 + 0xB1, kEl, kByte0 + 0xC3}), "ñel\uFFFD");
}

TEST(TokenizerSentencePiece, StreamingKeepsSpacesAndHoldsPartialCharacters) {
  const auto tok = Tokenizer::from_json(llama2_shape(), "t.json");
  EXPECT_EQ(tok.decode_token(kSpHello), " hello");  // never stripped: streamed tokens follow a prompt
  EXPECT_EQ(tok.decode_token(kByte0 + 0xC3), "\xC3");
  EXPECT_EQ(tok.decode_token(1), "<s>");
  // The engine's loop: each token's bytes, a cut character held back until it is whole.
  const Ids ids = tok.encode("hello ñ€ world", false);
  std::string pending, streamed;
  for (int32_t id : ids) {
    pending += tok.decode_token(id);
    const size_t n = complete_utf8_prefix(pending);
    if (id == kByte0 + 0xC3) { EXPECT_EQ(n, pending.size() - 1); }  // the lead byte waits
    streamed += pending.substr(0, n);
    pending.erase(0, n);
  }
  EXPECT_EQ(pending, "");
  EXPECT_EQ(streamed, " hello ñ€ world");
  EXPECT_EQ(streamed.substr(1), tok.decode(ids));
}

TEST(TokenizerSentencePiece, MetaspacePrependSchemes) {
  auto with = [](const std::string& scheme, bool split) {
    return Tokenizer::from_json(edited([&](json& j) {
                                  j["normalizer"] = nullptr;
                                  j["pre_tokenizer"] = metaspace(scheme, split);
                                }),
                                "t.json");
  };
  // "always": every piece gets a "▁" unless it starts with one; "first": only the piece that
  // starts the input; "never": none.
  EXPECT_EQ(with("always", true).encode("hello<s>hello", false), (Ids{kSpHello, 1, kSpHello}));
  EXPECT_EQ(with("first", true).encode("hello<s>hello", false), (Ids{kSpHello, 1, kH, kEl, kLo}));
  EXPECT_EQ(with("first", false).encode("<s>hello", false), (Ids{1, kH, kEl, kLo}));
  EXPECT_EQ(with("never", true).encode("hello", false), (Ids{kH, kEl, kLo}));
  EXPECT_EQ(with("always", true).encode(" hello", false), (Ids{kSpHello}));  // the space is the "▁"

  const auto pre = [](const std::string& scheme, bool split) {
    return PreTokenizer::from_json(metaspace(scheme, split), "pre", false);
  };
  using P = std::vector<std::string>;
  EXPECT_EQ(pieces(pre("always", true), "hey  you "), (P{"▁hey", "▁", "▁you", "▁"}));
  EXPECT_EQ(pieces(pre("always", false), "hey  you "), (P{"▁hey▁▁you▁"}));
  EXPECT_EQ(pieces(pre("first", true), "hey you", false), (P{"hey", "▁you"}));
  EXPECT_EQ(pieces(pre("never", true), "▁hey"), (P{"▁hey"}));
  // Old files: add_prefix_space false means never.
  const json old = {{"type", "Metaspace"}, {"replacement", "▁"}, {"add_prefix_space", false}};
  EXPECT_EQ(pieces(PreTokenizer::from_json(old, "pre", false), "hey"), (P{"hey"}));
}

TEST(TokenizerSentencePiece, MetaspaceDecoderDropsTheFirstTokensMarks) {
  const auto tok = Tokenizer::from_json(edited([](json& j) {
                                          j["normalizer"] = nullptr;
                                          j["pre_tokenizer"] = metaspace("always", true);
                                          j["decoder"] = {{"type", "Sequence"},
                                                          {"decoders", {{{"type", "ByteFallback"}}, metaspace("always", true)}}};
                                        }),
                                        "t.json");
  EXPECT_EQ(tok.decode({kSpHello, kSpWorld}), "hello world");
  EXPECT_EQ(tok.decode({kSpace, kSpHello}), " hello");  // the first token's "▁" only
  EXPECT_EQ(tok.decode({kByte0 + 0xC3, kByte0 + 0xB1, kSpHello}), "ñ hello");
  EXPECT_EQ(tok.decode_token(kSpHello), " hello");
  const auto never = Tokenizer::from_json(edited([](json& j) { j["decoder"] = metaspace("never", true); }), "t.json");
  EXPECT_EQ(never.decode({kSpHello, kSpWorld}), " hello world");
}

TEST(TokenizerSentencePiece, StripDecoderCounts) {
  auto strip = [](int start, int stop) {
    return Tokenizer::from_json(edited([&](json& j) {
                                  j["decoder"] = {{"type", "Sequence"},
                                                  {"decoders",
                                                   {{{"type", "Replace"}, {"pattern", {{"String", "▁"}}}, {"content", " "}},
                                                    {{"type", "Fuse"}},
                                                    {{"type", "Strip"}, {"content", " "}, {"start", start}, {"stop", stop}}}}};
                                }),
                                "t.json");
  };
  const Ids ids = {kSpace, kSpace, kSpHello, kSpace};  // "   hello "
  EXPECT_EQ(strip(0, 0).decode(ids), "   hello ");
  EXPECT_EQ(strip(2, 0).decode(ids), " hello ");
  EXPECT_EQ(strip(5, 1).decode(ids), "hello");
  EXPECT_EQ(strip(2, 0).decode_token(kSpace), " ");  // after Fuse, Strip touches only the ends
}

TEST(TokenizerSentencePiece, SplitBehaviors) {
  const SplitRegex space(" ", true, "p");
  auto run = [&](SplitBehavior b, bool invert) {
    std::vector<std::string_view> out;
    space.split("a b  c", b, invert, &out);
    return std::vector<std::string>(out.begin(), out.end());
  };
  using P = std::vector<std::string>;
  EXPECT_EQ(run(SplitBehavior::kIsolated, false), (P{"a", " ", "b", " ", " ", "c"}));
  EXPECT_EQ(run(SplitBehavior::kRemoved, false), (P{"a", "b", "c"}));
  EXPECT_EQ(run(SplitBehavior::kRemoved, true), (P{" ", " ", " "}));  // GPT-4o's: keep the matches
  EXPECT_EQ(run(SplitBehavior::kMergedWithPrevious, false), (P{"a ", "b ", " ", "c"}));
  EXPECT_EQ(run(SplitBehavior::kMergedWithNext, false), (P{"a", " b", " ", " c"}));
  EXPECT_EQ(run(SplitBehavior::kContiguous, false), (P{"a", " ", "b", "  ", "c"}));
  EXPECT_EQ(run(SplitBehavior::kMergedWithPrevious, true), (P{"a", " b", " ", " c"}));
}

TEST(TokenizerSentencePiece, SaveLoadRoundTrip) {
  TempDir dir;
  const auto tok = Tokenizer::from_json(llama2_shape(), "t.json", {{"add_bos_token", true}, {"bos_token", "<s>"},
                                                                   {"eos_token", "</s>"}});
  tok.save(dir.file("tok"));
  const auto back = Tokenizer::load(dir.file("tok"));
  EXPECT_EQ(back.to_json(), tok.to_json());
  for (const std::string text : {"hello world", " hñ€ <s>hé", ""}) {
    EXPECT_EQ(back.encode(text), tok.encode(text)) << text;
    EXPECT_EQ(back.decode(back.encode(text), true), tok.decode(tok.encode(text), true)) << text;
  }
  EXPECT_EQ(back.encode("hello"), (Ids{1, kSpHello}));  // add_bos_token does not add a second <s>
  EXPECT_EQ(back.eos_id(), 2);
}

TEST(TokenizerSentencePiece, UnsupportedPartsAreOneLineErrors) {
  auto load = [](const std::function<void(json&)>& f) { Tokenizer::from_json(edited(f), "t.json"); };
  EXPECT_ERROR(load([](json& j) { j["model"]["type"] = "Unigram"; }), "t.json: model.type is 'Unigram'");
  EXPECT_ERROR(load([](json& j) { j["normalizer"] = {{"type", "Precompiled"}}; }),
               "t.json: normalizer.type: unsupported normalizer 'Precompiled'");
  EXPECT_ERROR(load([](json& j) { j["normalizer"]["normalizers"][1]["pattern"] = {{"Regex", "\\s+"}}; }),
               "t.json: normalizer.normalizers[1].pattern: a Regex pattern");
  EXPECT_ERROR(load([](json& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; }),
               "t.json: pre_tokenizer.type: unsupported pre-tokenizer 'Whitespace'");
  EXPECT_ERROR(load([](json& j) { j["pre_tokenizer"] = {{"type", "ByteLevel"}}; }),
               "ByteLevel needs a ByteLevel decoder");
  EXPECT_ERROR(load([](json& j) { j["pre_tokenizer"] = metaspace("sometimes", true); }),
               "pre_tokenizer.prepend_scheme: 'sometimes' is not one of always, first, never");
  EXPECT_ERROR(load([](json& j) {
                 j["pre_tokenizer"] = metaspace("always", true);
                 j["pre_tokenizer"]["add_prefix_space"] = false;
               }),
               "add_prefix_space: false does not match prepend_scheme 'always'");
  EXPECT_ERROR(load([](json& j) { j["decoder"] = {{"type", "WordPiece"}}; }),
               "t.json: decoder.type: unsupported decoder 'WordPiece'");
  EXPECT_ERROR(load([](json& j) { j["decoder"]["decoders"][1] = {{"type", "ByteLevel"}}; }),
               "t.json: decoder.decoders[1].type: unsupported decoder 'ByteLevel'");
  EXPECT_ERROR(load([](json& j) { j["decoder"]["decoders"][3]["start"] = "one"; }),
               "decoder.decoders[3].start: expected a non-negative integer");
  EXPECT_ERROR(load([](json& j) { j["model"]["merges"][0] = {"▁", "x"}; }), "model.merges[0]: 'x' is not in model.vocab");
  // Byte-level BPE still refuses byte_fallback (its decoder is ByteLevel).
  EXPECT_ERROR(load([](json& j) { j["decoder"] = {{"type", "ByteLevel"}}; }), "byte_fallback is true");
}

}  // namespace
}  // namespace tessera::io
