// Chrome trace-event recording (open the JSON in Perfetto or chrome://tracing): spans
// of named work per thread. Off unless started; a disabled TraceScope costs one branch.
#pragma once
#include <cstdint>
#include <string>

namespace tessera::base {

// Starts recording; events go to `path` when stop_trace() runs (also at exit).
void start_trace(const std::string& path);
// Writes the trace file (atomically) and stops recording. Safe to call when not started.
void stop_trace();
bool tracing();

// One "complete" event (ph "X") on the calling thread from construction to destruction.
class TraceScope {
 public:
  explicit TraceScope(const char* name, const char* category = "tessera");
  ~TraceScope();
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  const char* name_;
  const char* category_;
  int64_t start_us_ = -1;  // -1 when tracing was off at construction
};

}  // namespace tessera::base
