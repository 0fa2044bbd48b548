// The pipeline executor (pipeline_parallel.h).
#include "tessera/parallel/pipeline_parallel.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "tessera/base/error.h"
#include "tessera/base/trace.h"

namespace tessera::parallel {
namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One tag per (direction, micro-batch, receiving virtual stage): messages never need to
// arrive in order.
int message_tag(bool forward, int micro, int vstage, int num_virtual, int micro_batches) {
  return ((forward ? 0 : 1) * num_virtual + vstage) * micro_batches + micro;
}

// Completes the step's sends in the background. MPI moves a large message only while the
// sender is inside an MPI call (rendezvous), so a send left alone while its rank computes
// the next pass would reach the neighbour only after that pass: this thread tests the
// pending sends every 100 us (without spinning a core) until they are done.
class SendProgress {
 public:
  SendProgress() : thread_([this] { loop(); }) {}
  ~SendProgress() { finish(); }
  void add(comm::RequestPtr req, Tensor data) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back({std::move(req), std::move(data)});
    cv_.notify_one();
  }
  // Waits for every send; rethrows the first failure.
  void finish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      stop_ = true;
      cv_.notify_one();
    }
    thread_.join();
    if (error_) std::rethrow_exception(error_);
  }

 private:
  struct Item {
    comm::RequestPtr req;
    Tensor data;  // kept alive until sent
  };
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (pending_.empty()) {
        if (stop_) return;
        cv_.wait(lock, [this] { return stop_ || !pending_.empty(); });
        continue;
      }
      std::deque<Item> batch;
      batch.swap(pending_);
      lock.unlock();
      try {
        while (!batch.empty()) {
          for (auto it = batch.begin(); it != batch.end();)
            it = it->req->test() ? batch.erase(it) : it + 1;
          if (!batch.empty()) std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
      } catch (...) {
        lock.lock();
        if (!error_) error_ = std::current_exception();
        pending_.clear();
        stop_ = true;
        return;
      }
      lock.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> pending_;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace

Pipeline::Pipeline(const model::Model& model, comm::Communicator& pp, PipeSchedule schedule,
                   int micro_batches)
    : model_(model), pp_(pp), schedule_(schedule) {
  const model::PpStage& st = model.pp_stage();
  TESSERA_CHECK(st.size == pp.size() && st.rank == pp.rank(), "pipeline: the model holds stage ",
                st.rank, " of ", st.size, ", the pipeline group is rank ", pp.rank(), " of ",
                pp.size());
  shape_.pp = pp.size();
  shape_.micro_batches = micro_batches;
  shape_.virtual_stages = st.num_chunks();
  actions_ = pipe_schedule(schedule, shape_);
  TESSERA_CHECK(2 * shape_.pp * shape_.virtual_stages * micro_batches < (1 << 20),
                "pipeline: ", micro_batches, " micro-batches x ", shape_.pp * shape_.virtual_stages,
                " virtual stages is too many for the message tags");
}

void Pipeline::add_expert_loads(int chunk, const model::Model::LossResult& lr, PipelineStep& out) const {
  if (lr.expert_load.empty()) return;
  const model::ModelConfig& c = model_.config();
  if (out.expert_load.empty()) out.expert_load.assign(lr.expert_load.size(), 0.0);
  for (size_t e = 0; e < lr.expert_load.size(); ++e) out.expert_load[e] += lr.expert_load[e];
  out.dropped += lr.dropped;
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) moe_layers += c.layer_is_moe(l);
  if (out.layer_load.empty()) out.layer_load.assign(moe_layers, std::vector<double>(lr.expert_load.size(), 0.0));
  // The chunk's MoE layers, in order, at their places among the model's.
  const auto [l0, l1] = model_.pp_stage().layers(chunk, c.num_layers);
  size_t k = 0;
  int64_t index = 0;
  for (int64_t l = 0; l < l1; ++l) {
    if (!c.layer_is_moe(l)) continue;
    if (l >= l0 && k < lr.layer_load.size()) {
      auto& dst = out.layer_load[index];
      for (size_t e = 0; e < dst.size() && e < lr.layer_load[k].size(); ++e) dst[e] += lr.layer_load[k][e];
      ++k;
    }
    ++index;
  }
}

PipelineStep Pipeline::run(const std::vector<MicroBatch>& batches, model::Params& grads,
                           float grad_scale,
                           const std::function<void(int chunk, bool last)>& before_backward) {
  const int P = shape_.pp, M = shape_.micro_batches, VS = P * shape_.virtual_stages;
  const int r = pp_.rank();
  TESSERA_CHECK(static_cast<int>(batches.size()) == M, "pipeline: ", batches.size(),
                " micro-batches given, the schedule has ", M);
  const model::PpStage& st = model_.pp_stage();
  const auto& c = model_.config();
  PipelineStep out;
  SendProgress sent;
  auto send = [&](const Tensor& t, int vstage_to, bool forward, int micro) {
    Tensor data = t.contiguous();
    const int tag = message_tag(forward, micro, vstage_to, VS, M);
    sent.add(pp_.isend(data.raw_data(), static_cast<int64_t>(data.nbytes()), vstage_to % P, tag), data);
    out.sent_bytes += static_cast<int64_t>(data.nbytes());
    ++out.sent_messages;
  };
  // Rows of the residual stream this rank holds for a micro-batch.
  auto rows = [&](const MicroBatch& b) {
    const int64_t n = b.ids.numel();
    return model_.sequence_parallel() ? n / model_.tp_shard().size : n;
  };
  auto recv = [&](int vstage_from, bool forward, int micro, int vstage_to) {
    Tensor t = Tensor::empty({rows(batches[micro]), c.hidden_size}, DType::kF32);
    const int tag = message_tag(forward, micro, vstage_to, VS, M);
    const double t0 = now_seconds();
    pp_.recv(t.raw_data(), static_cast<int64_t>(t.nbytes()), vstage_from % P, tag);
    out.recv_wait_s += now_seconds() - t0;
    return t;
  };

  std::map<std::pair<int, int>, model::ChunkPass> passes;  // (micro, chunk) in flight
  int64_t held = 0;
  pp_.barrier();  // a common start for the timeline
  const double start = now_seconds();
  for (const PipeAction& a : actions_[r]) {
    const int vs = a.chunk * P + r;
    const MicroBatch& b = batches[a.micro];
    // A pass starts once its input has arrived: time blocked receiving is bubble.
    double t0 = 0;
    if (a.kind == PipeAction::kForward) {
      Tensor input;
      if (vs > 0) input = recv(vs - 1, true, a.micro, vs);
      t0 = now_seconds();
      base::TraceScope scope("pp_forward");
      model::ChunkPass& pass = passes[{a.micro, a.chunk}];
      const Tensor y = model_.forward_chunk(a.chunk, b.ids, input, pass, b.positions);
      held += pass.activation_bytes;
      out.activation_bytes = std::max(out.activation_bytes, held);
      out.max_in_flight = std::max(out.max_in_flight, static_cast<int>(passes.size()));
      if (vs + 1 < VS) send(y, vs + 1, true, a.micro);
    } else {
      const auto it = passes.find({a.micro, a.chunk});
      TESSERA_CHECK(it != passes.end(), "pipeline: backward of micro-batch ", a.micro,
                    " before its forward");
      Tensor grad_out;
      if (vs + 1 < VS) grad_out = recv(vs + 1, false, a.micro, vs);
      t0 = now_seconds();
      base::TraceScope scope("pp_backward");
      if (before_backward) before_backward(a.chunk, a.micro + 1 == M);
      model::Model::LossResult lr;
      held -= it->second.activation_bytes;
      const Tensor dx = model_.backward_chunk(
          it->second, b.targets, grad_out, grads, grad_scale,
          a.micro == 0 ? model::Model::GradWrite::kAssign : model::Model::GradWrite::kAccumulate,
          &lr);
      passes.erase(it);
      if (st.last_chunk(a.chunk)) {
        out.loss_sum += lr.loss;
        out.count += lr.count;
      }
      add_expert_loads(a.chunk, lr, out);
      if (vs > 0) send(dx, vs - 1, false, a.micro);
    }
    out.spans.push_back({t0 - start, now_seconds() - start});
  }
  sent.finish();
  out.seconds = now_seconds() - start;
  return out;
}

std::pair<double, int64_t> Pipeline::evaluate(const std::vector<MicroBatch>& batches) {
  const int P = shape_.pp, VS = P * shape_.virtual_stages;
  const int r = pp_.rank();
  const int B = static_cast<int>(batches.size());
  const model::PpStage& st = model_.pp_stage();
  double sum = 0;
  int64_t count = 0;
  std::vector<std::pair<comm::RequestPtr, Tensor>> sent;
  for (int i = 0; i < B; ++i) {
    const MicroBatch& b = batches[i];
    const int64_t rows = model_.sequence_parallel() ? b.ids.numel() / model_.tp_shard().size
                                                    : b.ids.numel();
    for (int chunk = 0; chunk < st.num_chunks(); ++chunk) {
      const int vs = chunk * P + r;
      Tensor input;
      const int tag = message_tag(true, i % (1 << 10), vs, VS, 1 << 10);  // evaluation's own tags
      if (vs > 0) {
        input = Tensor::empty({rows, model_.config().hidden_size}, DType::kF32);
        pp_.recv(input.raw_data(), static_cast<int64_t>(input.nbytes()), (vs - 1) % P, tag + (1 << 19));
      }
      model::ChunkPass pass;
      Tensor y = model_.forward_chunk(chunk, b.ids, input, pass, b.positions);
      if (vs + 1 < VS) {
        y = y.contiguous();
        const int next_tag = message_tag(true, i % (1 << 10), vs + 1, VS, 1 << 10);
        sent.emplace_back(pp_.isend(y.raw_data(), static_cast<int64_t>(y.nbytes()), (vs + 1) % P,
                                    next_tag + (1 << 19)),
                          y);
      } else {
        const auto lr = model_.loss_chunk(pass, b.targets);
        sum += lr.loss;
        count += lr.count;
      }
    }
  }
  for (auto& [req, t] : sent) req->wait();
  return {sum, count};
}

std::vector<std::pair<std::string, Tensor>> gather_stage_tensors(
    const model::ModelConfig& config, comm::Communicator& pp, bool participate,
    std::vector<std::pair<std::string, Tensor>> mine, int virtual_stages,
    const std::vector<int64_t>& layers) {
  if (!participate) return {};
  const int P = pp.size(), r = pp.rank();
  constexpr int kTag = (1 << 19) - 1;
  // The (name, shape) list stage s holds, in one order both ends compute.
  auto listing = [&](int s) {
    const model::PpStage st = model::pipeline_stage(config, s, P, virtual_stages, layers);
    const auto layout = model::Params::allocate(config, DType::kF32,
                                                model::local_dims(config, model::TpShard{}), false, st);
    std::vector<std::pair<std::string, Shape>> out;
    for (const auto& piece : layout.pieces(config, model::TpShard{}))
      // A tied table is saved once, as the embedding (the last stage's lm_head is its copy).
      if (!(config.tie_word_embeddings && piece.name == "lm_head.weight"))
        out.emplace_back(piece.name, piece.full);
    return out;
  };
  if (r != 0) {
    std::map<std::string, Tensor> by_name(mine.begin(), mine.end());
    for (const auto& [name, shape] : listing(r)) {
      const auto it = by_name.find(name);
      TESSERA_CHECK(it != by_name.end() && it->second.shape() == shape, "pipeline: stage ", r,
                    " lacks tensor '", name, "'");
      const Tensor t = it->second.to(DType::kF32).contiguous();
      pp.send(t.raw_data(), static_cast<int64_t>(t.nbytes()), 0, kTag);
    }
    return {};
  }
  for (int s = 1; s < P; ++s)
    for (const auto& [name, shape] : listing(s)) {
      Tensor t = Tensor::empty(shape, DType::kF32);
      pp.recv(t.raw_data(), static_cast<int64_t>(t.nbytes()), s, kTag);
      mine.emplace_back(name, std::move(t));
    }
  return mine;
}

}  // namespace tessera::parallel
