// The thread pool every kernel uses. It is OpenMP's team: oneDNN (Debian's build)
// runs on OpenMP too, so sharing one team keeps two sets of spinning workers from
// fighting over the same cores.
#pragma once
#include <cstdint>
#include <functional>

namespace tessera::base {

// Worker count: TESSERA_NUM_THREADS, else OMP_NUM_THREADS, else the cores we may run on.
int num_threads();
void set_num_threads(int n);

// Runs fn(begin, end) over [0, n) split into contiguous chunks of at least `grain`
// items, one chunk per worker at most. Runs inline when n is small.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// Index of the calling worker inside parallel_for (0 outside).
int thread_index();

}  // namespace tessera::base
