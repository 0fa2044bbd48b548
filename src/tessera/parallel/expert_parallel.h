// Expert parallelism: the mixture-of-experts layer's token exchange (model::EpComm) over a
// communicator of the `ep` axis. model/moe.h does the routing, grouping and expert GEMMs;
// this moves the rows.
#pragma once
#include <vector>

#include "tessera/comm/communicator.h"
#include "tessera/model/moe.h"

namespace tessera::parallel {

class CommEp : public model::EpComm {
 public:
  explicit CommEp(comm::Communicator& group) : group_(group) {}
  int rank() const override { return group_.rank(); }
  int size() const override { return group_.size(); }
  Tensor all_to_allv(const Tensor& in, const std::vector<int64_t>& send_rows,
                     std::vector<int64_t>* recv_rows) override;
  // Bytes sent to other ranks so far (the rows this rank keeps are not counted).
  int64_t bytes_sent() const { return bytes_sent_; }

 private:
  comm::Communicator& group_;
  int64_t bytes_sent_ = 0;
};

}  // namespace tessera::parallel
