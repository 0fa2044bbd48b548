// Pipeline schedules (GPipe, 1F1B, interleaved 1F1B): for each pipeline rank, the ordered
// list of forward and backward passes it runs over one step's micro-batches. Pure logic:
// the executor (pipeline_parallel.h) runs these lists; simulate_schedule() replays them
// with given pass costs, which checks that every dependency is met without a deadlock and
// gives the ideal bubble a measured run is compared with (docs/parallelism.md).
#pragma once
#include <string>
#include <vector>

namespace tessera::parallel {

enum class PipeSchedule { kGpipe, k1F1B, kInterleaved };
// "gpipe" | "1f1b" | "interleaved"; anything else is a one-line error naming the choices.
PipeSchedule parse_pipe_schedule(const std::string& name);
const char* pipe_schedule_name(PipeSchedule s);

struct PipeAction {
  enum Kind { kForward, kBackward };
  Kind kind = kForward;
  int micro = 0;  // micro-batch
  int chunk = 0;  // model chunk of this rank; virtual stage = chunk * pp + rank
};

struct PipeShape {
  int pp = 1;              // pipeline ranks
  int micro_batches = 1;   // per step (m)
  int virtual_stages = 1;  // chunks per rank (interleaved only; 1 otherwise)
};

// Throws a one-line error when the shape does not suit the schedule (interleaved needs
// virtual_stages >= 2 and micro-batches a multiple of pp, as Megatron-LM requires).
void check_pipe_shape(PipeSchedule s, const PipeShape& shape);

// actions[rank]: what that rank runs, in order. Every (micro, virtual stage) pair appears
// once as a forward and once as a backward on the rank that holds the stage.
//   GPipe: every forward, then every backward (micro-batch order).
//   1F1B: pp - rank - 1 warm-up forwards, then one forward one backward, then the rest of
//     the backwards (PipeDream-Flush, Megatron-LM's default): at most pp - rank passes
//     held at once instead of m.
//   Interleaved: Megatron-LM's interleaved 1F1B over virtual_stages chunks per rank,
//     (pp - rank - 1) * 2 + (v - 1) * pp warm-up forwards.
std::vector<std::vector<PipeAction>> pipe_schedule(PipeSchedule s, const PipeShape& shape);

// "rank 0: F0 F1 B0 F2 B1 ..." per line; interleaved passes carry their chunk ("F0.1").
std::string format_pipe_schedule(const std::vector<std::vector<PipeAction>>& actions,
                                 const PipeShape& shape);

// One pass's place on the timeline (seconds from the step's start).
struct PipeSpan {
  double start = 0, end = 0;
};

struct PipeTimeline {
  std::vector<std::vector<PipeSpan>> spans;  // [rank][action index]
  double makespan = 0;
  // Idle share of the makespan averaged over ranks: 1 - busy / (ranks x makespan).
  double bubble = 0;
  int max_in_flight = 0;  // most forwards awaiting their backward on one rank
};

// Replays the lists with every forward costing `forward` and every backward `backward`
// (communication free): each pass starts when its rank is free and its input has been
// produced. Throws naming the rank and pass when a list waits for something that never
// comes (an invalid schedule would deadlock).
PipeTimeline simulate_schedule(const std::vector<std::vector<PipeAction>>& actions,
                               const PipeShape& shape, double forward = 1.0, double backward = 2.0);

// The bubble of the measured spans (same definition as PipeTimeline::bubble): the idle
// share of the pipeline's span summed over every rank.
double measured_bubble(const std::vector<std::vector<PipeSpan>>& spans);
// The idle share of the busiest rank alone: 1 - max busy / span. The formula assumes
// equal stages; when they are not, the faster ones also wait on the slowest (imbalance,
// in measured_bubble), while the slowest idles only where the schedule makes it: this is
// the schedule's own bubble. Equal to measured_bubble when the stages are equally busy.
double critical_bubble(const std::vector<std::vector<PipeSpan>>& spans);

// The textbook bubble fraction: (pp - 1) / (v m + pp - 1) (v = 1 for GPipe and 1F1B).
double ideal_bubble(const PipeShape& shape);

// An SVG of the timeline: one row per rank, a box per pass (forwards light, backwards
// dark, labelled by micro-batch), the time axis in milliseconds.
std::string pipe_timeline_svg(const std::vector<std::vector<PipeAction>>& actions,
                              const std::vector<std::vector<PipeSpan>>& spans,
                              const PipeShape& shape, const std::string& title);

}  // namespace tessera::parallel
