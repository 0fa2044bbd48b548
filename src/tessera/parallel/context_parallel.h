// Context parallelism's transfers (model::CpComm) over a communicator of the `cp` axis:
// the all-to-all of Ulysses and the ring shifts of ring attention. model/context_parallel.h
// does the attention; this moves the bytes.
#pragma once
#include <algorithm>
#include <memory>
#include <string>

#include "tessera/comm/communicator.h"
#include "tessera/model/context_parallel.h"

namespace tessera::parallel {

class CommCp : public model::CpComm {
 public:
  explicit CommCp(comm::Communicator& group) : group_(group) {}
  int rank() const override { return group_.rank(); }
  int size() const override { return group_.size(); }
  void all_to_all(const Tensor& in, Tensor& out) override { group_.all_to_all(in, out); }
  std::unique_ptr<Pending> ring_shift(const Tensor& send, Tensor& recv, int channel) override;

 private:
  comm::Communicator& group_;
};

// `tessera bench cp`: one layer's context-parallel attention, forward and backward, over
// `cp` ranks (mpirun's world when under mpirun, else threads of this process), against
// the whole sequence's attention on one rank; and the transfers alone (the same shifts or
// all-to-alls with no attention), so the part of them hidden behind attention is known.
struct CpBenchOptions {
  int cp = 2;
  std::string method = "ring";
  int64_t tokens = 8192, heads = 8, kv_heads = 8, head_dim = 64, batch = 1;
  int repeats = 3;
};
struct CpBench {
  double step_s = 0;        // forward + backward, median, rank 0
  double attention_s = 0;   // of which attending (rank 0)
  double wait_s = 0;        // waiting for transfers: the exposed communication
  double transfer_s = 0;    // the same transfers alone, no attention
  double single_s = 0;      // forward + backward of the whole sequence on one rank
  int64_t bytes = 0;        // sent by rank 0 per step
  double exposed_fraction() const { return attention_s > 0 ? wait_s / attention_s : 0; }
  // A lower bound: the waits include the ranks' compute skew as well as transfer.
  double hidden_fraction() const { return transfer_s > 0 ? std::max(0.0, 1.0 - wait_s / transfer_s) : 0; }
};
CpBench bench_context_parallel(const CpBenchOptions& o);

}  // namespace tessera::parallel
