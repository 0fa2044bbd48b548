// Alpha-beta collective costs (formulas and sources in comm_model.h and docs/planner.md).
#include "tessera/plan/comm_model.h"

#include <cmath>

namespace tessera::plan {

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::kAllReduce: return "all-reduce";
    case Collective::kAllGather: return "all-gather";
    case Collective::kReduceScatter: return "reduce-scatter";
    case Collective::kAllToAll: return "all-to-all";
    case Collective::kSendRecv: return "send/recv";
  }
  return "?";
}

double ring_all_reduce_seconds(double bytes, int p, const Link& l) {
  if (p <= 1) return 0;
  return 2.0 * (p - 1) * l.latency + 2.0 * (p - 1) / p * bytes / l.bandwidth;
}

double tree_all_reduce_seconds(double bytes, int p, const Link& l) {
  if (p <= 1) return 0;
  return 2.0 * std::ceil(std::log2(static_cast<double>(p))) * l.latency + 2.0 * bytes / l.bandwidth;
}

CollectiveCost collective_cost(Collective c, double bytes, int p, const Link& l) {
  if (c == Collective::kSendRecv) return {l.latency + bytes / l.bandwidth, "p2p"};
  if (p <= 1 || bytes <= 0) return {0, "none"};
  switch (c) {
    case Collective::kAllReduce: {
      const double ring = ring_all_reduce_seconds(bytes, p, l);
      const double tree = tree_all_reduce_seconds(bytes, p, l);
      return tree < ring ? CollectiveCost{tree, "tree"} : CollectiveCost{ring, "ring"};
    }
    case Collective::kAllGather:
    case Collective::kReduceScatter:
      return {(p - 1) * l.latency + (p - 1.0) / p * bytes / l.bandwidth, "ring"};
    case Collective::kAllToAll:
      return {(p - 1) * l.latency + (p - 1.0) / p * bytes / l.bandwidth, "pairwise"};
    case Collective::kSendRecv: break;
  }
  return {0, "none"};
}

Link group_link(const Hardware& hw, int size, int stride) {
  Link l;
  const long span = static_cast<long>(size) * stride;
  l.inter_node = size > 1 && span > hw.devices_per_node;
  l.bandwidth = (l.inter_node ? hw.inter_bandwidth : hw.intra_bandwidth) * hw.link_efficiency;
  l.latency = l.inter_node ? hw.inter_latency : hw.intra_latency;
  return l;
}

}  // namespace tessera::plan
