// Parses TOML text (run configs, hardware files) with toml++, with errors that name the
// source and the line and column, as io/json_file.h does for JSON.
#pragma once
#include <string>

#include <toml++/toml.h>

namespace tessera::io {

// Throws tessera::Error: "run.toml:3:7: invalid TOML: ...". `source` names where the
// text came from (a path).
toml::table parse_toml_text(const std::string& text, const std::string& source);

}  // namespace tessera::io
