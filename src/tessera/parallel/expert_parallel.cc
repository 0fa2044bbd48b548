// Expert parallelism's token exchange (expert_parallel.h).
#include "tessera/parallel/expert_parallel.h"

namespace tessera::parallel {

Tensor CommEp::all_to_allv(const Tensor& in, const std::vector<int64_t>& send_rows, std::vector<int64_t>* recv_rows) {
  const int64_t row_bytes = in.size(0) > 0 ? static_cast<int64_t>(in.nbytes()) / in.size(0) : 0;
  for (int j = 0; j < static_cast<int>(send_rows.size()); ++j)
    if (j != group_.rank()) bytes_sent_ += send_rows[j] * row_bytes;
  return group_.all_to_allv(in.contiguous(), send_rows, recv_rows);
}

}  // namespace tessera::parallel
