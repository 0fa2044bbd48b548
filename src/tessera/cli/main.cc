// The `tessera` command: parses flags and hands off to library functions.
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "tessera/base/cpu_features.h"
#include "tessera/base/error.h"
#include "tessera/cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"Tessera: LLM training and serving in C++"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "tessera 0.1.0");
  tessera::cli::Action action;
  tessera::cli::add_quickstart(app, action);
  tessera::cli::add_generate(app, action);
  tessera::cli::add_serve(app, action);
  tessera::cli::add_router(app, action);
  tessera::cli::add_eval(app, action);
  tessera::cli::add_bench(app, action);
  tessera::cli::add_tokenizer(app, action);
  tessera::cli::add_data(app, action);
  tessera::cli::add_train(app, action);
  tessera::cli::add_plot(app, action);
  tessera::cli::add_plan(app, action);
  tessera::cli::add_quantize(app, action);
  tessera::cli::add_export(app, action);
  tessera::cli::add_info(app, action);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return tessera::cli::report_parse_error(app, e, argc, argv);
  } catch (const std::exception& e) {
    // A flag whose callback parses its value (--kv-cache-dtype, ...) rejected it: a parse
    // error like any other, not an uncaught exception.
    return tessera::cli::report_parse_error(app, CLI::ValidationError(e.what()), argc, argv);
  }
  // Tests of the documentation's commands (tests/docs): the flags parse, nothing runs.
  if (const char* p = std::getenv("TESSERA_PARSE_ONLY"); p && *p == '1') return 0;
  try {
    tessera::base::check_isa_cap();
    return action ? action() : 0;
  } catch (const tessera::Error& e) {
    std::fprintf(stderr, "tessera: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera: error: %s\n", e.what());
    return 1;
  }
}
