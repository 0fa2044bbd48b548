// CommTp (tensor_parallel.h).
#include "tessera/parallel/tensor_parallel.h"

#include <algorithm>
#include <vector>

#include "tessera/base/error.h"

namespace tessera::parallel {

void CommTp::all_reduce_sum(Tensor& t) {
  ++traffic_.all_reduces;
  traffic_.all_reduce_bytes += static_cast<int64_t>(t.nbytes());
  group_.all_reduce(t, comm::ReduceOp::kSum);
}

void CommTp::all_reduce_max(Tensor& t) {
  ++traffic_.all_reduces;
  traffic_.all_reduce_bytes += static_cast<int64_t>(t.nbytes());
  group_.all_reduce(t, comm::ReduceOp::kMax);
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
  group_.all_gather(mine.view({N * per}), all);
  ++traffic_.all_gathers;
  traffic_.all_gather_bytes += static_cast<int64_t>(all.nbytes());
  for (int r = 0; r < tp; ++r) {
    const int64_t begin = std::min<int64_t>(V, per * r), end = std::min<int64_t>(V, begin + per);
    if (end <= begin) continue;
    const Tensor block = all.slice(0, r * N * per, (r + 1) * N * per).view({N, per});
    out.slice(1, begin, end).copy_from(block.slice(1, 0, end - begin));
  }
}

}  // namespace tessera::parallel
