// ISA selection and the deterministic column reduction of the CPU pointwise kernels.
#include "tessera/kernels/dispatch.h"
#include "tessera/kernels/cpu/pointwise_common.h"

#include <atomic>
#include <vector>

#include "tessera/base/cpu_features.h"
#include "tessera/base/thread_pool.h"

namespace tessera::kernels::cpu {
namespace {

std::atomic<bool> g_force_scalar{false};

// Enough partial rows for every core of a big machine while keeping the partial
// buffer small (64 * width floats).
constexpr int64_t kMaxReduceBlocks = 64;

}  // namespace

Isa pointwise_isa() {
  const bool avx512 = cpu_has(IsaLevel::kAvx512);  // the kernels' one ISA level (dispatch.h)
  return avx512 && !g_force_scalar.load(std::memory_order_relaxed) ? Isa::kAvx512
                                                                   : Isa::kScalar;
}

void set_pointwise_isa_for_testing(Isa isa) {
  g_force_scalar.store(isa == Isa::kScalar, std::memory_order_relaxed);
}

void reduce_rows_into(int64_t rows, int64_t grain, std::initializer_list<float*> accs,
                      int64_t width, const std::function<void(int64_t, int64_t, float*)>& fn) {
  if (rows <= 0 || width <= 0) return;
  const std::vector<float*> acc(accs);
  const int64_t total = width * static_cast<int64_t>(acc.size());
  grain = std::max<int64_t>(grain, 1);
  const int64_t blocks = std::min<int64_t>(kMaxReduceBlocks, (rows + grain - 1) / grain);
  // Even a single block goes through a zeroed partial, so the rounding does not depend
  // on whether the input happened to be split.
  std::vector<float> partials(static_cast<size_t>(blocks * total), 0.f);
  base::parallel_for(blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      fn(rows * b / blocks, rows * (b + 1) / blocks, partials.data() + b * total);
  });
  base::parallel_for(total, 1 << 14, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      float s = partials[c];
      for (int64_t b = 1; b < blocks; ++b) s += partials[b * total + c];
      acc[c / width][c % width] += s;
    }
  });
}

}  // namespace tessera::kernels::cpu
