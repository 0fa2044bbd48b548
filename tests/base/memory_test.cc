// Resident-memory readings: peak and current RSS follow a 200 MB allocation, checked
// against the kernel's other views (getrusage, /proc/self/statm).
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <string>

#include "tessera/base/aligned_alloc.h"
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

// The VmFlags line of the /proc/self/smaps mapping that holds `addr` ("" if none is found).
std::string vm_flags_at(const void* addr) {
  FILE* f = std::fopen("/proc/self/smaps", "r");
  if (!f) return "";
  const auto a = reinterpret_cast<uintptr_t>(addr);
  char line[512];
  bool inside = false;
  std::string flags;
  while (std::fgets(line, sizeof line, f)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && std::strchr(line, '-') < std::strchr(line, ' ')) {
      inside = a >= lo && a < hi;
    } else if (inside && std::strncmp(line, "VmFlags:", 8) == 0) {
      flags = line + 8;
      break;
    }
  }
  std::fclose(f);
  return flags;
}

// Blocks of 2 MiB and more start on a 2 MiB boundary and their pages carry the
// MADV_HUGEPAGE advice ("hg" in the mapping's VmFlags), whatever mode the host's
// transparent huge pages run in; the last partly used 2 MiB page only when rounding up to
// it adds at most an eighth.
TEST(Memory, LargeBlocksAskForHugePages) {
  if (!base::huge_pages_enabled()) GTEST_SKIP() << "TESSERA_HUGEPAGES=0";
  const size_t big = 6 * kMiB - 200 * 1024, odd = 2 * kMiB + 100 * 1024;
  char* p = static_cast<char*>(base::aligned_malloc(big));
  char* q = static_cast<char*>(base::aligned_malloc(odd));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % base::kHugePageBytes, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(q) % base::kHugePageBytes, 0u);
  const std::string first = vm_flags_at(p), last = vm_flags_at(p + big - 1), q_first = vm_flags_at(q);
  FILE* thp = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
  if (thp) std::fclose(thp);
  if (first.empty()) {
    std::printf("note: /proc/self/smaps not readable here; the advice is not checked\n");
  } else if (!thp) {
    std::printf("note: this kernel has no transparent huge pages; the advice is not checked\n");
  } else {
    EXPECT_NE(first.find(" hg"), std::string::npos) << first;
    EXPECT_NE(last.find(" hg"), std::string::npos) << "a 200 KiB tail of a 6 MiB block is advised too: " << last;
    EXPECT_NE(q_first.find(" hg"), std::string::npos) << q_first;
  }
  // Usable end to end.
  for (size_t i = 0; i < big; i += 4096) p[i] = 1;
  for (size_t i = 0; i < odd; i += 4096) q[i] = 1;
  base::aligned_free(p);
  base::aligned_free(q);
  // Small blocks keep the 64-byte alignment contract.
  void* s = base::aligned_malloc(base::kHugePageBytes - 64);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(s) % base::kAlignment, 0u);
  base::aligned_free(s);
}

}  // namespace
}  // namespace tessera
