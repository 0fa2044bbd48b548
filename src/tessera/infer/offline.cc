// Request parsing and the offline run loop.
#include "tessera/infer/offline.h"

#include <fstream>
#include <map>
#include <optional>

#include "tessera/base/error.h"
#include "tessera/base/timer.h"

namespace tessera::infer {
namespace {

template <typename T>
std::optional<T> get(const nlohmann::json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if constexpr (std::is_same_v<T, bool>) {
    if (!it->is_boolean()) fail_field(key, where, ": '", key, "' must be true or false");
  } else if constexpr (std::is_unsigned_v<T>) {
    if (!it->is_number_unsigned()) fail_field(key, where, ": '", key, "' must be a non-negative integer");
  } else if constexpr (std::is_integral_v<T>) {
    if (!it->is_number_integer()) fail_field(key, where, ": '", key, "' must be an integer");
    // Out-of-range integers (beyond int64) arrive as unsigned; reject rather than wrap.
    if (it->is_number_unsigned() && it->template get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
      fail_field(key, where, ": '", key, "' is too large");
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!it->is_number()) fail_field(key, where, ": '", key, "' must be a number");
  }
  return it->template get<T>();
}

}  // namespace

SamplingParams sampling_params_from_json(const nlohmann::json& j, const std::string& where,
                                         int64_t default_max_tokens) {
  SamplingParams d;
  d.max_tokens = default_max_tokens;
  return sampling_params_from_json(j, where, d);
}

SamplingParams sampling_params_from_json(const nlohmann::json& j, const std::string& where,
                                         const SamplingParams& defaults) {
  TESSERA_CHECK(j.is_object(), where, ": a request must be a JSON object");
  SamplingParams p = defaults;
  if (auto v = get<int64_t>(j, "max_tokens", where)) p.max_tokens = *v;
  if (auto v = get<int64_t>(j, "max_completion_tokens", where)) p.max_tokens = *v;
  if (auto v = get<double>(j, "temperature", where)) p.temperature = static_cast<float>(*v);
  if (auto v = get<double>(j, "top_p", where)) p.top_p = static_cast<float>(*v);
  if (auto v = get<int64_t>(j, "top_k", where)) p.top_k = *v;
  if (auto v = get<double>(j, "min_p", where)) p.min_p = static_cast<float>(*v);
  if (auto v = get<int64_t>(j, "n", where)) p.n = *v;
  if (auto v = get<uint64_t>(j, "seed", where)) p.seed = *v;
  if (auto v = get<double>(j, "presence_penalty", where)) p.presence_penalty = static_cast<float>(*v);
  if (auto v = get<double>(j, "frequency_penalty", where)) p.frequency_penalty = static_cast<float>(*v);
  if (auto v = get<double>(j, "repetition_penalty", where)) p.repetition_penalty = static_cast<float>(*v);
  if (auto v = get<int64_t>(j, "min_tokens", where)) p.min_tokens = *v;
  if (auto v = get<bool>(j, "ignore_eos", where)) p.ignore_eos = *v;
  if (auto it = j.find("logprobs"); it != j.end() && !it->is_null()) {
    // OpenAI chat: logprobs true + top_logprobs N; completions: logprobs N.
    if (it->is_boolean()) {
      if (it->get<bool>()) p.logprobs = static_cast<int>(get<int64_t>(j, "top_logprobs", where).value_or(0));
    } else {
      if (!it->is_number_integer())
        fail_field("logprobs", where, ": 'logprobs' must be an integer or a boolean");
      if (it->get<int64_t>() < 0 || it->get<int64_t>() > 20)
        fail_field("logprobs", where, ": 'logprobs' must be in [0, 20]");
      p.logprobs = it->get<int>();
    }
  }
  if (auto it = j.find("stop"); it != j.end() && !it->is_null()) {
    if (it->is_string()) {
      p.stop = {it->get<std::string>()};
    } else {
      if (!it->is_array()) fail_field("stop", where, ": 'stop' must be a string or a list of strings");
      for (const auto& s : *it) {
        if (!s.is_string()) fail_field("stop", where, ": 'stop' must be a string or a list of strings");
        p.stop.push_back(s.get<std::string>());
      }
    }
  }
  if (auto it = j.find("stop_token_ids"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) fail_field("stop_token_ids", where, ": 'stop_token_ids' must be a list of token ids");
    for (const auto& s : *it) {
      if (!s.is_number_integer() || s.get<int64_t>() < 0 || s.get<int64_t>() > INT32_MAX)
        fail_field("stop_token_ids", where, ": 'stop_token_ids' must be a list of token ids");
      p.stop_token_ids.push_back(s.get<int32_t>());
    }
  }
  if (const auto err = p.find_error()) fail_field(err->field, where, ": ", err->message);
  return p;
}

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
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      fail(where, ": invalid JSON: ", e.what());
    }
    OfflineRequest r;
    r.params = sampling_params_from_json(j, where, default_max_tokens);
    r.id = j.contains("id") ? j["id"] : nlohmann::json(lineno);
    if (auto v = get<int64_t>(j, "priority", where)) r.priority = static_cast<int>(*v);
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
        TESSERA_CHECK(t.is_number_integer(), where, ": 'prompt_ids' must be a list of token ids");
        r.prompt.push_back(t.get<int32_t>());
      }
    }
    TESSERA_CHECK(!r.prompt.empty(), where, ": the prompt is empty");
    out.push_back(std::move(r));
  }
  TESSERA_CHECK(!out.empty(), path, ": no requests");
  return out;
}

std::vector<nlohmann::json> run_offline(Engine& engine, const io::Tokenizer* tok,
                                        const std::vector<OfflineRequest>& requests, bool progress) {
  struct Sample {
    std::string text;
    std::vector<int32_t> tokens;
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
