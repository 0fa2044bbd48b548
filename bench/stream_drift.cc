// Measures the STREAM triad and read-only bandwidths back to back for a while, to show how
// much a host's memory speed drifts within a run (bench decode's ratios pair against it).
#include <cstdio>
#include <cstdlib>

#include "tessera/base/timer.h"
#include "tessera/kernels/peak.h"

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 30.0;
  tessera::kernels::StreamProbe probe;  // (the triad's arrays, allocated once)
  tessera::base::Timer t;
  while (t.seconds() < seconds) {
    const double triad = probe.best_triad_gbps(3);
    const double read = tessera::kernels::measure_stream_read_gbps(0, 3);
    std::printf("%7.2f s  triad %6.2f GB/s  read %6.2f GB/s\n", t.seconds(), triad, read);
  }
}
