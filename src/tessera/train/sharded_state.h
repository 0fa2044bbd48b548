// Master weights and optimizer state saved in pieces by the ranks of a data-parallel run
// and read back by any other layout (resharding on load). A tensor in a shard file is
// named "<kind>.<tensor>" (the whole tensor, any shape) or "<kind>.<tensor>@<offset>"
// (elements [offset, offset + numel) of the flattened tensor, 1-D).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/io/safetensors.h"
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

}  // namespace tessera::train
