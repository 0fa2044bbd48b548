// PieceReader: an index of saved pieces by (kind.tensor, offset) and interval copies.
#include "tessera/train/sharded_state.h"

#include <algorithm>

#include "tessera/base/error.h"
#include "tessera/model/params.h"
#include "tessera/parallel/tensor_parallel.h"

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

int64_t copy_box_overlap(const Box& src, const Box& dst, int64_t window_begin, Tensor& window,
                         const std::function<void(int64_t, Tensor&)>& read) {
  const size_t nd = dst.extent.size();
  TESSERA_CHECK(src.extent.size() == nd && src.offset.size() == nd && dst.offset.size() == nd && nd > 0,
                "checkpoint: blocks of different ranks");
  std::vector<int64_t> lo(nd), hi(nd);
  for (size_t d = 0; d < nd; ++d) {
    lo[d] = std::max(src.offset[d], dst.offset[d]);
    hi[d] = std::min(src.offset[d] + src.extent[d], dst.offset[d] + dst.extent[d]);
    if (lo[d] >= hi[d]) return 0;
  }
  // Row-major strides of both blocks; runs along the last dim.
  std::vector<int64_t> ss(nd, 1), ds(nd, 1);
  for (size_t d = nd - 1; d > 0; --d) {
    ss[d - 1] = ss[d] * src.extent[d];
    ds[d - 1] = ds[d] * dst.extent[d];
  }
  Tensor flat = window.view({window.numel()});
  const int64_t w0 = window_begin, w1 = window_begin + window.numel();
  const int64_t run = hi[nd - 1] - lo[nd - 1];
  int64_t filled = 0;
  std::vector<int64_t> idx(lo.begin(), lo.end());  // global coordinates of the run's start
  while (true) {
    int64_t sf = 0, df = 0;
    for (size_t d = 0; d < nd; ++d) {
      sf += (idx[d] - src.offset[d]) * ss[d];
      df += (idx[d] - dst.offset[d]) * ds[d];
    }
    const int64_t a = std::max(df, w0), b = std::min(df + run, w1);  // clipped to the window
    if (a < b) {
      Tensor out = flat.slice(0, a - w0, b - w0);
      read(sf + (a - df), out);
      filled += b - a;
    }
    size_t d = nd - 1;  // next run: advance the leading dims like an odometer
    while (d > 0) {
      --d;
      if (++idx[d] < hi[d]) break;
      idx[d] = lo[d];
      if (d == 0) return filled;
    }
    if (nd == 1) return filled;
  }
}

std::map<std::string, std::vector<std::pair<std::string, Box>>> tp_blocks(
    const model::ModelConfig& config, int64_t tp) {
  std::map<std::string, std::vector<std::pair<std::string, Box>>> out;
  for (int r = 0; r < tp; ++r) {
    const model::TpShard shard{r, static_cast<int>(tp)};
    // Untouched memory: only the pieces' geometry is read.
    const auto p = model::Params::allocate(config, DType::kF32, model::local_dims(config, shard), false);
    for (const auto& piece : p.pieces(config, shard)) {
      Box box{piece.offset, piece.view.shape()};
      auto& list = out[piece.name];
      bool seen = false;
      for (const auto& [key, b] : list) seen |= b.offset == box.offset && b.extent == box.extent;
      if (!seen) list.emplace_back(parallel::tp_piece_key(piece.name, shard, piece.block), std::move(box));
    }
  }
  return out;
}

std::vector<std::pair<std::string, Tensor>> read_sharded_state(
    const std::string& dir, const std::vector<std::string>& files, int64_t saved_tp,
    const model::ModelConfig& config, model::TpShard shard, int64_t tp, std::vector<parallel::ShardPiece>& pieces,
    const std::vector<ParamRef>& refs, const std::vector<std::pair<std::string, Tensor>>& state) {
  const PieceReader reader(files);
  std::shared_ptr<io::SafetensorsFile> weights;  // only for checkpoints without masters
  // A checkpoint without masters (fp32 without sharding, at tp 1): the model's weights.
  auto whole_weight = [&](const parallel::ShardPiece& piece) {
    if (!weights) weights = io::SafetensorsFile::open(dir + "/model.safetensors");
    TESSERA_CHECK(weights->has(piece.name), dir, "/model.safetensors: missing tensor ", piece.name);
    const Tensor src = weights->get(piece.name);
    TESSERA_CHECK(src.shape() == piece.full_shape, dir, "/model.safetensors: ", piece.name, " has shape ",
                  src.describe(), ", the configured model needs ", shape_str(piece.full_shape));
    return src.view({src.numel()});
  };
  // At another tp the saved blocks of each tensor are cut to this rank's block.
  const auto saved_blocks = saved_tp == tp ? decltype(tp_blocks(config, 1)){} : tp_blocks(config, saved_tp);
  // Fills dst with state `kind` ("master.", "exp_avg.", ...) of `piece`.
  // A pipeline's last-stage copy of a tied table has the embedding's values and state
  // (the two take the same steps): it reads the embedding's, under any saved layout.
  const std::string embed_name = model::embedding_name(config);
  auto read_state = [&](const std::string& kind, const parallel::ShardPiece& piece_in, Tensor& dst) {
    parallel::ShardPiece piece = piece_in;
    if (config.tie_word_embeddings && piece.name == "lm_head.weight") {
      piece.name = embed_name;
      piece.key = parallel::tp_piece_key(embed_name, shard);
    }
    auto source = [&](const std::string& key) -> std::function<void(int64_t, Tensor&)> {
      if (reader.has(kind + key) || kind != "master.")
        return [&reader, name = kind + key](int64_t at, Tensor& out) { reader.read(name, at, out); };
      const Tensor src = whole_weight(piece);
      return [src](int64_t at, Tensor& out) { out.copy_from(src.slice(0, at, at + out.numel()).view(out.shape())); };
    };
    if (saved_tp == tp) {
      source(piece.key)(piece.offset, dst);
      return;
    }
    const Box mine{piece.block_offset, piece.tensor_shape};
    int64_t filled = 0;
    for (const auto& [key, box] : saved_blocks.at(piece.name))
      filled += copy_box_overlap(box, mine, piece.offset, dst, source(key));
    TESSERA_CHECK(filled == dst.numel(), dir, ": the tp = ", saved_tp, " blocks of ", kind, piece.name, " cover ",
                  filled, " of this rank's ", dst.numel(), " elements");
  };
  std::map<std::string, const parallel::ShardPiece*> by_ref;
  for (size_t i = 0; i < refs.size(); ++i) {
    auto& piece = pieces[i];
    by_ref[refs[i].name] = &piece;
    Tensor dst = piece.master;
    read_state("master.", piece, dst);
  }
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, t] : state) {
    const size_t dot = name.find('.');
    const auto* piece = by_ref.at(name.substr(dot + 1));
    Tensor dst = Tensor::empty(t.shape(), DType::kF32);
    read_state(name.substr(0, dot + 1), *piece, dst);
    out.emplace_back(name, dst);
  }
  return out;
}

}  // namespace tessera::train
