// The registered-buffer arena (shm_arena.h): set-up of one sparse POSIX segment per rank,
// mapped by every rank of the group, and the first-fit allocator behind alloc_shared.
#include "tessera/comm/shm_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "tessera/base/error.h"
#include "tessera/base/logging.h"

namespace tessera::comm {

namespace {

constexpr int64_t kMinArena = int64_t{64} << 10;
constexpr int64_t kMaxArena = int64_t{1} << 40;

std::atomic<int64_t> g_arena_bytes{0};  // 0: not read from the environment yet

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

std::string segment_name(uint64_t id, int rank) {
  char name[64];
  std::snprintf(name, sizeof name, "/tessera-arena-%016llx-%d", static_cast<unsigned long long>(id),
                rank);
  return name;
}

}  // namespace

int64_t shm_arena_bytes() {
  return env_bytes_setting(g_arena_bytes, 0, "TESSERA_SHM_ARENA_BYTES", int64_t{1} << 30, kMinArena,
                           kMaxArena, 4096);
}

void set_shm_arena_bytes(int64_t bytes) {
  TESSERA_CHECK(bytes >= kMinArena && bytes <= kMaxArena, "shm: arena size ", bytes,
                " bytes is outside [65536, 2^40]");
  g_arena_bytes.store(round_up(bytes, 4096));
}

namespace {
// Measured (docs/performance.md, "Communication"): in place, a rank must wait at the end
// for every peer to finish reading its input, a flag round the slot path defers to the
// next call. With 4 ranks on 2 cores that wait (a futex sleep) cost more than the copy it
// saves up to 64 KiB (0.66-0.95x); from 256 KiB up in place won at 2 and 4 ranks.
constexpr int64_t kRegisteredMinDefault = int64_t{128} << 10;
std::atomic<int64_t> g_registered_min{-1};  // -1: not read from the environment yet
}  // namespace

int64_t shm_registered_min_bytes() {
  return env_bytes_setting(g_registered_min, -1, "TESSERA_SHM_REGISTERED_MIN_BYTES",
                           kRegisteredMinDefault, 0, INT64_MAX, 1);
}

void set_shm_registered_min_bytes(int64_t bytes) {
  TESSERA_CHECK(bytes >= 0, "shm: registered minimum ", bytes, " bytes is negative");
  g_registered_min.store(bytes);
}

ShmArena::ShmArena(int rank, int64_t bytes, int fd, std::vector<void*> bases)
    : rank_(rank), bytes_(bytes), fd_(fd), bases_(std::move(bases)) {
  free_[0] = bytes_;
}

ShmArena::~ShmArena() {
  for (void* b : bases_)
    if (b && b != MAP_FAILED) munmap(b, bytes_);
  if (fd_ >= 0) close(fd_);
}

std::shared_ptr<ShmArena> ShmArena::create(int rank, int size, int64_t bytes,
                                           const ShmGroup::Setup& setup, std::string* why) {
  struct {
    uint64_t id;
    int64_t bytes;
  } hdr{0, 0};
  if (rank == 0) {
    std::random_device rd;
    hdr.id = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(getpid());
    hdr.bytes = round_up(std::clamp(bytes, kMinArena, kMaxArena), 4096);
  }
  setup.broadcast_from_0(&hdr, static_cast<int>(sizeof hdr));
  std::vector<void*> bases(size, MAP_FAILED);
  std::string err;
  const std::string own = segment_name(hdr.id, rank);
  // Own segment: sized but not fallocated (tmpfs backs the pages a block is given, see
  // allocate), and not MAP_POPULATE (that would back all of it).
  int fd = shm_open(own.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  const bool named = fd >= 0;
  if (fd < 0) {
    err = "shm_open(" + own + ", O_CREAT): " + std::strerror(errno);
  } else if (ftruncate(fd, hdr.bytes) != 0) {
    err = "sizing " + own + " to " + std::to_string(hdr.bytes) + " bytes: " + std::strerror(errno);
  } else {
    bases[rank] = mmap(nullptr, hdr.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (bases[rank] == MAP_FAILED) err = "mmap of " + own + ": " + std::strerror(errno);
  }
  // Peers only ever read this rank's arena, so they map it read only.
  if (setup.all_ok(err.empty())) {
    for (int r = 0; r < size && err.empty(); ++r) {
      if (r == rank) continue;
      const std::string name = segment_name(hdr.id, r);
      const int pfd = shm_open(name.c_str(), O_RDONLY, 0);
      if (pfd < 0) {
        err = "shm_open(" + name + "): " + std::strerror(errno);
        break;
      }
      bases[r] = mmap(nullptr, hdr.bytes, PROT_READ, MAP_SHARED, pfd, 0);
      if (bases[r] == MAP_FAILED) err = "mmap of " + name + ": " + std::strerror(errno);
      close(pfd);
    }
    if (!setup.all_ok(err.empty()) && err.empty()) err = "another rank could not map the arenas";
  } else if (err.empty()) {
    err = "another rank could not create its arena";
  }
  // Every rank has every arena mapped (or gave up): the names can go.
  if (named) shm_unlink(own.c_str());
  if (!err.empty()) {
    for (void* b : bases)
      if (b != MAP_FAILED) munmap(b, hdr.bytes);
    if (fd >= 0) close(fd);
    if (why) *why = err;
    return nullptr;
  }
  return std::shared_ptr<ShmArena>(new ShmArena(rank, hdr.bytes, fd, std::move(bases)));
}

int64_t ShmArena::alloc_block(int64_t bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < bytes) continue;
    const int64_t off = it->first, rest = it->second - bytes;
    free_.erase(it);
    if (rest > 0) free_[off + bytes] = rest;
    // tmpfs backs pages on first touch, and a full /dev/shm then raises SIGBUS inside
    // whatever touches them; posix_fallocate reserves them now and fails cleanly. First
    // fit keeps blocks low, so a reserved prefix covers them without a call per block.
    if (off + bytes > reserved_) {
      const int64_t end = std::min(bytes_, round_up(off + bytes, int64_t{2} << 20));
      const int rc = posix_fallocate(fd_, reserved_, end - reserved_);
      if (rc != 0) {
        free_[off] = bytes;  // undo, coalescing with the remainder
        auto next = free_.find(off + bytes);
        if (next != free_.end()) {
          free_[off] += next->second;
          free_.erase(next);
        }
        if (!warned_)
          TESSERA_LOG(kWarn, "shm: rank ", rank_, " could not reserve ", end - reserved_,
                      " bytes of its arena in /dev/shm (", std::strerror(rc),
                      "); alloc_shared falls back to ordinary memory");
        warned_ = true;
        return -1;
      }
      reserved_ = end;
    }
    in_use_ += bytes;
    return off;
  }
  if (!warned_)
    TESSERA_LOG(kWarn, "shm: rank ", rank_, "'s arena (", bytes_, " bytes, ", in_use_,
                " in use) has no free block of ", bytes,
                " bytes; alloc_shared falls back to ordinary memory (TESSERA_SHM_ARENA_BYTES)");
  warned_ = true;
  return -1;
}

void ShmArena::free_block(int64_t offset, int64_t bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  in_use_ -= bytes;
  auto it = free_.emplace(offset, bytes).first;
  auto next = std::next(it);
  if (next != free_.end() && it->first + it->second == next->first) {
    it->second += next->second;
    free_.erase(next);
  }
  if (it != free_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      free_.erase(it);
    }
  }
}

Tensor ShmArena::allocate(const std::shared_ptr<ShmArena>& arena, const Shape& shape, DType dtype) {
  const int64_t numel = shape_numel(shape);
  const int64_t bytes = round_up(std::max<int64_t>(1, numel * static_cast<int64_t>(dtype_size(dtype))),
                                 kAlign);
  const int64_t off = arena->alloc_block(bytes);
  if (off < 0) return Tensor();
  void* p = static_cast<char*>(arena->bases_[arena->rank_]) + off;
  // The owner handle gives the block back when the last view goes; it holds the arena.
  std::shared_ptr<void> owner(p, [arena, off, bytes](void*) { arena->free_block(off, bytes); });
  return Tensor::from_blob(p, shape, dtype, std::move(owner));
}

int64_t ShmArena::offset_of(const void* p, int64_t bytes) const {
  const char* b = static_cast<const char*>(bases_[rank_]);
  const char* q = static_cast<const char*>(p);
  if (q < b || bytes < 0 || q + bytes > b + bytes_) return -1;
  return q - b;
}

int64_t ShmArena::bytes_in_use() const {
  std::lock_guard<std::mutex> lk(mu_);
  return in_use_;
}

bool shm_registered(Communicator& c, const Tensor& t) {
  auto* h = dynamic_cast<ShmHost*>(&c);
  const ShmArena* a = h ? h->shm_arena() : nullptr;
  return a && t.defined() && a->offset_of(t.raw_data(), static_cast<int64_t>(t.nbytes())) >= 0;
}

}  // namespace tessera::comm
