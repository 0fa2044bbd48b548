// Streaming next-token NLL through Scheduler + BlockManager + KvPool + run_step (stream_eval.h).
#include "tessera/infer/stream_eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "tessera/base/error.h"
#include "tessera/infer/block_manager.h"
#include "tessera/infer/scheduler.h"
#include "tessera/infer/tp_serving.h"
#include "tessera/kernels/cross_entropy.h"
#include "tessera/model/attention_sinks.h"

namespace tessera::infer {

StreamEvalResult evaluate_stream(const model::Model& m, const std::vector<int32_t>& tokens,
                                 const StreamEvalOptions& o) {
  const auto& c = m.config();
  const int64_t n = static_cast<int64_t>(tokens.size());
  TESSERA_CHECK(n >= 2, "stream evaluation needs at least two tokens, got ", n);
  TESSERA_CHECK(o.chunk >= 1 && o.block_size >= 1, "stream evaluation: chunk and block size must be >= 1");
  const bool streaming = o.window > 0;
  SchedulerConfig sc;
  sc.max_num_batched_tokens = o.chunk;
  sc.max_num_seqs = 1;
  sc.max_model_len = streaming ? o.attention_sinks + o.window : n;
  if (streaming) {
    const std::string why = model::attention_sinks_unsupported(c, sc.max_model_len);
    TESSERA_CHECK(why.empty(), "--attention-sinks: ", why);
    sc.attention_sinks = o.attention_sinks;
    sc.stream_window = o.window;
  }
  BlockManager blocks(BlockManagerConfig{Scheduler::blocks_per_request(sc, o.block_size), o.block_size, false});
  Scheduler sched(sc, blocks);
  KvPool pool = KvPool::create(c, blocks.num_blocks(), o.block_size, 0, o.kv_cache_dtype);
  SchedRequest req;
  req.id = 1;
  req.tokens = tokens;
  req.num_prompt_tokens = n;
  sched.add_request(std::move(req));

  StreamEvalResult res;
  res.nll.assign(static_cast<size_t>(n - 1), 0.0);
  const int64_t V = c.vocab_size;
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    const SchedulerOutput so = sched.schedule();
    if (so.requests.empty()) break;
    const ScheduledRequest& sr = so.requests.front();
    StepPlan plan;
    plan.copies.assign(so.copies.begin(), so.copies.end());
    for (const KvShift& k : so.shifts) plan.shifts.push_back({blocks.block_table(k.id), k.sinks, k.length, k.delta});
    res.shifts += static_cast<int64_t>(so.shifts.size());
    plan.ids = Tensor::empty({sr.num_tokens}, DType::kI32);
    plan.positions = Tensor::empty({sr.num_tokens}, DType::kI32);
    for (int64_t i = 0; i < sr.num_tokens; ++i) {
      plan.ids.data<int32_t>()[i] = tokens[static_cast<size_t>(sr.start + i)];
      plan.positions.data<int32_t>()[i] = static_cast<int32_t>(sr.start - sr.shift + i);
      plan.rows.push_back(i);
    }
    kernels::PagedSequence ps;
    ps.q_len = sr.num_tokens;
    ps.context_len = sr.start + sr.num_tokens - sr.shift;
    const auto& table = blocks.block_table(sr.id);
    plan.tables.emplace_back(table.begin(), table.begin() + (ps.context_len + o.block_size - 1) / o.block_size);
    ps.block_table = plan.tables.back().data();
    plan.seqs.push_back(ps);
    const Tensor logits = run_step(m, pool, plan);
    for (int64_t i = 0; i < sr.num_tokens; ++i) {
      const int64_t t = sr.start + i;
      if (t + 1 >= n) break;
      const float* x = logits.data<float>() + i * V;
      res.nll[static_cast<size_t>(t)] = kernels::log_sum_exp(x, V) - x[tokens[static_cast<size_t>(t + 1)]];
    }
    res.max_blocks = std::max(res.max_blocks, blocks.num_blocks() - blocks.num_free_blocks());
    sched.update(so, {});
    sched.check_invariants();
  }
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  TESSERA_CHECK(sched.find(1) && sched.find(1)->num_computed_tokens == n, "stream evaluation stopped early");
  return res;
}

}  // namespace tessera::infer
