// How a model's tensors are laid out on one rank: the whole model, or one tensor-parallel
// shard (Megatron-LM). The block's linears are listed once with their parallel style, and
// everything that splits or joins them (allocation, Hugging Face loading, checkpoints,
// forward and backward) reads that table.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tessera/model/config.h"
#include "tessera/tensor/tensor.h"

namespace tessera::model {

// Where a linear sits under tensor parallelism. Column-parallel linears split their output
// features (q, k, v by heads; gate and up by the MLP's intermediate features): each rank
// computes its slice, nothing is reduced. Row-parallel linears split their input features
// (o, down) and leave partial sums, all-reduced over the tp group right after them (their
// bias is added once, after the reduction).
enum class LinearStyle { kReplicated, kColumn, kRow };

struct BlockLinear {
  const char* name;   // "qkv", "o", "up", "down" (Params::unit_tensors names)
  int which;          // Model::compute_linear index
  LinearStyle style;  // under tp > 1
};
// The block's linears in the order forward runs them.
inline constexpr std::array<BlockLinear, 4> kBlockLinears{{{"qkv", 0, LinearStyle::kColumn},
                                                           {"o", 1, LinearStyle::kRow},
                                                           {"up", 2, LinearStyle::kColumn},
                                                           {"down", 3, LinearStyle::kRow}}};

// This rank's place in the tensor-parallel group and, for mixture-of-experts layers, in
// the expert-parallel group (ep_rank of ep_size holds experts [ep_rank E / ep_size,
// (ep_rank + 1) E / ep_size) of every layer; everything else is replicated over it).
struct TpShard {
  int rank = 0;
  int size = 1;
  int ep_rank = 0;
  int ep_size = 1;
  bool whole() const { return size == 1 && ep_size == 1; }  // every tensor whole here
};

// This rank's place in the pipeline (pipeline parallelism): the model's layers are cut into
// size x virtual_stages consecutive blocks, virtual stage v = [bounds[v], bounds[v + 1]).
// Rank r runs virtual stages r, r + size, r + 2 size, ... as its chunks 0, 1, ... (the
// interleaved 1F1B schedule of Megatron-LM; one chunk per rank otherwise). Virtual stage 0
// also holds the embeddings, the last one the final norm and lm_head. The default (empty
// bounds) is the whole model.
struct PpStage {
  int rank = 0, size = 1, virtual_stages = 1;
  std::vector<int64_t> bounds;  // size * virtual_stages + 1 layer indices, 0 first, L last

  bool whole() const { return bounds.empty(); }
  int num_chunks() const { return whole() ? 1 : virtual_stages; }
  int virtual_stage(int chunk) const { return chunk * size + rank; }
  int num_virtual() const { return size * virtual_stages; }
  // [begin, end) of chunk `chunk`; the whole model has one chunk of every layer.
  std::pair<int64_t, int64_t> layers(int chunk, int64_t num_layers) const;
  bool holds_layer(int64_t layer) const;
  int chunk_of_layer(int64_t layer) const;  // -1 when this rank does not hold it
  bool first_chunk(int chunk) const { return virtual_stage(chunk) == 0; }
  bool last_chunk(int chunk) const { return whole() || virtual_stage(chunk) == num_virtual() - 1; }
  bool holds_embed() const { return rank == 0; }
  bool holds_head() const { return whole() || rank == size - 1; }
  // "layers 0-5 (+ embeddings)" or "layers 0-2, 6-8 (+ head)".
  std::string describe() const;
};

// Stage `rank` of `size` with `virtual_stages` chunks per rank. `given` (optional) lists the
// layers per virtual stage (size x virtual_stages numbers summing to the layers); otherwise
// the cut balances parameters (the embeddings count on the first virtual stage, the final
// norm and an untied lm_head on the last), every virtual stage getting at least one layer.
// Throws a one-line error naming what does not fit.
PpStage pipeline_stage(const ModelConfig& c, int rank, int size, int virtual_stages = 1,
                       const std::vector<int64_t>& given = {});

// The sizes this rank computes with. The vocabulary (embedding rows and lm_head rows,
// vocab-parallel) is split in ceil(V / tp) blocks, the last one shorter.
struct LocalDims {
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  // GQA with tp above the kv heads (as vLLM does): each rank holds one kv head, the one
  // its query heads read (kv_index), replicated on kv_replicas = tp / kv heads ranks.
  // Otherwise kv heads are split: kv_replicas 1, kv_index the tp rank.
  int64_t kv_replicas = 1, kv_index = 0;
  int64_t q = 0, kv = 0, qkv = 0;  // heads * head_dim, kv_heads * head_dim, q + 2 kv
  int64_t ffn = 0;                 // intermediate features
  int64_t vocab = 0, vocab_begin = 0;
  // Mixture-of-experts layers: the experts this rank holds, [expert_begin, + experts).
  int64_t experts = 0, expert_begin = 0;
};
// Throws a one-line error naming the size tp does not divide (kv heads: neither divides
// the other).
LocalDims local_dims(const ModelConfig& c, TpShard shard);

// The collectives a tensor-parallel model needs, over its tp group. The model layer knows
// no communicator: parallel/ implements this over comm::Communicator.
class TpComm {
 public:
  virtual ~TpComm() = default;
  virtual void all_reduce_sum(Tensor& t) = 0;  // f32, contiguous, in place
  virtual void all_reduce_max(Tensor& t) = 0;
  // in (N, cols_r) on each rank -> out (N, sum of cols_r), rank blocks side by side.
  virtual void all_gather_columns(const Tensor& in, Tensor& out) = 0;
  // Sum over the ranks that hold the same replicated kv head (LocalDims::kv_replicas > 1).
  virtual void all_reduce_kv_replicas(Tensor& t) = 0;
  // Sequence parallelism: in (n, C) on each rank -> out (tp n, C), rank blocks stacked;
  // and in (tp n, C) summed over the group -> out (n, C), this rank's block of rows.
  virtual void all_gather_rows(const Tensor& in, Tensor& out) = 0;
  virtual void reduce_scatter_rows(const Tensor& in, Tensor& out) = 0;
  // all_gather_rows in the background (communication/compute overlap): `in` unchanged and
  // `out` untouched until all_gather_rows_wait() returns. One at a time. By default the
  // gather runs at once and the wait does nothing.
  virtual void all_gather_rows_start(const Tensor& in, Tensor& out) { all_gather_rows(in, out); }
  virtual void all_gather_rows_wait() {}
};

}  // namespace tessera::model
