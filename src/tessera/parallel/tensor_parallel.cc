// CommTp (tensor_parallel.h).
#include "tessera/parallel/tensor_parallel.h"

#include <algorithm>
#include <map>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/base/timer.h"

namespace tessera::parallel {

CommTp::CommTp(comm::Communicator& group, int64_t kv_replicas) : group_(group) {
  TESSERA_CHECK(kv_replicas >= 1 && group.size() % kv_replicas == 0, "CommTp: ", kv_replicas,
                " kv replicas in a tp group of ", group.size());
  if (kv_replicas > 1)
    kv_group_ = group.split(static_cast<int>(group.rank() / kv_replicas), group.rank());
}

CommTp::~CommTp() = default;

void CommTp::all_reduce_kv_replicas(Tensor& t) {
  TESSERA_CHECK(kv_group_, "all_reduce_kv_replicas: the kv heads are not replicated");
  ++traffic_.all_reduces;
  traffic_.all_reduce_bytes += static_cast<int64_t>(t.nbytes());
  {
    const base::Timer timer;
    kv_group_->all_reduce(t, comm::ReduceOp::kSum);
    traffic_.seconds += timer.seconds();
  }
}

// The row gather's checks and traffic count (blocking or started), and out as one vector.
Tensor CommTp::gather_rows_target(const char* op, const Tensor& in, Tensor& out) {
  TESSERA_CHECK(in.is_contiguous() && out.is_contiguous() && in.dtype() == out.dtype() &&
                    out.numel() == in.numel() * group_.size(),
                op, ": in ", in.describe(), " and out ", out.describe());
  ++traffic_.all_gathers;
  traffic_.all_gather_bytes += static_cast<int64_t>(out.nbytes());
  return out.view({out.numel()});
}

void CommTp::all_gather_rows(const Tensor& in, Tensor& out) {
  Tensor o = gather_rows_target("all_gather_rows", in, out);
  {
    const base::Timer timer;
    group_.all_gather(in.view({in.numel()}), o);
    traffic_.seconds += timer.seconds();
  }
}

void CommTp::all_gather_rows_start(const Tensor& in, Tensor& out) {
  TESSERA_CHECK(!pending_gather_, "all_gather_rows_start: a gather is already in flight");
  Tensor o = gather_rows_target("all_gather_rows_start", in, out);
  const base::Timer timer;
  pending_gather_ = group_.all_gather_async(in.view({in.numel()}), o);
  traffic_.seconds += timer.seconds();  // issuing; the exposed wait is added below
}

void CommTp::all_gather_rows_wait() {
  if (!pending_gather_) return;
  const base::Timer timer;
  pending_gather_->wait();
  pending_gather_ = nullptr;
  traffic_.seconds += timer.seconds();  // only the time the compute did not hide
}

void CommTp::reduce_scatter_rows(const Tensor& in, Tensor& out) {
  TESSERA_CHECK(in.is_contiguous() && out.is_contiguous() && in.dtype() == DType::kF32 &&
                    out.dtype() == DType::kF32 && in.numel() == out.numel() * group_.size(),
                "reduce_scatter_rows: in ", in.describe(), " and out ", out.describe());
  ++traffic_.reduce_scatters;
  traffic_.reduce_scatter_bytes += static_cast<int64_t>(in.nbytes());
  Tensor o = out.view({out.numel()});
  {
    const base::Timer timer;
    group_.reduce_scatter(in.view({in.numel()}), o, comm::ReduceOp::kSum);
    traffic_.seconds += timer.seconds();
  }
}

void CommTp::all_reduce_sum(Tensor& t) {
  ++traffic_.all_reduces;
  traffic_.all_reduce_bytes += static_cast<int64_t>(t.nbytes());
  {
    const base::Timer timer;
    group_.all_reduce(t, comm::ReduceOp::kSum);
    traffic_.seconds += timer.seconds();
  }
}

void CommTp::all_reduce_max(Tensor& t) {
  ++traffic_.all_reduces;
  traffic_.all_reduce_bytes += static_cast<int64_t>(t.nbytes());
  {
    const base::Timer timer;
    group_.all_reduce(t, comm::ReduceOp::kMax);
    traffic_.seconds += timer.seconds();
  }
}

void CommTp::all_gather_columns(const Tensor& in, Tensor& out) {
  const int tp = group_.size();
  const int64_t N = in.size(0), V = out.size(1);
  TESSERA_CHECK(out.size(0) == N && in.dtype() == DType::kF32 && out.dtype() == DType::kF32,
                "all_gather_columns: in ", in.describe(), " and out ", out.describe());
  // Every rank sends a block padded to ceil(V / tp) columns (the vocab split), so the
  // gather's chunks are equal; the padding is dropped when the blocks are laid side by side.
  const int64_t per = (V + tp - 1) / tp;
  TESSERA_CHECK(in.size(1) <= per, "all_gather_columns: ", in.size(1), " columns exceed the ",
                per, " of a block");
  Tensor mine = Tensor::zeros({N, per}, DType::kF32);
  mine.slice(1, 0, in.size(1)).copy_from(in);
  Tensor all = Tensor::empty({static_cast<int64_t>(tp) * N * per}, DType::kF32);
  {
    const base::Timer timer;
    group_.all_gather(mine.view({N * per}), all);
    traffic_.seconds += timer.seconds();
  }
  ++traffic_.all_gathers;
  traffic_.all_gather_bytes += static_cast<int64_t>(all.nbytes());
  for (int r = 0; r < tp; ++r) {
    const int64_t begin = std::min<int64_t>(V, per * r), end = std::min<int64_t>(V, begin + per);
    if (end <= begin) continue;
    const Tensor block = all.slice(0, r * N * per, (r + 1) * N * per).view({N, per});
    out.slice(1, begin, end).copy_from(block.slice(1, 0, end - begin));
  }
}

std::string tp_piece_key(const std::string& name, model::TpShard shard, int block) {
  if (shard.size == 1 && block == 0) return name;
  std::string key = name + "@tp" + std::to_string(shard.rank) + "of" + std::to_string(shard.size);
  if (block > 0) key += ".b" + std::to_string(block);
  return key;
}

std::vector<std::pair<std::string, Tensor>> gather_whole_tensors(const model::Model& m,
                                                                 comm::Communicator& group) {
  const auto& c = m.config();
  // (An expert shard lists only its own experts, whole: the ep gather is the caller's.)
  const model::TpShard me{group.rank(), group.size(), m.tp_shard().ep_rank, m.tp_shard().ep_size};
  TESSERA_CHECK(m.tp_shard().size == me.size && m.tp_shard().rank == me.rank,
                "gather_whole_tensors: the model is shard ", m.tp_shard().rank, " of ",
                m.tp_shard().size, ", the group has rank ", me.rank, " of ", me.size);
  const auto pieces = m.weights().pieces(c, me);
  constexpr int kTag = 4242;
  if (me.rank != 0) {
    // Each split piece: its offsets and extents, then its values (f32). Every rank lists
    // the same names in the same order (only the blocks differ).
    for (const auto& p : pieces) {
      if (p.whole()) continue;
      std::vector<int64_t> where = p.offset;
      for (int64_t dim = 0; dim < p.view.dim(); ++dim) where.push_back(p.view.size(dim));
      group.send(where.data(), static_cast<int64_t>(where.size() * sizeof(int64_t)), 0, kTag);
      const Tensor v = p.view.contiguous().to(DType::kF32);
      group.send(v.raw_data(), static_cast<int64_t>(v.nbytes()), 0, kTag);
    }
    return {};
  }
  std::vector<std::pair<std::string, Tensor>> out;
  std::map<std::string, size_t> at;
  for (const auto& p : pieces) {
    if (at.count(p.name)) continue;
    at[p.name] = out.size();
    out.emplace_back(p.name, Tensor::zeros(p.full, DType::kF32));
  }
  auto place = [&](const model::Piece& like, const std::vector<int64_t>& off, const Tensor& v) {
    model::Piece q{like.name, v, like.full, off};
    Tensor dst = q.block_of(out[at.at(like.name)].second);
    dst.copy_from(v);
  };
  for (const auto& p : pieces) place(p, p.offset, p.view.contiguous().to(DType::kF32));
  for (int r = 1; r < me.size; ++r) {
    for (const auto& p : pieces) {
      if (p.whole()) continue;
      const size_t nd = p.full.size();
      std::vector<int64_t> where(2 * nd);
      group.recv(where.data(), static_cast<int64_t>(where.size() * sizeof(int64_t)), r, kTag);
      const std::vector<int64_t> off(where.begin(), where.begin() + static_cast<int64_t>(nd));
      Tensor v = Tensor::empty(Shape(where.begin() + static_cast<int64_t>(nd), where.end()), DType::kF32);
      group.recv(v.raw_data(), static_cast<int64_t>(v.nbytes()), r, kTag);
      place(p, off, v);
    }
  }
  if (m.dtype() != DType::kF32)
    for (auto& [name, t] : out) t = t.to(m.dtype());
  return out;
}

}  // namespace tessera::parallel
