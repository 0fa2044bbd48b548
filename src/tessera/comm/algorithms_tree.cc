// Binomial-tree and pipelined-chain broadcast, tree and ring+gather reduce, pairwise
// all-to-all and dissemination barrier (algorithms.h).
#include <algorithm>
#include <cstring>
#include <vector>

#include "tessera/comm/algorithms.h"

namespace tessera::comm::algo {

namespace {
int mod(int a, int n) { return ((a % n) + n) % n; }

void wait_all(std::vector<RequestPtr>& reqs) {
  for (auto& r : reqs) r->wait();
  reqs.clear();
}
}  // namespace

void broadcast_tree(Communicator& c, int tag, void* data, int64_t bytes, int root) {
  const int N = c.size(), r = c.rank(), v = mod(r - root, N);  // v: rank relative to root
  if (N == 1) return;
  int mask = 1;
  while (mask < N) {
    if (v & mask) {
      c.recv(data, bytes, mod(r - mask, N), tag);
      break;
    }
    mask <<= 1;
  }
  std::vector<RequestPtr> sends;
  for (mask >>= 1; mask > 0; mask >>= 1)
    if (v + mask < N) sends.push_back(c.isend(data, bytes, mod(r + mask, N), tag));
  wait_all(sends);
}

void broadcast_chain(Communicator& c, int tag, void* data, int64_t bytes, int root) {
  const int N = c.size(), r = c.rank(), v = mod(r - root, N);
  if (N == 1) return;
  char* p = static_cast<char*>(data);
  const int64_t S = std::max<int64_t>(1, (bytes + segment_bytes() - 1) / segment_bytes());
  const int next = v + 1 < N ? mod(r + 1, N) : -1, prev = mod(r - 1, N);
  std::vector<RequestPtr> recvs, sends;
  if (v > 0)
    for (int64_t k = 0; k < S; ++k) {
      const ChunkRange s = chunk_range(bytes, static_cast<int>(S), static_cast<int>(k));
      recvs.push_back(c.irecv(p + s.begin, s.size(), prev, tag));
    }
  for (int64_t k = 0; k < S; ++k) {
    const ChunkRange s = chunk_range(bytes, static_cast<int>(S), static_cast<int>(k));
    if (v > 0) recvs[k]->wait();
    if (next >= 0) sends.push_back(c.isend(p + s.begin, s.size(), next, tag));
  }
  wait_all(sends);
}

void reduce_tree(Communicator& c, int tag, void* data, int64_t n, DType dt, ReduceOp op, int root) {
  const int N = c.size(), r = c.rank(), v = mod(r - root, N);
  if (N == 1 || n == 0) return;
  const int64_t bytes = n * static_cast<int64_t>(dtype_size(dt));
  std::vector<char> scratch;
  for (int mask = 1; mask < N; mask <<= 1) {
    if (v & mask) {
      c.send(data, bytes, mod(r - mask, N), tag);
      break;
    }
    if (v + mask < N) {
      scratch.resize(bytes);
      c.recv(scratch.data(), bytes, mod(r + mask, N), tag);
      reduce_into(data, scratch.data(), n, dt, op);
    }
  }
}

void reduce_ring_gather(Communicator& c, int tag, void* data, int64_t n, DType dt, ReduceOp op,
                        int root) {
  const int N = c.size(), r = c.rank();
  if (N == 1 || n == 0) return;
  const int64_t elem = dtype_size(dt);
  char* p = static_cast<char*>(data);
  ring_reduce_scatter(c, tag, data, n, dt, op);
  if (r != root) {
    const ChunkRange mine = chunk_range(n, N, r);
    c.send(p + mine.begin * elem, mine.size() * elem, root, tag);
    return;
  }
  std::vector<RequestPtr> recvs;
  for (int j = 0; j < N; ++j) {
    if (j == root) continue;
    const ChunkRange ch = chunk_range(n, N, j);
    recvs.push_back(c.irecv(p + ch.begin * elem, ch.size() * elem, j, tag));
  }
  wait_all(recvs);
}

void all_to_all_pairwise(Communicator& c, int tag, const void* in, void* out, int64_t block_bytes) {
  const int N = c.size();
  std::vector<int64_t> off(N), bytes(N, block_bytes);
  for (int j = 0; j < N; ++j) off[j] = j * block_bytes;
  all_to_allv_pairwise(c, tag, in, off, bytes, out, off, bytes);
}

void all_to_allv_pairwise(Communicator& c, int tag, const void* in, const std::vector<int64_t>& send_off,
                          const std::vector<int64_t>& send_bytes, void* out, const std::vector<int64_t>& recv_off,
                          const std::vector<int64_t>& recv_bytes) {
  const int N = c.size(), r = c.rank();
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  std::vector<RequestPtr> reqs;
  // Step s pairs rank r with r+s (send) and r-s (receive); every receive is posted
  // before any send so no exchange waits on a receive that is not there yet.
  for (int s = 1; s < N; ++s) {
    const int from = mod(r - s, N);
    reqs.push_back(c.irecv(dst + recv_off[from], recv_bytes[from], from, tag));
  }
  for (int s = 1; s < N; ++s) {
    const int to = mod(r + s, N);
    reqs.push_back(c.isend(src + send_off[to], send_bytes[to], to, tag));
  }
  if (send_bytes[r] > 0) std::memcpy(dst + recv_off[r], src + send_off[r], static_cast<size_t>(send_bytes[r]));
  wait_all(reqs);
}

void barrier_dissemination(Communicator& c, int tag) {
  const int N = c.size(), r = c.rank();
  char token = 0, sink = 0;
  for (int k = 1; k < N; k <<= 1) {
    std::vector<RequestPtr> reqs{c.isend(&token, 0, mod(r + k, N), tag),
                                 c.irecv(&sink, 0, mod(r - k, N), tag)};
    wait_all(reqs);
  }
}

}  // namespace tessera::comm::algo
