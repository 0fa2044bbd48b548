// printf-style formatting into std::string.
#include "tessera/base/strings.h"

#include <algorithm>
#include <vector>

#include <cstdarg>
#include <cstdio>

namespace tessera::base {
namespace {

void vappendf(std::string& out, const char* fmt, va_list ap) {
  char buf[512];
  va_list again;
  va_copy(again, ap);
  const int n = std::vsnprintf(buf, sizeof buf, fmt, ap);
  if (n < 0) {
    va_end(again);
    return;
  }
  if (static_cast<size_t>(n) < sizeof buf) {
    out.append(buf, static_cast<size_t>(n));
  } else {  // longer than the stack buffer: format again into the string itself
    const size_t at = out.size();
    out.resize(at + static_cast<size_t>(n) + 1);
    std::vsnprintf(out.data() + at, static_cast<size_t>(n) + 1, fmt, again);
    out.resize(at + static_cast<size_t>(n));
  }
  va_end(again);
}

}  // namespace

std::string strprintf(const char* fmt, ...) {
  std::string out;
  va_list ap;
  va_start(ap, fmt);
  vappendf(out, fmt, ap);
  va_end(ap);
  return out;
}

void appendf(std::string& out, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vappendf(out, fmt, ap);
  va_end(ap);
}

void replace_all(std::string* s, std::string_view from, std::string_view to) {
  if (from.empty() || s->find(from) == std::string::npos) return;
  std::string out;
  out.reserve(s->size() + s->size() / 4);
  size_t i = 0;
  for (size_t k; (k = s->find(from, i)) != std::string::npos; i = k + from.size()) {
    out.append(*s, i, k - i);
    out += to;
  }
  out.append(*s, i);
  s->swap(out);
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace tessera::base
