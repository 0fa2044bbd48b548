// Expert parallelism's token exchange (expert_parallel.h).
#include "tessera/parallel/expert_parallel.h"

#include "tessera/base/error.h"

namespace tessera::parallel {

Tensor CommEp::all_to_allv(const Tensor& in, const std::vector<int64_t>& send_rows, std::vector<int64_t>* recv_rows) {
  const int64_t row_bytes = in.size(0) > 0 ? static_cast<int64_t>(in.nbytes()) / in.size(0) : 0;
  for (int j = 0; j < static_cast<int>(send_rows.size()); ++j)
    if (j != group_.rank()) bytes_sent_ += send_rows[j] * row_bytes;
  return group_.all_to_allv(in.contiguous(), send_rows, recv_rows);
}

std::vector<std::pair<std::string, Tensor>> gather_expert_tensors(const model::Model& m,
                                                                  comm::Communicator& group) {
  TESSERA_CHECK(m.tp_shard().ep_size == group.size() && m.tp_shard().ep_rank == group.rank(),
                "gather_expert_tensors: the model is expert shard ", m.tp_shard().ep_rank, " of ",
                m.tp_shard().ep_size, ", the group has rank ", group.rank(), " of ", group.size());
  model::Params whole = m.weights();  // the same tensors; each layer's experts replaced
  for (auto& L : whole.layers)
    for (Tensor* t : {&L.moe.gate_up, &L.moe.down}) {
      if (!t->defined()) continue;
      Shape shape = t->shape();
      shape[0] *= group.size();
      const Tensor mine = t->dtype() == DType::kF32 ? t->contiguous() : t->to(DType::kF32);
      Tensor all = Tensor::empty(shape, DType::kF32);
      Tensor flat = all.view({all.numel()});
      group.all_gather(mine.view({mine.numel()}), flat);
      *t = all;
    }
  return whole.named(m.config());
}

}  // namespace tessera::parallel
