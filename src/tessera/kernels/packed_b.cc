// Packed matmul weights (packed_b.h): checks, the parallel whole-weight packer, and the
// product through oneDNN with b in its own layout.
#include "tessera/kernels/packed_b.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "tessera/base/error.h"
#include "tessera/base/thread_pool.h"
#include "tessera/kernels/cpu/matmul_cpu.h"
#include "tessera/kernels/dispatch.h"

namespace tessera::kernels {

int64_t packed_b_elements(int64_t k, int64_t n) { return cpu::packed_elements(k, n); }

int64_t packed_b_index(int64_t kk, int64_t nn, int64_t k) {
  return cpu::packed_index(kk, nn, (k + 31) / 32 * 32);
}

PackedB packed_b_like(int64_t k, int64_t n, bool trans) {
  TESSERA_CHECK(k >= 1 && n >= 1, "packed weight: (K, N) = (", k, ", ", n, ") must be positive");
  PackedB p;
  p.data = Tensor::zeros({packed_b_elements(k, n)}, DType::kBF16);
  p.k = k, p.n = n, p.trans = trans;
  return p;
}

void pack_b_rows(const uint16_t* w, int64_t ld, int64_t r0, int64_t r1, PackedB& p) {
  const int64_t rows = p.trans ? p.n : p.k, cols = p.trans ? p.k : p.n;
  TESSERA_CHECK(p.defined() && 0 <= r0 && r0 <= r1 && r1 <= rows && ld >= cols,
                "packed weight: rows [", r0, ", ", r1, ") of a (", rows, ", ", cols, ") weight with row stride ",
                ld);
  cpu::pack_rows(w + r0 * ld, ld, r0, r1, p.k, p.n, p.trans, static_cast<uint16_t*>(p.data.raw_data()));
}

void pack_b(const Tensor& w, bool trans, PackedB& p) {
  TESSERA_CHECK(w.defined() && w.dim() == 2 && w.dtype() == DType::kBF16 &&
                    (w.size(1) <= 1 || w.stride(1) == 1),
                "packed weight: needs a 2-D bf16 weight with a contiguous last dim, got ",
                w.defined() ? w.describe() : std::string("an undefined tensor"));
  const int64_t k = trans ? w.size(1) : w.size(0), n = trans ? w.size(0) : w.size(1);
  if (!p.defined() || p.k != k || p.n != n || p.trans != trans) p = packed_b_like(k, n, trans);
  const auto* src = static_cast<const uint16_t*>(w.raw_data());
  const int64_t ld = w.size(0) <= 1 ? w.size(1) : w.stride(0);
  // 64-row grains keep every 16-row group (and pair of rows) in one call.
  const int64_t rows = w.size(0);
  base::parallel_for((rows + 63) / 64, 1, [&](int64_t g0, int64_t g1) {
    pack_b_rows(src, ld, g0 * 64, std::min(rows, g1 * 64), p);
  });
}

void publish_packed(const PackTargets& t, int64_t first, const uint16_t* values, int64_t n) {
  const int64_t size = t.rows * t.cols;
  TESSERA_CHECK(size > 0 && t.fwd.size() == t.dx.size() && first >= 0 &&
                    first + n <= size * static_cast<int64_t>(t.fwd.size()),
                "packed weight: elements [", first, ", ", first + n, ") of ", t.fwd.size(), " stacked (", t.rows,
                ", ", t.cols, ") weights");
  int64_t e = first;
  const int64_t end = first + n;
  const uint16_t* v = values;
  while (e < end) {
    const int64_t w = e / size, base = w * size, stop = std::min(end, base + size);
    const int64_t e0 = e - base, e1 = stop - base;
    const int64_t r0 = (e0 + t.cols - 1) / t.cols, r1 = e1 / t.cols;
    for (PackedB* p : {t.fwd[w], t.dx[w]}) {
      if (!p) continue;
      TESSERA_CHECK(p->defined() && (p->trans ? p->n == t.rows && p->k == t.cols : p->k == t.rows && p->n == t.cols),
                    "packed weight: a target of (", p->k, ", ", p->n, ") for (", t.rows, ", ", t.cols, ") weights");
      auto* dst = static_cast<uint16_t*>(p->data.raw_data());
      if (r0 >= r1) {
        cpu::pack_elements(v, e0, e1, t.cols, p->k, p->trans, dst);
        continue;
      }
      cpu::pack_elements(v, e0, r0 * t.cols, t.cols, p->k, p->trans, dst);
      cpu::pack_rows(v + (r0 * t.cols - e0), t.cols, r0, r1, p->k, p->n, p->trans, dst);
      cpu::pack_elements(v + (r1 * t.cols - e0), r1 * t.cols, e1, t.cols, p->k, p->trans, dst);
    }
    v += stop - e;
    e = stop;
  }
}

bool packed_weights_enabled() {
  static const bool on = [] {
    if (const char* v = std::getenv("TESSERA_PACKED_WEIGHTS")) {
      const std::string s = v;
      TESSERA_CHECK(s == "on" || s == "off" || s.empty(), "TESSERA_PACKED_WEIGHTS = '", s,
                    "' is not one of on, off");
      if (s == "on") {
        TESSERA_CHECK(packed_products_supported(), "TESSERA_PACKED_WEIGHTS = on needs a CPU with AVX512-BF16 "
                      "or AMX (this one runs ", isa_level_name(cpu_isa_level()), ")");
        return true;
      }
    }
    return false;
  }();
  return on;
}

bool packed_products_supported() { return cpu_has(IsaLevel::kAvx512Bf16); }

}  // namespace tessera::kernels
