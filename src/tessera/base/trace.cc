// Chrome trace-event recording: events are buffered in memory under a mutex (spans are
// coarse: steps, passes, collectives) and written as {"traceEvents": [...]} at stop.
#include "tessera/base/trace.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>
#include <vector>

#include "tessera/base/error.h"

namespace tessera::base {
namespace {

struct Event {
  const char* name;
  const char* category;
  int64_t start_us, dur_us;
  int tid;
};

struct State {
  std::mutex mu;
  std::string path;
  std::vector<Event> events;
  std::atomic<bool> on{false};
  std::chrono::steady_clock::time_point t0;
};

State& state() {
  static State* s = new State();  // never destroyed: scopes may end during exit
  return *s;
}

int thread_index() {
  static std::atomic<int> next{0};
  thread_local int id = next++;
  return id;
}

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() -
                                                               state().t0)
      .count();
}

}  // namespace

void start_trace(const std::string& path) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.path = path;
  s.events.clear();
  s.t0 = std::chrono::steady_clock::now();
  s.on = true;
  static bool registered = false;
  if (!registered) {
    registered = true;
    std::atexit([] {
      try {
        stop_trace();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "tessera: trace not written: %s\n", e.what());
      }
    });
  }
}

bool tracing() { return state().on.load(std::memory_order_relaxed); }

void stop_trace() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.on) return;
  s.on = false;
  std::ostringstream out;
  out << "{\"traceEvents\": [\n";
  const int pid = static_cast<int>(::getpid());
  for (size_t i = 0; i < s.events.size(); ++i) {
    const Event& e = s.events[i];
    out << (i ? ",\n" : "") << "{\"name\": \"" << e.name << "\", \"cat\": \"" << e.category
        << "\", \"ph\": \"X\", \"ts\": " << e.start_us << ", \"dur\": " << e.dur_us
        << ", \"pid\": " << pid << ", \"tid\": " << e.tid << "}";
  }
  out << "\n], \"displayTimeUnit\": \"ms\"}\n";
  const std::string tmp = s.path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    TESSERA_CHECK(f.good(), tmp, ": cannot write the trace");
    f << out.str();
    TESSERA_CHECK(f.good(), tmp, ": write failed");
  }
  TESSERA_CHECK(std::rename(tmp.c_str(), s.path.c_str()) == 0, s.path, ": cannot rename the trace into place");
}

TraceScope::TraceScope(const char* name, const char* category) : name_(name), category_(category) {
  if (tracing()) start_us_ = now_us();
}

TraceScope::~TraceScope() {
  if (start_us_ < 0 || !tracing()) return;
  const int64_t end = now_us();
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.events.push_back({name_, category_, start_us_, end - start_us_, thread_index()});
}

}  // namespace tessera::base
