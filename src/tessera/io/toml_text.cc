#include "tessera/io/toml_text.h"

#include "tessera/base/error.h"

namespace tessera::io {

toml::table parse_toml_text(const std::string& text, const std::string& source) {
  try {
    return toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    const auto& b = e.source().begin;
    fail(source, ":", b.line, ":", b.column, ": invalid TOML: ", e.description());
  }
}

}  // namespace tessera::io
