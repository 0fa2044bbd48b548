// The HttpBenchOptions the load-generator tests start from: n requests of fixed prompt and
// output lengths against a mock server's url, no progress bar, a 10 s timeout.
#pragma once
#include <cstdint>
#include <string>

#include "tessera/serve/bench_client.h"

namespace tessera::serve {

inline HttpBenchOptions bench_options(const std::string& url, int64_t n, int64_t prompt, int64_t output) {
  HttpBenchOptions o;
  o.url = url;
  o.num_requests = n;
  o.prompt_len = {prompt, prompt};
  o.output_len = {output, output};
  o.progress = false;
  o.timeout_s = 10;
  return o;
}

}  // namespace tessera::serve
