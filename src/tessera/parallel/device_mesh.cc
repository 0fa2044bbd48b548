// DeviceMesh: axis sizes checked against the world, the model and the batch; one
// sub-communicator per axis made by split.
#include "tessera/parallel/device_mesh.h"

#include <sstream>

#include "tessera/base/error.h"

namespace tessera::parallel {

namespace {

constexpr std::array<Axis, kNumAxes> kAxes = {Axis::kPp, Axis::kDp, Axis::kEp, Axis::kCp, Axis::kTp};
// The order `describe` prints in (how layouts are usually spelled).
constexpr std::array<Axis, kNumAxes> kPrintOrder = {Axis::kDp, Axis::kPp, Axis::kTp, Axis::kCp, Axis::kEp};

}  // namespace

const char* axis_name(Axis a) {
  switch (a) {
    case Axis::kPp: return "pp";
    case Axis::kDp: return "dp";
    case Axis::kEp: return "ep";
    case Axis::kCp: return "cp";
    case Axis::kTp: return "tp";
  }
  return "?";
}

int64_t MeshShape::size(Axis a) const {
  switch (a) {
    case Axis::kPp: return pp;
    case Axis::kDp: return dp;
    case Axis::kEp: return ep;
    case Axis::kCp: return cp;
    case Axis::kTp: return tp;
  }
  return 1;
}

std::string MeshShape::describe() const {
  std::string out;
  for (Axis a : kPrintOrder) {
    if (size(a) == 1) continue;
    out += (out.empty() ? "" : " x ") + std::string(axis_name(a)) + std::to_string(size(a));
  }
  return out.empty() ? "1 rank" : out;
}

MeshShape resolve_mesh_shape(MeshShape s, int64_t world, const std::string& source) {
  const std::string where = source + ": [parallel] ";
  for (Axis a : {Axis::kPp, Axis::kTp, Axis::kCp, Axis::kEp})
    TESSERA_CHECK(s.size(a) >= 1 && s.size(a) <= 65536, where, axis_name(a), " must be in [1, 65536], got ",
                  s.size(a));
  const int64_t inner = s.pp * s.tp * s.cp * s.ep;
  const std::string ep = (s.ep > 1 ? " x ep " + std::to_string(s.ep) : "") + (s.cp > 1 ? " x cp " + std::to_string(s.cp) : "");
  if (s.dp == 0) {
    TESSERA_CHECK(world % inner == 0, where, "pp ", s.pp, " x tp ", s.tp, ep, " = ", inner, " does not divide the ",
                  world, " ranks");
    s.dp = world / inner;
  }
  TESSERA_CHECK(s.dp >= 1 && s.dp <= 65536, where, "dp must be in [1, 65536] (or 0: the rest), got ", s.dp);
  TESSERA_CHECK(s.dp * inner == world, where, "dp ", s.dp, " x pp ", s.pp, " x tp ", s.tp, ep, " = ", s.dp * inner,
                " ranks, but the job has ", world);
  return s;
}

void check_layout(const MeshShape& s, const model::ModelConfig& m, int64_t micro_batches,
                  const std::string& source) {
  const std::string where = source + ": [parallel] ";
  if (s.tp > 1) {
    TESSERA_CHECK(m.num_heads % s.tp == 0, where, "tp = ", s.tp, " does not divide the model's ", m.num_heads,
                  " attention heads");
    TESSERA_CHECK(m.num_kv_heads % s.tp == 0 || s.tp % m.num_kv_heads == 0, where, "tp = ", s.tp,
                  " and the model's ", m.num_kv_heads,
                  " key/value heads: one must divide the other (kv heads are split, or replicated when tp exceeds them)");
    TESSERA_CHECK(m.intermediate_size % s.tp == 0 || (m.is_moe() && !m.shared_expert), where, "tp = ", s.tp,
                  " does not divide the model's MLP size ", m.intermediate_size);
  }
  TESSERA_CHECK(s.pp <= m.num_layers, where, "pp = ", s.pp, " is more pipeline stages than the model's ",
                m.num_layers, " layers");
  TESSERA_CHECK(s.pp == 1 || micro_batches >= s.pp, where, "pp = ", s.pp, " needs at least ", s.pp,
                " micro-batches per step to fill the pipeline, got data.grad_accum = ", micro_batches);
  if (s.ep > 1) {
    TESSERA_CHECK(m.is_moe(), where, "ep = ", s.ep, " needs a mixture-of-experts model; ", m.model_type,
                  " has no experts");
    TESSERA_CHECK(m.num_experts % s.ep == 0, where, "ep = ", s.ep, " does not divide the model's ", m.num_experts,
                  " experts");
  }
}

int DeviceMesh::rank_of(const MeshShape& s, const std::array<int, kNumAxes>& c) {
  int64_t r = 0;
  for (Axis a : kAxes) r = r * s.size(a) + c[static_cast<int>(a)];
  return static_cast<int>(r);
}

std::array<int, kNumAxes> DeviceMesh::coords_of(const MeshShape& s, int rank) {
  std::array<int, kNumAxes> c{};
  int64_t r = rank;
  for (int i = kNumAxes - 1; i >= 0; --i) {
    const int64_t n = s.size(kAxes[i]);
    c[static_cast<int>(kAxes[i])] = static_cast<int>(r % n);
    r /= n;
  }
  return c;
}

DeviceMesh::DeviceMesh(comm::Communicator& world, const MeshShape& shape) : world_(world), shape_(shape) {
  int64_t product = 1;
  for (Axis a : kAxes) product *= shape.size(a);
  TESSERA_CHECK(product == world.size(), "device mesh ", shape.describe(), " has ", product,
                " ranks, but the communicator has ", world.size());
  coords_ = coords_of(shape, world.rank());
  // The group along axis a: ranks with the same coordinates on every other axis. Colour =
  // the rank with this axis's coordinate set to 0; key = the coordinate.
  for (Axis a : kAxes) {
    auto c = coords_;
    c[static_cast<int>(a)] = 0;
    groups_[static_cast<int>(a)] = world.split(rank_of(shape, c), coords_[static_cast<int>(a)]);
  }
  if (shape.ep > 1 || shape.cp > 1) {
    auto c = coords_;
    c[static_cast<int>(Axis::kDp)] = c[static_cast<int>(Axis::kEp)] = c[static_cast<int>(Axis::kCp)] = 0;
    const int64_t key = (coords_[static_cast<int>(Axis::kDp)] * shape.ep + coords_[static_cast<int>(Axis::kEp)]) *
                            shape.cp + coords_[static_cast<int>(Axis::kCp)];
    data_ = world.split(rank_of(shape, c), static_cast<int>(key));
  }
  if (shape.ep > 1 && shape.cp > 1) {
    auto c = coords_;
    c[static_cast<int>(Axis::kDp)] = c[static_cast<int>(Axis::kCp)] = 0;
    const int64_t key = coords_[static_cast<int>(Axis::kDp)] * shape.cp + coords_[static_cast<int>(Axis::kCp)];
    expert_data_ = world.split(rank_of(shape, c), static_cast<int>(key));
  }
}

std::string DeviceMesh::describe() const {
  std::ostringstream os;
  os << "rank " << world_.rank() << "/" << world_.size();
  bool first = true;
  for (Axis a : kPrintOrder) {
    if (size(a) == 1) continue;
    os << (first ? ": " : ", ") << axis_name(a) << " " << coord(a) << "/" << size(a);
    first = false;
  }
  return os.str();
}

}  // namespace tessera::parallel
