// Resident-memory readings: peak and current RSS follow a 200 MB allocation, checked
// against the kernel's other views (getrusage, /proc/self/statm).
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "tessera/base/memory.h"

namespace tessera {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// Resident pages from /proc/self/statm (second field) in bytes.
int64_t statm_rss_bytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return -1;
  long long size = 0, resident = -1;
  if (std::fscanf(f, "%lld %lld", &size, &resident) != 2) resident = -1;
  std::fclose(f);
  return resident < 0 ? -1 : resident * ::sysconf(_SC_PAGESIZE);
}

TEST(Memory, PeakRssFollowsA200MBAllocation) {
  const int64_t before = base::current_rss_bytes();
  ASSERT_GT(before, 0);
  ASSERT_GE(base::peak_rss_bytes(), before);

  const size_t bytes = 200 * kMiB;
  char* p = static_cast<char*>(std::malloc(bytes));
  ASSERT_NE(p, nullptr);
  volatile char* touch = p;  // volatile: the stores must happen, page by page
  for (size_t i = 0; i < bytes; i += 4096) touch[i] = static_cast<char>(i >> 12);
  const int64_t during = base::current_rss_bytes();
  const int64_t peak = base::peak_rss_bytes();
  const int64_t statm = statm_rss_bytes();
  struct rusage ru;
  ASSERT_EQ(::getrusage(RUSAGE_SELF, &ru), 0);
  EXPECT_GE(during, before + 190 * kMiB);
  EXPECT_GE(peak, before + 190 * kMiB);
  // The kernel's RSS counters are per-CPU approximations: allow a MiB of jitter.
  EXPECT_GE(peak, during - kMiB);
  // ru_maxrss (kB) is the lifetime maximum: never below VmHWM.
  EXPECT_GE(static_cast<int64_t>(ru.ru_maxrss) * 1024, before + 190 * kMiB);
  if (statm > 0) {
    EXPECT_NEAR(static_cast<double>(during), static_cast<double>(statm), 8.0 * kMiB);
  }
  std::free(p);

  // glibc returns a block this large to the kernel at once (it was mmap'ed); the peak stays.
  EXPECT_LT(base::current_rss_bytes(), during - 150 * kMiB);
  EXPECT_GE(base::peak_rss_bytes(), peak - kMiB);
  if (base::reset_peak_rss()) {
    EXPECT_LT(base::peak_rss_bytes(), peak - 150 * kMiB) << "clear_refs accepted but VmHWM not reset";
  } else {
    std::printf("note: /proc/self/clear_refs not writable here; reset_peak_rss() is a no-op\n");
  }
}

}  // namespace
}  // namespace tessera
