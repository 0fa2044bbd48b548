// A KV pool in POSIX shared memory (prefill/decode disaggregation on one host): the decode
// worker's pool lives in a segment the prefill worker maps, so a transfer writes the prefill
// side's block bytes straight into the decode side's blocks (one copy, no socket).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/infer/kv_pool.h"

namespace tessera::infer {

// Where each layer's K and V caches lie in the segment. Block b of layer l's K cache starts at
// k_offset[l] + b * k_block_bytes[l] (V likewise; v_block_bytes 0 for latent attention).
struct KvShmLayout {
  std::string name;  // shm_open name, "/tessera-kv-..."
  int64_t bytes = 0, num_blocks = 0;
  std::vector<int64_t> k_offset, v_offset, k_block_bytes, v_block_bytes;
};

// Moves the (unused) pool's caches into a new segment `name` (created exclusively; its pages
// are touched only as blocks are written). The segment is unlinked and unmapped when the
// last of the pool's tensors is gone. Throws naming the segment when it cannot be created.
KvShmLayout place_pool_in_shm(KvPool& pool, const std::string& name);

// Another process's segment mapped read-write (the prefill side).
class KvShmMapping {
 public:
  // Throws naming the segment when it is missing or smaller than `bytes`.
  KvShmMapping(const std::string& name, int64_t bytes);
  ~KvShmMapping();
  KvShmMapping(const KvShmMapping&) = delete;
  KvShmMapping& operator=(const KvShmMapping&) = delete;
  uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  uint8_t* data_ = nullptr;
  int64_t size_ = 0;
};

}  // namespace tessera::infer
