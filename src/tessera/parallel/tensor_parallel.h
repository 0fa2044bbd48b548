// Tensor parallelism (Megatron-LM) from outside the model: the model's TpComm over the
// mesh's tp group, with the communication it does counted, so a test can hold it to the
// analytic count (per layer, one all-reduce of (tokens, hidden) after attention and one
// after the MLP in forward, and the matching ones in backward).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/comm/communicator.h"
#include "tessera/model/model.h"
#include "tessera/model/shard.h"

namespace tessera::parallel {

struct TpTraffic {
  int64_t all_reduces = 0, all_reduce_bytes = 0;  // sums and maxima, by tensor bytes
  int64_t all_gathers = 0, all_gather_bytes = 0;  // bytes of the gathered output
  int64_t reduce_scatters = 0, reduce_scatter_bytes = 0;  // bytes of the summed input
  double seconds = 0;  // wall time inside these collectives (all exposed: they block)
  int64_t collectives() const { return all_reduces + all_gathers + reduce_scatters; }
  int64_t bytes() const { return all_reduce_bytes + all_gather_bytes + reduce_scatter_bytes; }
};

class CommTp : public model::TpComm {
 public:
  // kv_replicas: LocalDims::kv_replicas of the model (above 1 the ranks sharing a kv head
  // get a sub-group: collective over `group`).
  explicit CommTp(comm::Communicator& group, int64_t kv_replicas = 1);
  ~CommTp() override;
  void all_reduce_sum(Tensor& t) override;
  void all_reduce_max(Tensor& t) override;
  void all_gather_columns(const Tensor& in, Tensor& out) override;
  void all_reduce_kv_replicas(Tensor& t) override;
  void all_gather_rows(const Tensor& in, Tensor& out) override;
  void reduce_scatter_rows(const Tensor& in, Tensor& out) override;
  void all_gather_rows_start(const Tensor& in, Tensor& out) override;
  void all_gather_rows_wait() override;

  model::TpShard shard() const { return {group_.rank(), group_.size()}; }
  const TpTraffic& traffic() const { return traffic_; }
  void reset_traffic() { traffic_ = {}; }

 private:
  Tensor gather_rows_target(const char* op, const Tensor& in, Tensor& out);
  comm::Communicator& group_;
  std::unique_ptr<comm::Communicator> kv_group_;
  TpTraffic traffic_;
  comm::RequestPtr pending_gather_;  // all_gather_rows_start's, until the wait
  double pending_start_ = 0;         // when it was started (its time counts to the wait)
};

// The whole Hugging Face tensors of a tensor-parallel model, assembled on tp rank 0 from
// every rank's pieces (Params::pieces; a replicated tensor is rank 0's), in the order
// Params::named lists them. Other ranks get an empty list. Collective over `group`.
std::vector<std::pair<std::string, Tensor>> gather_whole_tensors(const model::Model& m,
                                                                 comm::Communicator& group);
// The name a tensor-parallel piece's training state is saved under: the Hugging Face name
// at tp 1, "NAME@tpRofN" otherwise (every tp rank holds a different block of NAME). A rank
// holding several blocks of one tensor (GPT-2's fused c_attn: its q, k and v columns)
// names the block-th one after the first "NAME@tpRofN.bBLOCK" (model::Piece::block).
std::string tp_piece_key(const std::string& name, model::TpShard shard, int block = 0);

}  // namespace tessera::parallel
