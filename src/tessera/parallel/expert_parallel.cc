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

namespace {

// "...experts.<id>.<rest>": the id and where it sits in the name; -1 for other tensors.
int64_t expert_id(const std::string& name, size_t* at, size_t* len) {
  const size_t p = name.find(".experts.");
  if (p == std::string::npos) return -1;
  *at = p + 9;
  *len = name.find('.', *at) - *at;
  return std::stoll(name.substr(*at, *len));
}

}  // namespace

std::vector<std::pair<std::string, Tensor>> gather_expert_tensors(
    const std::vector<std::pair<std::string, Tensor>>& named, const model::ModelConfig& config,
    comm::Communicator& group) {
  const int P = group.size();
  const int64_t El = config.num_experts / P;
  // This rank's expert tensors, in list order, packed into one buffer (every rank's has
  // the same size and layout), gathered, and named for each rank's experts.
  int64_t total = 0;
  for (const auto& [name, t] : named) {
    size_t at = 0, len = 0;
    if (expert_id(name, &at, &len) >= 0) total += t.numel();
  }
  Tensor mine = Tensor::empty({total}, DType::kF32);
  int64_t off = 0;
  for (const auto& [name, t] : named) {
    size_t at = 0, len = 0;
    if (expert_id(name, &at, &len) < 0) continue;
    mine.slice(0, off, off + t.numel()).view(t.shape()).copy_from(t);
    off += t.numel();
  }
  Tensor all = Tensor::empty({total * P}, DType::kF32);
  group.all_gather(mine, all);
  std::vector<std::pair<std::string, Tensor>> out;
  bool placed = false;
  for (const auto& [name, t] : named) {
    size_t at = 0, len = 0;
    if (expert_id(name, &at, &len) < 0) {
      out.emplace_back(name, t);
      continue;
    }
    if (placed) continue;
    placed = true;  // every rank's experts, in rank order, where this rank's first one was
    for (int j = 0; j < P; ++j) {
      int64_t o = j * total;
      for (const auto& [n2, t2] : named) {
        size_t a2 = 0, l2 = 0;
        const int64_t id = expert_id(n2, &a2, &l2);
        if (id < 0) continue;
        const int64_t global = id - static_cast<int64_t>(group.rank()) * El + j * El;
        out.emplace_back(n2.substr(0, a2) + std::to_string(global) + n2.substr(a2 + l2),
                         all.slice(0, o, o + t2.numel()).view(t2.shape()));
        o += t2.numel();
      }
    }
  }
  return out;
}

std::vector<std::pair<std::string, Tensor>> gather_expert_tensors(const model::Model& m,
                                                                  comm::Communicator& group) {
  TESSERA_CHECK(m.tp_shard().ep_size == group.size() && m.tp_shard().ep_rank == group.rank(),
                "gather_expert_tensors: the model is expert shard ", m.tp_shard().ep_rank, " of ",
                m.tp_shard().ep_size, ", the group has rank ", group.rank(), " of ", group.size());
  std::vector<std::pair<std::string, Tensor>> named;  // (tp 1: every piece whole)
  for (auto& p : m.weights().pieces(m.config(), m.tp_shard())) named.emplace_back(std::move(p.name), std::move(p.view));
  return gather_expert_tensors(named, m.config(), group);
}

}  // namespace tessera::parallel
