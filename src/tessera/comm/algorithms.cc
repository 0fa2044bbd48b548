// Reductions, ring, recursive halving-doubling and hierarchical algorithms
// (algorithms.h); trees, chain, all-to-all and barrier are in algorithms_tree.cc.
#include "tessera/comm/algorithms.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "tessera/base/error.h"

namespace tessera::comm::algo {

namespace {

std::atomic<int64_t> g_segment_bytes{256 << 10};  // measured: docs/comm.md

int mod(int a, int n) { return ((a % n) + n) % n; }

void wait_all(std::vector<RequestPtr>& reqs) {
  for (auto& r : reqs)
    if (r) r->wait();
  reqs.clear();
}

template <typename T>
void reduce_loop(T* __restrict acc, const T* __restrict in, int64_t n, ReduceOp op) {
  if (op == ReduceOp::kMax) {
    for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] < in[i] ? in[i] : acc[i];
  } else {
    for (int64_t i = 0; i < n; ++i) acc[i] += in[i];
  }
}

// Segment k of chunk c when n elements are chunked over N ranks and each chunk is cut
// into S segments (the same S for every chunk, so both ends of a message agree).
struct Segments {
  int64_t n;
  int N, S;
  ChunkRange get(int c, int k) const {
    const ChunkRange ch = chunk_range(n, N, c);
    const ChunkRange s = chunk_range(ch.size(), S, k);
    return {ch.begin + s.begin, ch.begin + s.end};
  }
};

// The ring, as reduce-scatter units (steps 0..N-2: receive a segment of chunk r-s-2 from
// the left, reduce it in, pass it right) followed by all-gather units (steps 0..N-2:
// receive a segment of chunk r-t-1 in place, pass it right). Each reduced or received
// segment is forwarded at once, so segments of consecutive steps are in flight together.
void ring(Communicator& c, int tag, char* data, int64_t n, int64_t elem, DType dt, ReduceOp op,
          bool rs, bool ag) {
  const int N = c.size(), r = c.rank();
  if (N == 1 || n == 0) return;
  const int right = mod(r + 1, N), left = mod(r - 1, N);
  const int64_t max_chunk = (n + N - 1) / N;
  const int64_t seg_target = std::max<int64_t>(1, segment_bytes() / elem);
  const int S = static_cast<int>(std::max<int64_t>(1, (max_chunk + seg_target - 1) / seg_target));
  const int64_t slot_elems = (max_chunk + S - 1) / S;  // >= every segment
  const Segments g{n, N, S};
  const int rs_steps = rs ? N - 1 : 0;
  const int64_t units = static_cast<int64_t>(rs_steps + (ag ? N - 1 : 0)) * S;
  constexpr int kWindow = 4;  // receives posted ahead
  std::vector<char> scratch(rs ? kWindow * slot_elems * elem : 0);
  std::vector<RequestPtr> rs_sends(rs ? static_cast<size_t>(N - 1) * S : 0), sends;
  std::vector<RequestPtr> recvs(kWindow);

  auto region = [&](const ChunkRange& s) { return data + s.begin * elem; };
  auto chunk_of = [&](int64_t u) {
    const int step = static_cast<int>(u / S);
    return step < rs_steps ? mod(r - step - 2, N) : mod(r - (step - rs_steps) - 1, N);
  };
  // Posts the receive of unit u; receives are posted strictly in unit order (messages
  // match in posting order). An all-gather unit lands where this rank's reduce-scatter
  // send of the same index came from: with must_wait false it is posted only once that
  // send has completed (waiting then could deadlock the ring) and false is returned.
  auto post = [&](int64_t u, bool must_wait) {
    const int step = static_cast<int>(u / S), k = static_cast<int>(u % S);
    const ChunkRange s = g.get(chunk_of(u), k);
    if (step < rs_steps) {
      recvs[u % kWindow] =
          c.irecv(scratch.data() + (u % kWindow) * slot_elems * elem, s.size() * elem, left, tag);
    } else {
      if (rs) {
        RequestPtr& prior = rs_sends[static_cast<size_t>(step - rs_steps) * S + k];
        if (prior) {
          if (!must_wait && !prior->test()) return false;
          prior->wait();
          prior.reset();
        }
      }
      recvs[u % kWindow] = c.irecv(region(s), s.size() * elem, left, tag);
    }
    return true;
  };
  int64_t next_post = 0;

  if (rs) {
    for (int k = 0; k < S; ++k) {
      const ChunkRange s = g.get(mod(r - 1, N), k);
      rs_sends[k] = c.isend(region(s), s.size() * elem, right, tag);
    }
  } else {
    for (int k = 0; k < S; ++k) {
      const ChunkRange s = g.get(r, k);
      sends.push_back(c.isend(region(s), s.size() * elem, right, tag));
    }
  }
  while (next_post < std::min<int64_t>(kWindow, units) && post(next_post, false)) ++next_post;
  for (int64_t u = 0; u < units; ++u) {
    while (next_post <= u) post(next_post++, true);
    recvs[u % kWindow]->wait();
    const int step = static_cast<int>(u / S), k = static_cast<int>(u % S);
    const ChunkRange s = g.get(chunk_of(u), k);
    if (step < rs_steps) {
      reduce_into(region(s), scratch.data() + (u % kWindow) * slot_elems * elem, s.size(), dt, op);
      if (step + 1 < rs_steps)
        rs_sends[static_cast<size_t>(step + 1) * S + k] =
            c.isend(region(s), s.size() * elem, right, tag);
      else if (ag)
        sends.push_back(c.isend(region(s), s.size() * elem, right, tag));
    } else if (step - rs_steps + 1 < N - 1) {
      sends.push_back(c.isend(region(s), s.size() * elem, right, tag));
    }
    while (next_post < std::min<int64_t>(u + 1 + kWindow, units) && post(next_post, false))
      ++next_post;
  }
  wait_all(rs_sends);
  wait_all(sends);
}

// Recursive halving-doubling layout: P = largest power of two <= N participants. Of the
// first 2*rem ranks (rem = N - P) the even ones fold into their odd neighbour; participant
// j then owns the chunks of the ranks it stands for, a contiguous "block" of elements.
struct HdLayout {
  int N, P, rem, r;
  int64_t n;
  bool extra() const { return r < 2 * rem && r % 2 == 0; }
  int participant() const { return r < 2 * rem ? r / 2 : r - rem; }
  int old_rank(int j) const { return j < rem ? 2 * j + 1 : j + rem; }
  int64_t block_begin(int j) const {  // element offset of block j (j == P: n)
    if (j >= P) return n;
    return chunk_range(n, N, j < rem ? 2 * j : j + rem).begin;
  }
};

HdLayout hd_layout(const Communicator& c, int64_t n) {
  const int N = c.size();
  int P = 1;
  while (P * 2 <= N) P *= 2;
  return {N, P, N - P, c.rank(), n};
}

// Halving: participant j ends with block j reduced over all ranks.
void hd_halving(Communicator& c, int tag, const HdLayout& L, char* data, int64_t elem, DType dt,
                ReduceOp op) {
  const int j = L.participant();
  int lo = 0, hi = L.P;
  std::vector<char> scratch;
  for (int d = L.P / 2; d >= 1; d /= 2) {
    const int mid = lo + (hi - lo) / 2;
    const bool low = (j & d) == 0;
    const int keep_lo = low ? lo : mid, keep_hi = low ? mid : hi;
    const int send_lo = low ? mid : lo, send_hi = low ? hi : mid;
    const int64_t kb = L.block_begin(keep_lo), ke = L.block_begin(keep_hi);
    const int64_t sb = L.block_begin(send_lo), se = L.block_begin(send_hi);
    scratch.resize((ke - kb) * elem);
    const int peer = L.old_rank(j ^ d);
    std::vector<RequestPtr> reqs{c.isend(data + sb * elem, (se - sb) * elem, peer, tag),
                                 c.irecv(scratch.data(), (ke - kb) * elem, peer, tag)};
    reqs[1]->wait();
    reduce_into(data + kb * elem, scratch.data(), ke - kb, dt, op);
    wait_all(reqs);
    lo = keep_lo;
    hi = keep_hi;
  }
}

// Doubling: participant j holds block j; ends with every block.
void hd_doubling(Communicator& c, int tag, const HdLayout& L, char* data, int64_t elem) {
  const int j = L.participant();
  for (int d = 1; d < L.P; d *= 2) {
    const int mine = j & ~(d - 1), theirs = (j ^ d) & ~(d - 1);
    const int64_t mb = L.block_begin(mine), me = L.block_begin(mine + d);
    const int64_t tb = L.block_begin(theirs), te = L.block_begin(theirs + d);
    const int peer = L.old_rank(j ^ d);
    std::vector<RequestPtr> reqs{c.isend(data + mb * elem, (me - mb) * elem, peer, tag),
                                 c.irecv(data + tb * elem, (te - tb) * elem, peer, tag)};
    wait_all(reqs);
  }
}

// Extra ranks hand their whole buffer to their partner, which reduces it in.
void hd_fold_reduce(Communicator& c, int tag, const HdLayout& L, char* data, int64_t elem, DType dt,
                    ReduceOp op) {
  if (L.r >= 2 * L.rem) return;
  if (L.extra()) {
    c.send(data, L.n * elem, L.r + 1, tag);
  } else {
    std::vector<char> scratch(L.n * elem);
    c.recv(scratch.data(), L.n * elem, L.r - 1, tag);
    reduce_into(data, scratch.data(), L.n, dt, op);
  }
}

// Participants send the whole result back to their extra rank.
void hd_unfold_all(Communicator& c, int tag, const HdLayout& L, char* data, int64_t elem) {
  if (L.r >= 2 * L.rem) return;
  if (L.extra())
    c.recv(data, L.n * elem, L.r + 1, tag);
  else
    c.send(data, L.n * elem, L.r - 1, tag);
}

}  // namespace

void reduce_into(void* acc, const void* in, int64_t n, DType dt, ReduceOp op) {
  switch (dt) {
    case DType::kF32:
      reduce_loop(static_cast<float*>(acc), static_cast<const float*>(in), n, op);
      break;
    case DType::kI32:
      reduce_loop(static_cast<int32_t*>(acc), static_cast<const int32_t*>(in), n, op);
      break;
    case DType::kI64:
      reduce_loop(static_cast<int64_t*>(acc), static_cast<const int64_t*>(in), n, op);
      break;
    default:
      fail("comm: reduction on ", dtype_name(dt), " (working dtype must be f32, i32 or i64)");
  }
}

void divide_by(void* data, int64_t n, DType dt, int64_t divisor) {
  switch (dt) {
    case DType::kF32: {
      float* p = static_cast<float*>(data);
      const float d = static_cast<float>(divisor);
      for (int64_t i = 0; i < n; ++i) p[i] /= d;
      break;
    }
    case DType::kI32: {
      int32_t* p = static_cast<int32_t*>(data);
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<int32_t>(p[i] / divisor);
      break;
    }
    case DType::kI64: {
      int64_t* p = static_cast<int64_t*>(data);
      for (int64_t i = 0; i < n; ++i) p[i] /= divisor;
      break;
    }
    default:
      fail("comm: average on ", dtype_name(dt), " (working dtype must be f32, i32 or i64)");
  }
}

int64_t segment_bytes() { return g_segment_bytes.load(std::memory_order_relaxed); }
void set_segment_bytes(int64_t bytes) {
  TESSERA_CHECK(bytes >= 1, "comm: segment size must be >= 1 byte, got ", bytes);
  g_segment_bytes.store(bytes, std::memory_order_relaxed);
}

void ring_reduce_scatter(Communicator& c, int tag, void* data, int64_t n, DType dt, ReduceOp op) {
  ring(c, tag, static_cast<char*>(data), n, dtype_size(dt), dt, op, true, false);
}
void ring_all_gather(Communicator& c, int tag, void* data, int64_t n, int64_t elem) {
  ring(c, tag, static_cast<char*>(data), n, elem, DType::kU8, ReduceOp::kSum, false, true);
}
void ring_all_reduce(Communicator& c, int tag, void* data, int64_t n, DType dt, ReduceOp op) {
  ring(c, tag, static_cast<char*>(data), n, dtype_size(dt), dt, op, true, true);
}

void hd_reduce_scatter(Communicator& c, int tag, void* data, int64_t n, DType dt, ReduceOp op) {
  if (c.size() == 1 || n == 0) return;
  const HdLayout L = hd_layout(c, n);
  const int64_t elem = dtype_size(dt);
  char* p = static_cast<char*>(data);
  hd_fold_reduce(c, tag, L, p, elem, dt, op);
  if (!L.extra()) hd_halving(c, tag, L, p, elem, dt, op);
  if (L.r < 2 * L.rem) {  // the block of a folded pair holds both ranks' chunks
    const ChunkRange ch = chunk_range(n, L.N, L.r - (L.extra() ? 0 : 1));
    if (L.extra())
      c.recv(p + ch.begin * elem, ch.size() * elem, L.r + 1, tag);
    else
      c.send(p + ch.begin * elem, ch.size() * elem, L.r - 1, tag);
  }
}

void hd_all_gather(Communicator& c, int tag, void* data, int64_t n, int64_t elem) {
  if (c.size() == 1 || n == 0) return;
  const HdLayout L = hd_layout(c, n);
  char* p = static_cast<char*>(data);
  if (L.r < 2 * L.rem) {
    const ChunkRange ch = chunk_range(n, L.N, L.r - (L.extra() ? 0 : 1));
    if (L.extra())
      c.send(p + ch.begin * elem, ch.size() * elem, L.r + 1, tag);
    else
      c.recv(p + ch.begin * elem, ch.size() * elem, L.r - 1, tag);
  }
  if (!L.extra()) hd_doubling(c, tag, L, p, elem);
  hd_unfold_all(c, tag, L, p, elem);
}

void hd_all_reduce(Communicator& c, int tag, void* data, int64_t n, DType dt, ReduceOp op) {
  if (c.size() == 1 || n == 0) return;
  const HdLayout L = hd_layout(c, n);
  const int64_t elem = dtype_size(dt);
  char* p = static_cast<char*>(data);
  hd_fold_reduce(c, tag, L, p, elem, dt, op);
  if (!L.extra()) {
    hd_halving(c, tag, L, p, elem, dt, op);
    hd_doubling(c, tag, L, p, elem);
  }
  hd_unfold_all(c, tag, L, p, elem);
}

void hierarchical_all_reduce(Communicator& intra, Communicator& inter, bool inter_hd, int tag,
                             void* data, int64_t n, DType dt, ReduceOp op) {
  const int64_t elem = dtype_size(dt);
  ring_reduce_scatter(intra, tag, data, n, dt, op);
  const ChunkRange mine = chunk_range(n, intra.size(), intra.rank());
  char* chunk = static_cast<char*>(data) + mine.begin * elem;
  if (inter_hd)
    hd_all_reduce(inter, tag, chunk, mine.size(), dt, op);
  else
    ring_all_reduce(inter, tag, chunk, mine.size(), dt, op);
  ring_all_gather(intra, tag, data, n, elem);
}

}  // namespace tessera::comm::algo
