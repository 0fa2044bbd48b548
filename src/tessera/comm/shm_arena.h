// Registered ("zero-copy") buffers for the shm collectives: per rank one large POSIX
// shared-memory arena that every rank of the group maps, and a first-fit allocator over
// this rank's own one. See docs/comm.md, "Registered buffers".
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tessera/comm/shm_collectives.h"
#include "tessera/tensor/tensor.h"

namespace tessera::comm {

// Bytes of each rank's arena in communicators whose arena is made from now on (default
// 1 GiB; TESSERA_SHM_ARENA_BYTES overrides it at start-up; rank 0's value counts). The
// segment is sparse: tmpfs backs only the pages a tensor was ever given. >= 64 KiB.
int64_t shm_arena_bytes();
void set_shm_arena_bytes(int64_t bytes);

// A registered input smaller than this many bytes takes the slot path anyway (default
// 128 KiB, measured: shm_arena.cc; TESSERA_SHM_REGISTERED_MIN_BYTES at start-up). Each
// rank applies it to its own input, so ranks need not agree.
int64_t shm_registered_min_bytes();
void set_shm_registered_min_bytes(int64_t bytes);

class ShmArena {
 public:
  // Collective, with ShmGroup::create's conventions: rank 0 picks a name and the size,
  // every rank creates its own segment, then maps every peer's (read only), then each
  // unlinks its own. nullptr on every rank when any rank failed (`why` says what).
  static std::shared_ptr<ShmArena> create(int rank, int size, int64_t bytes,
                                          const ShmGroup::Setup& setup, std::string* why);
  ~ShmArena();
  ShmArena(const ShmArena&) = delete;
  ShmArena& operator=(const ShmArena&) = delete;

  // A contiguous, uninitialised tensor in this rank's arena, or an undefined Tensor when
  // no free block is large enough or tmpfs cannot back it (then the caller falls back to
  // ordinary memory). Thread safe; the block returns to the arena when the last view of
  // the tensor goes, on whatever thread that happens (the arena outlives its tensors).
  static Tensor allocate(const std::shared_ptr<ShmArena>& arena, const Shape& shape, DType dtype);

  // Offset of [p, p + bytes) in this rank's arena; -1 when it is not entirely inside.
  int64_t offset_of(const void* p, int64_t bytes) const;
  // Rank r's arena as mapped here (read only for peers; this rank's own is writable).
  const char* base(int r) const { return static_cast<const char*>(bases_[r]); }
  int64_t bytes() const { return bytes_; }
  int64_t bytes_in_use() const;  // allocated blocks, rounded up to kAlign
  // Collectives that read this rank's input in place (ShmGroup counts them; for tests).
  void count_registered_call() const { registered_calls_.fetch_add(1, std::memory_order_relaxed); }
  int64_t registered_calls() const { return registered_calls_.load(); }

  static constexpr int64_t kAlign = 64;  // every block starts on a cache line

 private:
  ShmArena(int rank, int64_t bytes, int fd, std::vector<void*> bases);
  int64_t alloc_block(int64_t bytes);  // offset, or -1
  void free_block(int64_t offset, int64_t bytes);

  int rank_;
  int64_t bytes_;
  int fd_;                     // this rank's segment (unlinked): fallocate reserves pages
  std::vector<void*> bases_;   // per rank, bytes_ each
  mutable std::mutex mu_;      // guards everything below
  std::map<int64_t, int64_t> free_;  // offset -> size of each free block, coalesced
  int64_t in_use_ = 0;
  int64_t reserved_ = 0;       // [0, reserved_) has tmpfs pages behind it (posix_fallocate)
  bool warned_ = false;        // logged "arena full" once
  mutable std::atomic<int64_t> registered_calls_{0};
};

// True when every byte of t lies in c's arena (t came from c.alloc_shared on a backend
// with one). For tests and the bench's output.
bool shm_registered(Communicator& c, const Tensor& t);

}  // namespace tessera::comm
