// Parses TOML text (run configs, hardware files) with toml++, with errors that name the
// source and the line and column, as io/json_file.h does for JSON. Every TOML reader in
// Tessera goes through parse_toml_text, so the checks that keep toml++ 3.3.0 off its
// undefined-behaviour paths are made once, here.
#pragma once
#include <cstddef>
#include <string>

#include <toml++/toml.h>

namespace tessera::io {

// Limits of check_toml_text; a run config or hardware file is a few KiB and two levels deep.
inline constexpr size_t kMaxTomlBytes = size_t{4} << 20;
inline constexpr int kMaxTomlNesting = 32;   // arrays / inline tables inside each other
inline constexpr int kMaxTomlKeyParts = 32;  // parts of one dotted key or table name

// Throws tessera::Error: "run.toml:3:7: invalid TOML: ...". `source` names where the
// text came from (a path). Runs check_toml_text first.
toml::table parse_toml_text(const std::string& text, const std::string& source);

// The checks made before toml++ sees the text (public for tests): at most kMaxTomlBytes,
// no NUL byte, valid UTF-8, no non-ASCII character outside strings and comments, a table
// name (or quote) right after a header's '[' / '[[', at most kMaxTomlNesting levels of
// arrays and inline tables, at most kMaxTomlKeyParts parts per key, and no non-ASCII
// character right after a backslash or a line-ending backslash in a """string""".
// Throws tessera::Error "source:line:col: invalid TOML: ..." on the first violation.
void check_toml_text(const std::string& text, const std::string& source);

// A number node (integer or float) as double. toml++'s value<double>() is empty for an
// integer that a double cannot hold exactly (655777777777777777), so dereferencing it is
// undefined; this converts such integers to the nearest double instead.
inline double toml_number(const toml::node& n) {
  if (const auto* i = n.as_integer()) return static_cast<double>(i->get());
  return n.as_floating_point() ? n.as_floating_point()->get() : 0.0;
}

}  // namespace tessera::io
