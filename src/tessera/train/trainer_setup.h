// Pieces of the trainer that are not the step loop: building the model from the
// config, the parameter list the optimizer sees, the loss-spike detector, and the
// trainer state a checkpoint carries. Internal to train/.
#pragma once
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/model/model.h"
#include "tessera/parallel/data_parallel.h"
#include "tessera/train/config.h"
#include "tessera/train/data_loader.h"
#include "tessera/train/optimizer.h"
#include "tessera/train/token_shard.h"

namespace tessera::train {

// data.dir's meta.json, checked against data.format (token shards or a chat directory).
DataMeta read_run_data_meta(const TrainConfig& c);
// One trace per rank: "run.json" -> "run.rank1.json" when there are several.
std::string trace_path(const std::string& path, int rank, int world);
// Bytes of the tensors a Params holds (undefined ones, as a frozen base's, not counted).
int64_t params_bytes(const model::ModelConfig& c, model::Params& p);
// Rows [r0, r1) of a batch (positions too when defined).
model::TokenBatch batch_rows(const model::TokenBatch& b, int64_t r0, int64_t r1);
// Context parallelism (cp != nullptr): this rank's tokens of the batch's rows; packed rows
// are an error (documents would straddle the ranks' shares).
model::TokenBatch cp_tokens(const model::TokenBatch& b, model::CpComm* cp, model::CpMethod method);
// "train: chat data ... packed into ... rows\n" for a loader of packed rows, else "".
std::string describe_packing(const DataLoader& loader);

// The configuration of the model a run starts from: init_from's config.json, an HF
// config.json, or a named shape with overrides; vocab_size defaults to the data's, and a
// new model's eos is the data's (-1: none) so generation stops where documents end.
// Nothing is allocated: the layout is checked against it before any weight exists.
model::ModelConfig build_model_config(const TrainConfig& c, int64_t data_vocab_size,
                                      int32_t data_eos_id);
// Its weights (f32 master weights): init_from's, or random from model.seed. Under tensor
// parallelism (shard.size > 1) only this rank's shard is kept: init_from is read block by
// block from the mmapped safetensors; a new model is drawn whole (the same weights as at
// tp 1) and cut. A pipeline stage keeps (and reads) only its layers.
model::Model build_model(const TrainConfig& c, const model::ModelConfig& config,
                         model::TpShard shard = {}, const model::PpStage& stage = {});
// Both at once, at tp 1.
model::Model build_model(const TrainConfig& c, int64_t data_vocab_size, int32_t data_eos_id);

// Every distinct parameter with its gradient, decay / muon flags set for 2-D hidden
// matmul weights (not embeddings, positions or the output head; the head is decayed
// when untied but stays on AdamW, as Muon's description prescribes).
std::vector<ParamRef> make_param_refs(const model::Model& m, model::Params& grads);
// The optimizer flags of every Hugging Face tensor of m (weights must be present):
// name -> {decay, muon}, decided as make_param_refs does.
struct ParamFlags {
  bool decay = false, muon = false;
  // Under tensor parallelism: how many tp ranks hold this same block (tp for norms,
  // row-parallel biases and positions; tp / kv heads for replicated kv heads), so that it
  // counts once, not that many times, in the global gradient norm.
  int64_t tp_copies = 1;
  // A pipeline's last-stage copy of a tied embedding (lm_head.weight): its gradient is the
  // embedding's, counted once on stage 0, so it adds nothing to the global norm.
  bool tied_copy = false;
};
std::map<std::string, ParamFlags> param_flags(const model::Model& m);

// The data-parallel wrapper `tessera train` puts around every model (one process too):
// ZeRO stage, buckets, offload, and the compute precision with its bf16 mode.
parallel::DataParallelConfig dp_config(const TrainConfig& c);
// The optimizer's parameter list over dp.pieces() (this rank's shard), flagged as
// param_flags() says; Muon needs each rank's tensor-parallel block whole (an error names
// the split tensor), and orthogonalises the whole matrix over `tp_group` (nullptr at tp 1).
std::vector<ParamRef> dp_param_refs(const parallel::DataParallel& dp,
                                    const std::map<std::string, ParamFlags>& flags,
                                    const std::string& optimizer_name,
                                    comm::Communicator* tp_group = nullptr);

// The gradient half of a training step, as `tessera train` and `bench train` run it:
// dp.start_step(), `accum` micro-batches from batch(micro) (ids, targets), the first
// writing the gradients and the rest adding to them, scaled by scale / accum, with
// gradient traffic only in the last; then dp.finish_gradients().
struct GradientPass {
  double loss_sum = 0;           // of the micro-batches' mean losses (this rank)
  int64_t count = 0;             // targets counted (this rank)
  int64_t activation_bytes = 0;  // most saved for backward by one micro-batch
  std::vector<double> expert_load;  // MoE: slots per expert over the micro-batches (this rank)
  double aux_loss_sum = 0;          // MoE: of the micro-batches' balancing losses (this rank)
  std::vector<std::vector<double>> layer_load;  // MoE: per layer, slots per expert (this rank)
  int64_t dropped = 0;              // MoE: slots dropped over capacity (this rank)
  double mtp_loss_sum = 0, mtp_passes = 0;  // multi-token prediction: its mean losses, micro-batches
};
// Mixture of experts, into a step's metrics record: each expert's share of the routed slots
// (every layer, rank and micro-batch of the step: summed over dp's ranks, so every rank
// calls this), the busiest over the mean, and the mean balancing loss over `micro_batches`.
// The MTP module's loss into a step's record, averaged like the model's over dp's ranks.
void add_mtp_metrics(nlohmann::json& rec, const GradientPass& gp, parallel::DataParallel& dp);
// The [training] options the model itself carries: activation checkpointing, MoE capacity,
// the MTP loss weight (unset: 0.1 for a model with the module, when it runs whole).
void apply_training_options(const TrainConfig& c, model::Model& m);
// The update as `tessera train` and `bench train` run it, with refs from dp_param_refs:
// the clip coefficient (grad_clip) folded into the optimizer's pass and, where dp allows
// (piece_copies), the new weights written into the model in that same pass; then
// `between` (the router-bias update) and dp.publish_params() for the rest (the gathers of
// ZeRO 1-2, or the whole copy where the optimizer could not write it).
void update_weights(Optimizer& opt, parallel::DataParallel& dp, double lr_scale, float clip_coef,
                    const std::function<void()>& between = {});
// Auxiliary-loss-free balancing, after the optimizer step and before dp.publish_params():
// each MoE layer's selection bias (its master copy in dp.pieces()) moves by `rate`
// towards the mean load, b_e += rate x sign(mean - load_e), over the step's global batch
// (summed over dp's ranks: every rank calls this).
// (gp.layer_load lists the MoE layers in order, a multi-token prediction layer last.)
// Each bias it moves is republished (dp.publish_piece).
void update_router_bias(parallel::DataParallel& dp, const GradientPass& gp, double rate, const model::ModelConfig& c);
// [training] memory_limit_mb against this rank's bytes after its first step (the
// record's mem_*): every rank of `world` stops together with one line naming the parts
// when one is over (collective over `world`).
void check_memory_limit(const nlohmann::json& rec, double limit_mb, comm::Communicator& world,
                        const std::string& source);
void add_moe_metrics(nlohmann::json& rec, const GradientPass& gp, parallel::DataParallel& dp,
                     int64_t micro_batches);
GradientPass accumulate_gradients(model::Model& model, parallel::DataParallel& dp, int64_t accum,
                                  float scale,
                                  const std::function<model::TokenBatch(int64_t)>& batch);

// ("master." + ref name, master) of every ref whose master is not one of `in_model`'s
// tensors bit for bit (an unsharded f32 master is the model's weight: model.safetensors
// holds it already, and the loader reads it from there instead of a second copy).
std::vector<std::pair<std::string, Tensor>> master_tensors(
    const std::vector<ParamRef>& refs, const std::vector<std::pair<std::string, Tensor>>& in_model);
// What this rank's optimizer shard file holds: the master weights (as master_tensors) and
// optimizer state ("<kind>.<ref>", from `state`) of the pieces it is the first holder of
// (ParamRef i is pieces[i]; ep at stage 0 replicates the shared tensors over the whole
// group, the experts over the dp axis: each piece is written once).
std::vector<std::pair<std::string, Tensor>> shard_file_tensors(
    const std::vector<parallel::ShardPiece>& pieces, const std::vector<ParamRef>& refs,
    std::vector<std::pair<std::string, Tensor>> state, const std::vector<std::pair<std::string, Tensor>>& in_model);

// Moving mean and deviation of the last `window` losses; a loss above
// mean + sigma * std (after min_history losses) is a spike and is not added.
class SpikeDetector {
 public:
  explicit SpikeDetector(const SpikeGuardSection& s) : s_(s) {}
  bool is_spike(double loss) const;
  void add(double loss);
  nlohmann::json to_json() const;
  void load_json(const nlohmann::json& j);
  double mean() const;
  double stddev() const;

 private:
  SpikeGuardSection s_;
  std::deque<double> losses_;
};

// Half-open ranges of loader sequence counters whose data is skipped (rollback policy).
using SkipRanges = std::vector<std::pair<uint64_t, uint64_t>>;

// Text files copied next to a saved model: the tokenizer's json files when known.
std::vector<std::pair<std::string, std::string>> tokenizer_files(const std::string& dir);

// `tessera train --print-schedule`: the pipeline schedule the config implies (pp ranks,
// data.grad_accum micro-batches, the [parallel] pp_schedule and pp_virtual_stages) as one
// line of passes per rank, the layers of each stage, and the bubble a replay with
// backward = 2 x forward gives beside the formula (pp-1)/(v m+pp-1). Errors as the trainer's.
std::string pipeline_schedule_text(const TrainConfig& c);

}  // namespace tessera::train
