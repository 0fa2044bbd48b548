// Communicator's collectives: argument checks, dtype handling (bf16/f16 reduced in f32),
// dispatch by Algorithm (auto table included), the watchdog scope of every collective,
// and the worker thread behind all_reduce_async.
#include "tessera/comm/communicator.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/base/logging.h"
#include "tessera/base/trace.h"
#include "tessera/comm/algorithms.h"
#include "tessera/comm/shm_collectives.h"
#include "tessera/comm/watchdog.h"

namespace tessera::comm {

Algorithm parse_algorithm(const std::string& name) {
  if (name == "auto") return Algorithm::kAuto;
  if (name == "backend") return Algorithm::kBackend;
  if (name == "ring") return Algorithm::kRing;
  if (name == "hd" || name == "halving_doubling") return Algorithm::kHalvingDoubling;
  if (name == "hierarchical") return Algorithm::kHierarchical;
  if (name == "shm") return Algorithm::kShm;
  fail("unknown collective algorithm '", name,
       "' (expected auto, backend, ring, hd, hierarchical, shm)");
}

const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::kAuto:
      return "auto";
    case Algorithm::kBackend:
      return "backend";
    case Algorithm::kRing:
      return "ring";
    case Algorithm::kHalvingDoubling:
      return "hd";
    case Algorithm::kHierarchical:
      return "hierarchical";
    case Algorithm::kShm:
      return "shm";
  }
  return "?";
}

ChunkRange chunk_range(int64_t numel, int size, int rank) {
  TESSERA_CHECK(size >= 1 && rank >= 0 && rank < size, "chunk_range: rank ", rank,
                " out of range for ", size, " ranks");
  const int64_t base = numel / size, extra = numel % size;
  const int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

namespace detail {

struct AsyncResult {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::string error;
};

struct CommState {
  explicit CommState(Communicator* owner) : owner(owner) {}
  Communicator* owner;

  // *_async: one worker runs queued collectives in issue order.
  struct Task {
    std::function<void()> run;  // the collective, with its sequence number bound in
    std::shared_ptr<AsyncResult> result;
  };
  std::mutex mu;
  std::condition_variable cv;       // worker: work queued or stop
  std::condition_variable idle_cv;  // drain_async: queue empty and worker idle
  std::deque<Task> queue;
  bool busy = false, stop = false;
  std::thread worker;
  std::thread::id worker_id;

  // Hierarchical all-reduce: node sub-groups, made on first use (0 unknown, 1 usable,
  // 2 not applicable: one node, one rank per node, or nodes of unequal size).
  int hier_status = 0;
  std::unique_ptr<Communicator> intra, inter;

  void start_worker() {
    if (worker.joinable()) return;
    worker = std::thread([this] { run_worker(); });
    worker_id = worker.get_id();
  }

  void run_worker() {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      cv.wait(lk, [&] { return stop || !queue.empty(); });
      if (queue.empty()) return;
      Task task = std::move(queue.front());
      queue.pop_front();
      busy = true;
      lk.unlock();
      std::string error;
      try {
        base::TraceScope span("comm_async", "comm");  // overlap with compute shows in traces
        task.run();
      } catch (const std::exception& e) {
        error = e.what();
      }
      {
        std::lock_guard<std::mutex> rl(task.result->mu);
        task.result->done = true;
        task.result->error = error;
      }
      task.result->cv.notify_all();
      lk.lock();
      busy = false;
      if (queue.empty()) idle_cv.notify_all();
    }
  }
};

}  // namespace detail

namespace {

constexpr int kCollectiveTagBase = 1 << 20;  // collective tags: [2^20, 2^30)

int tag_for(uint64_t seq) {
  return kCollectiveTagBase + static_cast<int>(seq % ((1u << 30) - kCollectiveTagBase));
}

bool is_reducible(DType dt) {
  return dt == DType::kF32 || dt == DType::kBF16 || dt == DType::kF16 || dt == DType::kI32 ||
         dt == DType::kI64;
}
DType working_dtype(DType dt) { return dt == DType::kBF16 || dt == DType::kF16 ? DType::kF32 : dt; }

void check_tensor(const char* what, const char* name, const Tensor& t, bool reducible) {
  TESSERA_CHECK(t.defined(), what, ": ", name, " tensor is undefined");
  TESSERA_CHECK(t.device() == Device::kCPU, what, ": ", name, " tensor ", t.describe(),
                " is not on the CPU");
  TESSERA_CHECK(t.is_contiguous(), what, ": ", name, " tensor ", t.describe(),
                " is not contiguous");
  TESSERA_CHECK(!reducible || is_reducible(t.dtype()), what, ": ", name, " dtype ",
                dtype_name(t.dtype()), " is not supported (f32, bf16, f16, i32, i64)");
}

void check_same_dtype(const char* what, const Tensor& in, const Tensor& out) {
  TESSERA_CHECK(in.dtype() == out.dtype(), what, ": out dtype ", dtype_name(out.dtype()),
                " differs from in dtype ", dtype_name(in.dtype()));
}

// A tensor's values in the working dtype: the tensor itself for f32/i32/i64 (or a copy
// when `copy`), an f32 conversion for bf16/f16.
Tensor to_working(const Tensor& t, bool copy) {
  if (t.dtype() == working_dtype(t.dtype())) return copy ? t.clone() : t;
  Tensor w = Tensor::empty({t.numel()}, DType::kF32);
  convert_elements(t.raw_data(), t.dtype(), w.raw_data(), DType::kF32, t.numel());
  return w;
}

// Writes n working-dtype values into dst (of dtype dst_dtype), rounding once for bf16/f16.
void from_working(const void* src, DType work, void* dst, DType dst_dtype, int64_t n) {
  if (src == dst || n == 0) return;
  if (work == dst_dtype)
    std::memcpy(dst, src, n * dtype_size(work));
  else
    convert_elements(src, work, dst, dst_dtype, n);
}

// "all_reduce #3 (ring, 1023 x f32) on rank 1/4 (backend local)": made for every
// collective, so plain string appends rather than a stream.
std::string describe(const Communicator& c, const char* what, uint64_t seq, const char* algo,
                     int64_t n, DType dt) {
  return std::string(what) + " #" + std::to_string(seq) + " (" + algo + ", " + std::to_string(n) +
         " x " + dtype_name(dt) + ") on rank " + std::to_string(c.rank()) + "/" +
         std::to_string(c.size()) + " (backend " + c.backend() + ")";
}

class AsyncRequest : public Request {
 public:
  explicit AsyncRequest(std::shared_ptr<detail::AsyncResult> r) : r_(std::move(r)) {}
  // No watchdog of its own: the worker runs every queued collective under one, so a hang
  // fires there and arrives here as the error (a long queue is progress, not a hang).
  void wait() override {
    std::unique_lock<std::mutex> lk(r_->mu);
    r_->cv.wait(lk, [&] { return r_->done; });
    if (!r_->error.empty()) throw Error(r_->error);
  }
  bool test() override {
    std::lock_guard<std::mutex> lk(r_->mu);
    return r_->done;
  }

 private:
  std::shared_ptr<detail::AsyncResult> r_;
};

}  // namespace

Communicator::Communicator() : state_(std::make_shared<detail::CommState>(this)) {}

Communicator::~Communicator() {
  {
    std::lock_guard<std::mutex> lk(state_->mu);
    state_->stop = true;
  }
  state_->cv.notify_all();
  if (state_->worker.joinable()) state_->worker.join();
}

void Communicator::drain_async() {
  detail::CommState& s = *state_;
  if (std::this_thread::get_id() == s.worker_id) return;  // called from a queued collective
  std::unique_lock<std::mutex> lk(s.mu);
  s.idle_cv.wait(lk, [&] { return s.queue.empty() && !s.busy; });
}

void Communicator::all_reduce(Tensor& t, ReduceOp op, Algorithm a) {
  check_tensor("all_reduce", "the", t, true);
  drain_async();
  run_all_reduce(t, op, a, ++sequence_, timeout_seconds_);
}

RequestPtr Communicator::all_reduce_async(Tensor& t, ReduceOp op, Algorithm a) {
  check_tensor("all_reduce_async", "the", t, true);
  const uint64_t seq = ++sequence_;
  const double timeout = timeout_seconds_;
  return enqueue([this, t, op, a, seq, timeout]() mutable { run_all_reduce(t, op, a, seq, timeout); });
}

RequestPtr Communicator::reduce_scatter_async(const Tensor& in, Tensor& out, ReduceOp op,
                                              Algorithm a) {
  check_reduce_scatter(in, out);
  const uint64_t seq = ++sequence_;
  const double timeout = timeout_seconds_;
  return enqueue([this, in, out, op, a, seq, timeout]() mutable {
    run_reduce_scatter(in, out, op, a, seq, timeout);
  });
}

RequestPtr Communicator::all_gather_async(const Tensor& in, Tensor& out, Algorithm a) {
  check_all_gather(in, out);
  const uint64_t seq = ++sequence_;
  const double timeout = timeout_seconds_;
  return enqueue([this, in, out, a, seq, timeout]() mutable {
    run_all_gather(in, out, a, seq, timeout);
  });
}

RequestPtr Communicator::enqueue(std::function<void()> run) {
  auto result = std::make_shared<detail::AsyncResult>();
  {
    std::lock_guard<std::mutex> lk(state_->mu);
    state_->start_worker();
    state_->queue.push_back({std::move(run), result});
  }
  state_->cv.notify_one();
  return std::make_shared<AsyncRequest>(result);
}

void Communicator::run_all_reduce(Tensor& t, ReduceOp op, Algorithm a, uint64_t seq,
                                  double timeout) {
  const int64_t n = t.numel();
  const DType work = working_dtype(t.dtype());
  const int64_t work_bytes = n * static_cast<int64_t>(dtype_size(work));
  detail::CommState& s = *state_;
  collective_tag_ = tag_for(seq);
  if (size() == 1 || n == 0) return;
  // One node: shm, or what won there (shm_collectives.cc); else the tables below.
  if (a == Algorithm::kAuto) a = shm_auto_choice(*this, ShmCollective::kAllReduce, work_bytes);
  if ((a == Algorithm::kAuto || a == Algorithm::kHierarchical) && s.hier_status == 0) {
    // Who shares a node, once per communicator: an all-gather of node ids, then (several
    // nodes of equal size) the two splits the hierarchical algorithm runs on.
    WatchdogScope watch(describe(*this, "all_reduce", seq, "node discovery", n, t.dtype()),
                        timeout);
    std::vector<int64_t> ids(size());
    ids[rank()] = node_id();
    algo::ring_all_gather(*this, collective_tag_, ids.data(), size(), sizeof(int64_t));
    std::map<int64_t, int> per_node;
    int local_rank = 0;
    for (int r = 0; r < size(); ++r) {
      if (r < rank() && ids[r] == ids[rank()]) ++local_rank;
      per_node[ids[r]]++;
    }
    const int num_nodes = static_cast<int>(per_node.size());
    const int local = per_node.begin()->second;
    const bool uniform = std::all_of(per_node.begin(), per_node.end(),
                                     [&](const auto& kv) { return kv.second == local; });
    if (!uniform && rank() == 0)
      TESSERA_LOG(kWarn, "comm: hierarchical all-reduce needs equal ranks per node; ",
                  "running ring instead on rank ", rank(), "/", size());
    if (uniform && num_nodes > 1 && local > 1) {
      s.intra = split(static_cast<int>(ids[rank()]), rank());
      s.inter = split(local_rank, rank());
      s.hier_status = 1;
    } else {
      s.hier_status = 2;
    }
  }
  if (a == Algorithm::kAuto) a = algo::auto_all_reduce(work_bytes, size(), s.hier_status == 1);
  WatchdogScope watch(describe(*this, "all_reduce", seq, algorithm_name(a), n, t.dtype()), timeout);
  const ReduceOp inner = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  Tensor w = to_working(t, false);
  switch (a) {
    case Algorithm::kBackend:
      backend_all_reduce(w, inner);
      break;
    case Algorithm::kHalvingDoubling:
      algo::hd_all_reduce(*this, collective_tag_, w.raw_data(), n, work, inner);
      break;
    case Algorithm::kShm:
      shm_all_reduce(*this, collective_tag_, w.raw_data(), n, work, inner);
      break;
    case Algorithm::kHierarchical:
      if (s.hier_status == 1) {
        s.intra->set_timeout(timeout);
        s.inter->set_timeout(timeout);
        const int64_t chunk_bytes = chunk_range(work_bytes, s.intra->size(), 0).size();
        const bool inter_hd = algo::auto_all_reduce(chunk_bytes, s.inter->size(), false) ==
                              Algorithm::kHalvingDoubling;
        algo::hierarchical_all_reduce(*s.intra, *s.inter, inter_hd, collective_tag_, w.raw_data(),
                                      n, work, inner);
        break;
      }
      [[fallthrough]];
    default:
      algo::ring_all_reduce(*this, collective_tag_, w.raw_data(), n, work, inner);
  }
  if (op == ReduceOp::kAvg) algo::divide_by(w.raw_data(), n, work, size());
  from_working(w.raw_data(), work, t.raw_data(), t.dtype(), n);
}

void Communicator::check_reduce_scatter(const Tensor& in, const Tensor& out) const {
  check_tensor("reduce_scatter", "in", in, true);
  check_tensor("reduce_scatter", "out", out, true);
  check_same_dtype("reduce_scatter", in, out);
  const int64_t n = in.numel();
  const ChunkRange mine = chunk_range(n, size(), rank());
  TESSERA_CHECK(out.numel() == mine.size(), "reduce_scatter: out has ", out.numel(),
                " elements, expected ", mine.size(), " (chunk ", rank(), " of ", n,
                " elements over ", size(), " ranks)");
}

void Communicator::reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op, Algorithm a) {
  check_reduce_scatter(in, out);
  drain_async();
  run_reduce_scatter(in, out, op, a, ++sequence_, timeout_seconds_);
}

void Communicator::run_reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op, Algorithm a,
                                      uint64_t seq, double timeout) {
  const int64_t n = in.numel();
  const ChunkRange mine = chunk_range(n, size(), rank());
  const DType work = working_dtype(in.dtype());
  const int64_t elem = dtype_size(work);
  if (a == Algorithm::kAuto) a = shm_auto_choice(*this, ShmCollective::kReduceScatter, n * elem);
  if (a == Algorithm::kAuto || a == Algorithm::kHierarchical)
    a = algo::auto_reduce_scatter(n * elem, size());
  WatchdogScope watch(describe(*this, "reduce_scatter", seq, algorithm_name(a), n, in.dtype()),
                      timeout);
  collective_tag_ = tag_for(seq);
  const ReduceOp inner = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  // (n): our algorithms reduce in place, so they get a copy; the backend only reads it.
  const bool shm = a == Algorithm::kShm && size() > 1;  // reads `in` too, writes a chunk
  Tensor w = to_working(in, a != Algorithm::kBackend && !shm);
  Tensor chunk;            // (mine.size()) in the working dtype, backend and shm only
  void* result = nullptr;  // this rank's reduced chunk
  if ((a == Algorithm::kBackend && size() > 1) || shm) {
    chunk = out.dtype() == work ? out : Tensor::empty({mine.size()}, work);
    if (shm)
      shm_reduce_scatter(*this, collective_tag_, w.raw_data(), chunk.raw_data(), n, work, inner);
    else
      backend_reduce_scatter(w, chunk, inner);
    result = chunk.raw_data();
  } else {
    if (size() > 1 && a == Algorithm::kHalvingDoubling)
      algo::hd_reduce_scatter(*this, collective_tag_, w.raw_data(), n, work, inner);
    else if (size() > 1)
      algo::ring_reduce_scatter(*this, collective_tag_, w.raw_data(), n, work, inner);
    result = static_cast<char*>(w.raw_data()) + mine.begin * elem;
  }
  if (op == ReduceOp::kAvg) algo::divide_by(result, mine.size(), work, size());
  from_working(result, work, out.raw_data(), out.dtype(), mine.size());
}

void Communicator::check_all_gather(const Tensor& in, const Tensor& out) const {
  check_tensor("all_gather", "in", in, false);
  check_tensor("all_gather", "out", out, false);
  check_same_dtype("all_gather", in, out);
  const int64_t n = out.numel();
  const ChunkRange mine = chunk_range(n, size(), rank());
  TESSERA_CHECK(in.numel() == mine.size(), "all_gather: in has ", in.numel(),
                " elements, expected ", mine.size(), " (chunk ", rank(), " of out's ", n,
                " elements over ", size(), " ranks)");
}

void Communicator::all_gather(const Tensor& in, Tensor& out, Algorithm a) {
  check_all_gather(in, out);
  drain_async();
  run_all_gather(in, out, a, ++sequence_, timeout_seconds_);
}

void Communicator::run_all_gather(const Tensor& in, Tensor& out, Algorithm a, uint64_t seq,
                                  double timeout) {
  const int64_t n = out.numel();
  const ChunkRange mine = chunk_range(n, size(), rank());
  const int64_t elem = dtype_size(in.dtype());
  if (a == Algorithm::kAuto) a = shm_auto_choice(*this, ShmCollective::kAllGather, n * elem);
  if (a == Algorithm::kAuto || a == Algorithm::kHierarchical)
    a = algo::auto_all_gather(n * elem, size());
  WatchdogScope watch(describe(*this, "all_gather", seq, algorithm_name(a), n, in.dtype()),
                      timeout);
  collective_tag_ = tag_for(seq);
  if (a == Algorithm::kBackend && size() > 1) {
    backend_all_gather(in, out);
    return;
  }
  if (a == Algorithm::kShm) {
    shm_all_gather(*this, collective_tag_, in.raw_data(), out.raw_data(), n, elem);
    return;
  }
  char* o = static_cast<char*>(out.raw_data());
  if (mine.size() > 0 && o + mine.begin * elem != in.raw_data())  // else already in place
    std::memcpy(o + mine.begin * elem, in.raw_data(), mine.size() * elem);
  if (a == Algorithm::kHalvingDoubling)
    algo::hd_all_gather(*this, collective_tag_, o, n, elem);
  else
    algo::ring_all_gather(*this, collective_tag_, o, n, elem);
}

void Communicator::broadcast(Tensor& t, int root) {
  check_tensor("broadcast", "the", t, false);
  TESSERA_CHECK(root >= 0 && root < size(), "broadcast: root ", root,
                " out of range for a group of ", size(), " ranks");
  drain_async();
  const uint64_t seq = ++sequence_;
  const int64_t bytes = static_cast<int64_t>(t.nbytes());
  const bool tree = bytes <= algo::broadcast_tree_max_bytes();
  WatchdogScope watch(
      describe(*this, "broadcast", seq, tree ? "tree" : "chain", t.numel(), t.dtype()),
      timeout_seconds_);
  collective_tag_ = tag_for(seq);
  if (tree)
    algo::broadcast_tree(*this, collective_tag_, t.raw_data(), bytes, root);
  else
    algo::broadcast_chain(*this, collective_tag_, t.raw_data(), bytes, root);
}

void Communicator::reduce(const Tensor& in, Tensor& out, ReduceOp op, int root) {
  check_tensor("reduce", "in", in, true);
  TESSERA_CHECK(root >= 0 && root < size(), "reduce: root ", root, " out of range for a group of ",
                size(), " ranks");
  const int64_t n = in.numel();
  if (rank() == root) {
    check_tensor("reduce", "out", out, true);
    check_same_dtype("reduce", in, out);
    TESSERA_CHECK(out.numel() == n, "reduce: out has ", out.numel(), " elements, expected ", n);
  }
  drain_async();
  const uint64_t seq = ++sequence_;
  const DType work = working_dtype(in.dtype());
  const int64_t bytes = n * static_cast<int64_t>(dtype_size(work));
  const bool tree = bytes <= algo::reduce_tree_max_bytes();
  WatchdogScope watch(describe(*this, "reduce", seq, tree ? "tree" : "ring+gather", n, in.dtype()),
                      timeout_seconds_);
  collective_tag_ = tag_for(seq);
  const ReduceOp inner = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  Tensor w = to_working(in, true);
  if (tree)
    algo::reduce_tree(*this, collective_tag_, w.raw_data(), n, work, inner, root);
  else
    algo::reduce_ring_gather(*this, collective_tag_, w.raw_data(), n, work, inner, root);
  if (rank() != root) return;
  if (op == ReduceOp::kAvg) algo::divide_by(w.raw_data(), n, work, size());
  from_working(w.raw_data(), work, out.raw_data(), out.dtype(), n);
}

void Communicator::all_to_all(const Tensor& in, Tensor& out) {
  check_tensor("all_to_all", "in", in, false);
  check_tensor("all_to_all", "out", out, false);
  check_same_dtype("all_to_all", in, out);
  TESSERA_CHECK(in.numel() % size() == 0, "all_to_all: in has ", in.numel(),
                " elements, not a multiple of the group size ", size());
  TESSERA_CHECK(out.numel() == in.numel(), "all_to_all: out has ", out.numel(),
                " elements, expected ", in.numel());
  drain_async();
  const uint64_t seq = ++sequence_;
  WatchdogScope watch(describe(*this, "all_to_all", seq, "pairwise", in.numel(), in.dtype()),
                      timeout_seconds_);
  collective_tag_ = tag_for(seq);
  algo::all_to_all_pairwise(*this, collective_tag_, in.raw_data(), out.raw_data(),
                            static_cast<int64_t>(in.nbytes()) / size());
}

Tensor Communicator::all_to_allv(const Tensor& in, const std::vector<int64_t>& send_rows,
                                 std::vector<int64_t>* recv_rows) {
  const int N = size();
  TESSERA_CHECK(in.dim() >= 1 && in.is_contiguous(), "all_to_allv: in must be a contiguous tensor of rows, got ",
                in.describe());
  TESSERA_CHECK(static_cast<int>(send_rows.size()) == N, "all_to_allv: ", send_rows.size(),
                " send counts for a group of ", N);
  int64_t total = 0;
  for (int j = 0; j < N; ++j) {
    TESSERA_CHECK(send_rows[j] >= 0, "all_to_allv: send count ", send_rows[j], " for rank ", j, " is negative");
    total += send_rows[j];
  }
  TESSERA_CHECK(total == in.size(0), "all_to_allv: the send counts add up to ", total, " rows, in has ", in.size(0));
  // The counts first: each rank learns how many rows every peer sends it.
  Tensor sc = Tensor::from_vector(send_rows, {N}), rc = Tensor::empty({N}, DType::kI64);
  all_to_all(sc, rc);
  std::vector<int64_t> recv(rc.data<int64_t>(), rc.data<int64_t>() + N);
  Shape shape = in.shape();
  int64_t rows = 0;
  for (int64_t v : recv) rows += v;
  shape[0] = rows;
  Tensor out = Tensor::empty(shape, in.dtype());
  int64_t row_bytes = static_cast<int64_t>(dtype_size(in.dtype()));
  for (int d = 1; d < in.dim(); ++d) row_bytes *= in.size(d);
  std::vector<int64_t> send_off(N), send_bytes(N), recv_off(N), recv_bytes(N);
  int64_t so = 0, ro = 0;
  for (int j = 0; j < N; ++j) {
    send_off[j] = so, send_bytes[j] = send_rows[j] * row_bytes, so += send_bytes[j];
    recv_off[j] = ro, recv_bytes[j] = recv[j] * row_bytes, ro += recv_bytes[j];
  }
  drain_async();
  const uint64_t seq = ++sequence_;
  WatchdogScope watch(describe(*this, "all_to_allv", seq, "pairwise", in.numel(), in.dtype()), timeout_seconds_);
  collective_tag_ = tag_for(seq);
  algo::all_to_allv_pairwise(*this, collective_tag_, in.raw_data(), send_off, send_bytes, out.raw_data(), recv_off,
                             recv_bytes);
  if (recv_rows) *recv_rows = std::move(recv);
  return out;
}

void Communicator::barrier() {
  drain_async();
  const uint64_t seq = ++sequence_;
  WatchdogScope watch("barrier #" + std::to_string(seq) + " (dissemination) on rank " +
                          std::to_string(rank()) + "/" + std::to_string(size()) + " (backend " +
                          backend() + ")",
                      timeout_seconds_);
  collective_tag_ = tag_for(seq);
  algo::barrier_dissemination(*this, collective_tag_);
}

Tensor Communicator::alloc_shared(const Shape& shape, DType dtype) {
  return Tensor::empty(shape, dtype);  // no shared arena on this backend
}

void Communicator::backend_all_reduce(Tensor& t, ReduceOp op) {
  algo::ring_all_reduce(*this, collective_tag_, t.raw_data(), t.numel(), t.dtype(), op);
}

void Communicator::backend_reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) {
  Tensor w = in.clone();
  algo::ring_reduce_scatter(*this, collective_tag_, w.raw_data(), w.numel(), w.dtype(), op);
  const ChunkRange mine = chunk_range(w.numel(), size(), rank());
  from_working(static_cast<char*>(w.raw_data()) + mine.begin * dtype_size(w.dtype()), w.dtype(),
               out.raw_data(), out.dtype(), mine.size());
}

void Communicator::backend_all_gather(const Tensor& in, Tensor& out) {
  const int64_t elem = dtype_size(in.dtype());
  const ChunkRange mine = chunk_range(out.numel(), size(), rank());
  char* o = static_cast<char*>(out.raw_data());
  if (mine.size() > 0 && o + mine.begin * elem != in.raw_data())  // else already in place
    std::memcpy(o + mine.begin * elem, in.raw_data(), mine.size() * elem);
  algo::ring_all_gather(*this, collective_tag_, o, out.numel(), elem);
}

// The auto table, from bench/comm_algorithms on the local backend (docs/comm.md).
Algorithm algo::auto_all_reduce(int64_t bytes, int group_size, bool multi_node) {
  if (multi_node && bytes > (int64_t{1} << 20)) return Algorithm::kHierarchical;
  if (bytes <= (4 << 10) || (group_size <= 3 && bytes <= (16 << 10))) return Algorithm::kBackend;
  if (bytes <= (int64_t{1} << 20)) return Algorithm::kHalvingDoubling;
  return Algorithm::kRing;
}

Algorithm algo::auto_reduce_scatter(int64_t bytes, int group_size) {
  if (group_size >= 4 && bytes <= (64 << 10)) return Algorithm::kHalvingDoubling;
  return Algorithm::kBackend;
}

// The backend's own all-gather wins or ties everywhere we measured (docs/performance.md)
// except very large messages on two ranks, where our ring moved 1.2-3x MPI_Allgatherv's
// bandwidth in every run (256 MiB).
Algorithm algo::auto_all_gather(int64_t bytes, int group_size) {
  if (group_size == 2 && bytes >= (int64_t{128} << 20)) return Algorithm::kRing;
  return Algorithm::kBackend;
}

namespace {
std::atomic<int64_t> g_broadcast_tree_max{int64_t{16} << 20}, g_reduce_tree_max{int64_t{1} << 20};
}  // namespace
int64_t algo::broadcast_tree_max_bytes() { return g_broadcast_tree_max.load(); }
int64_t algo::reduce_tree_max_bytes() { return g_reduce_tree_max.load(); }
void algo::set_tree_max_bytes(int64_t broadcast, int64_t reduce) {
  g_broadcast_tree_max = broadcast;
  g_reduce_tree_max = reduce;
}

}  // namespace tessera::comm
