// CLI11's parse errors as the CLI's one-line contract: "tessera: error: ..." on stderr,
// exit 2, with a did-you-mean for a mistyped command or flag.
#include <algorithm>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "tessera/base/strings.h"

#include "tessera/cli/commands.h"

namespace tessera::cli {
namespace {

using base::edit_distance;

// The candidate nearest `word`, or "" when none is close (at most a third of its length, and
// at least 2 edits, apart; a candidate that starts with the word also counts).
std::string nearest(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = std::max<size_t>(2, word.size() / 3) + 1;
  for (const auto& c : candidates) {
    const size_t d = c.rfind(word, 0) == 0 && word.size() >= 3 ? 1 : edit_distance(word, c);
    if (d < best_d) best_d = d, best = c;
  }
  return best;
}

std::vector<std::string> subcommand_names(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::App* s : app.get_subcommands([](const CLI::App*) { return true; }))
    if (!s->get_name().empty()) names.push_back(s->get_name());
  return names;
}

std::vector<std::string> option_names(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::Option* o : app.get_options()) {
    for (const auto& l : o->get_lnames()) names.push_back("--" + l);
    for (const auto& s : o->get_snames()) names.push_back("-" + s);
  }
  return names;
}

std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

}  // namespace

int report_parse_error(CLI::App& app, const CLI::ParseError& e, int argc, char** argv) {
  if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
  // Walk argv down the subcommand tree as far as it names subcommands.
  const CLI::App* cur = &app;
  std::string path = "tessera";
  std::string stray;  // the first word that is neither a flag nor a subcommand of cur
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.empty() || a[0] == '-') continue;
    const CLI::App* next = nullptr;
    for (const CLI::App* s : cur->get_subcommands([](const CLI::App*) { return true; }))
      if (s->get_name() == a) next = s;
    if (!next) {
      stray = a;
      break;
    }
    cur = next;
    path += " " + a;
  }
  std::ostringstream msg;
  const auto subs = subcommand_names(*cur);
  if (!subs.empty() && cur->get_require_subcommand_min() > 0 &&
      (cur->get_subcommands().empty() || !stray.empty())) {
    if (stray.empty()) {
      msg << "'" << path << "' needs a command: ";
    } else {
      msg << "unknown command '" << stray << "' for '" << path << "'";
      const std::string near = nearest(stray, subs);
      if (!near.empty()) msg << "; did you mean '" << near << "'?";
      msg << " Commands: ";
    }
    for (size_t i = 0; i < subs.size(); ++i) msg << (i ? ", " : "") << subs[i];
  } else if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) {
    // "The following argument(s) were not expected: --foo --bar"
    std::string list = e.what();
    list = list.substr(list.find(':') == std::string::npos ? 0 : list.find(':') + 1);
    std::istringstream words(list);
    std::string w, first;
    while (words >> w)  // the first flag among them (CLI11 may list a flag's value first)
      if (first.empty() || (first[0] != '-' && w[0] == '-')) first = w;
    msg << "unexpected argument '" << first << "' for '" << path << "'";
    if (!first.empty() && first[0] == '-') {
      const std::string flag = first.substr(0, first.find('='));
      const std::string near = nearest(flag, option_names(*cur));
      if (!near.empty()) msg << "; did you mean '" << near << "'?";
    }
  } else {
    msg << one_line(e.what());
  }
  std::fprintf(stderr, "tessera: error: %s (see '%s --help')\n", msg.str().c_str(), path.c_str());
  return 2;
}

}  // namespace tessera::cli

namespace tessera::cli {

CLI::Option* add_size_option(CLI::App* cmd, const std::string& name, int64_t& bytes,
                             const std::string& description) {
  return cmd->add_option(name, bytes, description + " (bytes; K/M/G/T suffixes: powers of 1024)")
      ->transform(CLI::AsSizeValue(false));
}

}  // namespace tessera::cli
