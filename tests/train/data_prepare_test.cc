// `tessera data prepare`, as a library call and as a command: the shards hold exactly the
// tokenizer's encoding of each file plus EOS; bad input is one error line and keeps the output.
#include <gtest/gtest.h>

#include "test_util/run_command.h"
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string_view>

#include <nlohmann/json.hpp>

#include "../io/io_test_util.h"
#include "data_test_util.h"
#include "tessera/io/tokenizer.h"
#include "tessera/train/data_loader.h"
#include "tessera/train/data_prepare.h"
#include "tessera/train/token_shard.h"

namespace tessera::train {
namespace {

using io::testing::read_bytes;
using io::testing::TempDir;
using io::testing::write_bytes;
using testing::expect_error;

// Text with the cases piecewise encoding must get right: paragraphs, runs of blank lines and
// spaces, tabs, punctuation at line ends, contractions, digits, non-ASCII letters, and a
// special token written inside the text.
std::string sample_corpus(int seed, int lines) {
  const char* words[] = {"the", "quick", "brown", "fox's", "jumps", "over", "lazy", "dogs",
                         "café", "naïve", "東京", "42", "3.14", "don't", "it'll", "(note)"};
  const char* ends[] = {".\n", "\n", "!\n\n", "\n\n\n", " \n", ":\n\t", "\n  ", "?\n"};
  std::mt19937 rng(seed);
  std::string s;
  for (int l = 0; l < lines; ++l) {
    const int n = 2 + static_cast<int>(rng() % 8);
    for (int w = 0; w < n; ++w) {
      if (w) s += rng() % 7 == 0 ? "  " : " ";
      s += words[rng() % 16];
    }
    s += ends[rng() % 8];
    if (l % 17 == 16) s += "<|endoftext|>";
  }
  return s;
}

// A tokenizer trained once per test binary on the sample corpus (GPT-2 pattern, EOS).
struct TrainedTokenizer {
  std::string root;
  TrainedTokenizer() {
    root = (std::filesystem::temp_directory_path() /
            ("tessera_data_tok_" + std::to_string(::getpid()))).string();
    std::filesystem::create_directories(root);
    write_bytes(root + "/corpus.txt", sample_corpus(1, 400));
    io::BpeTrainOptions o;
    o.vocab_size = 300;
    o.progress = false;
    io::train_bpe({root + "/corpus.txt"}, o).save(root + "/tok");
  }
  ~TrainedTokenizer() {
    std::error_code ec;
    std::filesystem::remove_all(root, ec);
  }
};
const std::string& trained_tokenizer_dir() {
  static const TrainedTokenizer t;
  static const std::string dir = t.root + "/tok";
  return dir;
}

std::vector<int32_t> read_split(const std::string& dir, const std::string& split) {
  const TokenStream s(dir, split);
  std::vector<int32_t> v(static_cast<size_t>(s.size()));
  s.read(0, s.size(), v.data());
  return v;
}

TEST(DataPrepare, SafeCutsDoNotChangeTheTokens) {
  const auto tok = io::Tokenizer::load(trained_tokenizer_dir());
  const std::string text = sample_corpus(2, 60);
  const auto whole = tok.encode(text, false);
  int cuts = 0;
  for (size_t c = next_safe_cut(text, 0); c < text.size(); c = next_safe_cut(text, c + 1)) {
    ASSERT_EQ(text[c - 1], '\n');
    auto parts = tok.encode(std::string_view(text).substr(0, c), false);
    const auto rest = tok.encode(std::string_view(text).substr(c), false);
    parts.insert(parts.end(), rest.begin(), rest.end());
    ASSERT_EQ(parts, whole) << "cut at byte " << c;
    ++cuts;
  }
  EXPECT_GT(cuts, 5);
  EXPECT_EQ(next_safe_cut("ab\ncd", 0), 3u);
  EXPECT_EQ(next_safe_cut("ab\ncd", 4), 5u);  // none at or after 4
  EXPECT_EQ(next_safe_cut("a\n\nb", 0), 4u);  // a blank line is never cut
  EXPECT_EQ(next_safe_cut("a \nb", 0), 4u);   // nor a newline after a space
}

TEST(DataPrepare, WritesTheEncodedStreamSplitIntoTrainAndVal) {
  TempDir d;
  const auto tok = io::Tokenizer::load(trained_tokenizer_dir());
  const std::string a = sample_corpus(3, 120), b = sample_corpus(4, 50);
  write_bytes(d.file("a.txt"), a);
  write_bytes(d.file("b.txt"), b);
  // Reference: each file encoded whole (no pieces), EOS after each.
  const int32_t eos = tok.eos_id();
  ASSERT_GE(eos, 0);
  std::vector<int32_t> expected = tok.encode(a, false);
  expected.push_back(eos);
  const auto eb = tok.encode(b, false);
  expected.insert(expected.end(), eb.begin(), eb.end());
  expected.push_back(eos);
  // The "<|endoftext|>" written in the text is the special token, not its characters.
  EXPECT_GT(std::count(expected.begin(), expected.end(), eos), 2);

  PrepareOptions o;
  o.tokenizer_dir = trained_tokenizer_dir();
  o.inputs = {d.file("a.txt"), d.file("b.txt")};
  o.out_dir = d.file("out");
  o.val_fraction = 0.1;
  o.shard_tokens = 200;
  o.chunk_bytes = 64;  // many pieces
  o.progress = false;
  const auto r = prepare_data(o);
  const int64_t total = static_cast<int64_t>(expected.size());
  EXPECT_EQ(r.val_tokens, total / 10);  // floor(total * 0.1)
  EXPECT_EQ(r.train_tokens, total - total / 10);
  EXPECT_EQ(r.vocab_size, 300);

  auto got = read_split(o.out_dir, "train");
  const auto val = read_split(o.out_dir, "val");
  EXPECT_EQ(static_cast<int64_t>(val.size()), r.val_tokens);
  got.insert(got.end(), val.begin(), val.end());
  EXPECT_EQ(got, expected);

  const DataMeta m = read_data_meta(o.out_dir);
  EXPECT_EQ(m.vocab_size, 300);
  EXPECT_EQ(m.eos_id, eos);
  EXPECT_EQ(m.token_bytes, 2);
  EXPECT_EQ(static_cast<int64_t>(m.train_shards.size()), (r.train_tokens + 199) / 200);
  EXPECT_EQ(m.train_shards[0], "train_00000.bin");
  EXPECT_EQ(m.inputs, o.inputs);
  EXPECT_EQ(m.tokenizer, o.tokenizer_dir);
  // Nothing but the output is left in the parent directory.
  int entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(d.path()))
    entries += e.path().filename().string().rfind("out", 0) == 0;
  EXPECT_EQ(entries, 1) << "leftover temporary directory";

  DataLoader dl(o.out_dir, "train", 16, 0);
  EXPECT_EQ(dl.windows_per_epoch(), (r.train_tokens - 1) / 16);
  expect_error([&] { DataLoader(o.out_dir, "val", r.val_tokens, 0); },
               {"\"val\"", "corpus of " + std::to_string(r.val_tokens) + " tokens"});
}

TEST(DataPrepare, BadInputIsAnErrorAndKeepsTheExistingOutput) {
  TempDir d;
  write_bytes(d.file("good.txt"), sample_corpus(5, 40));
  write_bytes(d.file("empty.txt"), "");
  write_bytes(d.file("latin1.txt"), std::string("caf\xe9 au lait\n"));
  PrepareOptions o;
  o.tokenizer_dir = trained_tokenizer_dir();
  o.out_dir = d.file("out");
  o.progress = false;

  o.inputs = {d.file("good.txt"), d.file("missing.txt")};
  expect_error([&] { prepare_data(o); }, {d.file("missing.txt")});
  EXPECT_FALSE(std::filesystem::exists(o.out_dir));

  o.inputs = {d.file("good.txt")};
  prepare_data(o);
  const std::string meta = read_bytes(d.file("out/meta.json"));
  const std::string shard = read_bytes(d.file("out/train_00000.bin"));

  o.inputs = {d.file("good.txt"), d.file("empty.txt")};
  expect_error([&] { prepare_data(o); }, {d.file("empty.txt"), "empty"});
  o.inputs = {d.file("latin1.txt")};
  expect_error([&] { prepare_data(o); }, {d.file("latin1.txt"), "UTF-8", "0xE9", "offset 3"});
  o.inputs = {};
  expect_error([&] { prepare_data(o); }, {"--input"});
  o.inputs = {d.file("good.txt")};
  o.val_fraction = 1.0;
  expect_error([&] { prepare_data(o); }, {"--val-fraction 1"});
  o.val_fraction = 0.01;
  o.tokenizer_dir = d.file("no_tokenizer");
  expect_error([&] { prepare_data(o); }, {"no_tokenizer"});
  // The earlier output is untouched by every failure above.
  EXPECT_EQ(read_bytes(d.file("out/meta.json")), meta);
  EXPECT_EQ(read_bytes(d.file("out/train_00000.bin")), shard);

  // A directory that is not ours is never replaced.
  std::filesystem::create_directories(d.file("mine"));
  write_bytes(d.file("mine/notes.txt"), "keep me");
  o.tokenizer_dir = trained_tokenizer_dir();
  o.out_dir = d.file("mine");
  expect_error([&] { prepare_data(o); }, {d.file("mine"), "not a Tessera data directory"});
  EXPECT_EQ(read_bytes(d.file("mine/notes.txt")), "keep me");

  // A successful run replaces the earlier output whole (its old shards are gone).
  write_bytes(d.file("small.txt"), "tiny corpus\n");
  o.out_dir = d.file("out");
  o.inputs = {d.file("small.txt")};
  o.shard_tokens = 1000;
  prepare_data(o);
  EXPECT_NE(read_bytes(d.file("out/meta.json")), meta);
  EXPECT_EQ(read_data_meta(o.out_dir).inputs, o.inputs);
}

using tessera::testing::run_cli;

TEST(DataPrepareCli, TrainsTokenizerThenPreparesShards) {
  TempDir d;
  write_bytes(d.file("corpus.txt"), sample_corpus(6, 300));
  auto r = run_cli("tokenizer train --input " + d.file("corpus.txt") +
                   " --vocab-size 300 --out " + d.file("tok") + " --quiet");
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_cli("data prepare --tokenizer " + d.file("tok") + " --input " + d.file("corpus.txt") +
              " --out " + d.file("data") + " --val-fraction 0.05 --quiet");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("wrote " + d.file("data")), std::string::npos) << r.out;
  const auto tok = io::Tokenizer::load(d.file("tok"));
  auto expected = tok.encode(read_bytes(d.file("corpus.txt")), false);
  expected.push_back(tok.eos_id());
  auto got = read_split(d.file("data"), "train");
  const auto val = read_split(d.file("data"), "val");
  EXPECT_EQ(static_cast<int64_t>(val.size()), static_cast<int64_t>(expected.size()) * 5 / 100);
  got.insert(got.end(), val.begin(), val.end());
  EXPECT_EQ(got, expected);

  r = run_cli("data prepare --help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("--val-fraction"), std::string::npos) << r.out;
}

TEST(DataPrepareCli, BadInputGivesOneLineAndKeepsOutput) {
  TempDir d;
  write_bytes(d.file("corpus.txt"), sample_corpus(7, 40));
  write_bytes(d.file("empty.txt"), "");
  const std::string base = "data prepare --quiet --tokenizer " + trained_tokenizer_dir() +
                           " --out " + d.file("data") + " --input ";
  auto r = run_cli(base + d.file("missing.txt"));
  EXPECT_NE(r.code, 0);
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  EXPECT_NE(r.out.find(d.file("missing.txt")), std::string::npos) << r.out;
  EXPECT_FALSE(std::filesystem::exists(d.file("data")));

  ASSERT_EQ(run_cli(base + d.file("corpus.txt")).code, 0);
  const std::string shard = read_bytes(d.file("data/train_00000.bin"));
  for (const std::string& bad : {d.file("empty.txt"), d.file("corpus.txt") + " --val-fraction -0.5",
                                 d.file("corpus.txt") + " --shard-tokens 0"}) {
    r = run_cli(base + bad);
    EXPECT_NE(r.code, 0) << bad;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
    EXPECT_NE(r.out.find("error"), std::string::npos) << r.out;
  }
  EXPECT_NE(run_cli(base + d.file("empty.txt")).out.find(d.file("empty.txt")), std::string::npos);
  EXPECT_EQ(read_bytes(d.file("data/train_00000.bin")), shard);
}

}  // namespace
}  // namespace tessera::train

namespace tessera::train {
namespace {

// Documents from JSON-lines files and from text split at a separator; validation holds
// whole documents (within 10% of the asked fraction), train + val hold every document once,
// each followed by EOS; the draw is fixed by the seed; a large vocabulary for the corpus
// is a warning; a bad JSONL line is an error naming the file and line.
TEST(DataPrepare, DocumentsFromJsonlAndSeparatorsAndAValidationSplitOfWholeDocuments) {
  TempDir d;
  const auto tok = io::Tokenizer::load(trained_tokenizer_dir());
  const int32_t eos = tok.eos_id();
  std::vector<std::string> docs;
  std::string jsonl, sep_text;
  for (int i = 0; i < 60; ++i) {
    std::string doc = sample_corpus(100 + i, 3 + i % 5);
    // No "<|endoftext|>" inside: it is a special token and would split counts.
    for (size_t p; (p = doc.find("<|endoftext|>")) != std::string::npos;) doc.erase(p, 13);
    docs.push_back(doc);
    if (i < 30) jsonl += nlohmann::json({{"text", doc}, {"meta", i}}).dump() + "\n";
    else sep_text += doc + "@@@";
  }
  jsonl += "\n";  // blank lines are skipped
  write_bytes(d.file("a.jsonl"), jsonl);
  write_bytes(d.file("b.txt"), sep_text);
  std::vector<std::vector<int32_t>> encoded;
  int64_t total = 0;
  for (const auto& doc : docs) {
    auto e = tok.encode(doc, false);
    e.push_back(eos);
    total += static_cast<int64_t>(e.size());
    encoded.push_back(std::move(e));
  }
  PrepareOptions o;
  o.tokenizer_dir = trained_tokenizer_dir();
  o.inputs = {d.file("a.jsonl"), d.file("b.txt")};
  o.separator = "@@@";
  o.out_dir = d.file("out");
  o.val_fraction = 0.2;
  o.progress = false;
  const auto r = prepare_data(o);
  EXPECT_EQ(r.documents, 60);
  EXPECT_EQ(r.val_split, "documents");
  EXPECT_EQ(r.train_tokens + r.val_tokens, total);
  const int64_t target = total / 5;
  EXPECT_GE(r.val_tokens, target - target / 10);
  EXPECT_LE(r.val_tokens, target + target / 10);
  // Train and val are each a subsequence of whole documents, in order, covering all of them.
  const auto train = read_split(o.out_dir, "train"), val = read_split(o.out_dir, "val");
  size_t ti = 0, vi = 0;
  int64_t val_docs = 0;
  for (const auto& e : encoded) {
    if (ti + e.size() <= train.size() && std::equal(e.begin(), e.end(), train.begin() + ti)) {
      ti += e.size();
    } else {
      ASSERT_TRUE(vi + e.size() <= val.size() && std::equal(e.begin(), e.end(), val.begin() + vi));
      vi += e.size();
      ++val_docs;
    }
  }
  EXPECT_EQ(ti, train.size());
  EXPECT_EQ(vi, val.size());
  EXPECT_EQ(val_docs, r.val_documents);
  EXPECT_GT(val_docs, 1);
  // 300 vocabulary entries for a few thousand tokens: the warning.
  ASSERT_EQ(r.warnings.size(), total < 6000 ? 1u : 0u);
  if (!r.warnings.empty()) {
    EXPECT_NE(r.warnings[0].find("is large for a corpus of"), std::string::npos);
  }
  // Another seed draws other documents; the same seed the same ones.
  o.out_dir = d.file("out2");
  o.split_seed = 7;
  prepare_data(o);
  EXPECT_NE(read_split(o.out_dir, "val"), val);
  o.out_dir = d.file("out3");
  o.split_seed = 0;
  prepare_data(o);
  EXPECT_EQ(read_split(o.out_dir, "val"), val);

  write_bytes(d.file("bad.jsonl"), "{\"text\": \"ok\"}\n[1, 2]\n");
  o.inputs = {d.file("bad.jsonl")};
  o.out_dir = d.file("out4");
  expect_error([&] { prepare_data(o); }, {d.file("bad.jsonl") + ":2:", "\"text\""});
}

}  // namespace
}  // namespace tessera::train

#include "tessera/model/model.h"
#include "tessera/train/config.h"
#include "tessera/train/trainer_setup.h"

namespace tessera::train {
namespace {

// Fine-tuning a model on data encoded with another tokenizer of the same vocabulary size
// is refused before training (issue 22: it was silently accepted); with the model's own
// tokenizer it runs.
TEST(DataPrepare, FineTuningOnDataOfAnotherTokenizerIsRefused) {
  TempDir d;
  write_bytes(d.file("other.txt"), sample_corpus(99, 400) + "zebra quartz vexing jinx\n");
  io::BpeTrainOptions bo;
  bo.vocab_size = 300;
  bo.progress = false;
  io::train_bpe({d.file("other.txt")}, bo).save(d.file("other_tok"));
  model::ModelConfig mc = model::ModelConfig::named_shape("tiny");
  mc.vocab_size = 300;
  const model::Model m = model::Model::random(mc, DType::kF32, 1);
  m.save(d.file("model_other"));
  m.save(d.file("model_same"));
  std::filesystem::copy_file(d.file("other_tok") + "/tokenizer.json", d.file("model_other") + "/tokenizer.json");
  std::filesystem::copy_file(trained_tokenizer_dir() + "/tokenizer.json", d.file("model_same") + "/tokenizer.json");

  write_bytes(d.file("a.txt"), sample_corpus(3, 200));
  PrepareOptions o;
  o.tokenizer_dir = trained_tokenizer_dir();
  o.inputs = {d.file("a.txt")};
  o.out_dir = d.file("data");
  o.progress = false;
  prepare_data(o);
  const auto config = [&](const std::string& model_dir) {
    return TrainConfig::parse("[model]\ninit_from = \"" + model_dir + "\"\n[data]\ndir = \"" + o.out_dir + "\"\n",
                              "ft.toml");
  };
  EXPECT_NO_THROW(read_run_data_meta(config(d.file("model_same"))));
  expect_error([&] { read_run_data_meta(config(d.file("model_other"))); },
               {"ft.toml: the data in", "was encoded with the tokenizer of " + trained_tokenizer_dir(),
                "is not the tokenizer of model.init_from " + d.file("model_other")});
}

}  // namespace
}  // namespace tessera::train
