// DataParallel's private parts (data_parallel.cc, data_parallel_publish.cc): the model's
// storage tensors in the flat layout (slots), the TrainHooks units, the reduction
// segments and the reductions in flight.
#pragma once
#include <string>
#include <vector>

#include "tessera/parallel/data_parallel.h"

namespace tessera::parallel {

struct DataParallel::Slot {
  std::string name;
  Tensor* w = nullptr;  // member of model_.weights()
  Tensor* g = nullptr;  // member of grads_
  Shape shape;
  int64_t numel = 0;
  int64_t flat = 0;  // first element in the flat layout
  bool expert = false;  // an expert-parallel model's experts (reduced over expert_comm)
};

struct DataParallel::Unit {
  std::vector<int> slots;
  int64_t begin = 0, end = 0;  // flat range
  int segment = 0;
  int expert_segment = -1;     // expert parallelism: the segment of its experts' slots
  Tensor ebuf;                 // stage 3 with ep: its experts' gathered values (over expert_comm)
  comm::RequestPtr egather;    // and their prefetch
  int refs = 0;                // stage 3: acquires outstanding
  bool resident = false;       // stage 3: gathered weights bound
  Tensor buf;                  // stage 3: (end - begin) gathered values
  comm::RequestPtr gather;     // stage 3: a prefetch in flight
};

struct DataParallel::Segment {
  int64_t begin = 0, end = 0;          // flat range
  int64_t own_begin = 0, own_end = 0;  // this rank's part (flat)
  int64_t own_offset = 0;              // where that part sits in the shard buffers
  std::vector<int> units;
  bool expert = false;                 // expert slots: reduced and sharded over expert_comm
  int ready = 0;                       // units whose gradients are final this micro-batch
  Tensor buf;                          // stages 2-3: (end - begin) gradients being accumulated
  int64_t own_size() const { return own_end - own_begin; }
};

struct DataParallel::Pending {
  comm::RequestPtr req;
  int segment = 0;
  Tensor out;  // stages 2-3: this rank's reduced chunk, added into grads_shard_ when done
  float scale = 1.f;  // applied to the reduced values (experts: 1 / ep, see launch_reduction)
};

}  // namespace tessera::parallel
