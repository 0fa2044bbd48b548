// DataParallel's publication of new weights: the masters, rounded to the compute precision,
// into the model's weights and its native bf16 copies, either written by the optimizer in
// its own pass (piece_copies) or copied after it (publish_params), then the gathers.
#include <algorithm>

#include "tessera/base/error.h"
#include "tessera/base/trace.h"
#include "tessera/parallel/data_parallel.h"
#include "tessera/parallel/data_parallel_parts.h"

namespace tessera::parallel {

std::pair<int64_t, int64_t> DataParallel::piece_chunk_alignment(size_t i) const {
  TESSERA_CHECK(i < pieces_.size(), "data parallel: no piece ", i);
  const Slot& s = slot_at(piece_flat_[i]);
  const auto packed = model_.packed_targets_of(*s.w);
  if (!packed) return {1, 0};
  return {16 * packed->cols, piece_flat_[i] - s.flat};
}

bool DataParallel::optimizer_publishes() const {
  // The weights are a rounded copy of this rank's masters in this rank's memory: stages
  // 0-2 with 16-bit compute. (ZeRO-3 publishes into shards it gathers per unit; offload
  // keeps the masters apart on purpose.)
  return separate_master_ && config_.zero_stage < 3 && !config_.offload;
}

const DataParallel::Slot& DataParallel::slot_at(int64_t flat) const {
  auto it = std::upper_bound(slots_.begin(), slots_.end(), flat,
                             [](int64_t f, const Slot& s) { return f < s.flat; });
  TESSERA_CHECK(it != slots_.begin() && flat < std::prev(it)->flat + std::prev(it)->numel,
                "data parallel: flat position ", flat, " is in no weight");
  return *std::prev(it);
}

Tensor DataParallel::compute_copy_range(const Slot& s, int64_t lo, int64_t hi) const {
  const Tensor copy = model_.compute_copy_of(*s.w);
  if (!copy.defined()) return copy;
  TESSERA_CHECK(copy.dtype() == DType::kBF16 && copy.is_contiguous() && copy.numel() == s.numel,
                "data parallel: the compute copy of ", s.name, " is ", copy.describe(),
                ", not a contiguous bf16 copy of ", shape_str(s.shape));
  return copy.view({s.numel}).slice(0, lo - s.flat, hi - s.flat);
}

kernels::ParamCopies DataParallel::copies_of_piece(size_t i) const {
  kernels::ParamCopies c;
  const int64_t lo = piece_flat_[i], hi = lo + pieces_[i].master.numel();
  c.rounded = params_.slice(0, lo, hi);
  c.format = config_.compute_dtype;
  const Slot& s = slot_at(lo);
  c.bf16 = compute_copy_range(s, lo, hi);
  c.packed = model_.packed_targets_of(*s.w);
  c.packed_first = lo - s.flat;
  return c;
}

std::vector<kernels::ParamCopies> DataParallel::piece_copies() const {
  std::vector<kernels::ParamCopies> out;
  if (!optimizer_publishes()) return out;
  for (size_t i = 0; i < pieces_.size(); ++i) out.push_back(copies_of_piece(i));
  return out;
}

void DataParallel::publish_piece(size_t i) {
  TESSERA_CHECK(i < pieces_.size(), "data parallel: no piece ", i);
  if (!optimizer_publishes()) return;  // publish_params() copies every piece
  const kernels::ParamCopies c = copies_of_piece(i);
  Tensor master = pieces_[i].master.view({pieces_[i].master.numel()});
  kernels::publish_values(c, master.data<float>(), 0, master.numel());
}

void DataParallel::refresh_copies(int64_t lo, int64_t hi) {
  while (lo < hi) {
    const Slot& s = slot_at(lo);
    const int64_t end = std::min(hi, s.flat + s.numel);
    Tensor copy = compute_copy_range(s, lo, end);
    if (copy.defined()) {
      copy.copy_from(params_.slice(0, lo, end));
      if (const auto packed = model_.packed_targets_of(*s.w))
        kernels::publish_packed(*packed, lo - s.flat, reinterpret_cast<const uint16_t*>(copy.data<bf16>()), end - lo);
    }
    lo = end;
  }
}

void DataParallel::publish_params(bool copies_written) {
  base::TraceScope scope("publish_params");
  const int stage = config_.zero_stage;
  TESSERA_CHECK(!copies_written || optimizer_publishes(),
                "data parallel: the optimizer cannot have written the weights (piece_copies is empty)");
  if (separate_master_ && !copies_written) {
    // Rounded as it is copied, one pass, into the weights' own storage: no temporary the
    // size of the shard (a fresh 500 MB for a 124M model every step, all of it page faults).
    auto publish = [&](Tensor dst, const Tensor& src) { copy_rounded(dst, src, config_.compute_dtype); };
    if (stage < 3) {
      for (const Segment& seg : segments_)
        publish(params_.slice(0, seg.own_begin, seg.own_end),
                master_.slice(0, seg.own_offset, seg.own_offset + seg.own_size()));
    } else {
      publish(params_shard_, master_);  // (host -> device with offload)
    }
  }
  bool gathered = false;
  if ((stage == 1 || stage == 2) && comm_.size() > 1) {
    std::vector<comm::RequestPtr> reqs;
    for (const Segment& seg : segments_) {
      comm::Communicator& g = group_of(seg);
      if (g.size() == 1) continue;
      Tensor out = params_.slice(0, seg.begin, seg.end);
      reqs.push_back(g.all_gather_async(params_.slice(0, seg.own_begin, seg.own_end), out,
                                        config_.algorithm));
      gathered = true;
    }
    for (auto& r : reqs) r->wait();
  }
  // Native bf16 (stages 0-2): the matmuls' bf16 copies follow the new weights; where the
  // optimizer wrote this rank's, only the parts the gathers brought. Stage 3 makes them as
  // each unit is gathered.
  if (stage == 3) return;
  if (!copies_written) {
    model_.refresh_compute_weights();
  } else if (gathered) {
    for (const Segment& seg : segments_) {
      if (group_of(seg).size() == 1) continue;
      refresh_copies(seg.begin, seg.own_begin);
      refresh_copies(seg.own_end, seg.end);
    }
  }
}

}  // namespace tessera::parallel
