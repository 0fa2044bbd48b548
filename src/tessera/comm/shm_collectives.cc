// The shared-memory collectives (shm_collectives.h): segment set-up, the pipelined
// reduce-scatter / all-reduce / all-gather over per-rank slots, and flag waits that spin,
// then sleep on a futex (ranks may outnumber cores), and let the collective's watchdog fire.
#include "tessera/comm/shm_collectives.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "tessera/base/cpu_features.h"
#include "tessera/base/error.h"
#include "tessera/base/logging.h"
#include "tessera/comm/algorithms.h"
#include "tessera/comm/shm_arena.h"
#include "tessera/comm/watchdog.h"

namespace tessera::comm {

namespace {

// Layout of one rank's area: a 4 KiB header, then slot 0 and slot 1. The header holds
// three sequence flags, each on its own cache line (a rank spinning on one flag must not
// steal the line its owner is writing another to) next to a count of peers asleep on it
// (futex), and one descriptor per slot.
//   written: steps whose input pieces are in this rank's slot   (= last step + 1)
//   reduced: steps whose reduced piece is in this rank's slot   (all-reduce only)
//   done:    steps this rank has finished reading peers' slots for
// A slot is reused two steps later, once every peer's `done` shows it read the old data.
// Rank 0's header also holds the two group-wide counters of the gathered path (run()):
//   arrived:  ranks that have entered gathered collectives (N per collective)
//   released: gathered collectives whose result the last rank to arrive has written
constexpr int64_t kHeaderBytes = 4096;
constexpr int64_t kLine = 64;
enum Flag { kWritten = 0, kReduced = 1, kDone = 2, kArrived = 5, kReleased = 6 };
constexpr int64_t kDescOffset = 3 * kLine;  // then one line per slot (lines 3 and 4)

// What a rank put in a slot; a reader checks it so ranks that disagree on a collective's
// size get an error instead of reading garbage. `reg` >= 0: the rank's input is
// registered (it lies at that offset in the rank's arena) and its slot holds nothing.
struct SlotDesc {
  uint64_t step;
  int64_t n, elem;
  int32_t op;
  int64_t reg;
};
static_assert(sizeof(SlotDesc) <= 64, "a slot descriptor fills at most one cache line");

std::atomic<int64_t> g_slot_bytes{0};  // 0: not read from the environment yet

// The flags are shared between processes: plain (not FUTEX_PRIVATE) futex calls on the
// low 32 bits of the counter (little-endian: same address), which change with every step.
void futex_wait(uint64_t* word, uint32_t seen, const timespec* timeout) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, timeout, nullptr, 0);
}
void futex_wake_all(uint64_t* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// How long a rank with a core of its own spins before sleeping (TESSERA_SHM_SPIN_US).
int64_t spin_us() {
  static const int64_t v = [] {
    const char* env = std::getenv("TESSERA_SHM_SPIN_US");
    return env ? std::max(0LL, std::atoll(env)) : 200LL;
  }();
  return v;
}

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

std::string errno_text(int e) { return std::strerror(e); }

// ---- reduction kernel ----------------------------------------------------------------

// dst1 (and dst2 when given) = src[0] op src[1] op ... op src[m-1], summed in rank order
// (the same bits whichever rank reduces, run after run). Works through an L1-sized
// buffer, so every source is read once and no pointer aliases another inside a loop (the
// all-reduce's own source is its destination).
template <typename T>
[[gnu::always_inline]] inline void reduce_sources_impl(T* dst1, T* dst2, const T* const* src,
                                                        int m, int64_t len, bool max) {
  constexpr int64_t kBlock = 8192 / sizeof(T);
  alignas(64) T tmp[kBlock];
  for (int64_t off = 0; off < len; off += kBlock) {
    const int64_t cnt = std::min(kBlock, len - off);
    const T* __restrict a = src[0] + off;
    const T* __restrict b = src[1] + off;
    if (max) {
      for (int64_t i = 0; i < cnt; ++i) tmp[i] = a[i] < b[i] ? b[i] : a[i];
    } else {
      for (int64_t i = 0; i < cnt; ++i) tmp[i] = a[i] + b[i];
    }
    for (int p = 2; p < m; ++p) {
      const T* __restrict c = src[p] + off;
      if (max) {
        for (int64_t i = 0; i < cnt; ++i) tmp[i] = tmp[i] < c[i] ? c[i] : tmp[i];
      } else {
        for (int64_t i = 0; i < cnt; ++i) tmp[i] += c[i];
      }
    }
    std::memcpy(dst1 + off, tmp, cnt * sizeof(T));
    if (dst2) std::memcpy(dst2 + off, tmp, cnt * sizeof(T));
  }
}

// The build has no -march: an AVX2 copy gives the loops full-width vectors where the CPU
// has them (the data is in L1/L2 here, so width matters more than for DRAM streams).
template <typename T>
__attribute__((target("avx2"))) void reduce_sources_avx2(T* dst1, T* dst2, const T* const* src,
                                                         int m, int64_t len, bool max) {
  reduce_sources_impl(dst1, dst2, src, m, len, max);
}
template <typename T>
void reduce_sources_portable(T* dst1, T* dst2, const T* const* src, int m, int64_t len, bool max) {
  reduce_sources_impl(dst1, dst2, src, m, len, max);
}

template <typename T>
void reduce_sources_t(void* dst1, void* dst2, const void* const* src, int m, int64_t len,
                      bool max) {
  static const bool avx2 = base::cpu_features().avx2;
  auto d1 = static_cast<T*>(dst1), d2 = static_cast<T*>(dst2);
  auto s = reinterpret_cast<const T* const*>(src);
  if (avx2)
    reduce_sources_avx2<T>(d1, d2, s, m, len, max);
  else
    reduce_sources_portable<T>(d1, d2, s, m, len, max);
}

void reduce_sources(void* dst1, void* dst2, const void* const* src, int m, int64_t len, DType dt,
                    ReduceOp op) {
  TESSERA_CHECK(op == ReduceOp::kSum || op == ReduceOp::kMax,
                "shm: reductions receive kSum or kMax (the caller divides for kAvg)");
  const bool max = op == ReduceOp::kMax;
  switch (dt) {
    case DType::kF32:
      return reduce_sources_t<float>(dst1, dst2, src, m, len, max);
    case DType::kI32:
      return reduce_sources_t<int32_t>(dst1, dst2, src, m, len, max);
    case DType::kI64:
      return reduce_sources_t<int64_t>(dst1, dst2, src, m, len, max);
    default:
      fail("shm: reduction on ", dtype_name(dt), " (working dtype must be f32, i32 or i64)");
  }
}

}  // namespace

bool ranks_outnumber_cores(int group_size) {
  static const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  return cpus > 0 && group_size > cpus;
}

// ---- slot size -----------------------------------------------------------------------

int64_t env_bytes_setting(std::atomic<int64_t>& cache, int64_t unset, const char* env,
                          int64_t fallback, int64_t lo, int64_t hi, int64_t align) {
  int64_t v = cache.load(std::memory_order_relaxed);
  if (v != unset) return v;
  v = fallback;
  if (const char* text = std::getenv(env)) {
    const long long e = std::atoll(text);
    TESSERA_CHECK(e >= lo && e <= hi, env, ": ", text, " is not a byte count in [", lo, ", ", hi, "]");
    v = e;
  }
  v = round_up(v, align);
  int64_t expected = unset;
  cache.compare_exchange_strong(expected, v);
  return cache.load();
}

// The gathered path's limit (rank 0's holds for the group): 256 KiB when ranks outnumber
// cores, else off; TESSERA_SHM_GATHERED_MAX_BYTES sets it for any group (0: off), which
// the tests use to run the path on 2 ranks.
std::atomic<int64_t> g_gathered_max{-1};
int64_t gathered_max_setting(int size) {
  const int64_t fallback = ranks_outnumber_cores(size) ? int64_t{256} << 10 : 0;
  return env_bytes_setting(g_gathered_max, -1, "TESSERA_SHM_GATHERED_MAX_BYTES", fallback, 0,
                           int64_t{1} << 30, 1);
}

int64_t shm_slot_bytes() {
  return env_bytes_setting(g_slot_bytes, 0, "TESSERA_SHM_SLOT_BYTES", int64_t{1} << 20, 4096,
                           int64_t{1} << 30, 4096);
}

void set_shm_slot_bytes(int64_t bytes) {
  TESSERA_CHECK(bytes >= 4096 && bytes <= (int64_t{1} << 30), "shm: slot size ", bytes,
                " bytes is outside [4096, 2^30]");
  g_slot_bytes.store(round_up(bytes, 4096));
}

// ---- the group -----------------------------------------------------------------------

// How one collective is cut into pipelined steps. Chunk q (chunk_range(n, N, q)) is cut
// into `steps` pieces; step k moves piece k of every chunk. For the reductions a slot
// holds one region per chunk (region q: piece of chunk q for its owner q; the owner's
// own region carries its reduced piece back out in an all-reduce); for the all-gather
// only the owner's piece, so its pieces can be N times larger.
struct ShmGroup::Plan {
  int64_t n = 0, elem = 0;
  int size = 1;
  int64_t steps = 0;
  int64_t region_bytes = 0;  // distance between regions in a slot
  ChunkRange chunk(int q) const { return chunk_range(n, size, q); }
  ChunkRange piece(int q, int64_t k) const {  // global element range
    const ChunkRange c = chunk(q);
    const int64_t s = c.size() / steps, extra = c.size() % steps;
    const int64_t b = c.begin + k * s + std::min(k, extra);
    return {b, b + s + (k < extra ? 1 : 0)};
  }
};

ShmGroup::ShmGroup(int rank, int size, void* base, int64_t bytes, int64_t slot_bytes)
    : rank_(rank), size_(size), base_(base), bytes_(bytes), slot_bytes_(slot_bytes),
      area_bytes_(kHeaderBytes + 2 * slot_bytes) {
  spin_limit_ = std::chrono::microseconds(ranks_outnumber_cores(size) ? 0 : spin_us());
}

ShmGroup::~ShmGroup() {
  if (base_) munmap(base_, bytes_);
}

char* ShmGroup::area(int r) const { return static_cast<char*>(base_) + r * area_bytes_; }
char* ShmGroup::slot(int r, uint64_t step) const {
  return area(r) + kHeaderBytes + static_cast<int64_t>(step % 2) * slot_bytes_;
}

std::unique_ptr<ShmGroup> ShmGroup::create(int rank, int size, int64_t slot_bytes,
                                           const Setup& setup, std::string* why) {
  // Rank 0 picks the name and the slot size (so a rank with another TESSERA_SHM_SLOT_BYTES
  // cannot disagree); random so that jobs, and groups of one job, never collide.
  struct {
    uint64_t id;
    int64_t slot_bytes;
    int64_t gathered_max;
  } hdr{0, 0, 0};
  if (rank == 0) {
    std::random_device rd;
    hdr.id = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(getpid());
    hdr.slot_bytes = round_up(std::max<int64_t>(slot_bytes, 4096), 4096);
    hdr.gathered_max = gathered_max_setting(size);
  }
  setup.broadcast_from_0(&hdr, static_cast<int>(sizeof hdr));
  char name[64];
  std::snprintf(name, sizeof name, "/tessera-shm-%016llx", static_cast<unsigned long long>(hdr.id));
  const int64_t area = kHeaderBytes + 2 * hdr.slot_bytes;
  const int64_t total = area * size;
  std::string err;
  bool named = false;  // rank 0 created the name (and must unlink it)
  void* base = MAP_FAILED;
  auto map = [&](int fd) {
    // MAP_POPULATE: the page tables for every rank's area are filled now, so the first
    // collective does not pay a page fault per 4 KiB (about 0.75 ms per MiB in some VMs).
    base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (base == MAP_FAILED) err = std::string("mmap of ") + name + ": " + errno_text(errno);
  };
  if (rank == 0) {
    const int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      err = std::string("shm_open(") + name + ", O_CREAT): " + errno_text(errno);
    } else {
      named = true;
      // fallocate reserves the pages now: a full /dev/shm fails here, cleanly, instead of
      // raising SIGBUS at the first touch inside a collective.
      int rc = ftruncate(fd, total) == 0 ? 0 : errno;
      if (rc == 0) rc = posix_fallocate(fd, 0, total);
      if (rc != 0)
        err = std::string("sizing ") + name + " to " + std::to_string(total) +
              " bytes (is /dev/shm full?): " + errno_text(rc);
      else
        map(fd);
      close(fd);
    }
  }
  const bool created = setup.all_ok(err.empty());
  if (created && rank != 0) {
    const int fd = shm_open(name, O_RDWR, 0);
    if (fd < 0) {
      err = std::string("shm_open(") + name + "): " + errno_text(errno);
    } else {
      map(fd);
      close(fd);
    }
  }
  const bool mapped = created && setup.all_ok(err.empty());
  // Every rank has it mapped (or gave up): the name can go, so a job killed from here on
  // leaves nothing behind in /dev/shm.
  if (named) shm_unlink(name);
  if (!mapped) {
    if (base != MAP_FAILED) munmap(base, total);
    if (why) *why = err.empty() ? "another rank could not set up " + std::string(name) : err;
    return nullptr;
  }
  auto group = std::unique_ptr<ShmGroup>(new ShmGroup(rank, size, base, total, hdr.slot_bytes));
  group->gathered_max_ = hdr.gathered_max;
  return group;
}

uint64_t* ShmGroup::flag_word(int r, int flag) const {
  return reinterpret_cast<uint64_t*>(area(r) + flag * kLine);
}
uint32_t* ShmGroup::sleepers_word(int r, int flag) const {
  return reinterpret_cast<uint32_t*>(area(r) + flag * kLine + 8);
}
uint64_t ShmGroup::peek(int r, int flag) const {
  return std::atomic_ref<uint64_t>(*flag_word(r, flag)).load(std::memory_order_acquire);
}

// seq_cst store, then seq_cst load of the sleepers (and the reverse in wait_flag): either
// this rank sees a sleeper and wakes it, or the sleeper sees the new value and never
// sleeps (and FUTEX_WAIT itself refuses to sleep once the word has changed).
void ShmGroup::publish(int flag, uint64_t value) { publish_at(rank_, flag, value); }

void ShmGroup::publish_at(int owner, int flag, uint64_t value) {
  std::atomic_ref<uint64_t>(*flag_word(owner, flag)).store(value, std::memory_order_seq_cst);
  if (std::atomic_ref<uint32_t>(*sleepers_word(owner, flag)).load(std::memory_order_seq_cst) != 0)
    futex_wake_all(flag_word(owner, flag));
}

void ShmGroup::wait_flag(int peer, int flag, uint64_t target, const char* phase) {
  if (peek(peer, flag) >= target) return;
  // With a core per rank the peer is running: spin (pause), as MPI's own progress loop
  // does; the usual wait is a few microseconds. Past spin_limit_ (the peer was
  // descheduled, or shares this core: 4 ranks on 2 cores get a limit near zero) sleep on
  // the flag's futex until the peer publishes. Not sched_yield: that hands the core to
  // any other runnable process (a build) for a whole time slice, milliseconds, measured;
  // a sleeper woken by the futex is scheduled ahead of such CPU hogs.
  WatchdogScope* scope = WatchdogScope::current();
  const auto start = WatchdogScope::Clock::now();
  std::atomic_ref<uint64_t> f(*flag_word(peer, flag));
  std::atomic_ref<uint32_t> sleepers(*sleepers_word(peer, flag));
  bool sleeping = false;
  for (uint64_t i = 1;; ++i) {
    if (sleeping) {
      sleepers.fetch_add(1, std::memory_order_seq_cst);
      const uint64_t seen = f.load(std::memory_order_seq_cst);
      if (seen < target) {
        const timespec tick{0, 10 * 1000 * 1000};  // 10 ms: look at the watchdog
        futex_wait(flag_word(peer, flag), static_cast<uint32_t>(seen), &tick);
      }
      sleepers.fetch_sub(1, std::memory_order_seq_cst);
    } else {
      __builtin_ia32_pause();
    }
    if (f.load(std::memory_order_acquire) >= target) return;
    if (!sleeping && (i & 15) != 0) continue;
    const auto now = WatchdogScope::Clock::now();
    if (now - start > spin_limit_) sleeping = true;
    if (scope && scope->enabled() && now > scope->deadline()) {
      broken_ = true;
      TESSERA_LOG(kError, "shm: rank ", rank_, "/", size_, " waited for rank ", peer, " (", phase,
                  " of step ", target - 1, "); the flag shows ", f.load(), "");
      scope->expire();  // logs, runs the timeout handler (abort by default), throws
    }
  }
}

void ShmGroup::run(const Plan& P, ShmCollective op, const void* in_v, void* out_v, DType dt,
                   ReduceOp red, const ShmArena* arena) {
  TESSERA_CHECK(!broken_, "shm: this group's shared segment was left mid-collective by an earlier "
                          "error (watchdog timeout or size mismatch); it cannot be used again");
  const int r = rank_, N = size_;
  const int64_t e = P.elem;
  const char* in = static_cast<const char*>(in_v);
  char* out = static_cast<char*>(out_v);
  const bool gather_only = op == ShmCollective::kAllGather;
  const ChunkRange mine = P.chunk(r);
  // Element offset of piece k of my chunk inside `in` (all-gather, whose in is the chunk)
  // or `out` (reduce-scatter, whose out is the chunk); the all-reduce's buffers are whole.
  const int64_t in_base = gather_only ? mine.begin : 0;
  const int64_t out_base = op == ShmCollective::kReduceScatter ? mine.begin : 0;
  // Registered input (all of `in` inside this rank's arena): no copy into the slots, peers
  // read it in place. reg[p]: peer p's input offset in its arena, -1 when it used its
  // slots, learned from its descriptor of each step.
  const int64_t in_bytes = (gather_only ? mine.size() : P.n) * e;
  const int64_t my_reg = arena && in_bytes > 0 && in_bytes >= shm_registered_min_bytes()
                             ? arena->offset_of(in, in_bytes)
                             : -1;
  if (my_reg >= 0) arena->count_registered_call();
  std::vector<int64_t> reg(N, -1);
  std::vector<const void*> srcs(N);
  std::vector<int> pending;
  pending.reserve(N);
  auto check_desc = [&](int p, uint64_t g) {
    const SlotDesc* d = reinterpret_cast<const SlotDesc*>(area(p) + kDescOffset + (g % 2) * kLine);
    if (d->step == g && d->n == P.n && d->elem == e && d->op == static_cast<int32_t>(op)) {
      reg[p] = d->reg;
      if (d->reg < 0 || arena) return;  // arenas are made collectively: all ranks or none
      broken_ = true;
      fail("shm: rank ", p, " offers its input in its arena, but rank ", r, " has no arena mapped");
    }
    broken_ = true;
    fail("shm: ranks disagree on a collective: rank ", r, " runs ", static_cast<int>(op), " of ",
         P.n, " x ", e, " bytes at step ", g, ", rank ", p, " wrote ", d->op, " of ", d->n, " x ",
         d->elem, " bytes at step ", d->step);
  };

  const bool reducing = !gather_only, gathering = op != ShmCollective::kReduceScatter;
  // Where peer p's piece lies: at byte `at` of its registered input, or in its slot.
  auto peer_src = [&](int p, uint64_t g, int64_t at, int64_t region) -> const char* {
    return reg[p] >= 0 ? arena->base(p) + reg[p] + at : slot(p, g) + region;
  };

  // Step k = global step step_ + k. write(k) puts my pieces of step k in my slot (unless
  // registered) and describes them; with own_region (the gathered path) a reduction's
  // slot gets my own chunk's piece too, for the rank that reduces it.
  auto write = [&](int64_t k, bool own_region = false) {
    const uint64_t g = step_ + k;
    char* my = slot(r, g);
    // My slot and descriptor g % 2 are free once every peer has finished step g - 2.
    if (g >= 2)
      for (int p = 0; p < N; ++p)
        if (p != r) wait_flag(p, kDone, g - 1, "done");
    if (gather_only) {
      const ChunkRange own = P.piece(r, k);
      const char* src = in + (own.begin - in_base) * e;
      if (my_reg < 0) std::memcpy(my, src, own.size() * e);
      if (out + own.begin * e != src) std::memcpy(out + own.begin * e, src, own.size() * e);
    } else if (my_reg < 0) {
      for (int q = 0; q < N; ++q) {
        if (q == r && !own_region) continue;
        const ChunkRange pc = P.piece(q, k);
        std::memcpy(my + q * P.region_bytes, in + pc.begin * e, pc.size() * e);
      }
    }
    SlotDesc* d = reinterpret_cast<SlotDesc*>(area(r) + kDescOffset + (g % 2) * kLine);
    *d = SlotDesc{g, P.n, e, static_cast<int32_t>(op), my_reg};
    publish(kWritten, g + 1);
  };
  // reduce(Q, k): my chunk's piece k of plan Q (P, or P in one piece) from my input and
  // every peer's region r, in rank order.
  auto reduce = [&](const Plan& Q, int64_t k) {
    const uint64_t g = step_ + k;
    const ChunkRange own = Q.piece(r, k);
    for (int p = 0; p < N; ++p) {
      if (p == r) {
        srcs[p] = in + own.begin * e;
        continue;
      }
      wait_flag(p, kWritten, g + 1, "written");
      check_desc(p, g);
      srcs[p] = peer_src(p, g, own.begin * e, r * Q.region_bytes);
    }
    // A registered all-reduce leaves its reduced piece in place (in == out) for the peers.
    const bool all_reduce = op == ShmCollective::kAllReduce;
    reduce_sources(out + (own.begin - out_base) * e,
                   all_reduce && my_reg < 0 ? slot(r, g) + r * Q.region_bytes : nullptr,
                   srcs.data(), N, own.size(), dt, red);
    if (all_reduce) publish(kReduced, g + 1);
  };
  // gather(k): every peer's piece k out of its slot, whichever peer is ready first.
  auto gather = [&](const Plan& Q, int64_t k) {
    const uint64_t g = step_ + k;
    const int flag = gather_only ? kWritten : kReduced;
    pending.clear();
    for (int p = 0; p < N; ++p)
      if (p != r) pending.push_back(p);
    while (!pending.empty()) {
      size_t kept = 0;
      for (int p : pending) {
        if (peek(p, flag) < g + 1) {
          pending[kept++] = p;
          continue;
        }
        if (gather_only) check_desc(p, g);  // (the all-reduce's reduce(k) checked it)
        const ChunkRange pc = Q.piece(p, k);
        const int64_t at = (pc.begin - (gather_only ? Q.chunk(p).begin : 0)) * e;
        std::memcpy(out + pc.begin * e, peer_src(p, g, at, gather_only ? 0 : p * Q.region_bytes),
                    pc.size() * e);
      }
      pending.resize(kept);
      if (!pending.empty())
        wait_flag(pending.front(), flag, g + 1, gather_only ? "written" : "reduced");
    }
  };

  // Whether this rank and every peer offered a registered input at step 0 (waits for
  // the peers' step-0 descriptors).
  auto all_registered = [&] {
    if (my_reg < 0) return false;
    for (int p = 0; p < N; ++p) {
      if (p == r) continue;
      wait_flag(p, kWritten, step_ + 1, "written");
      check_desc(p, step_);
      if (reg[p] < 0) return false;
    }
    return true;
  };

  // Gathered path, for small collectives when ranks outnumber cores (gathered_max_ > 0
  // only then): every wait of the stepped protocol below may be a futex sleep and a
  // context switch there. Instead each rank puts all its input in its slot (its own
  // chunk too) and counts itself in; the last rank to arrive does the whole reduction,
  // chunk q into rank q's region q, and releases the others, who copy their results out.
  // One sleep per rank. The reduction is in rank order like the stepped one, so the bits
  // do not depend on which rank arrived last. Every rank decides alike (n, the plan and
  // rank 0's limit).
  if (P.steps == 1 && P.n * e <= gathered_max_) {
    const uint64_t g = step_;
    // (write's wait for step g - 2 also frees the peers' regions g % 2 that I may write.)
    write(0, true);
    reg[r] = my_reg;
    const uint64_t call = gathered_;
    const uint64_t before =
        std::atomic_ref<uint64_t>(*flag_word(0, kArrived)).fetch_add(1, std::memory_order_seq_cst);
    if (before / N != call) {
      broken_ = true;
      fail("shm: rank ", r, " entered gathered collective ", call, " but the group's arrival count ",
           before, " says ", before / N, " (ranks disagree on the collectives they run)");
    }
    if (before % N == static_cast<uint64_t>(N - 1)) {  // last to arrive: everyone's input is in
      for (int p = 0; p < N; ++p)
        if (p != r) check_desc(p, g);
      if (reducing)
        for (int q = 0; q < N; ++q) {
          const ChunkRange c = P.chunk(q);
          for (int p = 0; p < N; ++p) srcs[p] = peer_src(p, g, c.begin * e, q * P.region_bytes);
          reduce_sources(slot(q, g) + q * P.region_bytes, nullptr, srcs.data(), N, c.size(), dt,
                         red);
        }
      publish_at(0, kReleased, call + 1);
    } else {
      wait_flag(0, kReleased, call + 1, "release by the last rank to arrive");
      for (int p = 0; p < N; ++p)
        if (p != r) check_desc(p, g);
    }
    if (op == ShmCollective::kReduceScatter) {
      std::memcpy(out, slot(r, g) + r * P.region_bytes, mine.size() * e);
    } else {
      for (int q = 0; q < N; ++q) {
        const ChunkRange c = P.chunk(q);
        if (gather_only && q == r) continue;
        std::memcpy(out + c.begin * e,
                    gather_only ? peer_src(q, g, 0, 0) : slot(q, g) + q * P.region_bytes,
                    c.size() * e);
      }
      if (op == ShmCollective::kAllReduce) publish(kReduced, g + 1);
    }
    publish(kDone, g + 1);
    ++gathered_;
    ++step_;
    if (my_reg >= 0 && gather_only)  // peers copy a registered chunk after the release
      for (int p = 0; p < N; ++p)
        if (p != r) wait_flag(p, kDone, step_, "done reading a registered input");
    return;
  }

  // Software-pipelined: step k + 1's pieces go in between reducing and gathering step k,
  // so a peer a little behind finishes its reduction while this rank copies instead of
  // waiting. write(k + 1) needs peers done with step k - 1, published an iteration ago.
  if (P.steps > 0) write(0);
  if (P.steps > 1 && all_registered()) {
    // Every input is registered: peers' whole inputs are readable now, so the collective
    // runs as one piece, with one round of waits instead of one per step (with more ranks
    // than cores each wait can be a futex sleep). Every rank reads the same step-0
    // descriptors, so all of them take this path or none. The flags end where the
    // stepped path leaves them.
    Plan whole = P;
    whole.steps = 1;
    if (gather_only && out + mine.begin * e != in)  // my own chunk (write(0) copied piece 0)
      std::memcpy(out + mine.begin * e, in, mine.size() * e);
    if (reducing) reduce(whole, 0);
    if (op == ShmCollective::kAllReduce) publish(kReduced, step_ + P.steps);
    if (gathering) gather(whole, 0);
    publish(kWritten, step_ + P.steps);
    publish(kDone, step_ + P.steps);
  } else {
    for (int64_t k = 0; k < P.steps; ++k) {
      if (reducing) reduce(P, k);
      if (k + 1 < P.steps) write(k + 1);
      if (gathering) gather(P, k);
      publish(kDone, step_ + k + 1);  // done reading peers' slots for this step
    }
  }
  step_ += P.steps;
  // Peers read a registered input in place: the caller may reuse it only once they are
  // all done (an unregistered rank's slots are protected by the next call's `done` waits).
  if (my_reg >= 0)
    for (int p = 0; p < N; ++p)
      if (p != r) wait_flag(p, kDone, step_, "done reading a registered input");
}

namespace {
// Steps of at most one slot: a reduction's slot holds one region per rank.
int64_t plan_steps(int64_t max_chunk, int64_t region_bytes, int64_t elem) {
  if (max_chunk == 0) return 0;
  const int64_t per = std::max<int64_t>(1, region_bytes / elem);
  return (max_chunk + per - 1) / per;
}
}  // namespace

ShmGroup::Plan ShmGroup::reduction_plan(int64_t n, DType dt) const {
  Plan P;
  P.n = n;
  P.elem = dtype_size(dt);
  P.size = size_;
  P.region_bytes = slot_bytes_ / size_ / kLine * kLine;
  P.steps = plan_steps(chunk_range(n, size_, 0).size(), P.region_bytes, P.elem);
  return P;
}

void ShmGroup::all_reduce(void* data, int64_t n, DType dt, ReduceOp op, const ShmArena* arena) {
  run(reduction_plan(n, dt), ShmCollective::kAllReduce, data, data, dt, op, arena);
}

void ShmGroup::reduce_scatter(const void* in, void* out, int64_t n, DType dt, ReduceOp op,
                              const ShmArena* arena) {
  run(reduction_plan(n, dt), ShmCollective::kReduceScatter, in, out, dt, op, arena);
}

void ShmGroup::all_gather(const void* in, void* out, int64_t n, int64_t elem,
                          const ShmArena* arena) {
  Plan P;
  P.n = n;
  P.elem = elem;
  P.size = size_;
  P.region_bytes = slot_bytes_;
  P.steps = plan_steps(chunk_range(n, size_, 0).size(), P.region_bytes, P.elem);
  run(P, ShmCollective::kAllGather, in, out, DType::kU8, ReduceOp::kSum, arena);
}

}  // namespace tessera::comm
