// parallel_for over the OpenMP team.
#include "tessera/base/thread_pool.h"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <thread>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace tessera::base {
namespace {

// Subnormal floats (below 1.2e-38) are flushed to zero and read as zero (MXCSR FTZ and
// DAZ), as oneDNN recommends: a few of them among a GEMM's operands made the grouped
// expert GEMMs of the MoE backward half again as slow (each one costs a microcode assist,
// 60x a normal operand's cost when every value is one), and no gradient or activation
// that small carries information. Set once on the main thread before any other thread
// exists, so OpenMP's threads (and every other) inherit it. TESSERA_DENORMALS=keep keeps
// IEEE subnormals.
struct FlushDenormals {
  FlushDenormals() {
#if defined(__x86_64__)
    const char* keep = std::getenv("TESSERA_DENORMALS");
    if (keep && std::strcmp(keep, "keep") == 0) return;
    _mm_setcsr(_mm_getcsr() | 0x8040);  // FTZ (bit 15) | DAZ (bit 6)
#endif
  }
} flush_denormals;

int detect_threads() {
  for (const char* var : {"TESSERA_NUM_THREADS", "OMP_NUM_THREADS"}) {
    if (const char* v = std::getenv(var)) {
      int n = std::atoi(v);
      if (n > 0) return n;
    }
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

int& thread_count() {
  static int n = [] {
    int t = detect_threads();
    omp_set_num_threads(t);
    return t;
  }();
  return n;
}

}  // namespace

int num_threads() { return thread_count(); }

void set_num_threads(int n) {
  thread_count() = std::max(1, n);
  omp_set_num_threads(thread_count());
}

int thread_index() { return omp_in_parallel() ? omp_get_thread_num() : 0; }

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t max_chunks = (n + grain - 1) / grain;
  const int nt = static_cast<int>(std::min<int64_t>(num_threads(), max_chunks));
  if (nt <= 1 || omp_in_parallel()) {
    fn(0, n);
    return;
  }
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    const int T = omp_get_num_threads();
    const int64_t begin = n * t / T;
    const int64_t end = n * (t + 1) / T;
    if (begin < end) fn(begin, end);
  }
}

}  // namespace tessera::base
