// Alpha-beta cost of collectives (Hockney's model: a message of n bytes costs
// alpha + n / beta) for ring and tree algorithms, and which link a process group spans.
#pragma once
#include <string>

#include "tessera/plan/hardware.h"

namespace tessera::plan {

struct Link {
  double bandwidth = 0;  // bytes/s per device per direction, efficiency applied
  double latency = 0;    // seconds per message step (alpha)
  bool inter_node = false;
};

enum class Collective { kAllReduce, kAllGather, kReduceScatter, kAllToAll, kSendRecv };
const char* collective_name(Collective c);

struct CollectiveCost {
  double seconds = 0;
  const char* algorithm = "";  // "ring", "tree", "pairwise", "p2p" or "none" (one rank)
};

// `bytes` is the whole tensor as nccl-tests counts it: the all-reduce buffer, the
// all-gather output, the reduce-scatter input, one rank's all-to-all send buffer, the
// point-to-point message. p ranks.
//   ring all-reduce      2(p-1) alpha + 2 (p-1)/p n / beta   (Patarasuk & Yuan 2009)
//   tree all-reduce      2 ceil(log2 p) alpha + 2 n / beta     (pipelined double binary
//                        tree, Sanders, Speck & Traeff 2009, as NCCL uses)
//   ring all-gather / reduce-scatter  (p-1) alpha + (p-1)/p n / beta  (Thakur et al. 2005)
//   pairwise all-to-all  (p-1) alpha + (p-1)/p n / beta
//   send/recv            alpha + n / beta
// All-reduce takes the cheaper of ring and tree, as NCCL's tuner does.
CollectiveCost collective_cost(Collective c, double bytes, int p, const Link& link);
double ring_all_reduce_seconds(double bytes, int p, const Link& link);
double tree_all_reduce_seconds(double bytes, int p, const Link& link);

// The link a group of `size` ranks whose members are `stride` ranks apart spans, with
// ranks numbered node by node: inside a node when stride * size <= devices_per_node,
// else the inter-node link (one NIC per device, as on DGX nodes).
Link group_link(const Hardware& hw, int size, int stride);

}  // namespace tessera::plan
