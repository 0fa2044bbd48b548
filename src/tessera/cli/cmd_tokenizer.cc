// `tessera tokenizer train|encode|decode` and `tessera bench tokenizer`: byte-level and
// SentencePiece-style BPE (see docs/tokenizer.md).
#include <time.h>

#include <algorithm>
#include <barrier>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <thread>

#include "tessera/base/error.h"
#include "tessera/base/timer.h"
#include "tessera/cli/commands.h"
#include "tessera/io/json_file.h"
#include "tessera/io/pretokenize.h"
#include "tessera/io/tokenizer.h"

namespace tessera::cli {
namespace {

struct TokenizerFlags {
  std::vector<std::string> inputs;
  std::string out, tokenizer, file, text, ids, ids_file;
  bool has_text = false, has_ids = false;
  io::BpeTrainOptions train;
  bool no_special_tokens = false, quiet = false, skip_special = false, no_add_special = false;
  bool json = false, stream = false;
};

int run_train(TokenizerFlags f) {
  TESSERA_CHECK(!f.inputs.empty(), "--input: give at least one text file");
  namespace fs = std::filesystem;
  std::error_code ec;
  // Fail before training, not after, when the output cannot be a directory.
  TESSERA_CHECK(!fs::exists(f.out, ec) || fs::is_directory(f.out, ec), "--out ", f.out,
                ": exists and is not a directory");
  if (f.no_special_tokens) f.train.special_tokens.clear();
  f.train.progress = !f.quiet;
  const auto tok = io::train_bpe(f.inputs, f.train);
  tok.save(f.out);
  std::fprintf(stderr, "wrote %s/tokenizer.json (vocab size %lld)\n", f.out.c_str(),
               static_cast<long long>(tok.vocab_size()));
  return 0;
}

int run_encode(const TokenizerFlags& f) {
  TESSERA_CHECK(f.file.empty() != !f.has_text, "give exactly one of --file and --text");
  const auto tok = io::Tokenizer::load(f.tokenizer);
  const std::string text = f.has_text ? f.text : io::read_file_bytes(f.file);
  const auto ids = tok.encode(text, !f.no_add_special);
  std::string line = f.json ? "[" : "";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) line += f.json ? "," : " ";
    line += std::to_string(ids[i]);
  }
  line += f.json ? "]\n" : "\n";
  std::fwrite(line.data(), 1, line.size(), stdout);
  return 0;
}

// "1 2 3", "1,2,3" or "[1, 2, 3]" -> ids; errors name the bad item and `flag`.
std::vector<int32_t> parse_ids(const std::string& text, const std::string& flag) {
  std::string normalized = text;
  for (char& c : normalized)
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '[' || c == ']') c = ',';
  std::vector<int32_t> ids;
  std::string item;
  for (size_t i = 0; i <= normalized.size(); ++i) {
    if (i < normalized.size() && normalized[i] != ',') {
      item += normalized[i];
      continue;
    }
    if (!item.empty()) ids.push_back(parse_id_list(item, flag)[0]);
    item.clear();
  }
  return ids;
}

int run_decode(const TokenizerFlags& f) {
  TESSERA_CHECK(f.ids_file.empty() != !f.has_ids, "give exactly one of --ids and --ids-file");
  const auto tok = io::Tokenizer::load(f.tokenizer);
  const auto ids = f.has_ids ? parse_ids(f.ids, "--ids") : parse_ids(io::read_file_bytes(f.ids_file), "--ids-file");
  std::string text;
  if (f.stream) {
    // What `generate` and the server stream: each token's bytes in turn (special tokens
    // left out), a character cut between tokens held back until it is whole.
    std::string pending;
    for (int32_t id : ids) {
      if (tok.is_special(id)) {
        tok.decode_token(id);  // still checks the id
        continue;
      }
      pending += tok.decode_token(id);
      const size_t n = io::complete_utf8_prefix(pending);
      text += pending.substr(0, n);
      pending.erase(0, n);
    }
    text += pending;
  } else {
    text = tok.decode(ids, f.skip_special);
  }
  std::fwrite(text.data(), 1, text.size(), stdout);  // exactly the text: no newline added
  return 0;
}

// The fortunes files (Debian package `fortunes`): plain text, the bench's default corpus.
std::vector<std::string> fortune_files() {
  namespace fs = std::filesystem;
  const fs::path root = "/usr/share/games/fortunes";
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (name.find('.') != std::string::npos || !e.is_regular_file()) continue;
    if (io::find_invalid_utf8(io::read_file_bytes(e.path().string())) != std::string_view::npos) continue;
    out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  TESSERA_CHECK(!out.empty(), "no fortunes text in ", root.string(),
                " (Debian package 'fortunes'); pass --tokenizer and --file");
  return out;
}

double thread_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

struct BenchFlags {
  std::string tokenizer, file;
  int64_t vocab_size = 4096;
  double min_seconds = 2.0;
  bool batch = false;  // also encode the text's lines as a batch of strings
  int threads = 1;     // for the batch
};

// The batch: the text's non-empty lines, each one string (as a serving front end or a
// data pipeline hands them over), encoded on `threads` threads in contiguous shares.
void bench_batch(const io::Tokenizer& tok, const std::string& text, const BenchFlags& f) {
  std::vector<std::string_view> lines;
  for (size_t i = 0; i < text.size();) {
    size_t e = text.find('\n', i);
    if (e == std::string::npos) e = text.size();
    if (e > i) lines.push_back(std::string_view(text).substr(i, e - i));
    i = e + 1;
  }
  TESSERA_CHECK(!lines.empty(), "--batch: the text has no lines");
  TESSERA_CHECK(f.threads >= 1 && f.threads <= 256, "--threads: expected 1 to 256, got ", f.threads);
  size_t bytes = 0;
  for (auto l : lines) bytes += l.size();
  std::vector<size_t> counts(static_cast<size_t>(f.threads));
  auto encode_share = [&](int t) {
    size_t n = 0;
    const size_t lo = lines.size() * t / f.threads, hi = lines.size() * (t + 1) / f.threads;
    for (size_t i = lo; i < hi; ++i) n += tok.encode(lines[i], false).size();
    counts[static_cast<size_t>(t)] = n;
  };
  // The workers live across runs, as a server's would, so their pre-token caches stay warm.
  std::barrier start(f.threads), done(f.threads);
  bool stop = false;
  std::vector<std::thread> pool;
  for (int t = 1; t < f.threads; ++t)
    pool.emplace_back([&, t] {
      for (start.arrive_and_wait(); !stop; start.arrive_and_wait()) {
        encode_share(t);
        done.arrive_and_wait();
      }
    });
  size_t n_tokens = 0;
  const double sec = base::median_call_seconds(
      [&](int64_t) {
        start.arrive_and_wait();
        encode_share(0);
        done.arrive_and_wait();
        n_tokens = 0;
        for (size_t c : counts) n_tokens += c;
      },
      f.min_seconds);
  stop = true;
  start.arrive_and_wait();
  for (auto& th : pool) th.join();
  std::printf("encode batch of %zu lines (%.2f MB, %zu tokens), %d thread(s): %.1f MB/s wall, %.2f M tokens/s\n",
              lines.size(), bytes / 1e6, n_tokens, f.threads, bytes / 1e6 / sec, n_tokens / sec / 1e6);
  std::printf("{\"tokenizer_batch_mb_per_s\": %.3f, \"tokenizer_batch_tokens_per_s\": %.1f, \"threads\": %d}\n",
              bytes / 1e6 / sec, n_tokens / sec, f.threads);
}

int run_bench_tokenizer(const BenchFlags& f) {
  std::vector<std::string> fortunes;
  if (f.tokenizer.empty() || f.file.empty()) fortunes = fortune_files();
  std::string text;
  if (!f.file.empty()) {
    text = io::read_file_bytes(f.file);
  } else {
    for (const auto& p : fortunes) text += io::read_file_bytes(p);
  }
  base::Timer load_timer;
  io::Tokenizer tok = [&] {
    if (!f.tokenizer.empty()) return io::Tokenizer::load(f.tokenizer);
    io::BpeTrainOptions o;
    o.vocab_size = f.vocab_size;
    o.progress = false;
    return io::train_bpe(fortunes, o);
  }();
  std::printf("tokenizer: %s, vocab size %lld (%s in %.2f s)\n",
              f.tokenizer.empty() ? "trained on the fortunes text" : f.tokenizer.c_str(),
              static_cast<long long>(tok.vocab_size()), f.tokenizer.empty() ? "trained" : "loaded",
              load_timer.seconds());
  // Cold: a fresh thread starts with an empty pre-token cache.
  double cold = 0, cold_cpu = 0;
  std::thread([&] {
    base::Timer t;
    const double c0 = thread_cpu_seconds();
    tok.encode(text);
    cold_cpu = thread_cpu_seconds() - c0;
    cold = t.seconds();
  }).join();
  // Wall time is what a user sees; this thread's CPU time is the same work without the
  // time other processes on a shared machine take from it.
  size_t n_tokens = 0;
  std::vector<double> cpu;
  const double warm = base::median_call_seconds(
      [&](int64_t) {
        const double c0 = thread_cpu_seconds();
        n_tokens = tok.encode(text).size();
        cpu.push_back(thread_cpu_seconds() - c0);
      },
      f.min_seconds);
  cpu.erase(cpu.begin());  // the untimed warm-up call
  const double warm_cpu = base::median(cpu);
  const double mb = text.size() / 1e6;
  std::printf("text: %s, %.2f MB, %zu tokens, %.2f bytes/token\n",
              f.file.empty() ? "fortunes" : f.file.c_str(), mb, n_tokens, text.size() / double(n_tokens));
  std::printf("encode, 1 thread, warm pre-token cache: %.1f MB/s wall (median of %zu runs), %.1f MB/s by CPU "
              "time, %.2f M tokens/s\n", mb / warm, cpu.size(), mb / warm_cpu, n_tokens / warm / 1e6);
  std::printf("encode, 1 thread, cold cache (one run): %.1f MB/s wall, %.1f MB/s by CPU time\n", mb / cold,
              mb / cold_cpu);
  std::printf("{\"tokenizer_encode_mb_per_s\": %.3f, \"tokenizer_encode_cpu_mb_per_s\": %.3f, "
              "\"tokenizer_encode_cold_mb_per_s\": %.3f, \"tokenizer_encode_tokens_per_s\": %.1f}\n",
              mb / warm, mb / warm_cpu, mb / cold, n_tokens / warm);
  if (f.batch) bench_batch(tok, text, f);
  return 0;
}

}  // namespace

void add_bench_tokenizer(CLI::App* bench, Action& action) {
  auto f = std::make_shared<BenchFlags>();
  auto* cmd = bench->add_subcommand("tokenizer", "Tokenizer encode MB/s (trains one on the fortunes text by default)");
  cmd->add_option("--tokenizer", f->tokenizer, "Tokenizer directory or tokenizer.json (default: train one)");
  cmd->add_option("--file", f->file, "Text to encode (default: the fortunes text)");
  cmd->add_option("--vocab-size", f->vocab_size, "Vocab size of the trained tokenizer")->capture_default_str();
  cmd->add_option("--min-seconds", f->min_seconds, "Time spent in timed runs")->capture_default_str();
  cmd->add_flag("--batch", f->batch, "Also encode the text's lines as a batch of strings");
  cmd->add_option("--threads", f->threads, "Threads for the batch")->capture_default_str();
  cmd->callback([&action, f] { action = [f] { return run_bench_tokenizer(*f); }; });
}

void add_tokenizer(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("tokenizer", "BPE tokenizer: train (byte-level), encode, decode");
  cmd->require_subcommand(1);
  auto f = std::make_shared<TokenizerFlags>();

  auto* train = cmd->add_subcommand("train", "Train a byte-level BPE and write DIR/tokenizer.json");
  train->add_option("--input", f->inputs, "UTF-8 text files")->required()->expected(1, -1);
  train->add_option("--vocab-size", f->train.vocab_size, "Vocabulary size: 256 bytes + merges + special tokens")
      ->required();
  train->add_option("--out", f->out, "Output directory")->required();
  train->add_option("--special-tokens", f->train.special_tokens,
                    "Special tokens (the first is EOS); they get the last ids")
      ->capture_default_str();
  train->add_flag("--no-special-tokens", f->no_special_tokens, "Train without special tokens");
  train->add_option("--min-frequency", f->train.min_frequency, "Never merge a pair seen fewer times")
      ->capture_default_str();
  train->add_option("--pattern", f->train.pattern, "Pre-tokenizer split regex (default: GPT-2's)");
  train->add_option("--model-max-length", f->train.model_max_length, "Written to tokenizer_config.json")
      ->capture_default_str();
  train->add_flag("--quiet", f->quiet, "No progress bar");
  train->callback([&action, f] { action = [f] { return run_train(*f); }; });

  auto* encode = cmd->add_subcommand("encode", "Print the token ids of a text, separated by spaces");
  encode->add_option("--tokenizer", f->tokenizer, "Directory with tokenizer.json, or the file")->required();
  encode->add_option("--file", f->file, "Text file to encode");
  encode->add_option("--text", f->text, "Text to encode")->each([f](const std::string&) { f->has_text = true; });
  encode->add_flag("--no-special-tokens", f->no_add_special, "Do not add BOS / EOS from the template");
  encode->add_flag("--json", f->json, "Print the ids as a JSON array");
  encode->callback([&action, f] { action = [f] { return run_encode(*f); }; });

  auto* decode = cmd->add_subcommand("decode", "Print the text of token ids (no newline is added)");
  decode->add_option("--tokenizer", f->tokenizer, "Directory with tokenizer.json, or the file")->required();
  decode->add_option("--ids", f->ids, "Token ids separated by spaces or commas, e.g. \"1 2 3\"")
      ->each([f](const std::string&) { f->has_ids = true; });
  decode->add_option("--ids-file", f->ids_file, "File of token ids (spaces, commas, or a JSON array)");
  decode->add_flag("--skip-special-tokens", f->skip_special, "Leave out special tokens");
  decode->add_flag("--stream", f->stream,
                   "Print the text as generation streams it: token by token, special tokens left out, "
                   "no leading space stripped");
  decode->callback([&action, f] { action = [f] { return run_decode(*f); }; });
}

}  // namespace tessera::cli
