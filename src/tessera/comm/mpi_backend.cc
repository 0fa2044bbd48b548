// The `mpi` backend: a Communicator over OpenMPI processes. Point to point is
// MPI_Isend/MPI_Irecv on bytes; Algorithm::kBackend collectives are MPI's own
// (MPI_Allreduce, MPI_Reduce_scatter, MPI_Allgatherv). See docs/comm.md, "MPI backend".
#include "tessera/comm/mpi_backend.h"

// The C API only: mpi.h would otherwise pull in the C++ bindings, whose library
// (libmpi_cxx) MPI::MPI_C does not link.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/base/logging.h"
#include "tessera/comm/communicator.h"
#include "tessera/comm/shm_arena.h"
#include "tessera/comm/shm_collectives.h"
#include "tessera/comm/watchdog.h"

namespace tessera::comm {
namespace {

// Process-wide MPI state. Leaked on purpose: the atexit MPI_Finalize and destructors of
// communicators that outlive main may still read it.
struct MpiState {
  std::once_flag once;
  int provided = 0;
  bool serialize = false;  // provided < MPI_THREAD_MULTIPLE: one MPI call at a time
  std::mutex mu;           // held around every MPI call when `serialize`
  int tag_ub = 32767;      // the MPI standard's guaranteed minimum until asked
  // Point-to-point messages are posted in pieces of at most this many bytes (MPI counts
  // are int). TESSERA_MPI_PIECE_BYTES lowers it so tests exercise the split cheaply.
  int64_t piece_bytes = int64_t{1} << 30;
  int ranks_per_node = 0;  // TESSERA_MPI_RANKS_PER_NODE (simulated nodes); 0: real ones
};
MpiState& state() {
  static MpiState* s = new MpiState;
  return *s;
}

// Serialises MPI calls when MPI did not grant MPI_THREAD_MULTIPLE; a no-op otherwise.
class MpiLock {
 public:
  MpiLock() {
    if (state().serialize) lock_ = std::unique_lock<std::mutex>(state().mu);
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  fail("mpi: ", what, " failed: ", std::string(msg, len));
}

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

void ensure_mpi() {
  MpiState& s = state();
  std::call_once(s.once, [&s] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &s.provided),
                "MPI_Init_thread");
      std::atexit(finalize_at_exit);
    } else {
      MPI_Query_thread(&s.provided);  // someone else initialised (and finalises) MPI
    }
    s.serialize = s.provided < MPI_THREAD_MULTIPLE;
    if (s.serialize)
      TESSERA_LOG(kWarn, "mpi: MPI granted thread level ", s.provided,
                  " (< MPI_THREAD_MULTIPLE); MPI calls are serialised behind one mutex");
    // Errors come back as codes we turn into tessera::Error instead of killing the job.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    int* ub = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
    if (flag && ub) s.tag_ub = *ub;
    if (const char* env = std::getenv("TESSERA_MPI_PIECE_BYTES")) {
      const long long v = std::atoll(env);
      TESSERA_CHECK(v > 0 && v <= INT_MAX, "TESSERA_MPI_PIECE_BYTES: ", env,
                    " is not a byte count in [1, ", INT_MAX, "]");
      s.piece_bytes = v;
    }
    if (const char* env = std::getenv("TESSERA_MPI_RANKS_PER_NODE")) {
      const int v = std::atoi(env);
      TESSERA_CHECK(v >= 1, "TESSERA_MPI_RANKS_PER_NODE: ", env, " is not a positive rank count");
      s.ranks_per_node = v;
    }
  });
}

// A point-to-point operation posted as one MPI request per piece.
class MpiRequest final : public Request {
 public:
  MpiRequest(std::vector<MPI_Request> reqs, std::vector<int64_t> piece_sizes, bool is_recv,
             int peer, int tag, int rank, int size, double timeout)
      : reqs_(std::move(reqs)), piece_sizes_(std::move(piece_sizes)), is_recv_(is_recv),
        peer_(peer), tag_(tag), rank_(rank), size_(size), timeout_(timeout),
        statuses_(reqs_.size()) {}

  ~MpiRequest() override {
    if (done_ || !still_usable()) return;
    // Abandoned while pending (an error unwound past it): a receive must not land in a
    // buffer that may be freed, so cancel it; a send is left to complete on its own.
    MpiLock lock;
    for (auto& r : reqs_) {
      if (r == MPI_REQUEST_NULL) continue;
      if (is_recv_) {
        MPI_Cancel(&r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
      } else {
        MPI_Request_free(&r);
      }
    }
  }

  bool test() override {
    if (done_) return true;
    std::vector<MPI_Status>& st = statuses_;
    int flag = 0;
    {
      MpiLock lock;
      const int rc = MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &flag, st.data());
      if (rc != MPI_SUCCESS) {
        for (const auto& s : st)
          if (s.MPI_ERROR != MPI_SUCCESS) check_mpi(s.MPI_ERROR, what().c_str());
        check_mpi(rc, what().c_str());
      }
    }
    if (!flag) return false;
    done_ = true;
    if (is_recv_) {
      for (size_t i = 0; i < st.size(); ++i) {
        int got = 0;
        MPI_Get_count(&st[i], MPI_BYTE, &got);
        TESSERA_CHECK(got == piece_sizes_[i], "mpi: ", what(), ": piece ", i, " received ", got,
                      " bytes, expected ", piece_sizes_[i], " (sender and receiver sizes differ)");
      }
    }
    return true;
  }

  // MPI_Wait would block where the watchdog cannot see it; poll MPI_Test instead (each
  // call also drives MPI's progress engine). Inside a collective the collective's
  // watchdog scope sets the deadline; a standalone wait opens its own.
  void wait() override {
    if (test()) return;
    std::optional<WatchdogScope> own;
    WatchdogScope* scope = WatchdogScope::current();
    if (!scope) scope = &own.emplace(what(), timeout_);
    for (int64_t polls = 1; !test(); ++polls) {
      if (polls % 16 == 0) std::this_thread::yield();  // ranks may share cores
      if (polls % 256 == 0 && scope->enabled() && WatchdogScope::Clock::now() > scope->deadline())
        scope->expire();  // logs, runs the timeout handler (abort by default), throws
    }
  }

 private:
  static bool still_usable() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    return !finalized;
  }
  std::string what() const {
    return tessera::detail::concat(is_recv_ ? "irecv from" : "isend to", " rank ", peer_, " (tag ", tag_,
                          ") on rank ", rank_, " of an mpi group of ", size_);
  }

  std::vector<MPI_Request> reqs_;
  std::vector<int64_t> piece_sizes_;
  bool is_recv_;
  int peer_, tag_, rank_, size_;
  double timeout_;
  std::vector<MPI_Status> statuses_;  // one per piece, reused by every poll
  bool done_ = false;
};

// MPI types for the dtypes MPI reduces natively (MPI has no bf16; the caller widens).
MPI_Datatype reduce_type(DType dt) {
  switch (dt) {
    case DType::kF32: return MPI_FLOAT;
    case DType::kI32: return MPI_INT32_T;
    case DType::kI64: return MPI_INT64_T;
    default: fail("mpi: no MPI reduction type for dtype ", dtype_name(dt));
  }
}
// Element types for moving data without arithmetic (all_gather).
MPI_Datatype copy_type(DType dt) {
  switch (dt) {
    case DType::kBF16:
    case DType::kF16: return MPI_UINT16_T;
    case DType::kI8: return MPI_INT8_T;
    case DType::kU8: return MPI_UINT8_T;
    default: return reduce_type(dt);
  }
}
MPI_Op mpi_op(ReduceOp op) {
  TESSERA_CHECK(op != ReduceOp::kAvg, "mpi: kAvg reaches backend collectives as kSum");
  return op == ReduceOp::kMax ? MPI_MAX : MPI_SUM;
}
int checked_count(int64_t n, const char* what) {
  TESSERA_CHECK(n <= INT_MAX, "mpi: ", what, " of ", n,
                " elements exceeds MPI's int counts (2^31 - 1 elements per rank)");
  return static_cast<int>(n);
}

// Also a ShmHost: a group whose ranks all share one node gets the shared-memory
// collectives (Algorithm::kShm, shm_collectives.h), its segment made on first use.
class MpiCommunicator final : public Communicator, public ShmHost {
 public:
  // Takes ownership of `comm` (freed in the destructor).
  explicit MpiCommunicator(MPI_Comm comm) : comm_(comm) {
    MpiLock lock;
    check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    // Node ids: ranks sharing memory form one node, numbered densely in the order of the
    // smallest rank (of this group) on each node. TESSERA_MPI_RANKS_PER_NODE=k instead
    // makes every k consecutive world ranks a node (as run_local(n, k, fn) does), so the
    // hierarchical algorithm can be tested and measured on one machine.
    MPI_Comm shm = MPI_COMM_NULL;
    if (state().ranks_per_node > 0) {
      int world_rank = 0;
      MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
      check_mpi(MPI_Comm_split(comm_, world_rank / state().ranks_per_node, rank_, &shm),
                "MPI_Comm_split");
    } else {
      check_mpi(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &shm),
                "MPI_Comm_split_type");
    }
    int leader = rank_;
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, &leader, 1, MPI_INT, MPI_MIN, shm), "MPI_Allreduce");
    MPI_Comm_free(&shm);
    std::vector<int> leaders(size_);
    check_mpi(MPI_Allgather(&leader, 1, MPI_INT, leaders.data(), 1, MPI_INT, comm_),
              "MPI_Allgather");
    std::sort(leaders.begin(), leaders.end());
    leaders.erase(std::unique(leaders.begin(), leaders.end()), leaders.end());
    node_id_ = static_cast<int>(std::lower_bound(leaders.begin(), leaders.end(), leader) -
                                leaders.begin());
    single_node_ = leaders.size() == 1;  // simulated nodes count: shm never spans two
  }
  ~MpiCommunicator() override {
    drain_async();  // queued collectives still need this backend's MPI communicator
    shm_.reset();   // unmaps this rank's view only; peers keep theirs
    arena_.reset(); // (tensors from alloc_shared keep the arena mapped until they go)
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && comm_ != MPI_COMM_NULL) {
      MpiLock lock;
      MPI_Comm_free(&comm_);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }
  int node_id() const override { return node_id_; }

  RequestPtr isend(const void* data, int64_t bytes, int dst, int tag) override {
    return post(const_cast<void*>(data), bytes, dst, tag, false);
  }
  RequestPtr irecv(void* data, int64_t bytes, int src, int tag) override {
    return post(data, bytes, src, tag, true);
  }

  bool shm_possible() const override { return single_node_ && size_ > 1 && !shm_failed_; }

  // Runs inside the first shm collective (every rank reaches it at the same call), so
  // the set-up's MPI_Bcast / MPI_Allreduce line up on every rank.
  ShmGroup* shm_group() override {
    if (shm_ || !shm_possible()) return shm_.get();
    std::string why;
    shm_ = ShmGroup::create(rank_, size_, shm_slot_bytes_, shm_setup(), &why);
    if (!shm_) {
      shm_failed_ = true;  // on every rank: create() agreed on the outcome
      TESSERA_LOG(kWarn, "mpi: shared-memory collectives unavailable on rank ", rank_, "/", size_,
                  " (", why, "); shm runs the ring over MPI instead");
    }
    return shm_.get();
  }

  ShmArena* shm_arena() override { return arena_.get(); }

  // The arena is made by the group's first call (collective, communicator.h). Queued
  // async collectives finish first: the set-up's MPI calls must not run beside them.
  Tensor alloc_shared(const Shape& shape, DType dtype) override {
    if (shm_possible() && !arena_ && !arena_failed_) {
      drain_async();
      std::string why;
      arena_ = ShmArena::create(rank_, size_, shm_arena_bytes(), shm_setup(), &why);
      if (!arena_) {
        arena_failed_ = true;  // on every rank: create() agreed on the outcome
        TESSERA_LOG(kWarn, "mpi: registered-buffer arena unavailable on rank ", rank_, "/", size_,
                    " (", why, "); alloc_shared returns ordinary memory");
      }
    }
    if (arena_ && shape_numel(shape) > 0)
      if (Tensor t = ShmArena::allocate(arena_, shape, dtype); t.defined()) return t;
    return Tensor::empty(shape, dtype);
  }

  std::unique_ptr<Communicator> split(int colour, int key) override {
    MPI_Comm nc = MPI_COMM_NULL;
    {
      MpiLock lock;
      check_mpi(MPI_Comm_split(comm_, colour < 0 ? MPI_UNDEFINED : colour, key, &nc),
                "MPI_Comm_split");
    }
    if (nc == MPI_COMM_NULL) return nullptr;
    auto sub = std::make_unique<MpiCommunicator>(nc);
    sub->set_timeout(timeout());
    return sub;
  }

 protected:
  // communicator.h's contract: f32/i32/i64 only (bf16/f16 arrive widened to f32 and are
  // rounded back by the caller), kSum or kMax only (the caller divides for kAvg), sizes
  // already checked. MPI counts are int, hence the element limits below.
  void backend_all_reduce(Tensor& t, ReduceOp op) override {
    const MPI_Datatype type = reduce_type(t.dtype());
    char* p = static_cast<char*>(t.raw_data());
    const int64_t n = t.numel(), es = static_cast<int64_t>(dtype_size(t.dtype()));
    const int64_t step = int64_t{1} << 30;  // elements per MPI_Allreduce
    MpiLock lock;
    for (int64_t off = 0; off < n; off += step) {
      const int count = static_cast<int>(std::min(step, n - off));
      check_mpi(MPI_Allreduce(MPI_IN_PLACE, p + off * es, count, type, mpi_op(op), comm_),
                "MPI_Allreduce");
    }
  }

  void backend_reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    const MPI_Datatype type = reduce_type(in.dtype());
    const int64_t n = in.numel();
    std::vector<int> counts(size_);
    for (int r = 0; r < size_; ++r)
      counts[r] = checked_count(chunk_range(n, size_, r).size(), "reduce_scatter chunk");
    MpiLock lock;
    check_mpi(MPI_Reduce_scatter(in.raw_data(), out.raw_data(), counts.data(), type, mpi_op(op),
                                 comm_),
              "MPI_Reduce_scatter");
  }

  void backend_all_gather(const Tensor& in, Tensor& out) override {
    const int64_t n = out.numel();
    std::vector<int> counts(size_), displs(size_);
    for (int r = 0; r < size_; ++r) {
      const ChunkRange c = chunk_range(n, size_, r);
      counts[r] = checked_count(c.size(), "all_gather chunk");
      displs[r] = checked_count(c.begin, "all_gather offset");
    }
    const MPI_Datatype type = copy_type(in.dtype());
    // MPI forbids aliased buffers; an input that already sits in its slot of out is in place.
    const char* slot = static_cast<const char*>(out.raw_data()) +
                       static_cast<int64_t>(displs[rank_]) * static_cast<int64_t>(dtype_size(in.dtype()));
    const void* send = in.raw_data() == slot ? MPI_IN_PLACE : in.raw_data();
    MpiLock lock;
    check_mpi(MPI_Allgatherv(send, counts[rank_], type, out.raw_data(), counts.data(),
                             displs.data(), type, comm_),
              "MPI_Allgatherv");
  }

 private:
  // The group-wide calls shm set-up needs (every rank reaches them at the same call).
  ShmGroup::Setup shm_setup() {
    ShmGroup::Setup setup;
    setup.broadcast_from_0 = [this](void* data, int bytes) {
      MpiLock lock;
      check_mpi(MPI_Bcast(data, bytes, MPI_BYTE, 0, comm_), "MPI_Bcast");
    };
    setup.all_ok = [this](bool ok) {
      int v = ok ? 1 : 0;
      MpiLock lock;
      check_mpi(MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT, MPI_LAND, comm_), "MPI_Allreduce");
      return v != 0;
    };
    return setup;
  }

  RequestPtr post(void* data, int64_t bytes, int peer, int tag, bool is_recv) {
    const char* what = is_recv ? "irecv" : "isend";
    TESSERA_CHECK(peer >= 0 && peer < size_ && peer != rank_, "mpi: ", what, ": peer rank ", peer,
                  " is not another rank of this group of ", size_, " (this is rank ", rank_, ")");
    TESSERA_CHECK(tag >= 0 && tag <= state().tag_ub, "mpi: ", what, ": tag ", tag,
                  " outside [0, MPI_TAG_UB = ", state().tag_ub, "]");
    TESSERA_CHECK(bytes >= 0, "mpi: ", what, ": negative byte count ", bytes);
    const int64_t piece = state().piece_bytes;
    std::vector<MPI_Request> reqs;
    std::vector<int64_t> sizes;
    char* p = static_cast<char*>(data);
    MpiLock lock;
    // Pieces of one message go out in order on one (peer, tag), and MPI never lets messages
    // on the same (peer, tag, comm) overtake, so the receiver's pieces match one to one.
    for (int64_t off = 0; off < bytes || (bytes == 0 && off == 0); off += piece) {
      const int count = static_cast<int>(std::min(piece, bytes - off));
      MPI_Request r;
      const int rc = is_recv ? MPI_Irecv(p + off, count, MPI_BYTE, peer, tag, comm_, &r)
                             : MPI_Isend(p + off, count, MPI_BYTE, peer, tag, comm_, &r);
      check_mpi(rc, is_recv ? "MPI_Irecv" : "MPI_Isend");
      reqs.push_back(r);
      sizes.push_back(count);
      if (bytes == 0) break;
    }
    return std::make_shared<MpiRequest>(std::move(reqs), std::move(sizes), is_recv, peer, tag,
                                        rank_, size_, timeout());
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, node_id_ = 0;
  bool single_node_ = false, shm_failed_ = false;
  int64_t shm_slot_bytes_ = shm_slot_bytes();  // as set when this communicator was made
  std::unique_ptr<ShmGroup> shm_;              // made by the first shm collective
  std::shared_ptr<ShmArena> arena_;            // made by the first alloc_shared
  bool arena_failed_ = false;
};

}  // namespace

bool running_under_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
}

Communicator& mpi_world() {
  ensure_mpi();
  // Leaked: it must outlive every static that might use it, and MPI_Finalize (atexit)
  // frees its MPI communicator anyway. A duplicate keeps our traffic apart from any
  // other MPI user of MPI_COMM_WORLD in this process.
  static MpiCommunicator* world = [] {
    MPI_Comm dup = MPI_COMM_NULL;
    {
      MpiLock lock;
      check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &dup), "MPI_Comm_dup");
    }
    return new MpiCommunicator(dup);
  }();
  return *world;
}

bool mpi_thread_multiple() {
  ensure_mpi();
  return !state().serialize;
}

void mpi_abort(int exit_code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  std::fflush(stdout);
  std::fflush(stderr);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::exit(exit_code);
}

}  // namespace tessera::comm
