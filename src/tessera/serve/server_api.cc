// The server's model and embeddings routes: GET /v1/models, GET /v1/models/{id} (OpenAI's
// Model object with vLLM's fields; LoRA adapters are models whose parent is the base) and
// POST /v1/embeddings (mean-pooled final hidden states, run by the engine thread as prefill
// steps batched with the generation requests).
#include "tessera/serve/embeddings.h"
#include "tessera/serve/server_impl.h"

namespace tessera::serve {
namespace {

using nlohmann::json;

void send(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

}  // namespace

json Server::Impl::model_cards() const {
  const int64_t created = started_unix_;  // the models exist from the server's start on
  auto card = [&](const std::string& id, const std::string& root, const json& parent) {
    return json{{"id", id},       {"object", "model"}, {"created", created},
                {"owned_by", "tessera"}, {"root", root},      {"parent", parent},
                {"max_model_len", info_.max_model_len}, {"vocab_size", info_.vocab_size}};
  };
  json data = json::array({card(info_.name, info_.name, nullptr)});
  // Extension: which chat template /v1/chat/completions renders with; "chatml (fallback)"
  // when the model has none (a base model, most likely).
  data[0]["chat_template"] = !tokenizer_ ? "none" : chat_template_.is_fallback() ? "chatml (fallback)" : "model";
  for (const auto& [name, dir] : config_.loras) data.push_back(card(name, dir, info_.name));  // as vLLM lists adapters
  return data;
}

void Server::Impl::handle_embeddings(const httplib::Request& req, httplib::Response& res) {
  bool base64 = false;
  ApiRequest r = parse_embedding_request(parse_body(req.body), info_, engine_.model().config().hidden_size, &base64);
  auto job = submit(std::move(r));
  if (config_.log_requests)
    std::fprintf(stderr, "tessera serve: %s %s: %zu input(s)\n", job->id.c_str(), req.path.c_str(),
                 job->req.prompts.size());
  std::vector<std::vector<float>> embeddings(job->req.prompts.size());
  std::unique_ptr<ApiError> error;
  {
    std::unique_lock<std::mutex> lock(job->m);
    job->cv.wait(lock, [&] { return job->done; });  // the engine thread enforces timeouts
    for (auto& e : job->events)
      if (!e.out.embedding.empty()) embeddings[static_cast<size_t>(e.choice)] = std::move(e.out.embedding);
    job->events.clear();
    error = std::move(job->error);
  }
  release(job, false);
  if (error) throw *error;
  int64_t tokens = 0;
  for (size_t i = 0; i < embeddings.size(); ++i) {
    if (embeddings[i].empty())
      throw ApiError(500, "internal_error", "", "", "the engine returned no embedding for input " + std::to_string(i));
    tokens += static_cast<int64_t>(job->req.prompts[i].size());
  }
  send(res, 200, embedding_response(job->req.model, embeddings, base64, tokens));
}

void Server::Impl::setup_api_routes(const std::function<Handler(Handler)>& guard) {
  http_.Get("/v1/models", guard([this](const httplib::Request&, httplib::Response& res) {
              send(res, 200, {{"object", "list"}, {"data", model_cards()}});
            }));
  // Ids may hold '/' ("org/model"): everything after /v1/models/ is the id.
  http_.Get(R"(/v1/models/(.+))", guard([this](const httplib::Request& req, httplib::Response& res) {
              const std::string id = req.matches[1];
              for (const auto& m : model_cards())
                if (m["id"] == id) return send(res, 200, m);
              throw ApiError(404, "invalid_request_error", "", "model_not_found",
                             "the model '" + id + "' does not exist");
            }));
  http_.Post("/v1/embeddings", guard([this](const httplib::Request& req, httplib::Response& res) {
               handle_embeddings(req, res);
             }));
}

}  // namespace tessera::serve
