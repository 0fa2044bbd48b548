// Context parallelism's transfers (model::CpComm) over a communicator of the `cp` axis:
// the all-to-all of Ulysses and the ring shifts of ring attention. model/context_parallel.h
// does the attention; this moves the bytes.
#pragma once
#include <memory>

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

}  // namespace tessera::parallel
