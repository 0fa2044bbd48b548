// The run's layout for the trainer (internal to train/): the [parallel] mesh resolved and
// checked against the model and the batch before any weight exists, this rank's tp shard
// and pipeline stage, the groups the model needs (tp collectives, the tied-embedding pair),
// and a pipeline-parallel step with its metrics and timeline.
#pragma once
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "tessera/comm/communicator.h"
#include "tessera/model/model.h"
#include "tessera/parallel/data_parallel.h"
#include "tessera/parallel/device_mesh.h"
#include "tessera/parallel/context_parallel.h"
#include "tessera/parallel/expert_parallel.h"
#include "tessera/parallel/pipeline_parallel.h"
#include "tessera/parallel/tensor_parallel.h"
#include "tessera/train/config.h"
#include "tessera/train/trainer_setup.h"

namespace tessera::train {

// The [parallel] mesh resolved against the world (one-line errors naming the key).
parallel::MeshShape run_mesh_shape(const TrainConfig& c, int64_t world);
// The layout against the model's configuration and the batch; this rank's tp shard.
// (With the ep axis: its expert shard, TpShard::ep_rank / ep_size.)
model::TpShard checked_tp_shard(const TrainConfig& c, const parallel::MeshShape& s,
                                const model::ModelConfig& m, int rank);
// This rank's pipeline stage (the whole model at pp 1), checked with the schedule.
model::PpStage checked_pp_stage(const TrainConfig& c, const parallel::MeshShape& s,
                                const model::ModelConfig& m, int rank);
// The mesh (collective over `comm`); prints this rank's coordinates when there are several.
std::unique_ptr<parallel::DeviceMesh> make_mesh(const parallel::MeshShape& s, comm::Communicator& comm);
// The model's tp collectives over the mesh's tp group (nullptr at tp 1), sequence
// parallelism and its overlap when asked for.
std::unique_ptr<parallel::CommTp> make_tp(parallel::DeviceMesh& mesh, model::Model& m,
                                          bool sequence_parallel, bool sp_overlap);
// The two ends of each pipeline (same dp and tp coordinates, pp 0 and pp - 1) when the
// model ties its embeddings to lm_head under pp > 1; nullptr elsewhere. Collective over
// the world (a split).
std::unique_ptr<comm::Communicator> make_embed_group(const parallel::MeshShape& s,
                                                     const model::ModelConfig& m,
                                                     comm::Communicator& world);

// This rank's tensor-parallel traffic since the last call (the step, evaluation included)
// into the step's metrics record; the count starts again.
void take_tp_metrics(nlohmann::json& rec, parallel::CommTp& tp);
// The model's expert exchange over the mesh's ep group (nullptr at ep 1).
std::unique_ptr<parallel::CommEp> make_ep(parallel::DeviceMesh& mesh, model::Model& m);
// Context parallelism's step figures into a metrics record (and reset): bytes sent,
// seconds of attention, seconds waiting for transfers.
void take_cp_metrics(nlohmann::json& rec, parallel::CommCp& cp, const std::string& method);
// The model's context-parallel attention over the mesh's cp group (nullptr at cp 1).
std::unique_ptr<parallel::CommCp> make_cp(parallel::DeviceMesh& mesh, model::Model& m, const std::string& method);

// One step's micro-batches through the pipeline: every stage draws the same batches (the
// data order is deterministic), runs the schedule, the replicas reduce, and a tied table's
// two gradients are summed over `embed_group`. `last` receives the step's record.
GradientPass run_pipeline_step(const model::Model& m, parallel::DataParallel& dp,
                               parallel::Pipeline& pipe, comm::Communicator* embed_group,
                               int64_t accum, float scale,
                               const std::function<model::TokenBatch(int64_t)>& batch,
                               parallel::PipelineStep& last);
// Every pp rank's pass spans of `last` (collective over the pipeline group).
std::vector<std::vector<parallel::PipeSpan>> gather_pipeline_spans(const parallel::PipelineStep& last,
                                                                   comm::Communicator& pp);
// This rank's pipeline traffic and the step's bubble (over every stage) beside the
// formula's, and each stage's busy seconds, into a metrics record.
void pipeline_metrics(nlohmann::json& rec, const parallel::Pipeline& pipe,
                      const parallel::PipelineStep& last,
                      const std::vector<std::vector<parallel::PipeSpan>>& spans);
// (sum of token losses, tokens counted) over the batches: the whole model's forward, or
// forward only through the pipeline's stages (at the last stage; 0, 0 elsewhere).
std::pair<double, int64_t> eval_loss_sums(const model::Model& m, parallel::Pipeline* pipe,
                                          const std::vector<model::TokenBatch>& batches);

// The timeline of `spans` as an SVG at `path` (nothing when there are none).
void write_pipeline_svg(const std::string& path, const parallel::Pipeline& pipe,
                        const std::vector<std::vector<parallel::PipeSpan>>& spans);

}  // namespace tessera::train
