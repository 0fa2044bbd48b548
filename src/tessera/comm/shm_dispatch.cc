// The communicator-facing side of the shared-memory collectives (shm_collectives.h):
// whether a group can use them, what `auto` runs on one node, and the calls that fall
// back to our point-to-point algorithms where there is no shared segment.
#include <cstring>
#include <vector>

#include "tessera/comm/algorithms.h"
#include "tessera/comm/shm_arena.h"
#include "tessera/comm/shm_collectives.h"

namespace tessera::comm {

namespace {
ShmHost* host_of(Communicator& c) { return dynamic_cast<ShmHost*>(&c); }
}  // namespace

bool shm_available(Communicator& c) {
  ShmHost* h = c.size() > 1 ? host_of(c) : nullptr;
  return h && h->shm_possible();
}

// Measured with `tessera bench comm` (docs/performance.md, "Communication"; 2 and 4 ranks
// on a 2-core VM, 4 KiB - 256 MiB). all_reduce and reduce_scatter: shm was the fastest or
// within the noise at every size with a core per rank; MPI's own costs a copy more per
// byte (and a fresh temporary buffer per call above 32 MiB), ring and hd pay an MPI
// message per step.
Algorithm shm_auto_choice(Communicator& c, ShmCollective op, int64_t bytes) {
  if (!shm_available(c)) return Algorithm::kAuto;
  // All-gather from ordinary memory on 2 ranks: MPI's single-copy path beat our two
  // copies above 64 KiB (0.8x); from registered buffers (alloc_shared: the trainer's
  // weights, the bench) shm wins at every size (1.2-2.4x), and those are the all-gathers
  // that matter, so shm is the choice throughout.
  // With more ranks than cores the small collectives take the gathered path (one sleep
  // per rank; run()). Measured at 4 ranks on 2 cores with the ranks pinned 2 per core
  // (mpirun --bind-to core:overload-allowed; unpinned runs scatter by 1.2-3x from sweep to
  // sweep), 2026-12-01: halving-doubling was fastest, by 1.1-1.5x, for all-gathers up to
  // 64 KiB and all-reduces of 4 KiB; reduce-scatters up to 64 KiB tied between it and MPI's
  // own (the table's choice). From 16 KiB (all-reduce) and 256 KiB (the others) shm won.
  if (ranks_outnumber_cores(c.size())) {
    const int64_t small = op == ShmCollective::kAllReduce ? int64_t{4} << 10 : int64_t{64} << 10;
    if (bytes <= small)
      return op == ShmCollective::kReduceScatter ? Algorithm::kAuto : Algorithm::kHalvingDoubling;
  }
  return Algorithm::kShm;
}

namespace {
ShmGroup* group_of(Communicator& c) { return shm_available(c) ? host_of(c)->shm_group() : nullptr; }
ShmArena* arena_of(Communicator& c) { return host_of(c)->shm_arena(); }  // after group_of
}  // namespace

void shm_all_reduce(Communicator& c, int tag, void* data, int64_t n, DType dt, ReduceOp op) {
  if (ShmGroup* g = group_of(c))
    g->all_reduce(data, n, dt, op, arena_of(c));
  else
    algo::ring_all_reduce(c, tag, data, n, dt, op);
}

void shm_reduce_scatter(Communicator& c, int tag, const void* in, void* out, int64_t n, DType dt,
                        ReduceOp op) {
  if (ShmGroup* g = group_of(c)) {
    g->reduce_scatter(in, out, n, dt, op, arena_of(c));
    return;
  }
  const int64_t e = dtype_size(dt);
  std::vector<char> w(static_cast<const char*>(in), static_cast<const char*>(in) + n * e);
  algo::ring_reduce_scatter(c, tag, w.data(), n, dt, op);
  const ChunkRange mine = chunk_range(n, c.size(), c.rank());
  std::memcpy(out, w.data() + mine.begin * e, mine.size() * e);
}

void shm_all_gather(Communicator& c, int tag, const void* in, void* out, int64_t n, int64_t elem) {
  if (ShmGroup* g = group_of(c)) {
    g->all_gather(in, out, n, elem, arena_of(c));
    return;
  }
  const ChunkRange mine = chunk_range(n, c.size(), c.rank());
  char* o = static_cast<char*>(out);
  if (mine.size() > 0 && o + mine.begin * elem != in)
    std::memmove(o + mine.begin * elem, in, mine.size() * elem);
  algo::ring_all_gather(c, tag, out, n, elem);
}

}  // namespace tessera::comm
