// The one communication interface every layer above uses (parallel/, train/): point to
// point with request handles, collectives over tensors, sub-groups. Backends (`local`:
// ranks as threads of one process; `mpi`: OpenMPI processes) provide point to point and
// may provide their own collectives; the collective algorithms of our own (ring,
// recursive halving-doubling, hierarchical) run over any backend's point to point.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "tessera/tensor/tensor.h"

namespace tessera::comm {

namespace detail {
struct CommState;  // communicator.cc: async worker, cached hierarchical sub-groups
}

enum class ReduceOp { kSum, kAvg, kMax };

// Which implementation a collective uses. kAuto picks by message size and group size
// (from measurements, docs/comm.md); kBackend is the backend's own (MPI_Allreduce, ...;
// for `local` a straightforward gather-to-all through shared memory). kShm: through a
// POSIX shared-memory segment of the group (mpi, every rank on one node; elsewhere it
// runs the ring), shm_collectives.h.
enum class Algorithm { kAuto, kBackend, kRing, kHalvingDoubling, kHierarchical, kShm };
Algorithm parse_algorithm(const std::string& name);  // auto|backend|ring|hd|hierarchical|shm
const char* algorithm_name(Algorithm a);

// Elements [begin, end) of rank `rank`'s chunk when `numel` elements are split over
// `size` ranks as evenly as possible (the first numel % size chunks get one more).
// reduce_scatter and all_gather use this split, so sizes need not divide evenly.
struct ChunkRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
ChunkRange chunk_range(int64_t numel, int size, int rank);

// A pending point-to-point operation or asynchronous collective.
class Request {
 public:
  virtual ~Request() = default;
  virtual void wait() = 0;  // throws tessera::Error on failure or watchdog timeout
  virtual bool test() = 0;  // true once complete (never blocks)
};
using RequestPtr = std::shared_ptr<Request>;

class Communicator {
 public:
  // Stops the async worker. A backend's destructor calls drain_async() first, so queued
  // collectives finish while the backend (its isend/irecv) is still alive.
  virtual ~Communicator();
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;  // "local" | "mpi"
  // Ranks on the same machine share a node id (the hierarchical all-reduce's inner level).
  virtual int node_id() const = 0;

  // Point to point on raw bytes. Messages between a pair of ranks with the same tag
  // arrive in order. Tags in [0, 2^20) are the caller's; collectives use their own.
  virtual RequestPtr isend(const void* data, int64_t bytes, int dst, int tag) = 0;
  virtual RequestPtr irecv(void* data, int64_t bytes, int src, int tag) = 0;
  void send(const void* data, int64_t bytes, int dst, int tag) { isend(data, bytes, dst, tag)->wait(); }
  void recv(void* data, int64_t bytes, int src, int tag) { irecv(data, bytes, src, tag)->wait(); }

  // Every rank of this group calls split; ranks with the same colour form a new group
  // ordered by (key, old rank). colour < 0: this rank joins no group (returns nullptr).
  virtual std::unique_ptr<Communicator> split(int colour, int key) = 0;

  // A contiguous, uninitialised tensor (like Tensor::empty) that every rank of the group
  // can read in place where the backend supports it ("registered"; `mpi` with every rank
  // on one node: this rank's shared arena, docs/comm.md). The shm collectives skip
  // copying a registered input into their segment. Elsewhere, or when the arena is full,
  // a plain Tensor::empty. Where the backend has an arena, the group's first call is
  // collective (every rank makes it, in the same order relative to the collectives): it
  // maps the peers' arenas. Later calls are local and thread safe.
  virtual Tensor alloc_shared(const Shape& shape, DType dtype);

  // Collectives. Tensors are contiguous, on the CPU, of f32, bf16, f16, i32 or i64
  // (bf16/f16 are reduced in f32 and rounded once; kAvg on integers divides with
  // truncation). Every rank of the group calls each collective in the same order.
  //   all_reduce:     t (n) in place
  //   reduce_scatter: in (n) -> out (chunk_range(n, size, rank).size())
  //   all_gather:     in (chunk_range(n, size, rank).size()) -> out (n)
  //   broadcast:      t (n) from root, in place
  //   reduce:         in (n) -> out (n) on root (out ignored elsewhere)
  //   all_to_all:     in (size * k) -> out (size * k): block j of in goes to rank j
  void all_reduce(Tensor& t, ReduceOp op = ReduceOp::kSum, Algorithm a = Algorithm::kAuto);
  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op = ReduceOp::kSum,
                      Algorithm a = Algorithm::kAuto);
  void all_gather(const Tensor& in, Tensor& out, Algorithm a = Algorithm::kAuto);
  void broadcast(Tensor& t, int root);
  void reduce(const Tensor& in, Tensor& out, ReduceOp op, int root);
  void all_to_all(const Tensor& in, Tensor& out);
  // Variable-size all-to-all over rows (expert parallelism's token dispatch): in's first
  // send_rows[0] rows go to rank 0, the next send_rows[1] to rank 1, ... (any dtype, any
  // trailing shape); returns rank j's rows for this rank, in rank order, and, when asked,
  // how many came from each rank. The counts are exchanged first (one all_to_all).
  Tensor all_to_allv(const Tensor& in, const std::vector<int64_t>& send_rows,
                     std::vector<int64_t>* recv_rows = nullptr);
  void barrier();
  // all_reduce on a background thread of this communicator (collectives issued this
  // way run in issue order); the tensor must not be touched until wait() returns.
  RequestPtr all_reduce_async(Tensor& t, ReduceOp op = ReduceOp::kSum,
                              Algorithm a = Algorithm::kAuto);
  // The same for reduce_scatter and all_gather (one queue: every *_async and blocking
  // collective of this communicator runs in issue order). `in` must stay unchanged and
  // `out` untouched until wait() returns.
  RequestPtr reduce_scatter_async(const Tensor& in, Tensor& out, ReduceOp op = ReduceOp::kSum,
                                  Algorithm a = Algorithm::kAuto);
  RequestPtr all_gather_async(const Tensor& in, Tensor& out, Algorithm a = Algorithm::kAuto);

  // Watchdog: a collective or wait() that takes longer than this logs the collective,
  // its sequence number and the group, then aborts the job (default 300 s; <= 0: off).
  void set_timeout(double seconds) { timeout_seconds_ = seconds; }
  double timeout() const { return timeout_seconds_; }
  uint64_t collectives_issued() const { return sequence_; }
  // What a fired watchdog does after logging its message: std::abort() by default. Tests
  // install a handler that records the message (nullptr restores the default); when the
  // handler returns, the timed-out wait (local backend) throws tessera::Error instead.
  using TimeoutHandler = std::function<void(const std::string& message)>;
  static void set_timeout_handler(TimeoutHandler handler);

 protected:
  Communicator();

  // Backends override these to offer their own implementation (Algorithm::kBackend);
  // the defaults use our ring algorithms. Sizes are checked before they are called.
  // all_reduce / reduce_scatter receive only f32, i32 or i64 tensors (bf16/f16 arrive as
  // an f32 working copy, rounded back by the caller) and only kSum or kMax (the caller
  // applies kAvg's division); all_gather receives the tensors as given (it moves bytes).
  virtual void backend_all_reduce(Tensor& t, ReduceOp op);
  virtual void backend_reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op);
  virtual void backend_all_gather(const Tensor& in, Tensor& out);

  // The point-to-point tag of the collective now running (in [2^20, 2^30)); one
  // collective runs at a time per communicator, so backend_* may use it for their traffic.
  int collective_tag() const { return collective_tag_; }
  // Blocks until the async worker has run every queued collective. Every collective and
  // split() call this first, so group-wide operations keep issue order on every rank.
  void drain_async();

  double timeout_seconds_ = 300.0;
  uint64_t sequence_ = 0;  // collectives issued on this communicator

 private:
  friend struct detail::CommState;
  void run_all_reduce(Tensor& t, ReduceOp op, Algorithm a, uint64_t seq, double timeout);
  void run_reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op, Algorithm a, uint64_t seq,
                          double timeout);
  void run_all_gather(const Tensor& in, Tensor& out, Algorithm a, uint64_t seq, double timeout);
  void check_reduce_scatter(const Tensor& in, const Tensor& out) const;
  void check_all_gather(const Tensor& in, const Tensor& out) const;
  RequestPtr enqueue(std::function<void()> run);  // onto the async worker

  std::shared_ptr<detail::CommState> state_;
  int collective_tag_ = 0;
};

// `local` backend: n ranks as threads of this process over shared memory.
// Runs fn(comm) on n threads (one communicator per rank) and rethrows the first error.
void run_local(int n, const std::function<void(Communicator&)>& fn);
// A group of one: this thread alone (`local` backend). For single-process code paths.
std::unique_ptr<Communicator> self_communicator();

// `mpi` backend (OpenMPI): the world communicator of this process; initialises MPI on
// first use (MPI_THREAD_MULTIPLE) and finalises it at exit. size() is 1 outside mpirun.
Communicator& mpi_world();
bool running_under_mpi();  // OMPI_COMM_WORLD_SIZE (or PMI_SIZE) is set

}  // namespace tessera::comm
