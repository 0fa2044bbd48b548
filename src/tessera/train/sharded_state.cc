// PieceReader: an index of saved pieces by (kind.tensor, offset) and interval copies.
#include "tessera/train/sharded_state.h"

#include <algorithm>

#include "tessera/base/error.h"

namespace tessera::train {

std::string piece_key(const std::string& tensor, int64_t offset, bool whole) {
  return whole ? tensor : tensor + "@" + std::to_string(offset);
}

PieceReader::PieceReader(const std::vector<std::string>& files) {
  for (const std::string& path : files) {
    files_.push_back(io::SafetensorsFile::open(path));
    const size_t f = files_.size() - 1;
    for (const auto& info : files_.back()->header().tensors) {
      std::string key = info.name;
      int64_t offset = 0;
      const size_t at = key.rfind('@');
      if (at != std::string::npos && at + 1 < key.size() &&
          std::all_of(key.begin() + static_cast<std::ptrdiff_t>(at) + 1, key.end(),
                      [](char ch) { return ch >= '0' && ch <= '9'; })) {
        offset = std::stoll(key.substr(at + 1));
        key.resize(at);
      }
      pieces_[key].push_back({f, info.name, offset, shape_numel(info.shape)});
    }
  }
}

void PieceReader::read(const std::string& key, int64_t offset, Tensor& dst) const {
  TESSERA_CHECK(dst.is_contiguous(), "checkpoint: destination of ", key, " is not contiguous");
  const auto it = pieces_.find(key);
  TESSERA_CHECK(it != pieces_.end(), "checkpoint: no saved tensor ", key);
  const int64_t lo = offset, hi = offset + dst.numel();
  Tensor flat = dst.view({dst.numel()});
  int64_t covered = 0;
  for (const Piece& p : it->second) {
    const int64_t a = std::max(lo, p.offset), b = std::min(hi, p.offset + p.numel);
    if (a >= b) continue;
    const Tensor src = files_[p.file]->get(p.tensor);
    flat.slice(0, a - lo, b - lo).copy_from(src.view({p.numel}).slice(0, a - p.offset, b - p.offset));
    covered += b - a;
  }
  TESSERA_CHECK(covered == hi - lo, "checkpoint: the saved pieces of ", key, " cover ", covered,
                " of elements [", lo, ", ", hi, ")");
}

}  // namespace tessera::train
