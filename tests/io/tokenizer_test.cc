// Byte-level BPE parity: Tessera's tokenizer against the independent Python reference
// (tests/parity/tokenizer_reference.py) in the GPT-2, Llama 3, Qwen2 and RoBERTa shapes,
// on tricky strings and on a >= 100 kB mixed-script text; decode, round trips, BOS / EOS.
#include "tessera/io/tokenizer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <thread>

#include "io_test_util.h"
#include "tessera/base/error.h"
#include "tessera/io/json_file.h"
#include "tokenizer_test_util.h"

namespace tessera::io {
namespace {

using testing::read_bytes;
using namespace std::string_literals;

const char* const kStyles[] = {"gpt2", "llama3", "qwen2", "roberta", "trained"};

std::vector<std::string> tricky_strings() {
  std::vector<std::string> s = {
      "",
      "Hello, world!",
      "don't I'LL we've THEY'RE it's 'S 'sup O'Neil rock'n'roll 's'S'll'LL",
      "1234567 3.14159 1,000,000 2026-11-30 0x1F 12345678901234567890 ١٢٣ ٣٤٥ ⅫⅦ ²³",
      "   \n\n  x",
      "                                   leading and trailing                      ",
      std::string(300, ' ') + "x" + std::string(120, '\n') + "y" + std::string(70, '\t'),
      "\t\t\ttabs\tand\r\nCRLF\r\n\r\n  \n \n",
      "你好，世界！这是一个测试。机器学习模型需要大量的数据来训练。",
      "東京は日本の首都です。ひらがなとカタカナと漢字",
      "안녕하세요 세계, 한국어 문장도 토큰화해야 합니다!",
      "Привет, мир! Съешь же ещё этих мягких французских булок. Ёжик",
      "مرحبا بالعالم. اللغة العربية جميلة جداً",
      "हिन्दी में लिखा गया वाक्य। ไทย: สวัสดีครับ עברית",
      "😀👍🏽👨‍👩‍👧‍👦🇯🇵🇩🇪❤️🏳️‍🌈 emoji 🤖🤖🤖 1️⃣",
      "e\u0301 cafe\u0301 caf\u00e9 n\u0303 A\u030a o\u0302\u0323",
      "Z\u0351\u0352a\u0353l\u0354g\u0355o\u0356 stacked marks",
      "nbsp\u00a0ideo\u3000nel\u0085ls\u2028mvs\u180ex en\u2002quad \u00a0\u00a0 lead",
      "zero\u200bwidth\u200djoin\ufeffbom \u200e\u200f",
      "nul \0 and \x01\x02\x7f controls \x1b[31m"s,
      "<|endoftext|>",
      "text<|endoftext|>more<|endoftext|><|endoftext|>",
      "<|begin_of_text|>Hi there<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi",
      "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
      "almost special <|endof <|im_start <|begin_of_text",
      "<s> a <mask> b </s> x   <mask>y <mask><mask>",
      "def f(x):\n    return x ** 2  # square\n\n\tif (a && b) { return -1; }\n",
      "Tessera こんにちは 123 Привет\n\n Tessera",
      std::string(500, 'a'),
      "∑∫√∞≠≤≥ €£¥₹ ←→↑↓ ┌─┐│└┘ ½ ™ ©",
      "Zürich Straße naïve café résumé Ångström ﬁ ﬂ ＡＢＣ１２３",
      "jamo \u1100\u1161\u11a8 unassigned \u0378\U000E0080 private \ue000 \U0010FFFD Å Ω",
  };
  std::string cjk;
  for (int i = 0; i < 40; ++i) cjk += "数据训练模型";
  s.push_back(cjk);
  std::string emoji;
  for (int i = 0; i < 30; ++i) emoji += "🤖👍🏽";
  s.push_back(emoji);
  return s;
}

// One setup for the suite: the mixed text, a trained vocabulary, the four hub shapes and
// the reference's answers (Python starts twice). ctest runs each test in its own process,
// so the files are kept in the build tree, keyed by this binary and the script, and made
// once; a concurrent process builds its own copy and the first rename wins.
class TokenizerParity : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    namespace fs = std::filesystem;
    const std::string script = read_bytes(std::string(TESSERA_SOURCE_DIR) + "/tests/parity/tokenizer_reference.py");
    const fs::path exe = fs::read_symlink("/proc/self/exe");
    const size_t key = std::hash<std::string>{}(
        script + std::to_string(fs::file_size(exe)) +
        std::to_string(fs::last_write_time(exe).time_since_epoch().count()));
    const fs::path root = fs::path(TESSERA_PARITY_DIR) / "tokenizer";
    const std::string final_dir = (root / std::to_string(key)).string();
    if (!fs::exists(final_dir + "/result.json")) {
      fs::create_directories(root);
      const std::string tmp = final_dir + ".tmp-" + std::to_string(::getpid());
      fs::remove_all(tmp);
      fs::create_directories(tmp);
      make_references(tmp);
      std::error_code ec;
      fs::rename(tmp, final_dir, ec);
      if (ec) fs::remove_all(tmp, ec);  // another process made it first
      for (const auto& e : fs::directory_iterator(root, ec))  // references of older builds
        if (e.path().string() != final_dir && e.path().string().find(".tmp-") == std::string::npos)
          fs::remove_all(e.path(), ec);
    }
    dir_ = new std::string(final_dir);
    out_dir_ = new std::string(testing::make_suite_dir("tokenizer_parity"));
    result_ = new nlohmann::json(read_json_file(final_dir + "/result.json"));
    mixed_ = new std::string(read_bytes(final_dir + "/mixed.txt"));
  }
  static void make_references(const std::string& d) {
    testing::run_reference("mixed-text " + d + "/mixed.txt --bytes 120000");
    BpeTrainOptions o;
    o.vocab_size = 2500;
    o.progress = false;
    train_bpe({d + "/mixed.txt"}, o).save(d + "/trained");
    testing::run_reference("styles " + d + "/trained/tokenizer.json " + d + "/styles");

    nlohmann::json req;
    req["texts"] = tricky_strings();
    req["files"] = {d + "/mixed.txt"};
    std::mt19937 rng(7);
    for (const char* style : kStyles) {
      const std::string path = style == std::string("trained") ? d + "/trained" : d + "/styles/" + style;
      req["tokenizers"][style] = path + "/tokenizer.json";
      const auto tok = Tokenizer::load(path);
      // Random ids split multi-byte characters: the lossy UTF-8 decode is compared too.
      nlohmann::json lists = nlohmann::json::array();
      for (int n : {1, 2, 5, 17, 64}) {
        std::vector<int32_t> ids;
        for (int i = 0; i < n; ++i) ids.push_back(static_cast<int32_t>(rng() % tok.vocab_size()));
        lists.push_back(ids);
      }
      lists.push_back(tok.encode(tricky_strings()[22]));
      req["decode"][style] = lists;
    }
    write_file_atomic(d + "/request.json", req.dump());
    testing::run_reference("encode " + d + "/request.json " + d + "/result.json");
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(*out_dir_, ec);
    delete dir_;
    delete out_dir_;
    delete result_;
    delete mixed_;
  }
  static std::string style_path(const std::string& style) {
    return style == "trained" ? *dir_ + "/trained" : *dir_ + "/styles/" + style;
  }
  static std::vector<int32_t> ref_ids(const std::string& style, const char* key, size_t i) {
    return (*result_)[style][key][i].get<std::vector<int32_t>>();
  }

  static std::string* dir_;      // the references (shared, read-only)
  static std::string* out_dir_;  // this process's scratch space
  static nlohmann::json* result_;
  static std::string* mixed_;
};
std::string* TokenizerParity::dir_ = nullptr;
std::string* TokenizerParity::out_dir_ = nullptr;
nlohmann::json* TokenizerParity::result_ = nullptr;
std::string* TokenizerParity::mixed_ = nullptr;

// Index of the first difference, for a readable failure on long id lists.
std::string first_difference(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  if (i == a.size() && i == b.size()) return "equal";
  return "first difference at token " + std::to_string(i) + " of " + std::to_string(a.size()) + " vs " +
         std::to_string(b.size());
}

TEST_F(TokenizerParity, TrickyStringsMatchReference) {
  const auto texts = tricky_strings();
  for (const char* style : kStyles) {
    const auto tok = Tokenizer::load(style_path(style));
    for (size_t i = 0; i < texts.size(); ++i) {
      const auto got = tok.encode(texts[i]);
      const auto want = ref_ids(style, "ids", i);
      EXPECT_EQ(got, want) << style << " text " << i << " '" << texts[i] << "': " << first_difference(got, want);
      EXPECT_EQ(tok.encode(texts[i], false), ref_ids(style, "ids_no_special", i)) << style << " text " << i;
    }
  }
}

TEST_F(TokenizerParity, MixedScriptTextOver100kBMatchesReference) {
  ASSERT_GE(mixed_->size(), 100000u);
  const size_t index = tricky_strings().size();  // the file comes after the texts
  for (const char* style : kStyles) {
    const auto tok = Tokenizer::load(style_path(style));
    const auto got = tok.encode(*mixed_);
    const auto want = ref_ids(style, "ids", index);
    EXPECT_GT(want.size(), 10000u) << style;
    EXPECT_EQ(got, want) << style << ": " << first_difference(got, want);
  }
}

TEST_F(TokenizerParity, DecodeMatchesReference) {
  const auto request = read_json_file(*dir_ + "/request.json");
  for (const char* style : kStyles) {
    const auto tok = Tokenizer::load(style_path(style));
    const auto& lists = request["decode"][style];
    const auto& r = (*result_)[style];
    ASSERT_EQ(r["decoded"].size(), lists.size());
    for (size_t i = 0; i < lists.size(); ++i) {
      const auto ids = lists[i].get<std::vector<int32_t>>();
      EXPECT_EQ(tok.decode(ids), r["decoded"][i].get<std::string>()) << style << " list " << i;
      EXPECT_EQ(tok.decode(ids, true), r["decoded_skip_special"][i].get<std::string>()) << style << " list " << i;
    }
  }
}

TEST_F(TokenizerParity, DecodeOfEncodeIsTheText) {
  // Qwen2's NFC changes decomposed text and RoBERTa's prefix space adds a byte, so the
  // identity holds for the styles without them.
  auto texts = tricky_strings();
  texts.push_back(*mixed_);
  for (const char* style : {"gpt2", "llama3", "trained"}) {
    const auto tok = Tokenizer::load(style_path(style));
    for (size_t i = 0; i < texts.size(); ++i) {
      const auto ids = tok.encode(texts[i], false);
      EXPECT_EQ(tok.decode(ids), texts[i]) << style << " text " << i;
      std::string streamed;
      for (int32_t id : ids) streamed += tok.decode_token(id);
      EXPECT_EQ(streamed, texts[i]) << style << " text " << i;
    }
  }
}

TEST_F(TokenizerParity, BosEosAndTemplates) {
  for (const char* style : kStyles) {
    const auto tok = Tokenizer::load(style_path(style));
    const auto& r = (*result_)[style];
    EXPECT_EQ(tok.bos_id(), r["bos"].is_null() ? -1 : r["bos"].get<int32_t>()) << style;
    EXPECT_EQ(tok.eos_id(), r["eos"].is_null() ? -1 : r["eos"].get<int32_t>()) << style;
  }
  const auto llama = Tokenizer::load(style_path("llama3"));
  EXPECT_TRUE(llama.add_bos());
  EXPECT_EQ(llama.bos_id(), llama.token_to_id("<|begin_of_text|>"));
  EXPECT_EQ(llama.eos_id(), llama.token_to_id("<|end_of_text|>"));
  EXPECT_EQ(llama.encode("hi").front(), llama.bos_id());
  EXPECT_EQ(llama.encode("").size(), 1u);
  EXPECT_TRUE(llama.encode("", false).empty());
  EXPECT_TRUE(llama.is_special(llama.token_to_id("<|eot_id|>")));
  EXPECT_EQ(llama.decode(llama.encode("<|eot_id|>hi"), true), "hi");

  // ignore_merges: a pre-token that is itself in the vocabulary is one token, even with
  // no merge path to it (the GPT-2 style, same merges, has no such token).
  EXPECT_EQ(llama.encode(" Tessera", false).size(), 1u);
  EXPECT_GT(Tokenizer::load(style_path("gpt2")).encode(" Tessera", false).size(), 1u);

  // NFC before the model: decomposed and composed text encode alike, and the normalized
  // added token "café" is found in both.
  const auto qwen = Tokenizer::load(style_path("qwen2"));
  EXPECT_EQ(qwen.encode("cafe\u0301 e\u0301"), qwen.encode("caf\u00e9 \u00e9"));
  EXPECT_EQ(qwen.encode("cafe\u0301").at(0), qwen.token_to_id("café"));
  EXPECT_FALSE(qwen.is_special(qwen.token_to_id("café")));

  const auto gpt2 = Tokenizer::load(style_path("gpt2"));
  EXPECT_FALSE(gpt2.add_bos());
  EXPECT_EQ(gpt2.bos_id(), -1);
  EXPECT_EQ(gpt2.eos_id(), gpt2.token_to_id("<|endoftext|>"));
  EXPECT_EQ(gpt2.eos_id(), gpt2.vocab_size() - 1);

  const auto roberta = Tokenizer::load(style_path("roberta"));
  const auto ids = roberta.encode("x");
  EXPECT_EQ(ids.front(), roberta.token_to_id("<s>"));
  EXPECT_EQ(ids.back(), roberta.token_to_id("</s>"));

  const auto trained = Tokenizer::load(style_path("trained"));
  EXPECT_FALSE(trained.add_bos());
  EXPECT_EQ(trained.eos_id(), trained.token_to_id("<|endoftext|>"));
  EXPECT_EQ(trained.vocab_size(), 2500);
  EXPECT_EQ(trained.eos_id(), 2499);  // specials after the merges
  EXPECT_EQ(trained.token_to_id("Ġ"), trained.encode(" ", false).at(0));
  EXPECT_EQ(trained.token_to_id("no such token"), -1);
}

TEST_F(TokenizerParity, SaveAndLoadKeepsEncoding) {
  for (const char* style : kStyles) {
    const auto tok = Tokenizer::load(style_path(style));
    const std::string out = *out_dir_ + "/resaved_" + style;
    tok.save(out);
    const auto again = Tokenizer::load(out + "/tokenizer.json");
    EXPECT_EQ(again.encode(*mixed_), tok.encode(*mixed_)) << style;
    EXPECT_EQ(again.bos_id(), tok.bos_id()) << style;
    EXPECT_EQ(again.eos_id(), tok.eos_id()) << style;
    EXPECT_EQ(again.to_json(), tok.to_json()) << style;
  }
}

TEST_F(TokenizerParity, ConcurrentEncodesAgree) {
  const auto tok = Tokenizer::load(style_path("llama3"));
  const auto want = ref_ids("llama3", "ids", tricky_strings().size());
  std::vector<std::vector<int32_t>> got(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back([&, t] { got[t] = tok.encode(*mixed_); });
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(got[t], want) << "thread " << t;
}

// The per-thread pre-token cache is bounded (a server gives each HTTP thread a small share):
// with no cache, a cache that starts over every few hundred pre-tokens, and the default, the
// 100 kB text still encodes to the reference's ids.
TEST_F(TokenizerParity, SmallPreTokenCachesGiveTheSameIds) {
  const size_t index = tricky_strings().size();
  for (const char* style : {"llama3", "gpt2"}) {
    const auto tok = Tokenizer::load(style_path(style));
    const auto want = ref_ids(style, "ids", index);
    for (int64_t budget : {int64_t{0}, int64_t{8} << 10, int64_t{20} << 10, int64_t{32} << 20}) {
      tok.set_piece_cache_bytes(budget);
      const auto got = tok.encode(*mixed_);
      EXPECT_EQ(got, want) << style << " with a " << budget << "-byte cache: " << first_difference(got, want);
    }
  }
  EXPECT_THROW(Tokenizer::load(style_path("llama3")).set_piece_cache_bytes(-1), Error);
}

}  // namespace
}  // namespace tessera::io
