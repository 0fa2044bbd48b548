// DataParallel: the flat layout of the model's tensors, gradient buckets reduced while
// backward runs, ZeRO sharding of master weights / gradients / parameters, stage-3
// gathering with prefetch, and the offload copies.
//
// Layout: every storage tensor of the model gets a range in one flat f32 index space,
// ordered by the unit whose gradients are ready first (head, last layer, ..., embeddings),
// so a bucket is a contiguous range. Segments (buckets for stages 0-2, units for stage 3)
// are the unit of reduction; each rank owns chunk_range(segment, N, rank) of every segment
// (stages 1-3) and concatenates its chunks into its shard buffers.
#include "tessera/parallel/data_parallel.h"
#include "tessera/parallel/data_parallel_parts.h"
#include "tessera/parallel/tensor_parallel.h"

#include <algorithm>
#include <cstring>

#include "tessera/base/error.h"
#include "tessera/base/trace.h"
#include "tessera/kernels/elementwise.h"

namespace tessera::parallel {

namespace {

void round_in_place(Tensor t, DType compute) {
  if (compute == DType::kBF16) round_bf16_in_place(t);
  if (compute == DType::kF16) round_f16_in_place(t);
}

}  // namespace

DataParallel::DataParallel(model::Model& model, comm::Communicator& comm, DataParallelConfig config)
    : model_(model), comm_(comm), config_(config) {
  TESSERA_CHECK(config_.zero_stage >= 0 && config_.zero_stage <= 3, "parallel.zero_stage must be 0, 1, 2 or 3, got ",
                config_.zero_stage);
  TESSERA_CHECK(config_.bucket_bytes > 0, "parallel.bucket_mb must be > 0");
  TESSERA_CHECK(model_.dtype() == DType::kF32, "data parallel training needs f32 weights, the model holds ",
                dtype_name(model_.dtype()));
  TESSERA_CHECK(model_.train_hooks() == nullptr, "the model is already wrapped for data parallelism");
  separate_master_ = config_.compute_dtype != DType::kF32 || config_.offload;
  if (config_.expert_comm) {
    const int64_t n = config_.expert_comm->size();
    TESSERA_CHECK(n >= 1 && comm_.size() % n == 0, "data parallel: the expert group's ", n,
                  " ranks do not divide the data-parallel group's ", comm_.size());
    ep_ = comm_.size() / n;
    TESSERA_CHECK(ep_ == model_.tp_shard().ep_size, "data parallel: the model is an expert shard of ep = ",
                  model_.tp_shard().ep_size, ", the groups make ep = ", ep_);
  } else {
    TESSERA_CHECK(model_.tp_shard().ep_size == 1, "data parallel: an expert shard (ep = ",
                  model_.tp_shard().ep_size, ") needs the expert group (DataParallelConfig::expert_comm)");
  }
  // First, so that binding a unit's weights below also makes its native bf16 copy.
  model_.set_compute_dtype_in_place(config_.compute_dtype, config_.bf16_request);
  // Weights kept packed where asked and the optimizer's own pass writes them (stages 0-2
  // without offload); elsewhere each gather would pack them again.
  model_.set_packed_weights(config_.packed_weights && optimizer_publishes() &&
                            model_.bf16_mode() == model::Bf16Mode::kNative);
  build_layout();
  broadcast_and_shard();
  build_pieces();
  model_.set_train_hooks(this);
}

DataParallel::~DataParallel() {
  try {
    for (auto& p : pending_) p.req->wait();
    for (auto& u : units_)
      for (auto* r : {&u.gather, &u.egather})
        if (*r) (*r)->wait();
  } catch (...) {  // a failed collective was reported where it was waited for
  }
  model_.set_train_hooks(nullptr);
}

void DataParallel::build_layout() {
  const auto& c = model_.config();
  model::Params& W = model_.weights();
  grads_ = W;  // the same struct (layers, Linear layouts); every tensor is replaced below
  const int U = model_.num_units();
  units_.assign(U, Unit{});
  // Under expert parallelism the experts' slots (which differ between the ep ranks) come
  // after everything else (replicated over the whole group), each part in gradient-ready
  // order: a unit's flat range [begin, end) is then its replicated slots.
  const auto is_expert = [&](const std::string& name) {
    return ep_ > 1 && (name.find(".moe.gate_up") != std::string::npos || name.find(".moe.down") != std::string::npos);
  };
  int64_t flat = 0;
  for (bool experts : {false, true}) {
    if (experts) expert_begin_ = flat;
    for (int u = U - 1; u >= 0; --u) {  // gradient-ready order
      Unit& unit = units_[u];
      if (!experts) unit.begin = flat;
      const auto ws = W.unit_tensors(c, u);
      const auto gs = grads_.unit_tensors(c, u);
      TESSERA_CHECK(ws.size() == gs.size(), "data parallel: gradient layout mismatch in unit ", u);
      for (size_t i = 0; i < ws.size(); ++i) {
        if (is_expert(ws[i].first) != experts) continue;
        const Tensor& t = *ws[i].second;
        TESSERA_CHECK(t.dtype() == DType::kF32 && t.is_contiguous(), "data parallel: weight ",
                      ws[i].first, " must be contiguous f32");
        Slot s;
        s.name = ws[i].first;
        s.w = ws[i].second;
        s.g = gs[i].second;
        s.shape = t.shape();
        s.numel = t.numel();
        s.flat = flat;
        s.expert = experts;
        flat += s.numel;
        unit.slots.push_back(static_cast<int>(slots_.size()));
        slots_.push_back(std::move(s));
      }
      if (!experts) unit.end = flat;
    }
  }
  total_ = flat;
  for (auto& s : slots_) *s.g = Tensor();
  grads_.lm_head = Tensor();

  // Segments in flat order.
  const int N = comm_.size(), r = comm_.rank();
  const int64_t bucket_elems = std::max<int64_t>(1, config_.bucket_bytes / 4);
  Segment cur;
  bool open = false;
  auto close = [&] {
    segments_.push_back(cur);
    cur = Segment{};
    open = false;
  };
  // A pipeline stage holds some units only (the others have no tensors and join no
  // segment), and a segment never spans two of its chunks: each chunk's backward reports
  // its units once per micro-batch, at times of the schedule's choosing.
  const model::PpStage& stage = model_.pp_stage();
  const auto chunk_of_unit = [&](int u) {
    if (u == 0) return 0;
    if (u == U - 1) return stage.num_chunks() - 1;
    return stage.chunk_of_layer(u - 1);
  };
  int cur_chunk = -1;
  for (bool experts : {false, true}) {
    for (int u = U - 1; u >= 0; --u) {
      Unit& unit = units_[u];
      // The unit's slots of this part: a contiguous flat range.
      int64_t b = -1, e = -1;
      for (int i : unit.slots)
        if (slots_[i].expert == experts) {
          if (b < 0) b = slots_[i].flat;
          e = slots_[i].flat + slots_[i].numel;
        }
      int& seg_of_unit = experts ? unit.expert_segment : unit.segment;
      if (b < 0) {
        seg_of_unit = -1;
        continue;
      }
      if (open && chunk_of_unit(u) != cur_chunk) close();
      cur_chunk = chunk_of_unit(u);
      if (!open) {
        cur.begin = b;
        cur.expert = experts;
        open = true;
      }
      cur.end = e;
      cur.units.push_back(u);
      seg_of_unit = static_cast<int>(segments_.size());
      if (config_.zero_stage == 3 || cur.end - cur.begin >= bucket_elems) close();
    }
    if (open) close();
  }
  int64_t own = 0;
  for (auto& s : segments_) {
    const int Ns = s.expert ? config_.expert_comm->size() : N, rs = s.expert ? config_.expert_comm->rank() : r;
    if (config_.zero_stage == 0 || Ns == 1) {
      s.own_begin = s.begin;
      s.own_end = s.end;
    } else {
      const comm::ChunkRange ch = comm::chunk_range(s.end - s.begin, Ns, rs);
      s.own_begin = s.begin + ch.begin;
      s.own_end = s.begin + ch.end;
    }
    s.own_offset = own;
    own += s.own_size();
  }
  own_total_ = own;
}

comm::Communicator& DataParallel::group_of(const Segment& s) { return s.expert ? *config_.expert_comm : comm_; }

void DataParallel::bind_slots(int u, const Tensor& flat, int64_t flat_begin, int kind) {
  for (int i : units_[u].slots) {
    const Slot& s = slots_[i];
    if (kind >= 0 && s.expert != (kind == 1)) continue;
    *s.w = flat.slice(0, s.flat - flat_begin, s.flat - flat_begin + s.numel).view(s.shape);
  }
}

void DataParallel::bind_unit_weights(int u, const Tensor& flat, int64_t flat_begin) {
  bind_slots(u, flat, flat_begin, -1);
  bound(u);
}

void DataParallel::bound(int u) {
  if (u == 0) model_.weights().tie(model_.config());
  model_.refresh_compute_unit(u);  // native bf16: the unit's bf16 matmul weights
}

void DataParallel::unbind_unit_weights(int u) {
  for (int i : units_[u].slots) *slots_[i].w = Tensor();
  if (u == 0) model_.weights().tie(model_.config());
  model_.release_compute_unit(u);
}

void DataParallel::bind_segment_grads(Segment& seg, const Tensor& flat) {
  for (int u : seg.units) {
    for (int i : units_[u].slots) {
      const Slot& s = slots_[i];
      if (s.expert != seg.expert) continue;  // (the unit's other segment)
      *s.g = flat.slice(0, s.flat - seg.begin, s.flat - seg.begin + s.numel).view(s.shape);
    }
    if (u == 0) grads_.tie(model_.config());
  }
}

void DataParallel::broadcast_and_shard() {
  const int N = comm_.size();
  const int stage = config_.zero_stage;
  if (separate_master_) master_ = Tensor::empty({own_total_}, DType::kF32);
  if (stage < 3) {
    params_ = comm_.alloc_shared({total_}, DType::kF32);  // all-gathered in place (registered)
    for (const Slot& s : slots_) params_.slice(0, s.flat, s.flat + s.numel).view(s.shape).copy_from(*s.w);
    // (Experts: each ep rank's own, from the first rank holding the same ones.)
    Tensor shared = params_.slice(0, 0, expert_begin_), experts = params_.slice(0, expert_begin_, total_);
    if (N > 1) comm_.broadcast(shared, 0);
    if (ep_ > 1 && config_.expert_comm->size() > 1) config_.expert_comm->broadcast(experts, 0);
    for (int u = 0; u < static_cast<int>(units_.size()); ++u) bind_unit_weights(u, params_, 0);
    if (separate_master_)
      for (const Segment& seg : segments_)
        master_.slice(0, seg.own_offset, seg.own_offset + seg.own_size())
            .copy_from(params_.slice(0, seg.own_begin, seg.own_end));
    round_in_place(params_, config_.compute_dtype);
  } else {
    params_shard_ = comm_.alloc_shared({own_total_}, DType::kF32);  // the input of every gather
    for (int u = static_cast<int>(units_.size()) - 1; u >= 0; --u) {
      Unit& unit = units_[u];
      if (unit.segment < 0) continue;  // another pipeline stage's unit
      // Its replicated slots over the whole group, its experts (ep) over expert_comm.
      for (int si : {unit.segment, unit.expert_segment}) {
        if (si < 0) continue;
        const Segment& seg = segments_[si];
        comm::Communicator& g = group_of(seg);
        Tensor full = Tensor::empty({seg.end - seg.begin}, DType::kF32);
        for (int i : unit.slots) {
          const Slot& s = slots_[i];
          if (s.expert != seg.expert) continue;
          full.slice(0, s.flat - seg.begin, s.flat - seg.begin + s.numel).view(s.shape).copy_from(*s.w);
        }
        if (g.size() > 1) g.broadcast(full, 0);
        const Tensor mine = full.slice(0, seg.own_begin - seg.begin, seg.own_end - seg.begin);
        params_shard_.slice(0, seg.own_offset, seg.own_offset + seg.own_size()).copy_from(mine);
      }
      unbind_unit_weights(u);  // the full weights go; acquire() gathers them when needed
    }
    if (separate_master_) master_.copy_from(params_shard_);
    round_in_place(params_shard_, config_.compute_dtype);
  }
  if (stage < 2) {
    // Registered where the backend can (shm collectives then read it in place).
    grads_flat_ = comm_.alloc_shared({total_}, DType::kF32);
    grads_flat_.zero();
    for (Segment& seg : segments_) bind_segment_grads(seg, grads_flat_.slice(0, seg.begin, seg.end));
  } else {
    grads_shard_ = Tensor::zeros({own_total_}, DType::kF32);
  }
  if (config_.offload) host_grads_ = Tensor::zeros({own_total_}, DType::kF32);
}

void DataParallel::build_pieces() {
  // Hugging Face tensors are row blocks of the storage tensors: find each one's flat range
  // from its address while the weights are still bound (stage 3: re-gather). A column block
  // (GPT-2's fused c_attn under tensor parallelism: its q, k and v columns) is strided: each
  // of its rows is a flat range of its own.
  const auto& c = model_.config();
  gather_all();
  struct Param {
    std::string name, key;
    int64_t flat, numel;
    int64_t block_start;  // the first element's offset inside the block (row-major)
    Shape shape;
    std::vector<int64_t> block_offset;
    Shape full;
    bool expert;
  };
  std::vector<Param> params;
  for (const auto& piece : model_.weights().pieces(c, model_.tp_shard())) {
    const std::string name = piece.name;
    const std::string key = tp_piece_key(name, model_.tp_shard(), piece.block);
    const Tensor& view = piece.view;
    const char* p = static_cast<const char*>(view.raw_data());
    bool found = false;
    for (const Slot& s : slots_) {
      const char* base = static_cast<const char*>(s.w->raw_data());
      if (p >= base && p < base + s.numel * 4) {
        const int64_t flat = s.flat + (p - base) / 4;
        if (view.is_contiguous()) {
          params.push_back({name, key, flat, view.numel(), 0, view.shape(), piece.offset, piece.full, s.expert});
        } else {
          TESSERA_CHECK(view.dim() == 2 && view.stride(1) == 1, "data parallel: tensor ", name,
                        " is neither contiguous nor a block of whole rows");
          const int64_t rows = view.size(0), cols = view.size(1);
          for (int64_t r = 0; r < rows; ++r)
            params.push_back({name, key, flat + r * view.stride(0), cols, r * cols, view.shape(),
                              piece.offset, piece.full, s.expert});
        }
        found = true;
        break;
      }
    }
    TESSERA_CHECK(found, "data parallel: tensor ", name, " is not in the flat layout");
  }
  release_all();
  std::sort(params.begin(), params.end(), [](const Param& a, const Param& b) { return a.flat < b.flat; });
  for (const Param& p : params) {
    for (const Segment& seg : segments_) {
      const int64_t lo = std::max(p.flat, seg.own_begin), hi = std::min(p.flat + p.numel, seg.own_end);
      if (lo >= hi) continue;
      const int64_t shard_pos = seg.own_offset + (lo - seg.own_begin);
      ShardPiece piece;
      piece.name = p.name;
      piece.key = p.key;
      piece.offset = p.block_start + (lo - p.flat);
      piece.tensor_shape = p.shape;
      piece.block_offset = p.block_offset;
      piece.full_shape = p.full;
      piece.expert = p.expert;
      comm::Communicator& g = group_of(seg);
      const bool replicated = config_.zero_stage == 0 || g.size() == 1;
      piece.copies = replicated ? g.size() : 1;
      piece.primary = !replicated || g.rank() == 0;
      if (separate_master_)
        piece.master = master_.slice(0, shard_pos, shard_pos + hi - lo);
      else if (config_.zero_stage < 3)
        piece.master = params_.slice(0, lo, hi);
      else
        piece.master = params_shard_.slice(0, shard_pos, shard_pos + hi - lo);
      if (config_.offload)
        piece.grad = host_grads_.slice(0, shard_pos, shard_pos + hi - lo);
      else if (config_.zero_stage < 2)
        piece.grad = grads_flat_.slice(0, lo, hi);
      else
        piece.grad = grads_shard_.slice(0, shard_pos, shard_pos + hi - lo);
      if (hi - lo == shape_numel(p.shape)) {
        piece.master = piece.master.view(p.shape);
        piece.grad = piece.grad.view(p.shape);
      }
      pieces_.push_back(std::move(piece));
      piece_flat_.push_back(lo);
    }
  }
}

void DataParallel::start_step(bool first_micro_batch_assigns) {
  if (grads_flat_.defined() && !first_micro_batch_assigns) grads_flat_.zero();
  if (grads_shard_.defined()) grads_shard_.zero();
  for (auto& s : segments_) s.ready = 0;
  sync_ = true;
}

void DataParallel::set_sync(bool sync) { sync_ = sync; }

void DataParallel::prepare_grads(int unit) {
  if (config_.zero_stage < 2) return;
  for (int si : {units_[unit].segment, units_[unit].expert_segment}) {
    if (si < 0) continue;
    Segment& seg = segments_[si];
    if (seg.buf.defined()) continue;
    seg.buf = comm_.alloc_shared({seg.end - seg.begin}, DType::kF32);  // registered, see above
    seg.buf.zero();
    bind_segment_grads(seg, seg.buf);
  }
}

void DataParallel::grads_ready(int unit) {
  for (int si : {units_[unit].segment, units_[unit].expert_segment}) {
    if (si < 0) continue;  // another pipeline stage's unit, or no experts
    Segment& seg = segments_[si];
    if (++seg.ready < static_cast<int>(seg.units.size())) continue;
    seg.ready = 0;
    if (config_.zero_stage < 2 && (!sync_ || comm_.size() == 1)) continue;
    launch_reduction(seg);
  }
}

void DataParallel::launch_reduction(Segment& seg) {
  const int si = static_cast<int>(&seg - segments_.data());
  comm::Communicator& g = group_of(seg);
  // An expert's gradient already sums the ep ranks' tokens (the MoE backward brought them
  // to it): averaged over the ranks holding the expert, it is ep times the mean over the
  // whole group that every other gradient is.
  const float scale = seg.expert ? 1.f / static_cast<float>(ep_) : 1.f;
  if (config_.zero_stage < 2) {
    Tensor v = grads_flat_.slice(0, seg.begin, seg.end);
    pending_.push_back({g.all_reduce_async(v, comm::ReduceOp::kAvg, config_.algorithm), si, Tensor(), scale});
  } else {
    Tensor out = Tensor::empty({seg.own_size()}, DType::kF32);
    Tensor in = seg.buf;
    pending_.push_back(
        {g.reduce_scatter_async(in, out, comm::ReduceOp::kAvg, config_.algorithm), si, out, scale});
    // The model is done with these gradients; the queued collective keeps the buffer alive.
    for (int u : seg.units)
      for (int i : units_[u].slots)
        if (slots_[i].expert == seg.expert) *slots_[i].g = Tensor();
    if (std::find(seg.units.begin(), seg.units.end(), 0) != seg.units.end()) grads_.tie(model_.config());
    seg.buf = Tensor();
  }
  poll_pending();
}

void DataParallel::complete(Pending& p) {
  p.req->wait();
  const Segment& seg = segments_[p.segment];
  if (p.out.defined()) {
    if (p.scale != 1.f) kernels::scale_inplace(p.out, p.scale);
    Tensor dst = grads_shard_.slice(0, seg.own_offset, seg.own_offset + seg.own_size());
    kernels::add_inplace(dst, p.out);
  } else if (p.scale != 1.f) {
    Tensor v = grads_flat_.slice(0, seg.begin, seg.end);
    kernels::scale_inplace(v, p.scale);
  }
}

void DataParallel::poll_pending() {
  // Completes finished reductions in issue order, freeing their buffers early.
  size_t done = 0;
  while (done < pending_.size() && pending_[done].req->test()) complete(pending_[done++]);
  pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(done));
}

void DataParallel::finish_gradients() {
  base::TraceScope scope("grad_sync_wait");
  for (auto& p : pending_) complete(p);
  pending_.clear();
  // Stage 3: a prefetch nobody acquired (a step that skipped backward) is dropped.
  for (int u = 0; u < static_cast<int>(units_.size()); ++u) {
    Unit& unit = units_[u];
    if (unit.refs > 0) continue;
    if (unit.gather) finish_gather(u);
    if (unit.resident) drop_gathered(u);
  }
  if (config_.offload) {  // device -> host: the CPU optimizer reads host memory only
    for (const Segment& seg : segments_) {
      Tensor dst = host_grads_.slice(0, seg.own_offset, seg.own_offset + seg.own_size());
      if (config_.zero_stage < 2)
        dst.copy_from(grads_flat_.slice(0, seg.own_begin, seg.own_end));
      else
        dst.copy_from(grads_shard_.slice(0, seg.own_offset, seg.own_offset + seg.own_size()));
    }
  }
}

std::vector<double> exact_sums(comm::Communicator& comm, const std::vector<double>& local) {
  const int N = comm.size();
  const int64_t K = static_cast<int64_t>(local.size());
  if (N == 1 || K == 0) return local;
  // Collectives have no f64: gather the exact bits of every rank's values and add them in
  // rank order, so every rank gets the same, correctly rounded sums.
  Tensor in = Tensor::empty({K}, DType::kI64);
  std::memcpy(in.raw_data(), local.data(), static_cast<size_t>(K) * sizeof(double));
  Tensor all = Tensor::empty({N * K}, DType::kI64);
  comm.all_gather(in, all);
  std::vector<double> sum(static_cast<size_t>(K), 0.0);
  for (int r = 0; r < N; ++r)
    for (int64_t k = 0; k < K; ++k) {
      double v = 0;
      std::memcpy(&v, all.data<int64_t>() + r * K + k, sizeof v);
      sum[static_cast<size_t>(k)] += v;
    }
  return sum;
}

double exact_sum(comm::Communicator& comm, double local) { return exact_sums(comm, {local})[0]; }

double DataParallel::sum_over_ranks(double local) { return exact_sum(comm_, local); }
std::vector<double> DataParallel::sum_over_ranks(const std::vector<double>& local) { return exact_sums(comm_, local); }

void DataParallel::start_gather(int u, bool async) {
  Unit& unit = units_[u];
  // The replicated slots over the whole group; the experts (ep) over expert_comm.
  for (int si : {unit.segment, unit.expert_segment}) {
    if (si < 0) continue;
    const Segment& seg = segments_[si];
    Tensor& buf = seg.expert ? unit.ebuf : unit.buf;
    buf = Tensor::empty({seg.end - seg.begin}, DType::kF32);
    gathered_bytes_ += buf.numel() * 4;
    const Tensor in = params_shard_.slice(0, seg.own_offset, seg.own_offset + seg.own_size());
    (seg.expert ? unit.egather : unit.gather) = group_of(seg).all_gather_async(in, buf, config_.algorithm);
  }
  gathered_peak_ = std::max(gathered_peak_, gathered_bytes_);
  if (!async) finish_gather(u);
}

void DataParallel::finish_gather(int u) {
  Unit& unit = units_[u];
  for (auto* r : {&unit.gather, &unit.egather})
    if (*r) {
      (*r)->wait();
      *r = nullptr;
    }
  bind_slots(u, unit.buf, unit.begin, 0);
  if (unit.expert_segment >= 0) bind_slots(u, unit.ebuf, segments_[unit.expert_segment].begin, 1);
  bound(u);
  unit.resident = true;
}

void DataParallel::drop_gathered(int u) {
  Unit& unit = units_[u];
  unbind_unit_weights(u);
  unit.resident = false;
  gathered_bytes_ -= (unit.buf.numel() + (unit.ebuf.defined() ? unit.ebuf.numel() : 0)) * 4;
  unit.buf = unit.ebuf = Tensor();
}

void DataParallel::acquire(int u) {
  if (config_.zero_stage < 3 || units_[u].segment < 0) return;
  Unit& unit = units_[u];
  const int head = static_cast<int>(units_.size()) - 1;
  if (u == 0 && units_[head].refs == 0) backward_phase_ = false;  // a forward pass begins
  if (unit.refs++ > 0) return;
  if (unit.gather) {
    base::TraceScope wait("gather_wait");
    finish_gather(u);
  } else if (!unit.resident) {
    base::TraceScope gather("gather");
    start_gather(u, false);
  }
  if (u == head) backward_phase_ = true;
  if (!config_.prefetch || gather_all_depth_ > 0) return;
  const int next = backward_phase_ ? (u == head ? head - 1 : u - 1) : u + 1;
  if (next < 1 && backward_phase_) return;  // backward never reads the embeddings' weights
  if (next < 0 || next > head) return;
  Unit& n = units_[next];
  if (n.segment >= 0 && n.refs == 0 && !n.resident && !n.gather) start_gather(next, true);
}

void DataParallel::release(int u) {
  if (config_.zero_stage < 3 || units_[u].segment < 0) return;
  Unit& unit = units_[u];
  TESSERA_CHECK(unit.refs > 0, "data parallel: unit ", u, " released more often than acquired");
  if (--unit.refs > 0) return;
  drop_gathered(u);
}

void DataParallel::gather_all() {
  if (config_.zero_stage < 3) return;
  ++gather_all_depth_;  // no prefetching while everything is held, until release_all
  for (int u = 0; u < static_cast<int>(units_.size()); ++u) acquire(u);
}

void DataParallel::release_all() {
  if (config_.zero_stage < 3) return;
  for (int u = 0; u < static_cast<int>(units_.size()); ++u) release(u);
  --gather_all_depth_;
}

MemoryUse DataParallel::memory() const {
  MemoryUse m;
  const int64_t full = total_ * 4, own = own_total_ * 4;
  m.params = config_.zero_stage < 3 ? full : own;
  m.grads = config_.zero_stage < 2 ? full : own;
  m.master = separate_master_ ? own : 0;
  if (config_.offload) m.offloaded = m.master + own;  // master + the host gradient copy
  m.gathered_peak = gathered_peak_;
  return m;
}

}  // namespace tessera::parallel
