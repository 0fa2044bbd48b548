// Intra-node collectives through POSIX shared memory (Algorithm::kShm): the ranks of one
// machine copy their data into one shared segment and reduce straight out of each other's
// slots, instead of moving it through MPI point to point. See docs/comm.md, "shm".
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "tessera/comm/communicator.h"

namespace tessera::comm {

enum class ShmCollective { kAllReduce, kReduceScatter, kAllGather };
class ShmArena;  // shm_arena.h: registered buffers every rank of the group can read

// True when kShm can run on c: an `mpi` communicator of two or more ranks that all share
// one node, whose segment set-up has not failed. The same answer on every rank.
bool shm_available(Communicator& c);

// Whether a group of this size on this machine has more ranks than CPUs (then every
// shm wait sleeps, and small collectives take the gathered path).
bool ranks_outnumber_cores(int group_size);

// What kAuto runs on a group that shm serves (one node), ahead of the algo:: tables:
// kShm where it was measured fastest for `op` at `bytes` (the whole buffer in the
// working dtype, as the algo::auto_* tables count it), kHalvingDoubling for the small
// collectives where that won with more ranks than cores, kAuto (the tables decide)
// elsewhere, including every group shm cannot serve. The same answer on every rank.
Algorithm shm_auto_choice(Communicator& c, ShmCollective op, int64_t bytes);

// The collectives, with the buffer conventions of communicator.h's backend_* hooks:
// reductions on f32, i32 or i64 with kSum or kMax (the caller converts bf16/f16 and
// divides for kAvg). reduce_scatter: in (n) -> out (chunk_range(n, size, rank).size());
// all_gather: in (this rank's chunk) -> out (n). Where shm is not available they run the
// ring over c's point to point on `tag` (as kHierarchical runs the ring on one node).
// Where a rank's input lies in its registered arena (Communicator::alloc_shared), that
// rank skips copying it into its slots and peers read it in place (docs/comm.md).
void shm_all_reduce(Communicator& c, int tag, void* data, int64_t n, DType dt, ReduceOp op);
void shm_reduce_scatter(Communicator& c, int tag, const void* in, void* out, int64_t n, DType dt,
                        ReduceOp op);
void shm_all_gather(Communicator& c, int tag, const void* in, void* out, int64_t n, int64_t elem);

// Bytes of one of a rank's two pipeline slots in communicators created from now on
// (default 1 MiB, measured: docs/comm.md; TESSERA_SHM_SLOT_BYTES overrides it at
// start-up). Tests shrink it so that small messages already take several pipelined
// steps. >= 4096.
int64_t shm_slot_bytes();
// A byte-count setting of the shm path: read once from environment variable `env` (else
// `fallback`), checked against [lo, hi], rounded up to `align` and cached in `cache`, which
// holds `unset` until then (set_shm_*() store into the same cache).
int64_t env_bytes_setting(std::atomic<int64_t>& cache, int64_t unset, const char* env,
                          int64_t fallback, int64_t lo, int64_t hi, int64_t align);
void set_shm_slot_bytes(int64_t bytes);

// One shared segment for the ranks of a group on one node: per rank a header of sequence
// flags and two data slots. Collectives run in pipelined steps of at most one slot; step
// numbers continue from collective to collective, so a flag from an earlier call never
// satisfies a later wait. One collective at a time (communicator.h's contract).
class ShmGroup {
 public:
  // The group-wide calls set-up needs, supplied by the backend (MPI for `mpi`).
  struct Setup {
    std::function<void(void* data, int bytes)> broadcast_from_0;
    std::function<bool(bool ok)> all_ok;  // logical AND over the group
  };
  // Collective: rank 0 creates and sizes the segment (with its slot_bytes: the others'
  // are ignored), the others map it, then it is unlinked (so nothing is left in /dev/shm
  // once every rank has it mapped). nullptr on every rank when any rank failed; `why`
  // then says what failed here (or elsewhere).
  static std::unique_ptr<ShmGroup> create(int rank, int size, int64_t slot_bytes,
                                          const Setup& setup, std::string* why);
  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  // `arena`: this group's registered-buffer arena, or nullptr. A rank whose input (all
  // of it; the all-reduce's data, the all-gather's chunk) lies in its own arena skips the
  // copy into its slots: its slot descriptors carry the input's offset, peers read it in
  // place, and the rank returns only once every peer is done reading. Ranks decide this
  // each on their own, so registered and unregistered ranks mix in one collective.
  void all_reduce(void* data, int64_t n, DType dt, ReduceOp op, const ShmArena* arena = nullptr);
  void reduce_scatter(const void* in, void* out, int64_t n, DType dt, ReduceOp op,
                      const ShmArena* arena = nullptr);
  void all_gather(const void* in, void* out, int64_t n, int64_t elem,
                  const ShmArena* arena = nullptr);

 private:
  struct Plan;
  Plan reduction_plan(int64_t n, DType dt) const;  // all-reduce / reduce-scatter steps
  ShmGroup(int rank, int size, void* base, int64_t bytes, int64_t slot_bytes);
  void run(const Plan& plan, ShmCollective op, const void* in, void* out, DType dt, ReduceOp red,
           const ShmArena* arena);
  char* area(int r) const;  // rank r's header + slots
  char* slot(int r, uint64_t step) const;
  uint64_t* flag_word(int r, int flag) const;
  uint32_t* sleepers_word(int r, int flag) const;
  uint64_t peek(int r, int flag) const;           // acquire load of rank r's flag
  void publish(int flag, uint64_t value);         // this rank's flag; wakes sleepers
  void publish_at(int owner, int flag, uint64_t value);  // rank owner's flag (shared counters)
  void wait_flag(int peer, int flag, uint64_t target, const char* phase);

  int rank_, size_;
  void* base_;
  int64_t bytes_, slot_bytes_, area_bytes_;
  uint64_t step_ = 0;     // global pipeline steps run so far (equal on every rank)
  uint64_t gathered_ = 0;      // gathered-path collectives run so far (equal on every rank)
  int64_t gathered_max_ = 0;   // largest collective (bytes) for the gathered path; 0: off
  bool broken_ = false;   // an error left the flags mid-collective: refuse further calls
  std::chrono::steady_clock::duration spin_limit_;  // spin this long before yielding
};

// Implemented by backends that can give a communicator a ShmGroup (the mpi backend).
class ShmHost {
 public:
  virtual ~ShmHost() = default;
  // Whether every rank of the group is on this node and set-up has not failed.
  virtual bool shm_possible() const = 0;
  // The group, created (collectively) on first call; nullptr when set-up failed, after
  // which shm_possible() is false on every rank.
  virtual ShmGroup* shm_group() = 0;
  // The registered-buffer arena if it has been made (by alloc_shared); never creates it.
  virtual ShmArena* shm_arena() { return nullptr; }
};

}  // namespace tessera::comm
