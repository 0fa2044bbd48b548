// Reads VmHWM / VmRSS from /proc/self/status and AnonHugePages from /proc/self/smaps_rollup;
// resets VmHWM through /proc/self/clear_refs.
#include "tessera/base/memory.h"

#include <fcntl.h>
#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace tessera::base {

namespace {

// Value of a "Key:   123 kB" line of a /proc/self file in bytes, or -1 if absent.
int64_t read_proc_kb(const char* key, const char* file = "/proc/self/status") {
  FILE* f = std::fopen(file, "re");
  if (!f) return -1;
  const size_t key_len = std::strlen(key);
  char line[256];
  int64_t bytes = -1;
  while (std::fgets(line, sizeof line, f)) {
    if (std::strncmp(line, key, key_len) == 0 && line[key_len] == ':') {
      bytes = std::strtoll(line + key_len + 1, nullptr, 10) * 1024;  // the kernel reports kB
      break;
    }
  }
  std::fclose(f);
  return bytes;
}

}  // namespace

int64_t peak_rss_bytes() {
  const int64_t hwm = read_proc_kb("VmHWM");
  if (hwm >= 0) return hwm;
  struct rusage ru;
  if (::getrusage(RUSAGE_SELF, &ru) == 0) return static_cast<int64_t>(ru.ru_maxrss) * 1024;  // Linux: kB
  return 0;
}

int64_t current_rss_bytes() {
  const int64_t rss = read_proc_kb("VmRSS");
  return rss >= 0 ? rss : 0;
}

int64_t anon_huge_page_bytes() {
  const int64_t b = read_proc_kb("AnonHugePages", "/proc/self/smaps_rollup");
  return b >= 0 ? b : 0;
}

bool reset_peak_rss() {
  const int fd = ::open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::write(fd, "5", 1) == 1;
  ::close(fd);
  return ok;
}

int64_t heap_bytes_in_use() {
  const struct mallinfo2 mi = mallinfo2();
  return static_cast<int64_t>(mi.uordblks + mi.hblkhd);
}

}  // namespace tessera::base
