// Expert parallelism: the mixture-of-experts layer's token exchange (model::EpComm) over a
// communicator of the `ep` axis. model/moe.h does the routing, grouping and expert GEMMs;
// this moves the rows.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "tessera/comm/communicator.h"
#include "tessera/model/model.h"
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
  void reset_bytes() { bytes_sent_ = 0; }

 private:
  comm::Communicator& group_;
  int64_t bytes_sent_ = 0;
};

// An expert shard's Hugging Face tensors with every expert present (all-gathered over
// the ep group, f32), under transformers' names: what save() would write for the whole
// model. Collective over `group`. The model must be whole but for its experts (tp 1).
std::vector<std::pair<std::string, Tensor>> gather_expert_tensors(const model::Model& m,
                                                                  comm::Communicator& group);
// The same over a named list that holds this ep rank's experts (and any other tensors,
// kept as they are), e.g. what gather_whole_tensors gave a tp rank 0: every rank of
// `group` lists the same tensors but for its experts' ids. Collective over `group`.
std::vector<std::pair<std::string, Tensor>> gather_expert_tensors(
    const std::vector<std::pair<std::string, Tensor>>& named, const model::ModelConfig& config,
    comm::Communicator& group);

}  // namespace tessera::parallel
