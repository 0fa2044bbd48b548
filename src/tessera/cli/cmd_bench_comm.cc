// `tessera bench comm`: collective bandwidth of our algorithms against the backend's own
// (MPI's under mpirun, the local backend's otherwise), see docs/comm.md.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <sstream>

#include "tessera/base/error.h"
#include "tessera/cli/commands.h"
#include "tessera/comm/bench.h"
#include "tessera/comm/communicator.h"
#include "tessera/comm/local_backend.h"
#include "tessera/comm/mpi_backend.h"

namespace tessera::cli {
namespace {

struct CommFlags {
  int nproc = 2;
  int ranks_per_node = 0;  // 0: real nodes
  comm::CommBenchOptions options;
  std::string ops = "all_reduce,all_gather,reduce_scatter";
  std::string algorithms = "ring,hd,hierarchical,shm,auto,backend";
  bool json = false;
};

std::vector<std::string> split_list(const std::string& text, const std::string& flag) {
  std::vector<std::string> items;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    TESSERA_CHECK(!item.empty(), flag, ": empty item in '", text, "'");
    items.push_back(item);
  }
  TESSERA_CHECK(!items.empty(), flag, ": empty list");
  return items;
}

int run_bench_comm(CommFlags f, bool nproc_given) {
  comm::CommBenchOptions& o = f.options;
  o.ops = split_list(f.ops, "--ops");
  o.algorithms.clear();
  for (const auto& name : split_list(f.algorithms, "--algorithms"))
    o.algorithms.push_back(comm::parse_algorithm(name));
  auto body = [&](comm::Communicator& c) {
    const auto rows = comm::bench_collectives(c, o);
    if (c.rank() != 0) return;
    std::fputs(comm::format_comm_bench_table(rows).c_str(), stdout);
    if (f.json)
      for (const auto& r : rows) std::printf("%s\n", comm::comm_bench_row_json(r).c_str());
    std::fflush(stdout);
  };
  TESSERA_CHECK(f.ranks_per_node >= 0, "--ranks-per-node: ", f.ranks_per_node, " is negative");
  if (!comm::running_under_mpi()) {
    TESSERA_CHECK(f.nproc >= 1, "--nproc: ", f.nproc, " must be at least 1");
    comm::run_local(f.nproc, f.ranks_per_node > 0 ? f.ranks_per_node : f.nproc, body);
    return 0;
  }
  // The mpi backend reads its simulated node size when the world communicator is made.
  if (f.ranks_per_node > 0)
    setenv("TESSERA_MPI_RANKS_PER_NODE", std::to_string(f.ranks_per_node).c_str(), 1);
  comm::Communicator& world = comm::mpi_world();
  TESSERA_CHECK(!nproc_given || f.nproc == world.size(), "--nproc ", f.nproc, " differs from the ",
                world.size(), " ranks mpirun started (leave it out under mpirun)");
  try {
    body(world);
  } catch (const std::exception& e) {
    // Peers may be waiting in a collective this rank will never join: end the whole job
    // rather than hang in MPI_Finalize.
    if (world.size() == 1) throw;
    std::fprintf(stderr, "tessera: error: rank %d: %s\n", world.rank(), e.what());
    comm::mpi_abort(1);
  }
  return 0;
}

}  // namespace

void add_bench_comm(CLI::App* bench, Action& action) {
  auto f = std::make_shared<CommFlags>();
  auto* cmd = bench->add_subcommand(
      "comm", "Collective bus bandwidth: our algorithms vs the backend's own (MPI under mpirun)");
  auto* nproc = cmd->add_option("--nproc", f->nproc,
                                "Ranks as threads of this process (local backend); under mpirun "
                                "the ranks are mpirun's")
                    ->capture_default_str();
  cmd->add_option("--ranks-per-node", f->ranks_per_node,
                  "Simulate nodes of this many consecutive ranks (hierarchical algorithm); "
                  "0: the real nodes");
  cmd->add_option("--min-bytes", f->options.min_bytes, "Smallest message")->capture_default_str();
  cmd->add_option("--max-bytes", f->options.max_bytes, "Largest message (sizes grow by 4x)")
      ->capture_default_str();
  cmd->add_option("--ops", f->ops, "Collectives: all_reduce,all_gather,reduce_scatter")
      ->capture_default_str();
  cmd->add_option("--algorithms", f->algorithms, "ring,hd,hierarchical,shm,auto,backend")
      ->capture_default_str();
  cmd->add_option("--min-seconds", f->options.min_seconds, "Timed calls per point fill this")
      ->capture_default_str();
  cmd->add_flag("--json", f->json, "Also print one JSON line per row");
  cmd->callback([&action, f, nproc] {
    const bool nproc_given = nproc->count() > 0;
    action = [f, nproc_given] { return run_bench_comm(*f, nproc_given); };
  });
}

}  // namespace tessera::cli
