// Tensor-parallel serving (docs/parallelism.md, "Tensor-parallel inference"): the engine
// (scheduler, block manager, prefix cache, sampler, tokenizer) runs on tp rank 0. Each
// step it broadcasts the step's flattened batch (token ids, positions, block tables, the
// copy-on-write copies, the rows whose logits are wanted) to the group, and every rank runs
// its shard of the forward over its own paged KV cache. A rank's cache holds its kv heads
// only, under the block ids rank 0's block manager hands out, so the cache is split by kv
// heads and costs each rank 1/tp of the memory. The vocab-parallel head gathers the logits
// on every rank; rank 0 samples.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/comm/communicator.h"
#include "tessera/infer/kv_pool.h"
#include "tessera/kernels/paged_attention.h"
#include "tessera/model/model.h"
#include "tessera/model/quantize.h"
#include "tessera/tensor/tensor.h"

namespace tessera::infer {

// One engine step's forward, as every tp rank runs it.
struct StepPlan {
  std::vector<std::pair<int32_t, int32_t>> copies;  // copy-on-write block copies, applied first
  Tensor ids, positions;                            // (N) i32
  std::vector<kernels::PagedSequence> seqs;         // block_table: the engine's, or `tables`
  std::vector<std::vector<int32_t>> tables;         // a worker's copy of the block tables
  std::vector<int64_t> rows;                        // rows whose logits are returned
  bool batch_invariant = false;
  std::vector<int32_t> adapters;  // (N) LoRA bank index per row (-1: base); empty: none (tp 1 only)
  // Attention sinks: window shifts (kernels/kv_shift.h) applied after the copies, before the
  // forward, each with its own copy of the request's block table (tp 1 only).
  struct Shift {
    std::vector<int32_t> table;
    int64_t sinks = 0, length = 0, delta = 0;
  };
  std::vector<Shift> shifts;
};

// Applies the copies and the window shifts, then the model's forward over the paged cache: logits (rows, V);
// hidden (optional): every token's final hidden state (N, H).
Tensor run_step(const model::Model& m, KvPool& pool, const StepPlan& plan, Tensor* hidden = nullptr);

// The engine's side of a tp group (rank 0) and the workers' (ranks > 0). Rank 0 must end
// every group it started with stop() (the destructor does it), or the workers wait on.
class TpGroup {
 public:
  // `comm`: the tp group, the same communicator the model's TpComm uses. The watchdog is
  // turned off on it: a server's workers wait for requests as long as it is idle.
  explicit TpGroup(comm::Communicator& comm);
  ~TpGroup();
  TpGroup(const TpGroup&) = delete;
  TpGroup& operator=(const TpGroup&) = delete;
  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }

  // Rank 0.
  // Workers create their caches.
  void send_pool(int64_t num_blocks, int64_t block_size, kernels::KvCacheDtype dtype);
  void send_step(const StepPlan& plan);
  void stop();  // workers return from run_worker (once; later calls do nothing)

  // Ranks > 0: creates the cache rank 0 announces, runs each step it sends with `shard`
  // (this rank's shard, its TpComm over the same group) until rank 0 stops. Returns the
  // steps run.
  int64_t run_worker(const model::Model& shard);

 private:
  comm::Communicator& comm_;
  bool stopped_ = false;
};

// Runs `lead` on tp rank 0 with its shard of the model in `dir` (loaded block by block in
// `dtype`) and the group, while ranks 1..tp-1 serve as workers until it returns: ranks as
// the processes of mpirun (its world must be tp ranks) or, outside mpirun, as tp threads
// of this process. tp == 1 runs lead on the whole model with no group. Returns lead's value.
// `quantization` (a scheme, "" for none) quantizes the whole model on load (tp 1 only).
// ep > 1 (a mixture-of-experts model; tp must be 1): the experts are split over ep ranks
// (each loads only its own), the rest replicated; every rank runs each step over its own
// whole KV cache, the MoE layers exchanging tokens over the group (model::
// moe_forward_replicated). The world is then ep ranks.
int run_tensor_parallel(int tp, const std::string& dir, DType dtype,
                        const std::function<int(const model::Model&, TpGroup*)>& lead,
                        const model::LoadQuantization& quantization = {}, int ep = 1);

}  // namespace tessera::infer
