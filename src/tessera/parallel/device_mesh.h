// The ranks of a job laid out on named axes (Megatron's / torchtitan's device mesh): dp
// (data), pp (pipeline stages), tp (tensor), ep (expert: inside dp, the ep ranks of a
// replica hold different experts and see different data), cp (context: the cp ranks
// see the same sequences, each its share of their tokens).
// Rank order puts tp innermost, so a tensor-parallel group is consecutive ranks (one node
// under mpirun's default by-slot mapping), then cp, ep, dp, and pp outermost:
//   rank = (((pp_i * dp + dp_i) * ep + ep_i) * cp + cp_i) * tp + tp_i
// Each axis has its own sub-communicator: the ranks that differ only in that coordinate.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "tessera/comm/communicator.h"
#include "tessera/model/config.h"

namespace tessera::parallel {

enum class Axis { kPp = 0, kDp = 1, kEp = 2, kCp = 3, kTp = 4 };  // outermost to innermost
constexpr int kNumAxes = 5;
const char* axis_name(Axis a);

// Sizes per axis; 0 for dp means "the rest of the world" (world / (pp * ep * cp * tp)).
struct MeshShape {
  int64_t dp = 0, pp = 1, tp = 1, cp = 1, ep = 1;
  int64_t size(Axis a) const;
  // "dp2 x tp2" style, axes of size 1 left out ("1 rank" when all are 1).
  std::string describe() const;
};

// `shape` with dp resolved against `world`, checked: every size >= 1, the product equal to
// the world size. Throws tessera::Error with one
// line naming `source`, the axis and the reason ("run.toml: [parallel] tp = 3 times pp = 1
// does not divide the 4 ranks").
MeshShape resolve_mesh_shape(MeshShape shape, int64_t world, const std::string& source);

// The layout against the model and the batch, before any work starts: tp divides the
// attention heads and the intermediate size, kv heads divide tp or tp divides them (GQA
// heads are replicated when tp exceeds them, as vLLM does), pp <= layers, the
// micro-batches per step (grad_accum) are at least pp when pp > 1, and ep > 1 only for a
// mixture-of-experts model whose experts it divides. One line naming the axis.
void check_layout(const MeshShape& shape, const model::ModelConfig& model, int64_t micro_batches,
                  const std::string& source);

class DeviceMesh {
 public:
  // Collective over `world`: every rank calls it with the same (resolved) shape.
  DeviceMesh(comm::Communicator& world, const MeshShape& shape);

  const MeshShape& shape() const { return shape_; }
  int64_t size(Axis a) const { return shape_.size(a); }
  int coord(Axis a) const { return coords_[static_cast<int>(a)]; }
  // The group of ranks that differ from this one only along `a` (rank order = coordinate).
  comm::Communicator& group(Axis a) { return *groups_[static_cast<int>(a)]; }
  // The ranks that differ from this one only in dp, ep and cp: the data-parallel group
  // (gradients are averaged over it), rank (dp_i * ep + ep_i) * cp + cp_i; each dp x ep
  // coordinate takes its own rows of the batch, each cp rank its tokens of them. The dp
  // group itself when ep and cp are 1.
  comm::Communicator& data_group() { return data_ ? *data_ : group(Axis::kDp); }
  // The ranks that differ from this one only in dp and cp: under expert parallelism, those
  // holding the same experts (their gradients are reduced over it). The dp group at cp 1.
  comm::Communicator& expert_data_group() { return expert_data_ ? *expert_data_ : group(Axis::kDp); }
  comm::Communicator& world() { return world_; }

  // The world rank at the given coordinates (pp, dp, ep, cp, tp).
  static int rank_of(const MeshShape& shape, const std::array<int, kNumAxes>& coords);
  static std::array<int, kNumAxes> coords_of(const MeshShape& shape, int rank);

  // "rank 5/8: pp 1/2, dp 0/2, tp 1/2" (axes of size 1 left out).
  std::string describe() const;

 private:
  comm::Communicator& world_;
  MeshShape shape_;
  std::array<int, kNumAxes> coords_{};
  std::array<std::unique_ptr<comm::Communicator>, kNumAxes> groups_;
  std::unique_ptr<comm::Communicator> data_;         // ep or cp > 1
  std::unique_ptr<comm::Communicator> expert_data_;  // ep and cp > 1
};

}  // namespace tessera::parallel
