// printf-style formatting into std::string (reports, tables, SVG), any length; replacing
// every occurrence of a substring.
#pragma once
#include <string>
#include <string_view>

namespace tessera::base {

std::string strprintf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// Appends the formatted text to `out`.
void appendf(std::string& out, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
// Every occurrence of `from` in *s (left to right, not overlapping) becomes `to`; an empty
// `from` changes nothing.
void replace_all(std::string* s, std::string_view from, std::string_view to);
// Levenshtein distance (insertions, deletions, substitutions): did-you-mean suggestions.
size_t edit_distance(std::string_view a, std::string_view b);

}  // namespace tessera::base
