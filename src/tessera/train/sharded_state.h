// Master weights and optimizer state saved in pieces by the ranks of a data-parallel run
// and read back by any other layout (resharding on load). A tensor in a shard file is
// named "<kind>.<tensor>" (the whole tensor, any shape) or "<kind>.<tensor>@<offset>"
// (elements [offset, offset + numel) of the flattened tensor, 1-D).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/io/safetensors.h"
#include "tessera/model/config.h"
#include "tessera/parallel/data_parallel.h"
#include "tessera/train/grad_utils.h"
#include "tessera/tensor/tensor.h"

namespace tessera::train {

// "exp_avg.model.norm.weight" or "exp_avg.model.norm.weight@1024".
std::string piece_key(const std::string& tensor, int64_t offset, bool whole);

class PieceReader {
 public:
  // Opens every file (memory-mapped) and indexes its pieces; errors name the file.
  explicit PieceReader(const std::vector<std::string>& files);
  // True when some piece of `key` ("<kind>.<tensor>") exists.
  bool has(const std::string& key) const { return pieces_.count(key) != 0; }
  // Fills dst with elements [offset, offset + dst.numel()) of `key`, converting dtype;
  // throws naming the key and the missing range when the pieces do not cover it.
  void read(const std::string& key, int64_t offset, Tensor& dst) const;

 private:
  struct Piece {
    size_t file;
    std::string tensor;
    int64_t offset, numel;
  };
  std::vector<std::shared_ptr<io::SafetensorsFile>> files_;
  std::map<std::string, std::vector<Piece>> pieces_;
};

// An N-d block of a tensor: where it starts and how big it is in each dim (the whole
// tensor: offset 0, its shape). Tensor-parallel checkpoints save each rank's block.
struct Box {
  std::vector<int64_t> offset;
  Shape extent;
};

// Reading one saved block of a tensor under a layout with another block: fills the
// elements of `window` (elements [window_begin, window_begin + window.numel()) of the
// row-major block `dst`) that the saved block `src` covers, one contiguous row run at a
// time, through read(flat offset in src, out run). Returns the elements filled.
int64_t copy_box_overlap(const Box& src, const Box& dst, int64_t window_begin, Tensor& window,
                         const std::function<void(int64_t, Tensor&)>& read);

// The blocks every rank of a tp-way layout holds of each tensor of `config`: name ->
// (state name, block) (tp_piece_key names; a block held by several ranks listed once).
std::map<std::string, std::vector<std::pair<std::string, Box>>> tp_blocks(
    const model::ModelConfig& config, int64_t tp);

// Resumes from checkpoint `dir` under this rank's layout: fills each of `pieces`' master
// (refs[i] is pieces[i]'s optimizer name) from the saved shard `files`, cutting the blocks
// of a checkpoint saved at another tp (saved_tp) to this rank's (`shard` of `tp`); a
// checkpoint without masters (fp32, unsharded, tp 1) gives the model's weights. Returns
// the optimizer state named as `state` (the optimizer's state_tensors(): "<kind>.<ref>").
std::vector<std::pair<std::string, Tensor>> read_sharded_state(
    const std::string& dir, const std::vector<std::string>& files, int64_t saved_tp,
    const model::ModelConfig& config, model::TpShard shard, int64_t tp, std::vector<parallel::ShardPiece>& pieces,
    const std::vector<ParamRef>& refs, const std::vector<std::pair<std::string, Tensor>>& state);

}  // namespace tessera::train
