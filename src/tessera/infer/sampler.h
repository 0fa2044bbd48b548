// Per-request token sampling (vLLM / OpenAI semantics): penalties, temperature, min-p,
// top-k, top-p, seeded RNG, min-tokens, raw log-probabilities; and stop-string matching.
#pragma once
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/tensor/tensor.h"

namespace tessera::infer {

// A bad sampling field: `field` is the API name (e.g. "top_p") so the server can report it
// as the OpenAI error's `param`; `message` is one line that starts with the field name.
struct ParamError {
  std::string field;
  std::string message;
};

// A structured-output constraint as a request states it (compiled by the engine).
struct GuidedDecoding {
  std::string type;  // "" (none) | "json_object" | "json_schema" | "regex" | "grammar"
  std::string spec;  // the schema's JSON text, the regex or the GBNF grammar ("" for json_object)
  bool empty() const { return type.empty(); }
};

// What one request asks of the sampler. Defaults are "off" and follow vLLM / OpenAI.
// The first four fields keep their order: callers aggregate-initialise {T, k, p, seed}.
struct SamplingParams {
  float temperature = 0.f;            // 0 (below 1e-5, as vLLM) = greedy; no upper bound (as vLLM)
  int64_t top_k = 0;                  // 0 or -1 = off; larger than the vocabulary = off
  float top_p = 1.f;                  // in (0, 1]; 1 = off
  std::optional<uint64_t> seed{};     // absent = drawn from a process RNG; present = reproducible
  float min_p = 0.f;                  // in [0, 1]; drops tokens with p < min_p * p_max
  float repetition_penalty = 1.f;     // > 0; 1 = off; prompt + output tokens (HF / vLLM rule)
  float presence_penalty = 0.f;       // in [-2, 2]; output tokens (OpenAI rule)
  float frequency_penalty = 0.f;      // in [-2, 2]; output tokens (OpenAI rule)
  int64_t max_tokens = 16;            // >= 1 (OpenAI / vLLM default 16); the engine enforces it
  int64_t min_tokens = 0;             // stop tokens (and EOS) are suppressed until this many
  std::vector<std::string> stop{};    // stop strings, non-empty; see StopChecker
  std::vector<int32_t> stop_token_ids{};
  bool ignore_eos = false;            // EOS neither stops nor is suppressed by min_tokens
  int64_t n = 1;                      // samples per prompt, in [1, 128]; must be 1 when greedy
  std::optional<int> logprobs{};      // top alternatives 0..20; chosen token's logprob when set
  std::optional<int> prompt_logprobs{};  // prompt tokens' logprobs with this many alternatives (vLLM)
  // OpenAI logit_bias: (token, bias in [-100, 100]) added to the raw logits before everything.
  std::vector<std::pair<int32_t, float>> logit_bias{};
  // Structured outputs: the output must match this constraint (empty type: none). type is
  // "json_object", "json_schema" (spec: the schema's JSON text), "regex" or "grammar" (GBNF).
  GuidedDecoding guided{};
  // Beam search (vLLM's use_beam_search; beam_search.h): best_of beams (>= n, at most 128;
  // 0 = n), the n best hypotheses returned, scored by cumulative logprob /
  // length^length_penalty. Needs temperature 0 and no other sampling or penalty field.
  bool use_beam_search = false;
  int64_t best_of = 0;
  float length_penalty = 1.f;         // finite; must be 1 without use_beam_search (as vLLM)

  bool is_greedy() const { return temperature < 1e-5f; }
  // The first invalid field (or combination), or nothing. vocab_size > 0 also checks ids.
  std::optional<ParamError> find_error(int64_t vocab_size = 0) const;
  void validate(int64_t vocab_size = 0) const;  // throws tessera::Error with find_error's message
  std::optional<ParamError> find_beam_error() const;  // best_of, length_penalty, use_beam_search
};

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.f;
};

struct SampleResult {
  int32_t token = 0;
  // Log-probabilities are "raw" (vLLM's default logprobs mode): log_softmax of the model's
  // logits before logit_bias, penalties, temperature and filtering (vLLM v1 computes them
  // before every logits processor, its logit bias included). Filled only when
  // params.logprobs is set.
  float logprob = 0.f;
  std::vector<TokenLogprob> top_logprobs;  // params.logprobs entries, highest first (ties: lower id)
};

// Samples one sequence's tokens. Owns the RNG, so one Sampler per sequence; not thread-safe.
// Processing order (vLLM): logit_bias -> penalties and min-tokens suppression ->
// temperature -> min-p, top-k -> top-p -> draw. Top-k keeps exactly k tokens (ties broken by lower id).
class Sampler {
 public:
  // eos_token_ids: the model's end-of-sequence ids (negative ids are ignored); they are
  // suppressed before min_tokens unless ignore_eos. sample_index: which of the n samples
  // this is; with a seed the RNG starts at seed + sample_index (as vLLM's parallel sampling),
  // so the n samples differ but each is reproducible.
  explicit Sampler(const SamplingParams& params, std::vector<int32_t> eos_token_ids = {},
                   int64_t sample_index = 0);

  // logits: (vocab) f32. prompt_tokens / output_tokens: the sequence so far (repetition
  // penalty looks at both, presence / frequency penalties and min_tokens at the output).
  SampleResult sample(const float* logits, int64_t vocab, const std::vector<int32_t>& prompt_tokens,
                      const std::vector<int32_t>& output_tokens);
  // logits: (V) or (1, V) contiguous f32 tensor.
  SampleResult sample(const Tensor& logits, const std::vector<int32_t>& prompt_tokens = {},
                      const std::vector<int32_t>& output_tokens = {});

  // The logits after logit_bias, penalties and min-tokens suppression, before temperature
  // (for tests).
  std::vector<float> processed_logits(const float* logits, int64_t vocab,
                                      const std::vector<int32_t>& prompt_tokens,
                                      const std::vector<int32_t>& output_tokens);

  // Structured outputs: the next sample() (only) draws from the tokens whose bit is set in
  // `allowed` ((vocab + 63) / 64 words, owned by the caller); the others get -inf before
  // penalties, temperature and filtering. Raw logprobs are unaffected. Null: no mask.
  void set_token_mask(const uint64_t* allowed) { mask_ = allowed; }

  // Consumes the RNG draws of `samples` non-greedy samples (one draw each), as when the
  // sequence's first tokens were sampled by another Sampler with the same seed (prefill/decode
  // disaggregation): the next sample then continues that Sampler's stream.
  void skip_draws(int64_t samples) {
    for (int64_t i = 0; i < samples; ++i) (void)uniform();
  }
  // True when `token` ends the sequence: a stop_token_id, or an EOS id unless ignore_eos.
  bool is_stop_token(int32_t token) const;
  const SamplingParams& params() const { return params_; }

 private:
  const float* process(const float* logits, int64_t vocab, const std::vector<int32_t>& prompt,
                       const std::vector<int32_t>& output);
  int32_t draw(const float* x, int64_t vocab);
  int32_t top_p_cut(const float* x, int64_t vocab, float m, float inv_t, double target,
                    double& kept);
  void fill_logprobs(const float* raw, int64_t vocab, SampleResult& r);
  double uniform();  // in [0, 1), 53 random bits

  SamplingParams params_;
  std::vector<int32_t> eos_;
  std::mt19937_64 rng_;
  // Scratch reused across calls; sized to the vocabulary on first use.
  std::vector<float> work_;      // (V) processed logits
  std::vector<float> probs_;     // (V) unnormalised exp((x - max) / T), 0 where excluded
  std::vector<int32_t> idx_;     // (V) candidate ids
  std::vector<uint16_t> bins_;   // (V) top-p: each token's -log p bin
  std::vector<double> bin_mass_;  // (2048) top-p: probability mass per bin
  std::vector<int32_t> counts_;  // (V) output occurrences; zero between calls
  std::vector<uint8_t> seen_;    // (V) 1 while a token is in touched_; zero between calls
  std::vector<int32_t> touched_;  // distinct ids of prompt + output this call
  // Set by draw(): exp-sum of the processed logits over the whole vocabulary, reused as
  // the log-softmax normaliser when processed == raw and T == 1.
  double full_sum_ = 0.0;
  float full_max_ = 0.f;
  bool processed_is_raw_ = true;
  const uint64_t* mask_ = nullptr;  // set_token_mask(), for one sample() call
};

// Finds stop strings in detokenized output. Generation stops after the first piece that
// completes any stop string; the output is cut before the earliest one in the text at that
// moment (the stop string is not returned, as OpenAI does; vLLM takes the first *listed* stop
// found, we take the earliest position). A stop string may be split across tokens.
// Lengths and positions are in bytes (the caller still holds back an incomplete UTF-8 tail).
class StopChecker {
 public:
  struct Match {
    size_t pos = 0;         // truncate the text to [0, pos)
    size_t stop_index = 0;  // which stop string matched (the first listed on a tie)
  };
  struct Update {
    std::string emit;      // text that is now safe to stream
    bool stopped = false;  // a stop string matched; emit ends right before it
  };

  explicit StopChecker(std::vector<std::string> stop_strings);  // throws on an empty string

  // Stateless helpers on a whole text. find() only looks for matches that end at or after
  // byte `new_from` (earlier text was checked already).
  std::optional<Match> find(std::string_view text, size_t new_from = 0) const;
  // Bytes at the end of `text` that are a proper prefix of some stop string, so they must
  // not be streamed yet (they may become a stop string with the next token).
  size_t hold_back(std::string_view text) const;

  // Incremental use: feed each new piece of text; after stopped, further pieces are ignored.
  Update append(std::string_view piece);
  // When generation ends without a stop string: the held-back text, now safe to emit.
  std::string flush();
  const std::string& text() const { return text_; }  // all output so far (truncated on stop)
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string text_;
  size_t emitted_ = 0;  // bytes of text_ already handed out
  bool stopped_ = false;
};

}  // namespace tessera::infer
