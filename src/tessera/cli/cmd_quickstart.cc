// `tessera quickstart`: the README's main job. Builds an English corpus from the
// `fortunes` package, trains a BPE tokenizer and a small Llama-shaped model on it,
// saves the model, and prints samples, the validation loss against the corpus'
// unigram entropy, and the path of the loss-curve SVG.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>

#include "tessera/base/error.h"
#include "tessera/cli/commands.h"
#include "tessera/infer/generate.h"
#include "tessera/io/json_file.h"
#include "tessera/io/tokenizer.h"
#include "tessera/train/data_prepare.h"
#include "tessera/train/token_shard.h"
#include "tessera/train/trainer.h"

namespace tessera::cli {
namespace {

namespace fs = std::filesystem;

constexpr const char* kMarker = ".tessera-quickstart";

// Fortunes are separated by lines holding only "%"; documents here are separated by the
// tokenizer's end-of-text token so the model learns where one ends.
std::string build_corpus(const std::string& fortunes_dir) {
  TESSERA_CHECK(fs::is_directory(fortunes_dir), fortunes_dir,
                ": not found; install the Debian package `fortunes` (scripts/install-deps does)");
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(fortunes_dir))
    if (e.is_regular_file() && !e.is_symlink() && !e.path().has_extension()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::string corpus;
  for (const auto& path : files) {
    const std::string text = io::read_file_bytes(path.string());
    size_t pos = 0;
    while (pos < text.size()) {
      size_t end = text.find("\n%\n", pos);
      if (end == std::string::npos) end = text.size();
      std::string item = text.substr(pos, end - pos);
      if (item.rfind("%\n", 0) == 0) item.erase(0, 2);
      while (!item.empty() && (item.back() == '\n' || item.back() == '%')) item.pop_back();
      if (!item.empty()) corpus += item + "\n<|endoftext|>";
      pos = end + 3;
    }
  }
  TESSERA_CHECK(corpus.size() > 100000, fortunes_dir, ": only ", corpus.size(),
                " bytes of fortunes found; expected the `fortunes` package's ~1 MB");
  return corpus;
}

// Entropy in nats of the train split's token frequencies: the loss of the best model
// that ignores context. A model that learned anything beats it by a wide margin.
double unigram_entropy(const std::string& data_dir) {
  train::TokenStream stream(data_dir, "train");
  std::vector<int32_t> tokens(stream.size());
  stream.read(0, stream.size(), tokens.data());
  std::map<int32_t, int64_t> counts;
  for (int32_t t : tokens) ++counts[t];
  double h = 0;
  for (const auto& [t, n] : counts) {
    const double p = static_cast<double>(n) / static_cast<double>(tokens.size());
    h -= p * std::log(p);
  }
  return h;
}

struct Flags {
  std::string out = "runs/quickstart";
  std::string fortunes = "/usr/share/games/fortunes";
  int64_t steps = 800;
  int64_t vocab = 2048;
};

int run_quickstart(const Flags& f) {
  if (fs::exists(f.out)) {
    TESSERA_CHECK(fs::exists(f.out + "/" + kMarker), f.out,
                  " exists and is not an earlier quickstart run; choose another --out");
    fs::remove_all(f.out);  // our own earlier run: start over
  }
  fs::create_directories(f.out);
  io::write_file_atomic(f.out + "/" + kMarker, "written by tessera quickstart\n");

  std::printf("[1/5] corpus: fortunes from %s\n", f.fortunes.c_str());
  const std::string corpus_path = f.out + "/corpus.txt";
  io::write_file_atomic(corpus_path, build_corpus(f.fortunes));
  std::printf("      %s (%.2f MB)\n", corpus_path.c_str(), fs::file_size(corpus_path) / 1e6);

  std::printf("[2/5] tokenizer: byte-level BPE, vocabulary %lld\n", static_cast<long long>(f.vocab));
  io::BpeTrainOptions to;
  to.vocab_size = f.vocab;
  const auto tok = io::train_bpe({corpus_path}, to);
  tok.save(f.out + "/tokenizer");

  std::printf("[3/5] data: token shards with a 5%% validation split\n");
  train::PrepareOptions po;
  po.tokenizer_dir = f.out + "/tokenizer";
  po.out_dir = f.out + "/data";
  po.inputs = {corpus_path};
  po.val_fraction = 0.05;
  const auto prepared = train::prepare_data(po);
  std::printf("      %lld train tokens, %lld validation tokens\n",
              static_cast<long long>(prepared.train_tokens), static_cast<long long>(prepared.val_tokens));

  std::printf("[4/5] training a small Llama-shaped model (bf16 compute, AdamW, cosine schedule)\n");
  const std::string toml =
      "# Written by tessera quickstart; rerun with: tessera train --config " + f.out + "/train.toml\n"
      "[run]\nout_dir = \"" + f.out + "/train\"\n"
      "[model]\nshape = \"tiny\"\nhidden_size = 256\nnum_layers = 4\nnum_heads = 4\n"
      "num_kv_heads = 2\nintermediate_size = 704\nmax_position_embeddings = 512\n"
      "tie_word_embeddings = true\nseed = 1\n"
      "[data]\ndir = \"" + f.out + "/data\"\nseq_len = 128\nbatch_size = 16\n"
      "[optimizer]\nname = \"adamw\"\nlr = 0.003\nweight_decay = 0.1\n"
      "[schedule]\nkind = \"cosine\"\nwarmup_steps = " + std::to_string(std::max<int64_t>(1, f.steps / 10)) +
      "\nmin_lr_ratio = 0.1\n"
      "[training]\nsteps = " + std::to_string(f.steps) + "\nprecision = \"bf16\"\n"
      "eval_every = " + std::to_string(std::max<int64_t>(1, f.steps / 5)) + "\neval_batches = 8\n"
      "[checkpoint]\nevery = " + std::to_string(std::max<int64_t>(1, f.steps / 3)) + "\nkeep = 2\n";
  io::write_file_atomic(f.out + "/train.toml", toml);
  const auto result = train::run_training(train::TrainConfig::parse(toml, f.out + "/train.toml"));

  std::printf("[5/5] samples from %s\n", result.model_dir.c_str());
  const auto model = model::Model::load(result.model_dir, DType::kF32);
  const auto mtok = io::Tokenizer::load(result.model_dir);
  const char* prompts[] = {"The meaning of life is", "A computer", "Q: Why did the chicken"};
  for (size_t i = 0; i < std::size(prompts); ++i) {
    infer::GenerateOptions o;
    o.max_tokens = 40;
    o.sampling = {0.8f, 40, 0.95f, static_cast<uint64_t>(i + 1)};
    const auto r = infer::generate(model, mtok.encode(prompts[i]), o);
    std::printf("  > %s%s\n", prompts[i], mtok.decode(r.tokens, true).c_str());
  }
  const double h = unigram_entropy(f.out + "/data");
  std::printf("\nvalidation loss %.3f nats/token vs unigram entropy of the corpus %.3f nats/token "
              "(%.0f%% lower)\n",
              result.val_loss, h, 100.0 * (1.0 - result.val_loss / h));
  std::printf("loss curve: %s\nmetrics:    %s/train/metrics.jsonl\n", result.svg_path.c_str(),
              f.out.c_str());
  std::printf("next:       tessera generate --model %s --prompt \"Your text\" --temperature 0.8 --stream\n",
              result.model_dir.c_str());
  TESSERA_CHECK(result.val_loss > 0 && result.val_loss < h,
                "quickstart: validation loss ", result.val_loss,
                " did not fall below the unigram entropy ", h);
  return 0;
}

}  // namespace

void add_quickstart(CLI::App& app, Action& action) {
  auto f = std::make_shared<Flags>();
  auto* cmd = app.add_subcommand(
      "quickstart", "Train a tokenizer and a small Llama-shaped model on the fortunes corpus, "
                    "then generate from it");
  cmd->add_option("--out", f->out, "Run directory")->capture_default_str();
  cmd->add_option("--fortunes", f->fortunes, "Directory of fortune files")->capture_default_str();
  cmd->add_option("--steps", f->steps, "Training steps")->capture_default_str()->check(CLI::Range(1, 1000000));
  cmd->add_option("--vocab-size", f->vocab, "Tokenizer vocabulary")->capture_default_str();
  cmd->callback([&action, f] { action = [f] { return run_quickstart(*f); }; });
}

}  // namespace tessera::cli
