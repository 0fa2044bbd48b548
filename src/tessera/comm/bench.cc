// Times collectives per (op, size, algorithm) the way nccl-tests reports them, so our
// algorithms and the backend's own are compared in one run on one machine.
#include "tessera/comm/bench.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/base/timer.h"
#include "tessera/comm/shm_arena.h"
#include "tessera/comm/shm_collectives.h"

namespace tessera::comm {
namespace {

constexpr const char* kOps[] = {"all_reduce", "all_gather", "reduce_scatter"};

// Buffers for one op at one size, allocated once and reused by every algorithm.
struct Buffers {
  Tensor a, b;
};

// `shared`: from comm.alloc_shared, as the trainer's gradient buckets are (registered on
// `mpi` within one node, so shm reads them in place); otherwise ordinary memory.
Buffers make_buffers(const std::string& op, int64_t n, Communicator& comm, bool shared) {
  const int64_t chunk = chunk_range(n, comm.size(), comm.rank()).size();
  auto zeros = [&](int64_t numel) {
    Tensor t = shared ? comm.alloc_shared({numel}, DType::kF32) : Tensor::empty({numel}, DType::kF32);
    t.zero();
    return t;
  };
  Buffers bufs;
  if (op == "all_reduce") {
    bufs.a = zeros(n);  // (n) in place
  } else if (op == "all_gather") {
    bufs.a = zeros(chunk);  // (chunk) in
    bufs.b = zeros(n);      // (n) out
  } else {
    bufs.a = zeros(n);      // (n) in
    bufs.b = zeros(chunk);  // (chunk) out
  }
  return bufs;
}

void run_op(Communicator& comm, const std::string& op, Buffers& bufs, Algorithm a) {
  // Zeros stay zeros under a sum, so repeated calls never reach inf or denormals.
  if (op == "all_reduce")
    comm.all_reduce(bufs.a, ReduceOp::kSum, a);
  else if (op == "all_gather")
    comm.all_gather(bufs.a, bufs.b, a);
  else
    comm.reduce_scatter(bufs.a, bufs.b, ReduceOp::kSum, a);
}

// The largest value of `ns` over the ranks, element by element.
void max_over_ranks(Communicator& comm, std::vector<int64_t>& ns) {
  Tensor t = Tensor::from_vector(ns, {static_cast<int64_t>(ns.size())});
  comm.all_reduce(t, ReduceOp::kMax, Algorithm::kRing);
  std::copy(t.data<int64_t>(), t.data<int64_t>() + ns.size(), ns.begin());
}

// Times every algorithm at one point, interleaved call by call (algorithm 1, 2, ...,
// then 1 again), so that all of them see the same machine: on a shared box the load
// drifts over a point's second or so, and back-to-back blocks per algorithm turned that
// drift into 1.5x differences between two measurements of the same algorithm.
std::vector<CommBenchRow> time_point(Communicator& comm, const std::string& op,
                                     const std::vector<Algorithm>& algorithms,
                                     const std::function<Buffers&(Algorithm)>& buffers,
                                     int64_t bytes, const CommBenchOptions& o) {
  const size_t A = algorithms.size();
  // Warm-up; each algorithm's last warm-up call (slowest rank) sizes its timed calls.
  // Every rank must make the same number of calls, hence the agreement through
  // max_over_ranks.
  std::vector<int64_t> warm_ns(A, 0);
  for (int i = 0; i < std::max(o.warmup, 1); ++i)
    for (size_t a = 0; a < A; ++a) {
      comm.barrier();
      base::Timer t;
      run_op(comm, op, buffers(algorithms[a]), algorithms[a]);
      warm_ns[a] = static_cast<int64_t>(t.seconds() * 1e9);
    }
  max_over_ranks(comm, warm_ns);
  std::vector<int> iters(A);
  int rounds = 0;
  for (size_t a = 0; a < A; ++a) {
    const double warm_s = std::max(1e-9, warm_ns[a] * 1e-9);
    iters[a] = std::clamp(static_cast<int>(std::ceil(o.min_seconds / warm_s)), o.min_iterations,
                          std::max(o.min_iterations, o.max_iterations));
    rounds = std::max(rounds, iters[a]);
  }
  std::vector<std::vector<int64_t>> ns(A);
  for (size_t a = 0; a < A; ++a) ns[a].resize(iters[a]);
  for (int i = 0; i < rounds; ++i)
    for (size_t a = 0; a < A; ++a) {
      if (i >= iters[a]) continue;
      comm.barrier();
      base::Timer t;
      run_op(comm, op, buffers(algorithms[a]), algorithms[a]);
      ns[a][i] = static_cast<int64_t>(t.seconds() * 1e9);
    }

  std::vector<CommBenchRow> rows;
  for (size_t a = 0; a < A; ++a) {
    max_over_ranks(comm, ns[a]);
    std::vector<double> secs(ns[a].begin(), ns[a].end());
    for (double& s : secs) s *= 1e-9;
    CommBenchRow row;
    row.backend = comm.backend();
    row.ranks = comm.size();
    row.op = op;
    row.algorithm = algorithms[a];
    row.bytes = bytes;
    row.registered = shm_registered(comm, buffers(algorithms[a]).a);
    row.iterations = iters[a];
    row.seconds = std::max(1e-9, base::median(std::move(secs)));
    row.algbw_gbps = static_cast<double>(bytes) / row.seconds / 1e9;
    row.busbw_gbps = row.algbw_gbps * bus_factor(op, row.ranks);
    rows.push_back(row);
  }
  return rows;
}

std::string human_bytes(int64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (u < 3 && b >= 1024 && b % 1024 == 0) {
    b /= 1024;
    ++u;
  }
  return std::to_string(b) + " " + units[u];
}

}  // namespace

double bus_factor(const std::string& op, int ranks) {
  const double n = ranks;
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "all_gather" || op == "reduce_scatter") return (n - 1) / n;
  fail("bench comm: unknown collective '", op, "' (all_reduce, all_gather, reduce_scatter)");
}

std::vector<CommBenchRow> bench_collectives(Communicator& comm, const CommBenchOptions& opts) {
  // kShm elsewhere would only run the ring again under another name.
  CommBenchOptions o = opts;
  if (!shm_available(comm))
    o.algorithms.erase(std::remove(o.algorithms.begin(), o.algorithms.end(), Algorithm::kShm),
                       o.algorithms.end());
  for (const auto& op : o.ops)
    TESSERA_CHECK(std::find(std::begin(kOps), std::end(kOps), op) != std::end(kOps),
                  "bench comm: --ops: unknown collective '", op,
                  "' (all_reduce, all_gather, reduce_scatter)");
  TESSERA_CHECK(!opts.algorithms.empty(), "bench comm: --algorithms: empty list");
  TESSERA_CHECK(!o.algorithms.empty(), "bench comm: --algorithms: shm needs the mpi backend with "
                                       "every rank on one node");
  TESSERA_CHECK(o.min_bytes >= 4 && o.min_bytes <= o.max_bytes, "bench comm: --min-bytes ",
                o.min_bytes, " must be at least 4 and at most --max-bytes ", o.max_bytes);
  std::vector<int64_t> sizes;
  for (int64_t b = o.min_bytes; b <= o.max_bytes; b *= 4) sizes.push_back(b / 4 * 4);

  // Our algorithms get alloc_shared buffers (what the trainer gives them); the backend's
  // own collective (MPI's) gets ordinary ones, as any MPI program would.
  auto buffers_for = [](Algorithm a, Buffers& shared, Buffers& plain) -> Buffers& {
    return a == Algorithm::kBackend ? plain : shared;
  };
  // The first calls of a run pay for thread start-up, page faults and MPI connection
  // set-up: spend them on an untimed round of every algorithm at the smallest size.
  for (const auto& op : o.ops) {
    Buffers shared = make_buffers(op, sizes[0] / 4, comm, true);
    Buffers plain = make_buffers(op, sizes[0] / 4, comm, false);
    for (Algorithm a : o.algorithms)
      for (int i = 0; i < 5; ++i) run_op(comm, op, buffers_for(a, shared, plain), a);
  }
  std::vector<CommBenchRow> rows;
  for (const auto& op : o.ops) {
    for (int64_t bytes : sizes) {
      Buffers shared = make_buffers(op, bytes / 4, comm, true);
      Buffers plain = make_buffers(op, bytes / 4, comm, false);
      const size_t first = rows.size();
      for (CommBenchRow& r : time_point(
               comm, op, o.algorithms,
               [&](Algorithm a) -> Buffers& { return buffers_for(a, shared, plain); }, bytes, o))
        rows.push_back(std::move(r));
      const auto backend = std::find_if(rows.begin() + first, rows.end(), [](const auto& r) {
        return r.algorithm == Algorithm::kBackend;
      });
      if (backend == rows.end()) continue;
      const double ref = backend->busbw_gbps;
      for (size_t i = first; i < rows.size(); ++i)
        rows[i].ratio_vs_backend = ref > 0 ? rows[i].busbw_gbps / ref : 0;
    }
  }
  return rows;
}

std::string format_comm_bench_table(const std::vector<CommBenchRow>& rows) {
  std::string out;
  char line[256];
  if (!rows.empty()) {
    std::snprintf(line, sizeof line, "backend %s, %d ranks, f32; busbw as nccl-tests defines it\n",
                  rows[0].backend.c_str(), rows[0].ranks);
    out += line;
    const bool registered = std::any_of(rows.begin(), rows.end(), [](const CommBenchRow& r) {
      return r.registered;
    });
    out += registered ? "buffers: ours from alloc_shared (registered: shm reads them in place), "
                        "the backend's own collective's ordinary\n"
                      : "buffers: ordinary for every algorithm (this backend has no registered "
                        "memory)\n";
  }
  std::snprintf(line, sizeof line, "%-15s %10s %-13s %6s %12s %12s %12s %11s\n", "collective",
                "bytes", "algorithm", "iters", "time (us)", "algbw GB/s", "busbw GB/s",
                "vs backend");
  out += line;
  for (const auto& r : rows) {
    char ratio[32] = "-";
    if (r.ratio_vs_backend > 0) std::snprintf(ratio, sizeof ratio, "%.2fx", r.ratio_vs_backend);
    std::snprintf(line, sizeof line, "%-15s %10s %-13s %6d %12.1f %12.3f %12.3f %11s\n",
                  r.op.c_str(), human_bytes(r.bytes).c_str(), algorithm_name(r.algorithm),
                  r.iterations, r.seconds * 1e6, r.algbw_gbps, r.busbw_gbps, ratio);
    out += line;
  }
  return out;
}

std::string comm_bench_row_json(const CommBenchRow& r) {
  nlohmann::ordered_json j = {{"bench", "comm"},
                      {"backend", r.backend},
                      {"ranks", r.ranks},
                      {"op", r.op},
                      {"algorithm", algorithm_name(r.algorithm)},
                      {"bytes", r.bytes},
                      {"registered", r.registered},
                      {"iterations", r.iterations},
                      {"time_us", r.seconds * 1e6},
                      {"algbw_gbps", r.algbw_gbps},
                      {"busbw_gbps", r.busbw_gbps}};
  if (r.ratio_vs_backend > 0) j["ratio_vs_backend"] = r.ratio_vs_backend;
  return j.dump();
}

}  // namespace tessera::comm
