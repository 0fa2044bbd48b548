// Offline request files and the run loop.
#include "tessera/infer/offline.h"

#include <fstream>
#include <map>
#include <optional>

#include "tessera/base/error.h"
#include "tessera/base/timer.h"
#include "tessera/infer/sampling_json.h"
#include "tessera/io/json_file.h"

namespace tessera::infer {
namespace {

// An optional 32-bit integer field (priority), checked rather than narrowed.
std::optional<int64_t> get_int(const nlohmann::json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!io::json_int_in(*it, INT32_MIN, INT32_MAX)) fail_field(key, where, ": '", key, "' must be a 32-bit integer, got ", io::json_brief(*it));
  return it->get<int64_t>();
}

}  // namespace

std::vector<OfflineRequest> read_offline_requests(const std::string& path, const io::Tokenizer* tok,
                                                  int64_t default_max_tokens) {
  std::ifstream in(path);
  TESSERA_CHECK(in, path, ": cannot open the request file");
  std::vector<OfflineRequest> out;
  std::string line;
  int64_t lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(lineno);
    const nlohmann::json j = io::parse_json_text(line, where);  // bounded nesting
    OfflineRequest r;
    r.params = sampling_params_from_json(j, where, default_max_tokens);
    r.id = j.contains("id") ? j["id"] : nlohmann::json(lineno);
    if (auto v = get_int(j, "priority", where)) r.priority = static_cast<int>(*v);
    const bool text = j.contains("prompt"), ids = j.contains("prompt_ids");
    TESSERA_CHECK(text != ids, where, ": give exactly one of 'prompt' (text) or 'prompt_ids'");
    if (text) {
      TESSERA_CHECK(j["prompt"].is_string(), where, ": 'prompt' must be a string");
      TESSERA_CHECK(tok, where, ": 'prompt' is text but the model has no tokenizer.json");
      r.prompt_text = j["prompt"].get<std::string>();
      r.prompt = tok->encode(r.prompt_text);
    } else {
      TESSERA_CHECK(j["prompt_ids"].is_array(), where, ": 'prompt_ids' must be a list of token ids");
      for (const auto& t : j["prompt_ids"]) {
        TESSERA_CHECK(io::json_int_in(t, 0, INT32_MAX), where, ": 'prompt_ids' must be a list of token ids, got ", io::json_brief(t));
        r.prompt.push_back(static_cast<int32_t>(t.get<int64_t>()));
      }
    }
    TESSERA_CHECK(!r.prompt.empty(), where, ": the prompt is empty");
    out.push_back(std::move(r));
  }
  TESSERA_CHECK(!out.empty(), path, ": no requests");
  return out;
}

namespace {

// [{"token_id", "logprob", ["token",] "top_logprobs": [{"token_id", "logprob"[, "token"]}]}]
// per generated token (raw log-probabilities, as the server's).
nlohmann::json logprobs_json(const std::vector<SampleResult>& lps, const io::Tokenizer* tok) {
  const auto entry = [tok](int32_t id, float lp) {
    nlohmann::json e = {{"token_id", id}, {"logprob", lp}};
    if (tok) e["token"] = tok->decode_token(id);
    return e;
  };
  nlohmann::json out = nlohmann::json::array();
  for (const SampleResult& r : lps) {
    nlohmann::json e = entry(r.token, r.logprob);
    e["top_logprobs"] = nlohmann::json::array();
    for (const TokenLogprob& t : r.top_logprobs) e["top_logprobs"].push_back(entry(t.token, t.logprob));
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace

std::vector<nlohmann::json> run_offline(Engine& engine, const io::Tokenizer* tok,
                                        const std::vector<OfflineRequest>& requests, bool progress) {
  struct Sample {
    std::string text;
    std::vector<int32_t> tokens;
    std::vector<SampleResult> logprobs;  // per token, when the request asked for logprobs
    std::string finish_reason;
  };
  struct State {
    size_t index;
    std::map<int64_t, Sample> samples;
    int64_t cached = 0, completion = 0;
    int64_t done = 0;
  };
  std::map<RequestId, State> states;
  for (size_t i = 0; i < requests.size(); ++i) {
    const RequestId id = engine.add_request(requests[i].prompt, requests[i].params, requests[i].priority);
    states[id] = State{i, {}, 0, 0, 0};
  }
  std::optional<base::ProgressBar> bar;
  if (progress) bar.emplace("generate", static_cast<int64_t>(requests.size()));
  int64_t finished = 0, tokens = 0;
  base::Timer timer;
  while (engine.has_unfinished()) {
    for (const RequestOutput& o : engine.step()) {
      State& st = states.at(o.id);
      Sample& s = st.samples[o.index];
      s.tokens.insert(s.tokens.end(), o.new_tokens.begin(), o.new_tokens.end());
      s.text += o.new_text;
      s.logprobs.insert(s.logprobs.end(), o.logprobs.begin(), o.logprobs.end());
      st.cached = o.num_cached_tokens;
      tokens += static_cast<int64_t>(o.new_tokens.size());
      if (!o.finished) continue;
      s.finish_reason = o.finish_reason;
      if (++st.done == requests[st.index].params.n) ++finished;
    }
    if (bar) {
      char suffix[64];
      std::snprintf(suffix, sizeof suffix, "%.0f tok/s", tokens / std::max(1e-9, timer.seconds()));
      bar->update(finished, suffix);
    }
  }
  if (bar) bar->finish();
  std::vector<nlohmann::json> out(requests.size());
  for (auto& [id, st] : states) {
    const OfflineRequest& r = requests[st.index];
    nlohmann::json j;
    j["id"] = r.id;
    if (!r.prompt_text.empty()) j["prompt"] = r.prompt_text;
    j["outputs"] = nlohmann::json::array();
    int64_t completion = 0;
    for (auto& [index, s] : st.samples) {
      if (!tok) s.text.clear();
      nlohmann::json o = {{"index", index}, {"token_ids", s.tokens}, {"finish_reason", s.finish_reason}};
      if (tok) o["text"] = s.text;
      if (r.params.logprobs) o["logprobs"] = logprobs_json(s.logprobs, tok);
      j["outputs"].push_back(std::move(o));
      completion += static_cast<int64_t>(s.tokens.size());
    }
    j["usage"] = {{"prompt_tokens", r.prompt.size()},
                  {"completion_tokens", completion},
                  {"cached_tokens", st.cached}};
    out[st.index] = std::move(j);
  }
  return out;
}

}  // namespace tessera::infer
