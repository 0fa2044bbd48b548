// Run under mpirun: checks every collective x algorithm (ours and MPI's own) x dtype x
// size on the `mpi` backend against references computed here from the deterministic
// per-rank inputs, plus split, point to point, the wait() watchdog and the shared-memory
// path (kShm: tiny slots so every size is pipelined, a hung peer; registered buffers from
// alloc_shared, mixed with ordinary ones, and the arena's allocator). Prints "OK n checks"
// on rank 0; exits non-zero on any mismatch. `--shm-only` runs just the kShm checks.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/comm/communicator.h"
#include "tessera/comm/mpi_backend.h"
#include "tessera/comm/shm_arena.h"
#include "tessera/comm/shm_collectives.h"

using namespace tessera;
using namespace tessera::comm;

namespace {

int64_t g_checks = 0;
int64_t g_failures = 0;

void expect(bool ok, const std::string& what) {
  ++g_checks;
  if (ok) return;
  if (++g_failures <= 20) std::fprintf(stderr, "rank %d: MISMATCH %s\n", mpi_world().rank(), what.c_str());
}

bool is_int(DType dt) { return dt == DType::kI32 || dt == DType::kI64; }

// Inputs of rank r at global index i. Floats are multiples of 1/4 below 4 in magnitude:
// exact in bf16 and f16, so sums and maxima over a few ranks are exact too. Integers
// use the full width (i64 values above 2^32) and both signs (kAvg truncates toward 0).
double gen_real(int r, int64_t i) { return static_cast<double>((r * 7 + i * 13) % 31 - 15) * 0.25; }
int64_t gen_int(DType dt, int r, int64_t i) {
  if (dt == DType::kI32)
    return static_cast<int64_t>((static_cast<uint64_t>(i) * 2654435761ull + r * 40503ull) % 200001) - 100000;
  return ((i % 1000) - 500) * (int64_t{1} << 33) + r * 12345 + i;
}

// Values are carried as double (floats) or int64 (integers), per dtype.
struct Vals {
  std::vector<double> f;
  std::vector<int64_t> i;
};

Vals gen(DType dt, int r, int64_t begin, int64_t end) {
  Vals v;
  for (int64_t k = begin; k < end; ++k) {
    if (is_int(dt))
      v.i.push_back(gen_int(dt, r, k));
    else
      v.f.push_back(gen_real(r, k));
  }
  return v;
}

Tensor make(DType dt, const Vals& v) {
  if (dt == DType::kI64) return Tensor::from_vector(v.i, {static_cast<int64_t>(v.i.size())});
  if (dt == DType::kI32) {
    std::vector<int32_t> w(v.i.begin(), v.i.end());
    return Tensor::from_vector(w, {static_cast<int64_t>(w.size())});
  }
  std::vector<float> w(v.f.begin(), v.f.end());
  return Tensor::from_vector(w, {static_cast<int64_t>(w.size())}).to(dt);
}

Vals read(const Tensor& t) {
  Vals v;
  const int64_t n = t.numel();
  if (t.dtype() == DType::kI64) {
    v.i.assign(t.data<int64_t>(), t.data<int64_t>() + n);
  } else if (t.dtype() == DType::kI32) {
    v.i.assign(t.data<int32_t>(), t.data<int32_t>() + n);
  } else {
    const auto f = t.to_f32_vector();
    v.f.assign(f.begin(), f.end());
  }
  return v;
}

// The reduction of every rank's input, over global indices [begin, end).
Vals reference(DType dt, ReduceOp op, int size, int64_t begin, int64_t end) {
  Vals out = gen(dt, 0, begin, end);
  for (int r = 1; r < size; ++r) {
    const Vals v = gen(dt, r, begin, end);
    for (size_t k = 0; k < v.f.size(); ++k)
      out.f[k] = op == ReduceOp::kMax ? std::max(out.f[k], v.f[k]) : out.f[k] + v.f[k];
    for (size_t k = 0; k < v.i.size(); ++k)
      out.i[k] = op == ReduceOp::kMax ? std::max(out.i[k], v.i[k]) : out.i[k] + v.i[k];
  }
  if (op == ReduceOp::kAvg) {
    for (double& x : out.f) x /= size;
    for (int64_t& x : out.i) x /= size;  // truncation, as communicator.h specifies
  }
  return out;
}

// Exact for integers; for floats the dtype's rounding (CTranslate2's tolerances).
void compare(const Vals& got, const Vals& ref, DType dt, const std::string& what) {
  bool ok = got.f.size() == ref.f.size() && got.i.size() == ref.i.size();
  std::string detail = ok ? "" : " (length differs)";
  const double tol = dt == DType::kF32 ? 1e-5 : dt == DType::kF16 ? 1e-3 : 1e-2;
  for (size_t k = 0; ok && k < ref.i.size(); ++k)
    if (got.i[k] != ref.i[k]) {
      ok = false;
      detail = " at " + std::to_string(k) + ": got " + std::to_string(got.i[k]) + ", want " +
               std::to_string(ref.i[k]);
    }
  for (size_t k = 0; ok && k < ref.f.size(); ++k)
    if (!(std::fabs(got.f[k] - ref.f[k]) <= tol * std::max(1.0, std::fabs(ref.f[k])))) {
      ok = false;
      detail = " at " + std::to_string(k) + ": got " + std::to_string(got.f[k]) + ", want " +
               std::to_string(ref.f[k]);
    }
  expect(ok, what + detail);
}

const char* op_name(ReduceOp op) {
  return op == ReduceOp::kSum ? "sum" : op == ReduceOp::kAvg ? "avg" : "max";
}

std::string label(const char* coll, DType dt, int64_t n, const char* extra, Algorithm a) {
  return std::string(coll) + " " + dtype_name(dt) + " n=" + std::to_string(n) + " " + extra +
         " algorithm=" + algorithm_name(a);
}

void check_algorithm_collectives(Communicator& c, DType dt, int64_t n, Algorithm a) {
  const int me = c.rank(), p = c.size();
  const ChunkRange mine = chunk_range(n, p, me);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
    Tensor t = make(dt, gen(dt, me, 0, n));  // (n)
    c.all_reduce(t, op, a);
    compare(read(t), reference(dt, op, p, 0, n), dt, label("all_reduce", dt, n, op_name(op), a));

    const Tensor in = make(dt, gen(dt, me, 0, n));       // (n)
    Tensor out = Tensor::empty({mine.size()}, dt);       // (chunk)
    c.reduce_scatter(in, out, op, a);
    compare(read(out), reference(dt, op, p, mine.begin, mine.end), dt,
            label("reduce_scatter", dt, n, op_name(op), a));
  }
  const Tensor in = make(dt, gen(dt, me, mine.begin, mine.end));  // (chunk)
  Tensor out = Tensor::empty({n}, dt);                             // (n)
  c.all_gather(in, out, a);
  Vals want;
  for (int r = 0; r < p; ++r) {
    const ChunkRange cr = chunk_range(n, p, r);
    const Vals v = gen(dt, r, cr.begin, cr.end);
    want.f.insert(want.f.end(), v.f.begin(), v.f.end());
    want.i.insert(want.i.end(), v.i.begin(), v.i.end());
  }
  compare(read(out), want, dt, label("all_gather", dt, n, "", a));
}

void check_rooted_collectives(Communicator& c, DType dt, int64_t n) {
  const int me = c.rank(), p = c.size();
  for (int root = 0; root < p; ++root) {
    Tensor t = make(dt, gen(dt, me, 0, n));
    c.broadcast(t, root);
    compare(read(t), gen(dt, root, 0, n), dt,
            "broadcast " + std::string(dtype_name(dt)) + " n=" + std::to_string(n) + " root=" +
                std::to_string(root));
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      const Tensor in = make(dt, gen(dt, me, 0, n));
      Tensor out = Tensor::zeros({n}, dt);
      c.reduce(in, out, op, root);
      if (me == root)
        compare(read(out), reference(dt, op, p, 0, n), dt,
                "reduce " + std::string(dtype_name(dt)) + " " + op_name(op) + " n=" +
                    std::to_string(n) + " root=" + std::to_string(root));
    }
  }
  // all_to_all: block j of rank r's input goes to rank j; out block r of rank j.
  const int64_t k = n;
  const Tensor in = make(dt, gen(dt, me, 0, p * k));  // (p * k)
  Tensor out = Tensor::empty({p * k}, dt);             // (p * k)
  c.all_to_all(in, out);
  Vals want;
  for (int r = 0; r < p; ++r) {
    const Vals v = gen(dt, r, me * k, (me + 1) * k);
    want.f.insert(want.f.end(), v.f.begin(), v.f.end());
    want.i.insert(want.i.end(), v.i.begin(), v.i.end());
  }
  compare(read(out), want, dt, "all_to_all " + std::string(dtype_name(dt)) + " k=" + std::to_string(k));
}

// all_to_allv: rank r sends rank j (r + 2 j) % 5 rows of 3 i64 (zero rows too) holding
// (r, j, row, column); rank j receives each peer's rows in rank order, and their counts.
void check_all_to_allv(Communicator& c) {
  const int p = c.size(), me = c.rank();
  std::vector<int64_t> send(p);
  int64_t total = 0;
  for (int j = 0; j < p; ++j) total += send[j] = (me + 2 * j) % 5;
  auto value = [](int64_t r, int64_t j, int64_t i, int64_t k) { return ((r * 64 + j) * 64 + i) * 4 + k; };
  Tensor in = Tensor::empty({total, 3}, DType::kI64);
  int64_t row = 0;
  for (int j = 0; j < p; ++j)
    for (int64_t i = 0; i < send[j]; ++i, ++row)
      for (int k = 0; k < 3; ++k) in.data<int64_t>()[row * 3 + k] = value(me, j, i, k);
  std::vector<int64_t> recv;
  const Tensor out = c.all_to_allv(in, send, &recv);
  row = 0;
  bool ok = static_cast<int>(recv.size()) == p;
  for (int j = 0; ok && j < p; ++j) {
    ok = recv[j] == (j + 2 * me) % 5;
    for (int64_t i = 0; ok && i < recv[j]; ++i, ++row)
      for (int k = 0; k < 3; ++k) ok = ok && out.data<int64_t>()[row * 3 + k] == value(j, me, i, k);
  }
  expect(ok && out.size(0) == row, "all_to_allv rows and counts");
}

void check_async(Communicator& c) {
  const int p = c.size();
  for (Algorithm a : {Algorithm::kBackend, Algorithm::kRing, Algorithm::kHalvingDoubling,
                      Algorithm::kHierarchical, Algorithm::kShm, Algorithm::kAuto}) {
    const int64_t n = 4099;
    Tensor t1 = make(DType::kF32, gen(DType::kF32, c.rank(), 0, n));
    Tensor t2 = make(DType::kI64, gen(DType::kI64, c.rank(), 0, n));
    auto r1 = c.all_reduce_async(t1, ReduceOp::kSum, a);
    auto r2 = c.all_reduce_async(t2, ReduceOp::kMax, a);
    r2->wait();
    r1->wait();
    compare(read(t1), reference(DType::kF32, ReduceOp::kSum, p, 0, n), DType::kF32,
            label("all_reduce_async", DType::kF32, n, "sum", a));
    compare(read(t2), reference(DType::kI64, ReduceOp::kMax, p, 0, n), DType::kI64,
            label("all_reduce_async", DType::kI64, n, "max", a));
  }
}

// TESSERA_MPI_RANKS_PER_NODE=k: every k consecutive world ranks are a (simulated) node.
int ranks_per_node() {
  const char* env = std::getenv("TESSERA_MPI_RANKS_PER_NODE");
  return env ? std::atoi(env) : 0;
}
// The node id the backend must report for members[i] (world ranks, in group order): the
// nodes numbered by the first group rank on each.
int expected_node_id(const std::vector<int>& members, int i) {
  const int k = ranks_per_node();
  auto node_of = [k](int world_rank) { return k > 0 ? world_rank / k : 0; };
  std::vector<int> seen;
  for (int m : members) {
    if (std::find(seen.begin(), seen.end(), node_of(m)) == seen.end()) seen.push_back(node_of(m));
    if (node_of(m) == node_of(members[i]))
      return static_cast<int>(std::find(seen.begin(), seen.end(), node_of(m)) - seen.begin());
  }
  return -1;
}

// Even and odd ranks form two groups ordered by descending old rank (key = -rank).
void check_split(Communicator& world) {
  const int me = world.rank(), p = world.size();
  auto sub = world.split(me % 2, -me);
  std::vector<int> members;  // old ranks, in the new order
  for (int r = p - 1; r >= 0; --r)
    if (r % 2 == me % 2) members.push_back(r);
  expect(sub != nullptr, "split: even/odd group missing");
  if (!sub) return;
  int want_rank = 0;
  while (members[want_rank] != me) ++want_rank;
  expect(sub->size() == static_cast<int>(members.size()) && sub->rank() == want_rank,
         "split: rank " + std::to_string(sub->rank()) + " of " + std::to_string(sub->size()) +
             ", want " + std::to_string(want_rank) + " of " + std::to_string(members.size()));
  expect(sub->backend() == "mpi" && sub->node_id() == expected_node_id(members, want_rank),
         "split: backend mpi, node id " + std::to_string(sub->node_id()) + ", want " +
             std::to_string(expected_node_id(members, want_rank)));
  for (Algorithm a : {Algorithm::kBackend, Algorithm::kRing, Algorithm::kHalvingDoubling}) {
    const int64_t n = 1000;
    Tensor t = make(DType::kI64, gen(DType::kI64, me, 0, n));
    sub->all_reduce(t, ReduceOp::kSum, a);
    Vals want = gen(DType::kI64, members[0], 0, n);
    for (size_t m = 1; m < members.size(); ++m) {
      const Vals v = gen(DType::kI64, members[m], 0, n);
      for (int64_t k = 0; k < n; ++k) want.i[k] += v.i[k];
    }
    compare(read(t), want, DType::kI64, std::string("split all_reduce algorithm=") + algorithm_name(a));
  }
  // colour < 0: rank 0 joins no group; the others form one.
  auto rest = world.split(me == 0 ? -1 : 0, me);
  expect((me == 0) == (rest == nullptr), "split: colour -1 must give no group");
  if (rest) {
    expect(rest->size() == p - 1 && rest->rank() == me - 1, "split: group without rank 0");
    Tensor t = make(DType::kF32, gen(DType::kF32, me, 0, 7));
    rest->all_reduce(t, ReduceOp::kSum, Algorithm::kBackend);
    Vals want = gen(DType::kF32, 1, 0, 7);
    for (int r = 2; r < p; ++r)
      for (int k = 0; k < 7; ++k) want.f[k] += gen_real(r, k);
    compare(read(t), want, DType::kF32, "split (without rank 0) all_reduce");
  }
}

std::vector<uint8_t> pattern(int from, int64_t bytes, int salt) {
  std::vector<uint8_t> v(bytes);
  for (int64_t j = 0; j < bytes; ++j) v[j] = static_cast<uint8_t>(from * 31 + j * 7 + salt);
  return v;
}

// Ring exchange: rank r sends to r+1. Receives are posted out of tag order; two messages
// with the same tag must arrive in order; an empty message is allowed.
void check_point_to_point(Communicator& c) {
  const int me = c.rank(), p = c.size();
  const int next = (me + 1) % p, prev = (me + p - 1) % p;
  const int64_t big = 100003;
  auto s_big = pattern(me, big, 1), s_small = pattern(me, 5, 2);
  auto s_a = pattern(me, 10, 3), s_b = pattern(me, 20, 4);
  std::vector<uint8_t> r_big(big), r_small(5), r_a(10), r_b(20);
  char empty = 0;
  std::vector<RequestPtr> reqs = {
      c.irecv(r_small.data(), 5, prev, 8), c.irecv(r_big.data(), big, prev, 7),
      c.irecv(r_a.data(), 10, prev, 9),    c.irecv(r_b.data(), 20, prev, 9),
      c.irecv(&empty, 0, prev, 10)};
  auto s1 = c.isend(s_big.data(), big, next, 7);
  auto s2 = c.isend(s_small.data(), 5, next, 8);
  auto s3 = c.isend(s_a.data(), 10, next, 9);
  auto s4 = c.isend(s_b.data(), 20, next, 9);
  auto s5 = c.isend(&empty, 0, next, 10);
  while (!reqs[0]->test()) {
  }
  for (auto& r : reqs) r->wait();
  for (auto& s : {s1, s2, s3, s4, s5}) s->wait();
  expect(r_big == pattern(prev, big, 1), "p2p: 100003-byte message, tag 7");
  expect(r_small == pattern(prev, 5, 2), "p2p: 5-byte message, tag 8");
  expect(r_a == pattern(prev, 10, 3) && r_b == pattern(prev, 20, 4), "p2p: same-tag order");
  expect(reqs[0]->test(), "p2p: test() after completion");

  // A receive nobody sends: the watchdog fires (a handler records it instead of the
  // default abort) and wait() throws.
  if (me == 0) {
    std::fprintf(stderr, "(the watchdog line below is expected: a receive nobody sends)\n");
    const double saved = c.timeout();
    c.set_timeout(0.2);
    int fired = 0;
    Communicator::set_timeout_handler([&fired](const std::string& msg) {
      if (msg.find("irecv from rank") != std::string::npos) ++fired;
    });
    bool threw = false;
    {
      auto r = c.irecv(r_small.data(), 5, next, 99999);
      try {
        r->wait();
      } catch (const Error& e) {
        threw = std::strstr(e.what(), "did not finish within") != nullptr;
      }
    }  // the abandoned receive is cancelled here
    Communicator::set_timeout_handler(nullptr);
    c.set_timeout(saved);
    expect(threw && fired == 1, "p2p: wait() on a receive nobody sends must time out (threw " +
                                    std::to_string(threw) + ", handler ran " + std::to_string(fired) + "x)");
  }
  c.barrier();
}

// kShm: available exactly when every rank is on one (real or simulated) node; correct
// for every dtype and op at sizes of 1 element to many slots; a peer that never comes
// trips the watchdog instead of hanging, and the group refuses further use.
void check_shm(Communicator& world) {
  const int me = world.rank(), p = world.size();
  const bool one_node = ranks_per_node() == 0 || ranks_per_node() >= p;
  expect(shm_available(world) == one_node,
         "shm_available(world) = " + std::to_string(shm_available(world)) + " with " +
             std::to_string(p) + " ranks, TESSERA_MPI_RANKS_PER_NODE=" + std::to_string(ranks_per_node()));
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kI32, DType::kI64};
  // 4 KiB slots: a reduction region is 4096 / p bytes (at most 512 f32), so 20011 elements
  // take 10-40 pipelined steps; 1, 3 and 1023 leave some ranks with empty chunks or odd
  // splits; none of 3, 1023, 4097, 20011 divides by 2 and 4, and 4097 not by 3 either.
  const int64_t saved = shm_slot_bytes();
  set_shm_slot_bytes(4096);
  auto tiny = world.split(0, me);  // the same ranks; its segment gets the 4 KiB slots
  set_shm_slot_bytes(saved);
  for (DType dt : dtypes)
    for (int64_t n : {1, 3, 1023, 4097, 20011}) check_algorithm_collectives(*tiny, dt, n, Algorithm::kShm);
  // The default slot (1 MiB): 1 step for the sizes above in main(); this one takes several.
  check_algorithm_collectives(world, DType::kF32, 3 * (shm_slot_bytes() / 4) + 5, Algorithm::kShm);
  if (!one_node) return;

  // A hung peer: every rank makes the segment with one collective, then rank 0 alone
  // calls another. Its wait must end in the watchdog (handler recorded, Error thrown).
  auto lone = world.split(0, me);
  Tensor t = make(DType::kF32, gen(DType::kF32, me, 0, 64));
  lone->all_reduce(t, ReduceOp::kSum, Algorithm::kShm);
  compare(read(t), reference(DType::kF32, ReduceOp::kSum, p, 0, 64), DType::kF32, "shm lone warm-up");
  if (me == 0) {
    std::fprintf(stderr, "(the shm watchdog lines below are expected: rank 0 runs an all_reduce alone)\n");
    lone->set_timeout(0.2);
    int fired = 0;
    Communicator::set_timeout_handler([&fired](const std::string& msg) {
      if (msg.find("all_reduce") != std::string::npos && msg.find("shm") != std::string::npos) ++fired;
    });
    bool threw = false, refused = false;
    try {
      lone->all_reduce(t, ReduceOp::kSum, Algorithm::kShm);
    } catch (const Error& e) {
      threw = std::strstr(e.what(), "did not finish within") != nullptr;
    }
    Communicator::set_timeout_handler(nullptr);
    try {
      lone->all_reduce(t, ReduceOp::kSum, Algorithm::kShm);
    } catch (const Error& e) {
      refused = std::strstr(e.what(), "cannot be used again") != nullptr;
    }
    expect(threw && fired == 1 && refused,
           "shm: a rank alone in an all_reduce must time out (threw " + std::to_string(threw) +
               ", handler ran " + std::to_string(fired) + "x, later call refused " +
               std::to_string(refused) + ")");
  }
  world.barrier();
}

// A tensor holding v: in c's arena when `shared` (alloc_shared), else ordinary memory.
Tensor make_in(Communicator& c, DType dt, const Vals& v, bool shared) {
  Tensor plain = make(dt, v);
  if (!shared) return plain;
  Tensor t = c.alloc_shared(plain.shape(), dt);
  t.copy_from(plain);
  return t;
}

int64_t registered_calls(Communicator& c) {
  auto* h = dynamic_cast<ShmHost*>(&c);
  const ShmArena* a = h ? h->shm_arena() : nullptr;
  return a ? a->registered_calls() : 0;
}

// kShm with this rank's inputs registered (`shared`) or not; peers may differ. Checks the
// results and that the registered path ran exactly where this rank's input was
// registered and at least shm_registered_min_bytes(): f32/i32/i64 reductions (bf16/f16
// reduce an ordinary f32 working copy) and every all-gather of a non-empty chunk.
void check_registered_collectives(Communicator& c, DType dt, int64_t n, bool shared) {
  const int me = c.rank(), p = c.size();
  const ChunkRange mine = chunk_range(n, p, me);
  const Algorithm a = Algorithm::kShm;
  const char* how = shared ? "registered" : "unregistered";
  const int64_t calls0 = registered_calls(c);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
    const std::string what = std::string(op_name(op)) + " " + how;
    Tensor t = make_in(c, dt, gen(dt, me, 0, n), shared);  // (n)
    c.all_reduce(t, op, a);
    compare(read(t), reference(dt, op, p, 0, n), dt, label("all_reduce", dt, n, what.c_str(), a));
    const Tensor in = make_in(c, dt, gen(dt, me, 0, n), shared);  // (n)
    Tensor out = Tensor::empty({mine.size()}, dt);                 // (chunk)
    c.reduce_scatter(in, out, op, a);
    compare(read(out), reference(dt, op, p, mine.begin, mine.end), dt,
            label("reduce_scatter", dt, n, what.c_str(), a));
  }
  Vals want;
  for (int r = 0; r < p; ++r) {
    const ChunkRange cr = chunk_range(n, p, r);
    const Vals v = gen(dt, r, cr.begin, cr.end);
    want.f.insert(want.f.end(), v.f.begin(), v.f.end());
    want.i.insert(want.i.end(), v.i.begin(), v.i.end());
  }
  const Tensor in = make_in(c, dt, gen(dt, me, mine.begin, mine.end), shared);  // (chunk)
  Tensor out = Tensor::empty({n}, dt);                                          // (n)
  c.all_gather(in, out, a);
  compare(read(out), want, dt, label("all_gather", dt, n, how, a));
  // In place: the input is this rank's chunk of a registered output.
  Tensor whole = make_in(c, dt, gen(dt, me, 0, n), shared);  // (n)
  Tensor own = whole.slice(0, mine.begin, mine.end);
  own.copy_from(make(dt, gen(dt, me, mine.begin, mine.end)));
  c.all_gather(own, whole, a);
  compare(read(whole), want, dt, label("all_gather in place", dt, n, how, a));

  const bool reducible = dt == DType::kF32 || dt == DType::kI32 || dt == DType::kI64;
  const bool in_arena = shared && shm_available(c);  // else alloc_shared is plain memory
  const int64_t min = std::max<int64_t>(1, shm_registered_min_bytes()), es = dtype_size(dt);
  const int64_t want_calls = !in_arena ? 0
                             : (reducible && n * es >= min ? 6 : 0) + (mine.size() * es >= min ? 2 : 0);
  const int64_t got_calls = registered_calls(c) - calls0;
  expect(got_calls == want_calls, label("registered path", dt, n, how, a) + ": ran " +
                                      std::to_string(got_calls) + "x, want " +
                                      std::to_string(want_calls) + "x");
}

// Registered buffers (alloc_shared): on one node they land in the arena and the shm
// collectives read them in place, alone or mixed with ordinary inputs on other ranks;
// elsewhere alloc_shared is plain memory. Then the allocator: reuse, first fit, views
// keeping blocks, exhaustion falling back, threads.
void check_registered(Communicator& world) {
  const int me = world.rank(), p = world.size();
  const bool one_node = ranks_per_node() == 0 || ranks_per_node() >= p;
  const int64_t saved_slot = shm_slot_bytes(), saved_arena = shm_arena_bytes();
  set_shm_slot_bytes(4096);  // pipelined steps, as in check_shm
  auto tiny = world.split(0, me);
  set_shm_slot_bytes(saved_slot);
  set_shm_arena_bytes(int64_t{1} << 20);
  Tensor probe = tiny->alloc_shared({1000}, DType::kF32);  // makes tiny's 1 MiB arena
  set_shm_arena_bytes(saved_arena);
  expect(shm_registered(*tiny, probe) == one_node && probe.numel() == 1000,
         "alloc_shared: registered " + std::to_string(shm_registered(*tiny, probe)) +
             ", want " + std::to_string(one_node));
  probe = Tensor();
  struct RestoreMin {
    int64_t saved = shm_registered_min_bytes();
    ~RestoreMin() { set_shm_registered_min_bytes(saved); }
  } restore_min;
  set_shm_registered_min_bytes(0);  // in place at every size
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kI32, DType::kI64};
  for (DType dt : dtypes)
    for (int64_t n : {1, 3, 1023, 20011}) check_registered_collectives(*tiny, dt, n, true);
  // Mixed: even ranks registered, odd ones not, then the reverse.
  for (int parity : {0, 1})
    for (DType dt : {DType::kF32, DType::kI64})
      for (int64_t n : {3, 4097})
        check_registered_collectives(*tiny, dt, n, me % 2 == parity);
  // Below the minimum a registered input takes the slot path: reductions of 4097 x 4
  // bytes in place, the all-gathers of 4097 / p elements not.
  set_shm_registered_min_bytes(4097 * 4);
  check_registered_collectives(*tiny, DType::kF32, 4097, true);
  set_shm_registered_min_bytes(0);
  if (!one_node) return;

  // The default slot and arena on the world: one size over a slot.
  check_registered_collectives(world, DType::kF32, 3 * (shm_slot_bytes() / 4) + 5, true);

  ShmArena* arena = dynamic_cast<ShmHost*>(tiny.get())->shm_arena();
  expect(arena && arena->bytes() == (int64_t{1} << 20) && arena->bytes_in_use() == 0,
         "arena: 1 MiB, nothing in use after the collectives");
  if (!arena) return;
  const int64_t kb = 1024 / 4;  // f32 elements per KiB
  // 300 rounds of 3 x 300 KiB through a 1 MiB arena, freed in rotating order.
  bool all_in = true, kept = true;
  for (int round = 0; round < 300; ++round) {
    std::vector<Tensor> ts;
    for (int j = 0; j < 3; ++j) {
      ts.push_back(tiny->alloc_shared({300 * kb}, DType::kF32));
      all_in = all_in && shm_registered(*tiny, ts.back());
      ts.back().fill(static_cast<float>(round * 3 + j));
    }
    for (int j = 0; j < 3; ++j) kept = kept && ts[j].item_f32(300 * kb - 1) == round * 3 + j;
    for (int j = 0; j < 3; ++j) ts[(round + j) % 3] = Tensor();
  }
  expect(all_in && kept && arena->bytes_in_use() == 0,
         "arena: 300 rounds of 3 x 300 KiB in a 1 MiB arena (all registered " +
             std::to_string(all_in) + ", values kept " + std::to_string(kept) + ", in use " +
             std::to_string(arena->bytes_in_use()) + ")");
  // First fit fills a hole; a view keeps its block; freed blocks coalesce.
  Tensor a = tiny->alloc_shared({256 * kb}, DType::kF32), b = tiny->alloc_shared({256 * kb}, DType::kF32);
  Tensor c = tiny->alloc_shared({256 * kb}, DType::kF32);
  const void* hole = b.raw_data();
  b = Tensor();
  Tensor d = tiny->alloc_shared({200 * kb}, DType::kF32);
  expect(d.raw_data() == hole, "arena: first fit reuses the freed block");
  Tensor view = a.slice(0, 10, 20);
  a = Tensor();
  const int64_t with_view = arena->bytes_in_use();
  view = Tensor();
  expect(with_view == (256 + 256 + 200) * 1024 && arena->bytes_in_use() == (256 + 200) * 1024,
         "arena: a view keeps its block (in use " + std::to_string(with_view) + ")");
  c = Tensor();
  d = Tensor();
  Tensor all = tiny->alloc_shared({256 * kb * 4}, DType::kF32);  // the whole arena
  if (me == 0) std::fprintf(stderr, "(the arena warning below is expected: it is full)\n");
  Tensor over = tiny->alloc_shared({kb}, DType::kF32);  // no room: ordinary memory
  expect(shm_registered(*tiny, all) && !shm_registered(*tiny, over) && over.numel() == kb,
         "arena: the whole arena is one block again; one more falls back to ordinary memory");
  all = over = Tensor();
  // Two threads allocating and freeing at once (a deleter may run on any thread).
  auto churn = [&](int salt) {
    for (int i = 0; i < 500; ++i) {
      Tensor t = tiny->alloc_shared({(i * 7 + salt) % 100 * kb + 1}, DType::kF32);
      t.fill(1.0f);
    }
  };
  std::thread t1(churn, 1), t2(churn, 2);
  t1.join();
  t2.join();
  expect(arena->bytes_in_use() == 0, "arena: two threads' blocks all came back");
  // The recycled blocks still work as registered inputs.
  check_registered_collectives(*tiny, DType::kF32, 20011, true);
  world.barrier();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Communicator& world = mpi_world();
    const int me = world.rank(), p = world.size();
    if (p < 2) {
      std::fprintf(stderr, "mpi_collectives_check: run under mpirun with at least 2 ranks\n");
      return 2;
    }
    std::vector<int> everyone(p);
    for (int r = 0; r < p; ++r) everyone[r] = r;
    expect(world.backend() == "mpi" && world.node_id() == expected_node_id(everyone, me),
           "world: backend mpi, node id " + std::to_string(world.node_id()));
    expect(running_under_mpi(), "running_under_mpi() under mpirun");
    const bool shm_only = argc > 1 && std::strcmp(argv[1], "--shm-only") == 0;
    const Algorithm algorithms[] = {Algorithm::kBackend, Algorithm::kRing,
                                    Algorithm::kHalvingDoubling, Algorithm::kHierarchical,
                                    Algorithm::kShm, Algorithm::kAuto};
    const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kI32, DType::kI64};
    if (!shm_only) {
      for (DType dt : dtypes)
        for (int64_t n : {1, 3, 1023, 100000}) {
          for (Algorithm a : algorithms) check_algorithm_collectives(world, dt, n, a);
          check_rooted_collectives(world, dt, n == 100000 ? 10000 : n);
        }
      check_all_to_allv(world);
      check_async(world);
      check_split(world);
      check_point_to_point(world);
    }
    check_shm(world);
    check_registered(world);
    world.barrier();

    Tensor totals = Tensor::from_vector(std::vector<int64_t>{g_checks, g_failures}, {2});
    world.all_reduce(totals, ReduceOp::kSum, Algorithm::kBackend);
    const int64_t checks = totals.data<int64_t>()[0], failures = totals.data<int64_t>()[1];
    if (me == 0) {
      if (failures == 0)
        std::printf("OK %lld checks on %d ranks (MPI_THREAD_MULTIPLE: %s)\n",
                    static_cast<long long>(checks), p, mpi_thread_multiple() ? "yes" : "no");
      else
        std::printf("FAILED %lld of %lld checks on %d ranks\n", static_cast<long long>(failures),
                    static_cast<long long>(checks), p);
    }
    return g_failures == 0 && failures == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpi_collectives_check: error: %s\n", e.what());
    mpi_abort(1);
  }
}
