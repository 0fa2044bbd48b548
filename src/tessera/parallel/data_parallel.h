// Data parallelism for training: DDP (gradient buckets all-reduced asynchronously while
// backward runs) and ZeRO stages 1-3 with optional CPU offload, applied from outside to a
// single-device Model through its TrainHooks. The optimizer (train/) updates this rank's
// shard through pieces(); see docs/distributed.md.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/comm/communicator.h"
#include "tessera/kernels/optimizer_math.h"
#include "tessera/model/model.h"
#include "tessera/tensor/tensor.h"

namespace tessera::parallel {

struct DataParallelConfig {
  int zero_stage = 0;                     // 0 DDP, 1 optimizer state, 2 + gradients, 3 + parameters
  int64_t bucket_bytes = int64_t{25} << 20;  // gradient bucket size (stages 0-2)
  bool offload = false;   // fp32 master weights and optimizer state in host memory (CPU Adam)
  bool prefetch = true;   // stage 3: gather the next unit while the current one computes
  // Precision of the values the model computes with: f32, or bf16 / f16 (then fp32 master
  // weights are kept beside them and the model's weights hold the rounded values).
  DType compute_dtype = DType::kF32;
  // bf16: native or emulated (model::choose_bf16_mode decides from this and the CPU).
  model::Bf16Request bf16_request = model::Bf16Request::kAuto;
  comm::Algorithm algorithm = comm::Algorithm::kAuto;
  // Expert parallelism (the model is an expert shard, TpShard::ep_size > 1): the ranks of
  // the group that hold this rank's experts (the dp axis; the group itself is dp x ep). The
  // experts' gradients, summed over the ep ranks' tokens by the MoE backward, are reduced
  // and sharded over these ranks only; everything else over the whole group.
  comm::Communicator* expert_comm = nullptr;
  // Native bf16: the model also keeps its matmul weights packed in oneDNN's layout, which
  // the optimizer's pass writes (model::Model::set_packed_weights; stages 0-2 without
  // offload). The trainer sets it from kernels::packed_weights_enabled().
  bool packed_weights = false;
};

// A piece of one trainable tensor that this rank updates: the whole tensor (stage 0), or
// the part of it inside this rank's shard.
struct ShardPiece {
  std::string name;      // Hugging Face tensor name
  // The name its training state is saved under: `name`, or under tensor parallelism the
  // name of this tp rank's block of it (tp_piece_key).
  std::string key;
  int64_t offset = 0;    // first element of the piece inside the tensor (tp: the block) (row-major)
  Shape tensor_shape;    // the whole tensor's shape (tp: this rank's block of it)
  // Under tensor parallelism, where that block sits in the whole Hugging Face tensor
  // (offset per dim) and the whole tensor's shape; at tp 1 zeros and tensor_shape.
  std::vector<int64_t> block_offset;
  Shape full_shape;
  Tensor master;         // fp32 values the optimizer updates; tensor_shape when whole, else 1-D
  Tensor grad;           // same shape: the gradient averaged over ranks
  // Ranks of the group holding this same piece (whole pieces replicated without sharding;
  // 1 when sharded or under ep for experts): a sum over ranks counts it 1/copies each.
  int64_t copies = 1;
  bool primary = true;   // this rank is the first of those copies (it saves the piece)
  bool expert = false;   // an expert's tensor of an expert-parallel model
  bool whole() const { return master.numel() == shape_numel(tensor_shape); }
};

// Bytes this rank holds, by what they are for (persistent buffers; the optimizer's
// moments are the trainer's to add).
struct MemoryUse {
  int64_t params = 0;         // model weights as computed with (full, or the own shard in stage 3)
  int64_t grads = 0;          // gradient buffers (full in stages 0-1, own shard in 2-3)
  int64_t master = 0;         // separate fp32 master weights (16-bit compute or offload)
  int64_t offloaded = 0;      // the part of the above kept in host memory (offload)
  int64_t gathered_peak = 0;  // stage 3: most bytes of gathered units held at once
};

// The sum of one double per rank, the same on every rank (the exact bits gathered and
// added in rank order; collectives have no f64). Collective over `comm`.
double exact_sum(comm::Communicator& comm, double local);
std::vector<double> exact_sums(comm::Communicator& comm, const std::vector<double>& local);  // element-wise

class DataParallel final : public model::TrainHooks {
 public:
  // Broadcasts rank 0's weights, lays out the flat buffers, keeps this rank's shard and
  // installs itself as the model's TrainHooks (and sets the model's compute precision).
  DataParallel(model::Model& model, comm::Communicator& comm, DataParallelConfig config);
  ~DataParallel() override;  // uninstalls the hooks
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  const DataParallelConfig& config() const { return config_; }
  comm::Communicator& comm() { return comm_; }
  const model::Model& model() const { return model_; }
  int rank() const { return comm_.rank(); }
  int world_size() const { return comm_.size(); }

  // The step: start_step(); per micro-batch set_sync(last) then model.forward_backward(
  // ..., grads(), ...); finish_gradients(); the optimizer on pieces(); publish_params().
  model::Params& grads() { return grads_; }
  // Zeroes the gradient buffers; with first_micro_batch_assigns (the step's first
  // forward_backward runs with GradWrite::kAssign, which writes every gradient whole)
  // the replicated buffer is left as it is: that pass would only overwrite the zeros.
  void start_step(bool first_micro_batch_assigns = false);
  void set_sync(bool sync);     // stages 0-1: reduce only in the last micro-batch
  void finish_gradients();      // waits for every reduction; pieces() grads are final
  std::vector<ShardPiece>& pieces() { return pieces_; }
  const std::vector<ShardPiece>& pieces() const { return pieces_; }
  // True when pieces() cover only this rank's part (a sum over them is partial).
  bool sharded() const { return (config_.zero_stage > 0 && comm_.size() > 1) || ep_ > 1; }
  int64_t expert_parallel() const { return ep_; }  // ep (1: no expert parallelism)
  double sum_over_ranks(double local);  // all-reduce sum across the group
  std::vector<double> sum_over_ranks(const std::vector<double>& local);  // element-wise
  // After the optimizer changed pieces() masters: writes them (rounded to the compute
  // precision) into the model's weights and all-gathers (stages 1-2).
  // copies_written: the optimizer already wrote this rank's into piece_copies() (then only
  // the gathers and the compute copies of what they bring remain).
  void publish_params(bool copies_written = false);
  // Where the optimizer can write each piece's new value as it updates the master, in the
  // same pass (Optimizer StepOptions::copies), parallel to pieces(): the model's weight
  // rounded to the compute precision and, native bf16, the matmul's bf16 copy. Empty where
  // the weights are not a copy in this rank's memory (f32 compute: the master is the
  // weight; ZeRO-3; offload): publish_params() then does it all.
  std::vector<kernels::ParamCopies> piece_copies() const;
  bool optimizer_publishes() const;
  // Piece i's optimizer chunks start on whole groups of 16 rows of its storage tensor
  // (ParamRef::chunk_align, chunk_phase) when the model keeps it packed, so it is packed
  // from each chunk 16 rows at a time: (16 x the row length, the piece's first element in
  // the tensor); (1, 0) for the others.
  std::pair<int64_t, int64_t> piece_chunk_alignment(size_t i) const;
  // With piece_copies() in use: writes piece i's copies again after its master changed
  // outside the optimizer (the router-bias update). No-op otherwise.
  void publish_piece(size_t i);

  // Stage 3 holds only shards between steps: gather_all() makes every weight present
  // (evaluation, export) until release_all(). Both are collective; no-ops below stage 3.
  void gather_all();
  void release_all();

  MemoryUse memory() const;
  int64_t num_parameters() const { return total_; }

  // model::TrainHooks
  void acquire(int unit) override;
  void release(int unit) override;
  void prepare_grads(int unit) override;
  void grads_ready(int unit) override;

 private:
  struct Slot;     // one storage tensor of the model
  struct Unit;     // a TrainHooks unit: its slots, contiguous in the flat layout
  struct Segment;  // the unit of reduction and sharding: a bucket (stages 0-2) or a unit (3)
  struct Pending;  // a reduction in flight

  void build_layout();
  void broadcast_and_shard();
  void build_pieces();
  // Views into a unit's flat values: `flat` holds the flat range from flat_begin on.
  void bind_unit_weights(int unit, const Tensor& flat, int64_t flat_begin);
  // The same for some of its slots (kind 0: replicated, 1: experts, -1: all), and what
  // follows once they all are (the tied head, the compute copies).
  void bind_slots(int unit, const Tensor& flat, int64_t flat_begin, int kind);
  void bound(int unit);
  void drop_gathered(int unit);  // stage 3: unbinds a gathered unit and frees its buffers
  void unbind_unit_weights(int unit);
  void bind_segment_grads(Segment& s, const Tensor& flat);
  void launch_reduction(Segment& s);
  void complete(Pending& p);
  void poll_pending();
  void start_gather(int unit, bool async);
  void finish_gather(int unit);
  comm::Communicator& group_of(const Segment& s);  // the ranks it is reduced over
  const Slot& slot_at(int64_t flat) const;  // the slot holding a flat position
  // The bf16 compute copy of flat range [lo, hi) of slot s (undefined: s has none).
  Tensor compute_copy_range(const Slot& s, int64_t lo, int64_t hi) const;
  kernels::ParamCopies copies_of_piece(size_t i) const;
  void refresh_copies(int64_t lo, int64_t hi);  // compute copies of params_'s flat range

  model::Model& model_;
  comm::Communicator& comm_;
  DataParallelConfig config_;
  model::Params grads_;
  std::vector<Slot> slots_;
  std::vector<Unit> units_;        // indexed by TrainHooks unit id
  std::vector<Segment> segments_;  // in flat (gradient-ready) order
  std::vector<Pending> pending_;
  std::vector<ShardPiece> pieces_;
  std::vector<int64_t> piece_flat_;  // parallel to pieces_: each one's first flat position
  int64_t ep_ = 1;              // expert parallelism: comm_.size() / expert_comm's
  int64_t expert_begin_ = 0;    // the experts' slots fill the flat layout's tail from here
  int64_t total_ = 0;      // parameters (elements of the flat layout)
  int64_t own_total_ = 0;  // elements of this rank's shard
  bool sync_ = true;
  bool separate_master_ = false;
  bool backward_phase_ = false;  // stage 3 prefetch direction
  int64_t gathered_bytes_ = 0, gathered_peak_ = 0;
  int gather_all_depth_ = 0;

  Tensor params_;        // (total) stages 0-2: the model's weights live here
  Tensor params_shard_;  // (own_total) stage 3: this rank's part of every unit
  Tensor grads_flat_;    // (total) stages 0-1
  Tensor grads_shard_;   // (own_total) stages 2-3
  Tensor master_;        // (own_total) fp32 master when separate
  Tensor host_grads_;    // (own_total) offload: the gradients the CPU optimizer reads
};

}  // namespace tessera::parallel
