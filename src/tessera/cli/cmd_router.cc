// `tessera router`: the prefill/decode disaggregation front (serve/router.h, docs/serving.md).
#include <cstdlib>
#include <sstream>

#include "tessera/base/error.h"
#include "tessera/cli/commands.h"
#include "tessera/serve/router.h"

namespace tessera::cli {
namespace {

// "URL[,URL...]" (the flag may also repeat) -> the URLs.
std::vector<std::string> split_urls(const std::vector<std::string>& given) {
  std::vector<std::string> out;
  for (const auto& g : given) {
    std::stringstream in(g);
    std::string u;
    while (std::getline(in, u, ','))
      if (!u.empty()) out.push_back(u);
  }
  return out;
}

}  // namespace

void add_router(CLI::App& app, Action& action) {
  auto cfg = std::make_shared<serve::RouterConfig>();
  auto prefill = std::make_shared<std::vector<std::string>>();
  auto decode = std::make_shared<std::vector<std::string>>();
  auto* cmd = app.add_subcommand("router", "Prefill/decode disaggregation front: an OpenAI-compatible server that "
                                           "sends each request to a prefill worker, then a decode worker "
                                           "(docs/serving.md)");
  cmd->add_option("--prefill", *prefill, "Prefill worker URLs (tessera serve --role prefill), URL[,URL]")
      ->required()
      ->take_all();
  cmd->add_option("--decode", *decode, "Decode worker URLs (tessera serve --role decode), URL[,URL]")
      ->required()
      ->take_all();
  cmd->add_option("--host", cfg->host, "Address to bind")->capture_default_str();
  cmd->add_option("--port", cfg->port, "Port (0 = any free port)")->capture_default_str();
  cmd->add_option("--kv-transport", cfg->kv_transport,
                  "How KV blocks move: tcp, or shm (decode workers on this host started with --kv-transport shm)")
      ->capture_default_str();
  cmd->add_option("--api-key", cfg->api_key, "Require 'Authorization: Bearer KEY' on /v1 routes (or env TESSERA_API_KEY)");
  cmd->add_option("--health-interval", cfg->health_interval_s, "Seconds between health checks of each worker")
      ->capture_default_str();
  cmd->add_option("--request-timeout", cfg->request_timeout_s, "Seconds a worker call may take")->capture_default_str();
  cmd->add_option("--http-threads", cfg->http_threads, "HTTP worker threads (a streaming request holds one)")
      ->capture_default_str();
  cmd->add_option("--affinity-blocks", cfg->affinity_blocks,
                  "Prefix affinity: a hash of the prompt's first this many KV blocks picks the prefill worker")
      ->capture_default_str();
  cmd->add_option("--affinity-slack", cfg->affinity_slack,
                  "Prefix affinity yields when its worker has this many more requests in flight than the least loaded")
      ->capture_default_str();
  cmd->add_flag("--log-requests", cfg->log_requests, "One line per request on stderr");
  cmd->callback([&action, cfg, prefill, decode] {
    action = [cfg, prefill, decode] {
      cfg->prefill = split_urls(*prefill);
      cfg->decode = split_urls(*decode);
      if (cfg->api_key.empty())
        if (const char* k = std::getenv("TESSERA_API_KEY"); k && *k) cfg->api_key = k;
      serve::Router router(*cfg);
      return router.run(true);
    };
  });
}

}  // namespace tessera::cli
