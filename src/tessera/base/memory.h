// Resident memory of this process (Linux /proc) and its heap in use, for the metrics log,
// /stats and memory tests.
#pragma once
#include <cstdint>

namespace tessera::base {

// High-water mark of resident memory in bytes: VmHWM from /proc/self/status, or
// getrusage's ru_maxrss where /proc is not readable. ru_maxrss is never reset, so on that
// fallback reset_peak_rss() has no effect.
int64_t peak_rss_bytes();

// Resident memory now in bytes: VmRSS from /proc/self/status (0 where /proc is not readable).
int64_t current_rss_bytes();

// Resident bytes on transparent huge pages now: AnonHugePages from /proc/self/smaps_rollup
// (Linux >= 4.14; 0 where it cannot be read). Large tensors ask for them (aligned_alloc.h).
int64_t anon_huge_page_bytes();

// Bytes the heap hands out now (glibc's mallinfo2 over all arenas, mmapped blocks included):
// what a leak grows, unlike RSS, which also holds freed pages the allocator keeps.
int64_t heap_bytes_in_use();

// Resets the high-water mark to the current RSS by writing "5" to /proc/self/clear_refs
// (Linux >= 4.0), so peak_rss_bytes() afterwards measures a phase (one training step)
// instead of the whole process lifetime. Where the file cannot be written (old kernel,
// a sandbox that mounts /proc read-only, non-Linux) it does nothing and returns false;
// callers treat the peak as "since start" then. Never throws.
bool reset_peak_rss();

}  // namespace tessera::base
