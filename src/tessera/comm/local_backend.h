// The `local` backend: ranks as threads of one process, point to point through shared
// memory (a rendezvous: the receiver copies straight out of the posted send buffer).
// run_local(n, fn) is declared in communicator.h; this adds simulated nodes.
#pragma once
#include <functional>

#include "tessera/comm/communicator.h"

namespace tessera::comm {

// run_local with node_id() = rank / ranks_per_node, so that the hierarchical all-reduce
// (and anything else that looks at nodes) can be exercised in one process.
void run_local(int n, int ranks_per_node, const std::function<void(Communicator&)>& fn);

}  // namespace tessera::comm
