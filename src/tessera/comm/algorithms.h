// Collective algorithms of our own over any backend's point to point (isend / irecv):
// ring, recursive halving-doubling, hierarchical, binomial trees, pipelined chain,
// pairwise all-to-all, dissemination barrier. They work on raw buffers of a working
// dtype; communicator.cc checks tensors and converts bf16/f16 to f32 around them.
#pragma once
#include <cstdint>
#include <vector>

#include "tessera/comm/communicator.h"

namespace tessera::comm::algo {

// acc[i] = acc[i] op in[i] for dt in {f32, i32, i64}; kAvg reduces as kSum (the caller
// divides once at the end). Plain loops: -O3 vectorises them.
void reduce_into(void* acc, const void* in, int64_t n, DType dt, ReduceOp op);
// data[i] /= divisor (integers truncate toward zero).
void divide_by(void* data, int64_t n, DType dt, int64_t divisor);

// Pipelined algorithms move messages in segments of about this many bytes, so a big
// message streams through the ring or chain instead of hopping one whole chunk per step.
int64_t segment_bytes();
void set_segment_bytes(int64_t bytes);  // for benchmarks and tests; >= 1

// In-place conventions: `data` holds n elements of dt (elem bytes each). Reduce-scatter
// leaves this rank's chunk_range(n, size, rank) of data reduced (other chunks are
// clobbered); all-gather expects this rank's chunk in place and fills the others.

// Ring: N-1 steps each for reduce-scatter and all-gather, all-reduce = both (2(N-1)
// steps), streamed segment by segment with the all-gather starting as chunks finish.
void ring_reduce_scatter(Communicator& c, int tag, void* data, int64_t n, DType dt, ReduceOp op);
void ring_all_gather(Communicator& c, int tag, void* data, int64_t n, int64_t elem);
void ring_all_reduce(Communicator& c, int tag, void* data, int64_t n, DType dt, ReduceOp op);

// Recursive halving-doubling (Rabenseifner): log2(P) halving steps, then log2(P)
// doubling steps, over P = the largest power of two <= N; the first 2(N-P) ranks fold
// pairwise first (one extra step before and after).
void hd_reduce_scatter(Communicator& c, int tag, void* data, int64_t n, DType dt, ReduceOp op);
void hd_all_gather(Communicator& c, int tag, void* data, int64_t n, int64_t elem);
void hd_all_reduce(Communicator& c, int tag, void* data, int64_t n, DType dt, ReduceOp op);

// Hierarchical: ring reduce-scatter within the node (intra), all-reduce of this rank's
// chunk among the ranks with the same local rank on every node (inter; halving-doubling
// when inter_hd, else ring), ring all-gather within the node. Needs every node to have
// the same number of ranks.
void hierarchical_all_reduce(Communicator& intra, Communicator& inter, bool inter_hd, int tag,
                             void* data, int64_t n, DType dt, ReduceOp op);

// Broadcast of `bytes` from root: binomial tree (ceil(log2 N) steps, whole message) or
// pipelined chain (N-1 + segments - 1 segment steps).
void broadcast_tree(Communicator& c, int tag, void* data, int64_t bytes, int root);
void broadcast_chain(Communicator& c, int tag, void* data, int64_t bytes, int root);

// Reduce to root, in place (data is clobbered on other ranks): binomial tree
// (ceil(log2 N) steps, whole message), or ring reduce-scatter then a gather of the
// chunks to root (for large messages).
void reduce_tree(Communicator& c, int tag, void* data, int64_t n, DType dt, ReduceOp op, int root);
void reduce_ring_gather(Communicator& c, int tag, void* data, int64_t n, DType dt, ReduceOp op,
                        int root);

// Pairwise exchange: in and out hold N blocks of block_bytes; block j of in goes to rank j
// and lands in block rank() of j's out. All N-1 exchanges are posted at once.
void all_to_all_pairwise(Communicator& c, int tag, const void* in, void* out, int64_t block_bytes);
// The same with a block per peer of its own size: bytes [send_off[j], + send_bytes[j]) of in
// to rank j, rank j's into [recv_off[j], + recv_bytes[j]) of out.
void all_to_allv_pairwise(Communicator& c, int tag, const void* in, const std::vector<int64_t>& send_off,
                          const std::vector<int64_t>& send_bytes, void* out, const std::vector<int64_t>& recv_off,
                          const std::vector<int64_t>& recv_bytes);

// Dissemination barrier: ceil(log2 N) rounds of empty messages.
void barrier_dissemination(Communicator& c, int tag);

}  // namespace tessera::comm::algo

namespace tessera::comm::algo {

// What Algorithm::kAuto runs, by message bytes and group size (thresholds measured with
// bench/comm_algorithms, docs/comm.md). Never kAuto; kHierarchical only when the group
// spans several nodes (multi_node).
Algorithm auto_all_reduce(int64_t bytes, int group_size, bool multi_node);
Algorithm auto_reduce_scatter(int64_t bytes, int group_size);  // bytes: the whole input
Algorithm auto_all_gather(int64_t bytes, int group_size);      // bytes: the whole output
// Broadcast and reduce switch from the binomial tree to the pipelined algorithm above these.
int64_t broadcast_tree_max_bytes();
int64_t reduce_tree_max_bytes();
void set_tree_max_bytes(int64_t broadcast, int64_t reduce);  // tests: reach both paths cheaply

}  // namespace tessera::comm::algo
