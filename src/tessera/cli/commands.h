// Subcommand registration for the `tessera` CLI. Each adds its flags to the app
// and returns the function to run after parsing.
#pragma once
#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

#include "tessera/infer/engine.h"
#include "tessera/model/quantize.h"
#include "tessera/train/chat_data.h"

namespace tessera::cli {

using Action = std::function<int()>;

void add_generate(CLI::App& app, Action& action);
void add_eval(CLI::App& app, Action& action);
void add_bench(CLI::App& app, Action& action);
void add_quickstart(CLI::App& app, Action& action);
void add_tokenizer(CLI::App& app, Action& action);  // cmd_tokenizer.cc
void add_data(CLI::App& app, Action& action);       // cmd_data.cc
void add_train(CLI::App& app, Action& action);      // cmd_train.cc
void add_plot(CLI::App& app, Action& action);       // cmd_plot.cc
void add_plan(CLI::App& app, Action& action);       // cmd_plan.cc
void add_quantize(CLI::App& app, Action& action);   // cmd_quantize.cc
void add_export(CLI::App& app, Action& action);     // cmd_export.cc
void add_info(CLI::App& app, Action& action);       // cmd_info.cc

void add_serve(CLI::App& app, Action& action);      // cmd_serve.cc
void add_router(CLI::App& app, Action& action);     // cmd_router.cc
// --kv-cache-memory, --block-size, --max-num-seqs, ... (engine_flags.cc).
void add_engine_flags(CLI::App* cmd, infer::EngineConfig& e, bool& no_prefix_caching);
// --quantization SCHEME and --quantize-lm-head: quantizing a float model on load.
void add_quantization_flags(CLI::App* cmd, model::LoadQuantization& q);
// Checks a quantize-on-load scheme (int8, int4, fp8, w8a8; empty or none: no quantization)
// while the flags are parsed, so a bad one is a parse error before anything loads.
CLI::Validator quant_scheme_validator();

// Chat data (chat_data.cc): a JSONL of {"messages": [...]} rendered with the chat template of
// tokenizer_dir (ChatML when it has none) into a chat data directory (train/chat_data.h),
// the last floor(n x val_fraction) conversations for validation. With reuse, a directory
// already rendered from the same JSONL, template and tokenizer is kept (and under mpirun only
// rank 0 renders; the others wait for it). The directory is replaced only when complete.
struct ChatPrepareOptions {
  std::string jsonl, tokenizer_dir, out_dir;
  double val_fraction = 0.05;
  bool reuse = true;
};
struct ChatPrepareResult {
  std::string out_dir;
  train::ChatDataMeta meta;
  bool reused = false;
  double seconds = 0;
};
ChatPrepareResult prepare_chat_data(const ChatPrepareOptions& o);
std::string describe_chat_data(const ChatPrepareResult& r);  // one line for the terminal

// A CLI11 parse error as one line on stderr ("tessera: error: ... (see 'tessera CMD --help')"),
// with a did-you-mean for a mistyped command or flag; returns 2 (0 for --help / --version,
// which print as CLI11 prints them).
int report_parse_error(CLI::App& app, const CLI::ParseError& e, int argc, char** argv);
// A byte-size flag: plain bytes or with a K/M/G/T suffix (powers of 1024; "2G", "512MiB").
CLI::Option* add_size_option(CLI::App* cmd, const std::string& name, int64_t& bytes,
                             const std::string& description);

// "1,2,3" -> {1,2,3}; errors name the flag and the bad item.
std::vector<int32_t> parse_id_list(const std::string& text, const std::string& flag);

}  // namespace tessera::cli
