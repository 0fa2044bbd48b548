// The run's layout and the pipeline step (trainer_layout.h).
#include "tessera/train/trainer_layout.h"

#include <cstdio>
#include <cstring>

#include "tessera/base/error.h"
#include "tessera/base/trace.h"
#include "tessera/io/json_file.h"
#include "tessera/kernels/cross_entropy.h"
#include "tessera/train/trainer.h"

namespace tessera::train {

// The [parallel] mesh resolved against the world, before anything is loaded.
parallel::MeshShape run_mesh_shape(const TrainConfig& c, int64_t world) {
  parallel::MeshShape s;
  s.dp = c.parallel.dp, s.tp = c.parallel.tp, s.pp = c.parallel.pp, s.cp = c.parallel.cp, s.ep = c.parallel.ep;
  return parallel::resolve_mesh_shape(s, world, c.source_name());
}

model::ModelConfig check_run(const TrainConfig& c, int64_t world) {
  const parallel::MeshShape s = run_mesh_shape(c, world);
  const DataMeta meta = read_run_data_meta(c);
  const model::ModelConfig m = build_model_config(c, meta.vocab_size, meta.eos_id);
  for (int rank = 0; rank < world; ++rank) {  // shards and stages differ by rank
    checked_tp_shard(c, s, m, rank);
    checked_pp_stage(c, s, m, rank);
  }
  return m;
}

// This rank's pipeline stage (the whole model at pp 1), checked against the model and the
// schedule before any weight exists.
model::PpStage checked_pp_stage(const TrainConfig& c, const parallel::MeshShape& s,
                                const model::ModelConfig& m, int rank) {
  const std::string src = c.source_name();
  const auto& pa = c.parallel;
  const int V = static_cast<int>(pa.pp_virtual_stages);
  const auto schedule = parallel::parse_pipe_schedule(pa.pp_schedule);
  if (s.pp == 1) {
    TESSERA_CHECK(V == 1 && pa.pp_layers.empty(), src, ": [parallel] pp_virtual_stages and ",
                  "pp_layers need pp > 1");
    return {};
  }
  try {
    parallel::check_pipe_shape(schedule, {static_cast<int>(s.pp), static_cast<int>(c.data.grad_accum), V});
    const auto coords = parallel::DeviceMesh::coords_of(s, rank);
    return model::pipeline_stage(m, coords[static_cast<int>(parallel::Axis::kPp)],
                                 static_cast<int>(s.pp), V, pa.pp_layers);
  } catch (const Error& e) {
    fail(src, ": [parallel] ", e.what());
  }
}

// The layout checked against the model's configuration and the batch before any weight
// exists; this rank's tensor-parallel shard.
model::TpShard checked_tp_shard(const TrainConfig& c, const parallel::MeshShape& s,
                                const model::ModelConfig& m, int rank) {
  const std::string src = c.source_name();
  parallel::check_layout(s, m, c.data.grad_accum, src);
  TESSERA_CHECK(c.data.batch_size % (s.dp * s.ep) == 0, src, ": data.batch_size = ", c.data.batch_size,
                " does not split evenly over ", s.dp * s.ep, " data-parallel ranks ([parallel] dp",
                s.ep > 1 ? " x ep: each expert-parallel rank takes its own rows)" : ")");
  TESSERA_CHECK(!m.is_moe() || !c.parallel.sequence_parallel, src, ": [parallel] sequence_parallel = true over ",
                "mixture-of-experts layers is not supported yet");
  if (s.cp > 1) {
    const auto method = model::parse_cp_method(c.parallel.cp_method, src + ": [parallel]");
    TESSERA_CHECK(!c.parallel.sequence_parallel, src, ": [parallel] cp = ", s.cp,
                  " with sequence_parallel is not supported yet");
    TESSERA_CHECK(m.uses_rope(), src, ": [parallel] cp = ", s.cp, " needs a RoPE model (", m.model_type,
                  " has learned positions)");
    const int64_t parts = method == model::CpMethod::kRing ? 2 * s.cp : s.cp;
    TESSERA_CHECK(c.data.seq_len % parts == 0, src, ": data.seq_len = ", c.data.seq_len, " does not split in ", parts,
                  " equal chunks ([parallel] cp = ", s.cp, ", cp_method = \"", c.parallel.cp_method, "\"",
                  method == model::CpMethod::kRing ? ": ring attention holds 2 chunks per rank)" : ")");
  }
  TESSERA_CHECK(!c.parallel.sequence_parallel || s.tp > 1, src,
                ": [parallel] sequence_parallel = true needs tp > 1 (it splits the tp group's rows)");
  TESSERA_CHECK(!c.parallel.sp_overlap || c.parallel.sequence_parallel, src,
                ": [parallel] sp_overlap = true needs sequence_parallel = true (it overlaps SP's all-gathers)");
  if (c.parallel.sequence_parallel) {
    const int64_t rows = c.data.batch_size / s.dp * c.data.seq_len;
    TESSERA_CHECK(rows % s.tp == 0, src, ": [parallel] sequence_parallel = true splits each ",
                  "micro-batch's ", rows, " tokens (batch_size / dp x seq_len) over tp = ", s.tp,
                  " ranks: they must divide evenly");
  }
  const auto coords = parallel::DeviceMesh::coords_of(s, rank);
  const model::TpShard shard{coords[static_cast<int>(parallel::Axis::kTp)], static_cast<int>(s.tp),
                             coords[static_cast<int>(parallel::Axis::kEp)], static_cast<int>(s.ep)};
  model::LocalDims d;
  try {
    d = model::local_dims(m, shard);
  } catch (const Error& e) {
    fail(src, ": [parallel] ", e.what());
  }
  if (s.cp > 1 && c.parallel.cp_method == "ulysses")
    TESSERA_CHECK(d.heads % s.cp == 0 && d.kv_heads % s.cp == 0, src, ": [parallel] cp = ", s.cp,
                  " with cp_method = \"ulysses\" needs the ", d.heads, " query and ", d.kv_heads,
                  " key/value heads of a rank (after tp) divisible by cp");
  return shard;
}

std::unique_ptr<parallel::DeviceMesh> make_mesh(const parallel::MeshShape& s, comm::Communicator& comm) {
  auto mesh = std::make_unique<parallel::DeviceMesh>(comm, s);
  if (comm.size() > 1) std::fprintf(stderr, "train: mesh %s, %s\n", s.describe().c_str(), mesh->describe().c_str());
  return mesh;
}

// The model's tp collectives over the mesh's tp group (nullptr at tp 1), and sequence
// parallelism when asked for.
std::unique_ptr<parallel::CommTp> make_tp(parallel::DeviceMesh& mesh, model::Model& m,
                                          bool sequence_parallel, bool sp_overlap) {
  if (m.tp_shard().size == 1) return nullptr;
  auto tp = std::make_unique<parallel::CommTp>(mesh.group(parallel::Axis::kTp), m.dims().kv_replicas);
  m.set_tp_comm(tp.get());
  m.set_sequence_parallel(sequence_parallel);
  m.set_sp_overlap(sp_overlap);
  return tp;
}

// The two ends of each pipeline (same dp and tp coordinates, pp 0 and pp - 1) when the
// model ties its embeddings to lm_head under pp > 1; nullptr elsewhere. Collective over
// the world (a split).
std::unique_ptr<comm::Communicator> make_embed_group(const parallel::MeshShape& s,
                                                     const model::ModelConfig& m,
                                                     comm::Communicator& world) {
  if (s.pp == 1 || !m.tie_word_embeddings) return nullptr;
  const auto co = parallel::DeviceMesh::coords_of(s, world.rank());
  const int pp = co[static_cast<int>(parallel::Axis::kPp)];
  const bool end = pp == 0 || pp == s.pp - 1;
  const int colour = end ? co[static_cast<int>(parallel::Axis::kDp)] * static_cast<int>(s.tp) +
                               co[static_cast<int>(parallel::Axis::kTp)]
                         : -1;
  return world.split(colour, pp);
}

GradientPass run_pipeline_step(const model::Model& m, parallel::DataParallel& dp,
                               parallel::Pipeline& pipe, comm::Communicator* embed_group,
                               int64_t accum, float scale,
                               const std::function<model::TokenBatch(int64_t)>& batch,
                               parallel::PipelineStep& last) {
  std::vector<parallel::MicroBatch> mbs;
  for (int64_t i = 0; i < accum; ++i) {
    const model::TokenBatch b = batch(i);
    mbs.push_back({b.ids.contiguous().clone(), b.targets.contiguous().clone(),
                   b.positions.defined() ? b.positions.contiguous().clone() : Tensor()});
  }
  dp.start_step(/*first_micro_batch_assigns=*/true);
  base::TraceScope fb("pipeline");
  last = pipe.run(mbs, dp.grads(), scale / static_cast<float>(accum),
                  [&dp](int, bool final_micro) { dp.set_sync(final_micro); });
  dp.finish_gradients();
  if (embed_group) {
    // The tied table's two gradients (embedding lookups on stage 0, the head on the last
    // stage) summed, so both copies take the same step.
    base::TraceScope tied("tied_embedding_sum");
    if (dp.config().zero_stage < 2 || dp.world_size() == 1) {  // each is whole here
      model::Params& g = dp.grads();
      Tensor t = m.pp_stage().holds_embed() ? g.embed : g.lm_head;
      embed_group->all_reduce(t, comm::ReduceOp::kSum);
    } else {
      // ZeRO-2/3: each data-parallel rank holds its own pieces of the reduced gradient,
      // cut differently at the two ends. Assembled whole over the dp group (every element
      // is one rank's), summed between the ends, and each rank's pieces copied back.
      const std::string name = m.pp_stage().holds_embed() ? model::embedding_name(m.config())
                                                          : std::string("lm_head.weight");
      // (V / tp, H): this rank's tp block of the table, whichever end holds it.
      Tensor whole = Tensor::zeros({m.dims().vocab * m.config().hidden_size}, DType::kF32);
      for (const auto& piece : dp.pieces()) {
        if (piece.name != name) continue;
        const int64_t n = piece.grad.numel();
        whole.slice(0, piece.offset, piece.offset + n).copy_from(piece.grad.view({n}));
      }
      dp.comm().all_reduce(whole, comm::ReduceOp::kSum);
      embed_group->all_reduce(whole, comm::ReduceOp::kSum);
      for (auto& piece : dp.pieces()) {
        if (piece.name != name) continue;
        Tensor g = piece.grad.view({piece.grad.numel()});
        g.copy_from(whole.slice(0, piece.offset, piece.offset + g.numel()));
      }
    }
  }
  GradientPass r;
  r.loss_sum = last.loss_sum;
  r.count = last.count;
  r.activation_bytes = last.activation_bytes;
  if (m.config().is_moe()) {  // every stage's layers' loads, summed over the pp group
    // (The same length on every stage: E, then E per MoE layer of the model, then dropped.)
    const size_t E = static_cast<size_t>(m.config().num_experts);
    size_t moe_layers = 0;
    for (int64_t l = 0; l < m.config().num_layers; ++l) moe_layers += m.config().layer_is_moe(l);
    std::vector<double> flat = last.expert_load;
    flat.resize(E, 0.0);
    for (size_t i = 0; i < moe_layers; ++i) {
      if (i < last.layer_load.size()) flat.insert(flat.end(), last.layer_load[i].begin(), last.layer_load[i].end());
      flat.resize(E * (i + 2), 0.0);
    }
    flat.push_back(static_cast<double>(last.dropped));
    flat = parallel::exact_sums(pipe.comm(), flat);
    r.expert_load.assign(flat.begin(), flat.begin() + E);
    for (size_t at = E; at + E < flat.size(); at += E) r.layer_load.emplace_back(flat.begin() + at, flat.begin() + at + E);
    r.dropped = static_cast<int64_t>(flat.back());
  }
  return r;
}

std::vector<std::vector<parallel::PipeSpan>> gather_pipeline_spans(const parallel::PipelineStep& last,
                                                                   comm::Communicator& g) {
  const int64_t n = static_cast<int64_t>(last.spans.size());
  Tensor mine = Tensor::empty({2 * n}, DType::kI64), all = Tensor::empty({2 * n * g.size()}, DType::kI64);
  for (int64_t i = 0; i < n; ++i) {  // the exact bits of each double
    std::memcpy(mine.data<int64_t>() + 2 * i, &last.spans[i].start, 8);
    std::memcpy(mine.data<int64_t>() + 2 * i + 1, &last.spans[i].end, 8);
  }
  g.all_gather(mine, all);
  std::vector<std::vector<parallel::PipeSpan>> spans(g.size(), std::vector<parallel::PipeSpan>(n));
  for (int r = 0; r < g.size(); ++r)
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(&spans[r][i].start, all.data<int64_t>() + 2 * (r * n + i), 8);
      std::memcpy(&spans[r][i].end, all.data<int64_t>() + 2 * (r * n + i) + 1, 8);
    }
  return spans;
}

void pipeline_metrics(nlohmann::json& rec, const parallel::Pipeline& pipe,
                      const parallel::PipelineStep& last,
                      const std::vector<std::vector<parallel::PipeSpan>>& spans) {
  rec["pp_schedule"] = parallel::pipe_schedule_name(pipe.schedule());
  rec["pp_bubble"] = parallel::measured_bubble(spans);
  rec["pp_bubble_critical"] = parallel::critical_bubble(spans);
  rec["pp_bubble_formula"] = parallel::ideal_bubble(pipe.shape());
  rec["pp_sent_bytes"] = last.sent_bytes;
  rec["pp_messages"] = last.sent_messages;
  rec["pp_recv_wait_s"] = last.recv_wait_s;
  rec["pp_max_in_flight"] = last.max_in_flight;
  nlohmann::json busy = nlohmann::json::array();  // seconds computing per stage: the balance
  for (const auto& rank : spans) {
    double b = 0;
    for (const auto& sp : rank) b += sp.end - sp.start;
    busy.push_back(b);
  }
  rec["pp_stage_busy_s"] = busy;
}

std::pair<double, int64_t> eval_loss_sums(const model::Model& m, parallel::Pipeline* pipe,
                                          const std::vector<model::TokenBatch>& batches) {
  if (pipe) return pipe->evaluate(batches);
  double sum = 0;
  int64_t count = 0;
  for (const auto& [ids, targets, positions] : batches) {
    const Tensor logits = m.forward_batch(ids, positions);
    const int64_t n = ids.numel();
    const auto ce = kernels::cross_entropy(logits.view({n, logits.size(2)}),
                                           targets.contiguous().view({n}), nullptr, nullptr, 1.f);
    sum += ce.loss_sum;
    count += ce.count;
  }
  return {sum, count};
}

void write_pipeline_svg(const std::string& path, const parallel::Pipeline& pipe,
                        const std::vector<std::vector<parallel::PipeSpan>>& spans) {
  if (spans.empty()) return;
  const auto& sh = pipe.shape();
  io::write_file_atomic(path, parallel::pipe_timeline_svg(
                                  pipe.actions(), spans, sh,
                                  std::string("Tessera pipeline, ") + parallel::pipe_schedule_name(pipe.schedule()) +
                                      ", pp " + std::to_string(sh.pp) + ", m " + std::to_string(sh.micro_batches)));
}

std::unique_ptr<parallel::CommCp> make_cp(parallel::DeviceMesh& mesh, model::Model& m, const std::string& method) {
  if (mesh.size(parallel::Axis::kCp) == 1) return nullptr;
  auto cp = std::make_unique<parallel::CommCp>(mesh.group(parallel::Axis::kCp));
  m.set_cp_comm(cp.get(), model::parse_cp_method(method, "[parallel] cp_method"));
  return cp;
}

std::unique_ptr<parallel::CommEp> make_ep(parallel::DeviceMesh& mesh, model::Model& m) {
  if (m.tp_shard().ep_size == 1) return nullptr;
  auto ep = std::make_unique<parallel::CommEp>(mesh.group(parallel::Axis::kEp));
  m.set_ep_comm(ep.get());
  return ep;
}

void take_cp_metrics(nlohmann::json& rec, parallel::CommCp& cp, const std::string& method) {
  rec["cp_method"] = method;
  rec["cp_comm_bytes"] = cp.bytes_sent;
  rec["cp_attention_s"] = cp.attention_s;
  rec["cp_wait_s"] = cp.wait_s;  // the transfers' time not hidden behind attention
  cp.bytes_sent = 0;
  cp.attention_s = cp.wait_s = 0;
}

void take_tp_metrics(nlohmann::json& rec, parallel::CommTp& tp) {
  const auto& t = tp.traffic();
  rec["tp_collectives"] = t.collectives();
  rec["tp_comm_bytes"] = t.bytes();
  rec["tp_comm_s"] = t.seconds;
  tp.reset_traffic();
}

}  // namespace tessera::train
