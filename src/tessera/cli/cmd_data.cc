// `tessera data prepare`: text files -> token shards, or conversations -> chat data (see
// docs/data.md and docs/fine-tuning.md).
#include <cstdio>
#include <memory>

#include "tessera/base/error.h"
#include "tessera/cli/commands.h"
#include "tessera/train/data_prepare.h"

namespace tessera::cli {
namespace {

int run_prepare(train::PrepareOptions o, bool quiet) {
  o.progress = !quiet;
  const auto r = train::prepare_data(o);
  const double total = static_cast<double>(r.train_tokens + r.val_tokens);
  std::printf("wrote %s: %lld train tokens in %lld shard(s), %lld val tokens in %lld shard(s); "
              "vocab %lld (uint%d tokens); %lld bytes of text in %.2f s (%.0f tokens/s)\n",
              o.out_dir.c_str(), static_cast<long long>(r.train_tokens),
              static_cast<long long>(r.train_shards), static_cast<long long>(r.val_tokens),
              static_cast<long long>(r.val_shards), static_cast<long long>(r.vocab_size),
              8 * r.token_bytes, static_cast<long long>(r.input_bytes), r.seconds,
              r.seconds > 0 ? total / r.seconds : 0.0);
  if (r.val_split == "documents")
    std::printf("validation: %lld of %lld documents\n", static_cast<long long>(r.val_documents),
                static_cast<long long>(r.documents));
  else if (r.val_split == "stream tail")
    std::printf("validation: the last %lld tokens (%lld document%s: too few to hold out whole ones; "
                "--separator splits a file into documents)\n",
                static_cast<long long>(r.val_tokens), static_cast<long long>(r.documents), r.documents == 1 ? "" : "s");
  for (const auto& w : r.warnings) std::fprintf(stderr, "warning: %s\n", w.c_str());
  return 0;
}

}  // namespace

void add_data(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("data", "Training data: text -> token shards");
  cmd->require_subcommand(1);
  auto o = std::make_shared<train::PrepareOptions>();
  auto quiet = std::make_shared<bool>(false);
  auto format = std::make_shared<std::string>("tokens");

  auto* prepare = cmd->add_subcommand(
      "prepare", "Encode text files with a tokenizer and write DIR/{train,val}_NNNNN.bin + meta.json");
  prepare->add_option("--tokenizer", o->tokenizer_dir, "Directory with tokenizer.json, or the file")
      ->required();
  prepare->add_option("--input", o->inputs,
                      "UTF-8 text files (each one document, or split at --separator) or JSON-lines "
                      "files (*.jsonl: one {\"text\": ...} document per line)")
      ->required()
      ->expected(1, -1);
  prepare->add_option("--out", o->out_dir, "Output directory (replaced only when complete)")
      ->required();
  prepare->add_option("--val-fraction", o->val_fraction,
                      "Fraction of the tokens held out for validation, as whole documents (drawn by "
                      "--split-seed); the stream's tail when there are too few documents")
      ->capture_default_str();
  prepare->add_option_function<std::string>(
      "--separator",
      [o](const std::string& s) {
        std::string out;
        for (size_t i = 0; i < s.size(); ++i) {
          if (s[i] == '\\' && i + 1 < s.size() && (s[i + 1] == 'n' || s[i + 1] == 't')) {
            out += s[++i] == 'n' ? '\n' : '\t';
          } else {
            out += s[i];
          }
        }
        o->separator = out;
      },
      "Split text files into documents at this string (e.g. '<|endoftext|>'; \\n is a newline)");
  prepare->add_option("--input-format", o->input_format, "auto (by extension: .jsonl), text or jsonl")
      ->check(CLI::IsMember({"auto", "text", "jsonl"}))
      ->capture_default_str();
  prepare->add_option("--split-seed", o->split_seed, "Seed of the validation documents' draw")
      ->capture_default_str();
  prepare->add_option("--shard-tokens", o->shard_tokens, "Tokens per shard file")
      ->capture_default_str();
  prepare->add_option("--format", *format,
                      "tokens: text files -> token shards; chat: one JSONL of {\"messages\": [...]} "
                      "conversations rendered with the tokenizer's chat template (docs/fine-tuning.md)")
      ->check(CLI::IsMember({"tokens", "chat"}))
      ->capture_default_str();
  prepare->add_flag("--quiet", *quiet, "No progress bar");
  prepare->callback([&action, o, quiet, format] {
    action = [o, quiet, format] {
      if (*format == "tokens") return run_prepare(*o, *quiet);
      TESSERA_CHECK(o->inputs.size() == 1, "--format chat takes one --input (a JSONL file), got ", o->inputs.size());
      ChatPrepareOptions c;
      c.jsonl = o->inputs[0];
      c.tokenizer_dir = o->tokenizer_dir;
      c.out_dir = o->out_dir;
      c.val_fraction = o->val_fraction;
      c.reuse = false;
      std::printf("%s\n", describe_chat_data(prepare_chat_data(c)).c_str());
      return 0;
    };
  });
}

}  // namespace tessera::cli
