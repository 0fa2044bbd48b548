// Tensor-parallel serving: the step broadcast and the workers' loop (tp_serving.h).
#include "tessera/infer/tp_serving.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>

#include "tessera/base/error.h"
#include "tessera/base/trace.h"
#include "tessera/kernels/kv_shift.h"
#include "tessera/kernels/matmul.h"
#include "tessera/model/attention_sinks.h"
#include "tessera/model/quantize.h"
#include "tessera/parallel/expert_parallel.h"
#include "tessera/parallel/tensor_parallel.h"

namespace tessera::infer {
namespace {

// Header of every message, one i64 tensor: what it is and the sizes of the i32 payload.
enum Kind : int64_t { kStop = 0, kPool = 1, kStep = 2 };
constexpr int64_t kHeader = 8;  // kind, N, sequences, block-table entries, rows, copies, flags, pool

}  // namespace

Tensor run_step(const model::Model& m, KvPool& pool, const StepPlan& plan, Tensor* hidden) {
  if (!plan.copies.empty())
    for (int64_t l = 0; l < static_cast<int64_t>(pool.k.size()); ++l)
      kernels::copy_kv_blocks(pool.k[l], pool.v[l], plan.copies);
  if (!plan.shifts.empty()) {
    std::vector<kernels::KvWindowShift> shifts;
    for (const auto& sh : plan.shifts) shifts.push_back({sh.table.data(), sh.sinks, sh.length, sh.delta});
    const kernels::RopeFreqs freqs = model::key_rope_freqs(m.config());
    for (int64_t l = 0; l < static_cast<int64_t>(pool.k.size()); ++l)
      kernels::shift_kv_window(pool.k[l], pool.v[l], shifts, freqs);
  }
  kernels::PagedAttentionParams ap;
  ap.scale = m.config().attention_scale();
  ap.batch_invariant = plan.batch_invariant;
  PagedKvAttention kv(pool, plan.seqs, ap, m.config());
  base::TraceScope fwd("forward_tokens");
  // A step of decode rows only (one token per sequence) sends up to 8 rows to the skinny
  // kernel (kernels::DecodeRows); a step with a prompt chunk keeps the prompt's kernels.
  const bool decode_only = std::all_of(plan.seqs.begin(), plan.seqs.end(),
                                       [](const kernels::PagedSequence& q) { return q.q_len == 1; });
  std::optional<kernels::DecodeRows> decode_rows;
  if (decode_only) decode_rows.emplace();
  return m.forward_tokens(plan.ids, plan.positions, kv, plan.rows, plan.batch_invariant, hidden,
                          plan.adapters.empty() ? nullptr : &plan.adapters);
}

TpGroup::TpGroup(comm::Communicator& comm) : comm_(comm) { comm_.set_timeout(0); }

TpGroup::~TpGroup() {
  if (comm_.rank() != 0 || stopped_) return;
  try {
    stop();
  } catch (...) {  // a destructor does not throw; the group is already failing
  }
}

void TpGroup::send_pool(int64_t num_blocks, int64_t block_size, kernels::KvCacheDtype dtype) {
  TESSERA_CHECK(comm_.rank() == 0, "tp serving: only rank 0 runs the engine");
  Tensor h = Tensor::zeros({kHeader}, DType::kI64);
  h.data<int64_t>()[0] = kPool;
  h.data<int64_t>()[1] = num_blocks;
  h.data<int64_t>()[2] = static_cast<int64_t>(dtype);
  h.data<int64_t>()[7] = block_size;
  comm_.broadcast(h, 0);
}

void TpGroup::stop() {
  if (stopped_ || comm_.size() == 1) {
    stopped_ = true;
    return;
  }
  stopped_ = true;
  Tensor h = Tensor::zeros({kHeader}, DType::kI64);
  h.data<int64_t>()[0] = kStop;
  comm_.broadcast(h, 0);
}

void TpGroup::send_step(const StepPlan& p) {
  TESSERA_CHECK(comm_.rank() == 0 && !stopped_, "tp serving: send_step on a worker or after stop");
  if (comm_.size() == 1) return;
  TESSERA_CHECK(p.shifts.empty(), "tp serving: attention sinks are not served with tensor parallelism");
  const int64_t N = p.ids.numel(), S = static_cast<int64_t>(p.seqs.size());
  int64_t entries = 0;
  std::vector<int64_t> lens(S);
  for (int64_t i = 0; i < S; ++i) {
    // The entries a sequence's attention reads: its table up to the last block in use.
    lens[i] = p.tables.empty() ? -1 : static_cast<int64_t>(p.tables[i].size());
    entries += lens[i];
  }
  TESSERA_CHECK(!p.tables.empty() || S == 0, "tp serving: the step plan needs its block tables");
  const int64_t R = static_cast<int64_t>(p.rows.size()), C = static_cast<int64_t>(p.copies.size());
  Tensor h = Tensor::zeros({kHeader}, DType::kI64);
  int64_t* hd = h.data<int64_t>();
  hd[0] = kStep, hd[1] = N, hd[2] = S, hd[3] = entries, hd[4] = R, hd[5] = C, hd[6] = p.batch_invariant;
  comm_.broadcast(h, 0);
  Tensor body = Tensor::empty({2 * N + 4 * S + entries + R + 2 * C}, DType::kI32);
  int32_t* b = body.data<int32_t>();
  const Tensor ids = p.ids.contiguous(), pos = p.positions.contiguous();
  for (int64_t i = 0; i < N; ++i) *b++ = ids.data<int32_t>()[i];
  for (int64_t i = 0; i < N; ++i) *b++ = pos.data<int32_t>()[i];
  for (int64_t i = 0; i < S; ++i) {
    const auto& s = p.seqs[i];
    *b++ = static_cast<int32_t>(s.q_begin);
    *b++ = static_cast<int32_t>(s.q_len);
    *b++ = static_cast<int32_t>(s.context_len);
    *b++ = static_cast<int32_t>(lens[i]);
  }
  for (int64_t i = 0; i < S; ++i)
    for (int32_t e : p.tables[i]) *b++ = e;
  for (int64_t r : p.rows) *b++ = static_cast<int32_t>(r);
  for (const auto& [src, dst] : p.copies) {
    *b++ = src;
    *b++ = dst;
  }
  comm_.broadcast(body, 0);
}

int64_t TpGroup::run_worker(const model::Model& shard) {
  TESSERA_CHECK(comm_.rank() != 0, "tp serving: rank 0 runs the engine, not a worker");
  KvPool pool;
  int64_t steps = 0;
  for (;;) {
    Tensor h = Tensor::empty({kHeader}, DType::kI64);
    comm_.broadcast(h, 0);
    const int64_t* hd = h.data<int64_t>();
    if (hd[0] == kStop) return steps;
    if (hd[0] == kPool) {
      pool = KvPool::create(shard.config(), hd[1], hd[7], shard.dims().kv_heads,
                            static_cast<kernels::KvCacheDtype>(hd[2]));
      continue;
    }
    TESSERA_CHECK(hd[0] == kStep && pool.num_blocks > 0, "tp serving: unexpected message ", hd[0]);
    const int64_t N = hd[1], S = hd[2], entries = hd[3], R = hd[4], C = hd[5];
    Tensor body = Tensor::empty({2 * N + 4 * S + entries + R + 2 * C}, DType::kI32);
    comm_.broadcast(body, 0);
    const int32_t* b = body.data<int32_t>();
    StepPlan p;
    p.ids = Tensor::empty({N}, DType::kI32);
    p.positions = Tensor::empty({N}, DType::kI32);
    for (int64_t i = 0; i < N; ++i) p.ids.data<int32_t>()[i] = *b++;
    for (int64_t i = 0; i < N; ++i) p.positions.data<int32_t>()[i] = *b++;
    p.seqs.resize(S);
    std::vector<int64_t> lens(S);
    for (int64_t i = 0; i < S; ++i) {
      p.seqs[i].q_begin = *b++;
      p.seqs[i].q_len = *b++;
      p.seqs[i].context_len = *b++;
      lens[i] = *b++;
    }
    p.tables.resize(S);
    for (int64_t i = 0; i < S; ++i) {
      p.tables[i].assign(b, b + lens[i]);
      b += lens[i];
      p.seqs[i].block_table = p.tables[i].data();
    }
    for (int64_t i = 0; i < R; ++i) p.rows.push_back(*b++);
    for (int64_t i = 0; i < C; ++i, b += 2) p.copies.emplace_back(b[0], b[1]);
    p.batch_invariant = hd[6] != 0;
    run_step(shard, pool, p);  // the logits are rank 0's to sample
    ++steps;
  }
}

int run_tensor_parallel(int tp, const std::string& dir, DType dtype,
                        const std::function<int(const model::Model&, TpGroup*)>& lead,
                        const model::LoadQuantization& quantization, int ep) {
  TESSERA_CHECK(tp >= 1, "--tp ", tp, " must be >= 1");
  TESSERA_CHECK(ep >= 1, "--ep ", ep, " must be >= 1");
  const int ranks = tp * ep;
  const std::string flag = ep > 1 && tp > 1 ? "--tp " + std::to_string(tp) + " --ep " + std::to_string(ep)
                           : ep > 1         ? "--ep " + std::to_string(ep)
                                            : "--tp " + std::to_string(tp);
  if (ranks == 1 && !comm::running_under_mpi()) {
    model::Model m = model::Model::load(dir, dtype);
    model::quantize_on_load(m, quantization);
    return lead(m, nullptr);
  }
  TESSERA_CHECK(quantization.none() && !quantization.lm_head, "--quantization ", quantization.scheme,
                " with ", flag, ": tensor- or expert-parallel quantized weights are not supported yet");
  int rc = 0;
  auto body = [&](comm::Communicator& comm) {
    const model::ModelConfig c = model::ModelConfig::load(dir);
    // Rank r is tp rank r % tp of ep rank r / tp (tp innermost, as the training mesh orders
    // them): its attention shard with the ranks of its ep coordinate, its experts with the
    // ranks of its tp coordinate. Every rank runs every step (the step plan goes to all).
    const int t = comm.rank() % tp, e = comm.rank() / tp;
    const model::TpShard shard{t, tp, e, ep};
    model::LocalDims d;
    try {
      d = model::local_dims(c, shard);
    } catch (const Error& e) {
      fail(flag, ": ", dir, ": ", e.what());
    }
    model::Model m = model::Model::load(dir, dtype, shard);
    const std::unique_ptr<comm::Communicator> tp_group = comm.split(e, t), ep_group = comm.split(t, e);
    parallel::CommTp tpc(*tp_group, d.kv_replicas);
    parallel::CommEp epc(*ep_group);
    if (tp > 1) m.set_tp_comm(&tpc);
    if (ep > 1) m.set_ep_comm(&epc);
    TpGroup group(comm);
    if (comm.rank() == 0) {
      rc = lead(m, comm.size() > 1 ? &group : nullptr);
      group.stop();
    } else {
      group.run_worker(m);
    }
  };
  if (comm::running_under_mpi()) {
    comm::Communicator& world = comm::mpi_world();
    TESSERA_CHECK(world.size() == tp * ep, flag, " under mpirun needs -np ", tp * ep, ", got ", world.size(), " ranks");
    body(world);
    return world.rank() == 0 ? rc : 0;
  }
  comm::run_local(ranks, body);
  return rc;
}

}  // namespace tessera::infer
