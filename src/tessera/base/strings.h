// printf-style formatting into std::string (reports, tables, SVG), any length.
#pragma once
#include <string>

namespace tessera::base {

std::string strprintf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// Appends the formatted text to `out`.
void appendf(std::string& out, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

}  // namespace tessera::base
