// Engine: request bookkeeping around the scheduler, the flattened model step over the
// paged KV cache, sampling, stop conditions, incremental detokenization, n > 1 samples
// by forking (copy-on-write blocks). Beam search's part is in engine_beam.cc, the
// speculative proposers in engine_speculative.cc, a sequence's state in engine_seq.h.
#include "tessera/infer/engine.h"
#include "tessera/infer/engine_seq.h"

#include "tessera/base/strings.h"
#include "tessera/infer/attention_sinks.h"
#include "tessera/infer/kv_tiers.h"
#include "tessera/infer/structured/guided_runner.h"
#include "tessera/infer/tp_serving.h"

#include <algorithm>
#include <cmath>
#include <unordered_set>

#include "tessera/base/error.h"
#include "tessera/base/trace.h"
#include "tessera/kernels/paged_attention.h"

namespace tessera::infer {


std::string Engine::kv_cache_summary() const {
  const int64_t per_block = KvPool::bytes_per_block(model_.config(), pool_.block_size, model_.dims().kv_heads,
                                                    pool_.dtype);
  const int64_t tokens = pool_.num_blocks * pool_.block_size;
  std::string latent;  // latent attention: against the same model caching every head's k and v
  if (model_.config().uses_mla()) {
    const int64_t mha = KvPool::mha_bytes_per_token(model_.config(), pool_.dtype);
    latent = base::strprintf(" (latent rows; multi-head attention would cache %lld bytes per token: %.1f%%)",
                             (long long)mha, 100.0 * (per_block / pool_.block_size) / mha);
  }
  return base::strprintf("KV cache %s: %lld blocks of %lld tokens (%.1f MB, %lld bytes per token), "
                         "%lld requests of %lld tokens at once",
                         kernels::kv_cache_dtype_name(pool_.dtype), (long long)pool_.num_blocks,
                         (long long)pool_.block_size, pool_.num_blocks * per_block / 1e6,
                         (long long)(per_block / pool_.block_size), (long long)(tokens / max_len_),
                         (long long)max_len_) + latent +
         (config_.streaming() ? base::strprintf("; attention sinks %lld + window %lld: %lld blocks per stream, "
                                                "prefix caching off", (long long)config_.attention_sinks,
                                                (long long)config_.stream_window,
                                                (long long)Scheduler::blocks_per_request(scheduler_->config(),
                                                                                         pool_.block_size))
                              : std::string()) +
         (tiers_ ? "; " + tiers_->summary() : std::string());
}

void EngineConfig::validate() const {
  TESSERA_CHECK(block_size >= 1 && block_size <= 1024, "block_size must be in [1, 1024], got ",
                block_size);
  TESSERA_CHECK(kv_cache_memory >= 0, "kv_cache_memory must not be negative");
  TESSERA_CHECK(kv_cache_fraction > 0 && kv_cache_fraction <= 1,
                "kv_cache_fraction must be in (0, 1], got ", kv_cache_fraction);
  TESSERA_CHECK(max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1");
  TESSERA_CHECK(max_num_seqs >= 1, "max_num_seqs must be >= 1");
  TESSERA_CHECK(max_model_len >= 0, "max_model_len must not be negative");
  TESSERA_CHECK(speculative_method.empty() || speculative_method == "ngram" ||
                    speculative_method == "draft" || speculative_method == "mtp",
                "speculative method must be ngram, draft or mtp, got '", speculative_method, "'");
  TESSERA_CHECK(num_speculative_tokens >= 0 && num_speculative_tokens <= 16,
                "num_speculative_tokens must be in [0, 16], got ", num_speculative_tokens);
  TESSERA_CHECK(speculative_method.empty() || num_speculative_tokens > 0,
                "speculative decoding needs num_speculative_tokens > 0");
  TESSERA_CHECK(ngram_min >= 1 && ngram_max >= ngram_min, "ngram sizes must satisfy 1 <= min <= max");
  validate_attention_sinks(*this);
  validate_kv_tiers(*this);  // kv_tiers.cc
}

Engine::Engine(const model::Model& model, EngineConfig config, const io::Tokenizer* tokenizer,
               const model::Model* draft, TpGroup* tp)
    : model_(model), config_(std::move(config)), tokenizer_(tokenizer), draft_(draft), tp_(tp) {
  config_.validate();
  const auto& c = model_.config();
  TESSERA_CHECK(config_.speculative_method != "draft" || draft_,
                "speculative method draft needs a draft model");
  TESSERA_CHECK(config_.speculative_method != "mtp" || (c.mtp_layers > 0 && !tp_), "--speculative mtp needs a model "
                "with a multi-token prediction module (deepseek num_nextn_predict_layers; ", c.model_type,
                " has none) on one rank");
  TESSERA_CHECK(!draft_ || draft_->config().vocab_size == c.vocab_size, "the draft model's vocabulary (",
                draft_ ? draft_->config().vocab_size : 0, ") differs from the model's (", c.vocab_size,
                "); they must share a tokenizer");
  const int64_t context = model::max_context(c);
  max_len_ = config_.max_model_len > 0 ? config_.max_model_len : context;
  TESSERA_CHECK(max_len_ <= context, "max_model_len ", max_len_, " exceeds the model's ",
                context == c.max_position_embeddings ? "max_position_embeddings " : "context (rope_scaling) ",
                context);
  const int64_t bs = config_.block_size;
  SchedulerConfig sc;
  sc.max_num_batched_tokens = config_.max_num_batched_tokens;
  sc.max_num_seqs = config_.max_num_seqs;
  sc.max_model_len = max_len_;
  sc.chunked_prefill = config_.chunked_prefill;
  sc.sliding_window = c.all_layers_windowed() ? c.sliding_window : 0;
  if (config_.streaming()) {  // attention_sinks.cc; shifted blocks cannot serve as cached prefixes
    check_attention_sinks(config_, c, max_len_, tp_ != nullptr);
    config_.prefix_caching = false;
    sc.attention_sinks = config_.attention_sinks;
    sc.stream_window = config_.stream_window;
  }
  const int64_t blocks_per_seq = Scheduler::blocks_per_request(sc, bs);
  int64_t num_blocks = 0;
  const int64_t kv_heads = model_.dims().kv_heads;  // this rank's (tensor parallelism: 1/tp)
  if (config_.kv_cache_memory > 0) {
    num_blocks = kv_blocks_for_memory(c, bs, config_.kv_cache_memory, kv_heads, config_.kv_cache_dtype);
  } else {
    const int64_t budget = static_cast<int64_t>(static_cast<double>(available_memory_bytes()) *
                                                config_.kv_cache_fraction);
    num_blocks = std::max<int64_t>(
        blocks_per_seq, budget / KvPool::bytes_per_block(c, bs, kv_heads, config_.kv_cache_dtype));
    // More than every running sequence at full length only feeds the prefix cache.
    num_blocks = std::min(num_blocks, 2 * config_.max_num_seqs * blocks_per_seq);
  }
  pool_ = KvPool::create(c, num_blocks, bs, kv_heads, config_.kv_cache_dtype);
  tiers_ = make_kv_tiers(model_, config_, pool_, tp_ != nullptr);  // nullptr without tiers; throws before
  if (tp_) tp_->send_pool(num_blocks, bs, config_.kv_cache_dtype);     // the workers are told anything
  blocks_ = std::make_unique<BlockManager>(BlockManagerConfig{num_blocks, bs, config_.prefix_caching});
  sc.preemption_swap = config_.preemption == "swap";
  scheduler_ = std::make_unique<Scheduler>(sc, *blocks_);
  if (tiers_) blocks_->set_offloader(tiers_.get());
  if (c.eos_token_id >= 0) eos_.push_back(static_cast<int32_t>(c.eos_token_id));
  stats_.kv_blocks_total = num_blocks;
}

Engine::~Engine() {
  if (tp_) tp_->stop();
}

RequestId Engine::add_request(const std::vector<int32_t>& prompt, const SamplingParams& params,
                              int priority, int32_t adapter) {
  return add_request_impl(prompt, {}, params, priority, adapter, false, nullptr);
}

RequestId Engine::add_sequence(const std::vector<int32_t>& prompt, const SamplingParams& params, int priority,
                               int32_t adapter, bool pooling) {
  return add_request_impl(prompt, {}, params, priority, adapter, pooling, nullptr);
}

RequestId Engine::add_resumed_request(const std::vector<int32_t>& prompt, const std::vector<int32_t>& generated,
                                      const SamplingParams& params, int32_t adapter, RequestOutput* primed) {
  if (generated.empty()) fail_field("generated", "a resumed request needs the tokens generated so far");
  if (params.n != 1) fail_field("n", "a resumed request has one sample (n = 1), got n = ", params.n);
  if (static_cast<int64_t>(generated.size()) >= params.max_tokens)
    fail_field("max_tokens", "max_tokens ", params.max_tokens, " leaves nothing to generate after the ",
               generated.size(), " tokens generated so far");
  return add_request_impl(prompt, generated, params, 0, adapter, false, primed);
}

RequestId Engine::add_request_impl(const std::vector<int32_t>& prompt, const std::vector<int32_t>& generated,
                                   const SamplingParams& params, int priority, int32_t adapter,
                                   bool pooling, RequestOutput* primed) {
  const auto& c = model_.config();
  params.validate(c.vocab_size);
  const auto bank = static_cast<int64_t>(model_.lora_bank().size());
  if (adapter < -1 || adapter >= bank)
    fail_field("model", "LoRA adapter ", adapter, " does not exist; the model has ", bank,
               " (-1: the base model)");
  if (adapter >= 0 && tp_) fail_field("model", "LoRA adapters are not served with tensor parallelism");
  if (prompt.empty()) fail_field("prompt", "the prompt is empty");
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] < 0 || prompt[i] >= c.vocab_size)
      fail_field("prompt", "prompt token ", i, " has id ", prompt[i], " outside the vocabulary [0, ",
                 c.vocab_size, ")");
  if (static_cast<int64_t>(prompt.size()) >= max_len_ + (pooling ? 1 : 0) && !config_.streaming())  // room for a token unless pooling
    fail_field("prompt", "the prompt has ", prompt.size(), " tokens; the context length is ", max_len_);
  for (size_t i = 0; i < generated.size(); ++i)
    if (generated[i] < 0 || generated[i] >= c.vocab_size)
      fail_field("generated", "generated token ", i, " has id ", generated[i], " outside the vocabulary");
  if (!generated.empty() && !config_.streaming() && static_cast<int64_t>(prompt.size() + generated.size()) >= max_len_)
    fail_field("generated", "prompt and generated tokens reach the context length ", max_len_);
  if (!params.stop.empty() && !tokenizer_) fail_field("stop", "stop strings need a tokenizer");
  const RequestId id = next_id_;
  next_id_ += params.n;  // ids of the samples: id, id + 1, ...
  auto s = std::make_unique<Seq>();
  s->id = s->group = id;
  s->n = params.n;
  s->adapter = adapter;
  s->prompt = prompt;
  s->params = params;
  s->pooling = pooling;
  s->sampler = std::make_unique<Sampler>(params, eos_, 0);
  if (!params.stop.empty()) s->stop = std::make_unique<StopChecker>(params.stop);
  if (!params.guided.empty()) {
    if (!guided_) guided_ = std::make_unique<structured::GuidedRunner>(tokenizer_, c.vocab_size, eos_);
    s->guided = guided_->start(params);  // its first mask is computed during the prefill
  }
  if (!generated.empty()) resume_seq(*s, generated, primed);
  SchedRequest r;
  r.id = id;
  r.tokens = prompt;
  r.tokens.insert(r.tokens.end(), generated.begin(), generated.end());
  r.num_prompt_tokens = static_cast<int64_t>(prompt.size());
  r.max_tokens = params.max_tokens;
  r.priority = priority;
  r.cache_salt = static_cast<uint64_t>(adapter + 1);  // the base model's chain is salt 0
  // Positions served from the prefix cache have no logits or hidden states to read (vLLM too).
  r.skip_prefix_cache = pooling || params.prompt_logprobs.has_value();
  if (r.skip_prefix_cache) track_prompt(id, prompt, params, pooling);
  if (params.use_beam_search) start_beam_search(id, prompt, params);
  scheduler_->add_request(std::move(r));
  seqs_.emplace(id, std::move(s));
  return id;
}

void Engine::abort_request(RequestId id) {
  for (auto& [sid, s] : seqs_) {
    if (s->group != id || s->finished) continue;
    scheduler_->abort_request(sid);
    s->finished = true;
    aborted_.push_back(sid);
  }
}

bool Engine::has_unfinished() const {
  if (!aborted_.empty()) return true;
  for (const auto& [id, s] : seqs_)
    if (!s->finished) return true;
  return false;
}

RequestOutput& Engine::output_for(std::vector<RequestOutput>& out, const Seq& s) {
  for (auto& o : out)
    if (o.id == s.group && o.index == s.index) return o;
  RequestOutput o;
  o.id = s.group;
  o.index = s.index;
  o.num_prompt_tokens = static_cast<int64_t>(s.prompt.size());
  o.num_cached_tokens = std::max<int64_t>(0, s.cached_tokens);
  out.push_back(std::move(o));
  return out.back();
}

bool Engine::seq_live(RequestId id) const {
  auto it = seqs_.find(id);
  return it != seqs_.end() && !it->second->finished;
}

void Engine::extend_seq(RequestId id, int32_t token) { seqs_.at(id)->output.push_back(token); }

void Engine::fork_seq(RequestId parent, RequestId child, int32_t token) {
  const Seq& p = *seqs_.at(parent);
  auto c = std::make_unique<Seq>();
  c->id = child;
  c->group = p.group;
  c->adapter = p.adapter;
  c->prompt = p.prompt;
  c->output = p.output;
  c->output.back() = token;
  c->params = p.params;
  c->sampler = std::make_unique<Sampler>(p.params, eos_, 0);
  c->cached_tokens = p.cached_tokens;
  c->forked = true;
  seqs_.emplace(child, std::move(c));
}

void Engine::end_seq(RequestId id) { seqs_.at(id)->finished = true; }

void Engine::finish(Seq& s, const std::string& reason, std::vector<RequestOutput>& out) {
  RequestOutput& o = output_for(out, s);
  if (s.stop && !s.stop->stopped()) o.new_text += s.stop->flush();
  o.finished = true;
  o.finish_reason = reason;
  o.num_output_tokens = static_cast<int64_t>(s.output.size());
  s.finished = true;
  if (s.scheduled) scheduler_->finish_request(s.id);
  stats_.finished[reason]++;
}

// Appends a sampled token to the sequence; true when the sequence is finished by it.
bool Engine::append_token(Seq& s, int32_t token, const SampleResult& r, RequestOutput& o) {
  if (s.sampler->is_stop_token(token)) return true;  // the stop token is not part of the output
  s.output.push_back(token);
  o.new_tokens.push_back(token);
  if (s.params.logprobs) o.logprobs.push_back(r);
  o.num_output_tokens = static_cast<int64_t>(s.output.size());
  ++stats_.generation_tokens;
  if (tokenizer_ && !tokenizer_->is_special(token)) {
    // Only the new token's bytes are decoded; a token may end inside a UTF-8 character,
    // whose bytes wait in `pending` for the next one.
    s.pending += tokenizer_->decode_token(token);
    const size_t n = io::complete_utf8_prefix(s.pending);
    if (n > 0) {
      const std::string piece = s.pending.substr(0, n);
      s.pending.erase(0, n);
      if (s.stop) {
        const auto u = s.stop->append(piece);
        o.new_text += u.emit;
        if (u.stopped) return true;
      } else {
        o.new_text += piece;
      }
    }
  }
  return false;
}

// Disaggregation: the sequence continues after `generated`, sampled by another engine. The
// tokens go through append_token as if sampled here (detokenizer, stop strings), uncounted.
void Engine::resume_seq(Seq& s, const std::vector<int32_t>& generated, RequestOutput* primed) {
  RequestOutput o;
  o.id = s.group;
  o.num_prompt_tokens = static_cast<int64_t>(s.prompt.size());
  for (int32_t t : generated) {
    SampleResult r;
    r.token = t;
    if (append_token(s, t, r, o))
      fail_field("generated", "generated token ", t, " already ends the request (a stop token or stop string)");
  }
  stats_.generation_tokens -= static_cast<int64_t>(generated.size());  // the other engine's
  if (!s.params.is_greedy()) s.sampler->skip_draws(static_cast<int64_t>(generated.size()));
  if (primed) *primed = std::move(o);
}

std::vector<RequestOutput> Engine::step() {
  base::TraceScope scope("engine_step");
  std::vector<RequestOutput> out;
  started_.clear();
  for (RequestId sid : aborted_) {
    auto it = seqs_.find(sid);
    if (it == seqs_.end()) continue;
    RequestOutput& o = output_for(out, *it->second);
    o.finished = true;
    o.finish_reason = "abort";
    stats_.finished["abort"]++;
    seqs_.erase(it);
  }
  aborted_.clear();
  prune_prompt_work();

  if (config_.num_speculative_tokens > 0) {
    // Proposals for every running decode; the scheduler fits what the budget allows.
    for (auto& [sid, sp] : seqs_) {
      Seq& q = *sp;
      q.spec.clear();
      const SchedRequest* r = scheduler_->find(sid);
      if (q.finished || q.pooling || !r || r->status != RequestStatus::kRunning ||
          static_cast<int64_t>(r->tokens.size()) != r->num_computed_tokens + 1)
        continue;
      // Never propose past max_tokens (one token is sampled besides the proposals).
      const int64_t room = q.params.max_tokens - static_cast<int64_t>(q.output.size()) - 1;
      if (room <= 0) continue;
      q.spec = propose(q);
      if (static_cast<int64_t>(q.spec.size()) > room) q.spec.resize(room);
      if (!q.spec.empty()) scheduler_->set_spec_tokens(sid, q.spec);
    }
  }
  const SchedulerOutput so = scheduler_->schedule();
  ++stats_.steps;
  stats_.batched_tokens += so.num_batched_tokens;
  if (so.requests.empty()) {
    if (!beam_groups_.empty()) requeue_parked_beams();
    return out;
  }
  StepPlan plan;
  plan.copies.assign(so.copies.begin(), so.copies.end());

  // The flattened batch: every scheduled request's tokens, positions and block table.
  const int64_t N = so.num_batched_tokens;
  Tensor ids = Tensor::empty({N}, DType::kI32), positions = Tensor::empty({N}, DType::kI32);
  std::vector<kernels::PagedSequence> seqs;
  std::vector<int64_t> rows;
  struct Sampling {
    Seq* seq;
    int64_t num_spec;  // logits rows: 1 + num_spec, from the last known token on
  };
  std::vector<Sampling> sampling;
  struct Span {  // a request's rows of this step (--speculative mtp)
    RequestId id;
    int64_t start, num_tokens, row0;
  };
  std::vector<Span> spans;
  std::vector<int32_t> adapters;  // per row (multi-LoRA), only when some row has an adapter
  bool any_adapter = false;
  int64_t row = 0;
  for (const ScheduledRequest& sr : so.requests) {
    const SchedRequest* r = scheduler_->find(sr.id);
    Seq& s = *seqs_.at(sr.id);
    if (s.cached_tokens < 0) {  // first admission: the prefix hit
      s.cached_tokens = sr.start;
      if (s.index == 0) started_.push_back(s.group);
    }
    const int64_t known = sr.num_tokens - sr.num_spec;
    for (int64_t i = 0; i < sr.num_tokens; ++i) {
      ids.data<int32_t>()[row + i] =
          i < known ? r->tokens[sr.start + i] : s.spec[static_cast<size_t>(i - known)];
      positions.data<int32_t>()[row + i] = static_cast<int32_t>(sr.start - sr.shift + i);  // cache positions
    }
    if (sr.num_spec > 0) {
      ++stats_.spec_steps;
      stats_.spec_proposed += sr.num_spec;
    }
    if (sr.start < r->num_prompt_tokens)
      stats_.prompt_tokens += std::min(sr.start + sr.num_tokens, r->num_prompt_tokens) - sr.start;
    spans.push_back({sr.id, sr.start, sr.num_tokens, row});
    if (!prompt_work_.empty()) plan_prompt_read(sr.id, sr.start, sr.num_tokens, row);
    if (!model_.lora_bank().empty()) {
      adapters.insert(adapters.end(), static_cast<size_t>(sr.num_tokens), s.adapter);
      any_adapter = any_adapter || s.adapter >= 0;
    }
    kernels::PagedSequence ps;
    ps.q_begin = row;
    ps.q_len = sr.num_tokens;
    ps.context_len = sr.start + sr.num_tokens - sr.shift;
    const auto& table = blocks_->block_table(sr.id);
    const int64_t used = (ps.context_len + config_.block_size - 1) / config_.block_size;
    plan.tables.emplace_back(table.begin(), table.begin() + std::min<int64_t>(used, table.size()));
    seqs.push_back(ps);
    row += sr.num_tokens;
    if (sr.samples && !s.pooling) {
      for (int64_t i = sr.num_spec; i >= 0; --i) rows.push_back(row - 1 - i);
      sampling.push_back({&s, sr.num_spec});
    }
  }
  const bool read_hidden = add_prompt_rows(rows);  // prompt logprobs' rows follow the sampled ones
  for (size_t i = 0; i < seqs.size(); ++i) seqs[i].block_table = plan.tables[i].data();
  for (const KvShift& k : so.shifts) plan.shifts.push_back({blocks_->block_table(k.id), k.sinks, k.length, k.delta});
  plan.ids = ids;
  plan.positions = positions;
  plan.seqs = std::move(seqs);
  plan.rows = std::move(rows);
  plan.batch_invariant = config_.batch_invariant;
  if (any_adapter) plan.adapters = std::move(adapters);
  if (tp_) tp_->send_step(plan);  // the workers run their shards of the same step
  const bool mtp = config_.speculative_method == "mtp";
  Tensor hidden;
  const Tensor logits = run_step(model_, pool_, plan, mtp || read_hidden ? &hidden : nullptr);
  read_prompt_rows(logits, hidden, out);

  // Sample, then let the scheduler advance every request; finish sequences after that.
  const int64_t V = model_.config().vocab_size;
  std::vector<std::pair<RequestId, int32_t>> sampled;
  std::vector<std::pair<Seq*, std::string>> done;
  std::vector<std::pair<RequestId, int32_t>> forks;  // (child id, its first token)
  int64_t logit_row = 0;
  for (const Sampling& sm : sampling) {
    Seq& s = *sm.seq;
    const float* lg = logits.data<float>() + logit_row * V;
    logit_row += 1 + sm.num_spec;
    // Samples one token from logits `x`; true when the sequence ended with it.
    auto sample_into = [&](Seq& q, const float* x, int32_t* token) {
      if (q.guided) {  // structured outputs: wait for the mask the worker computed during the forward
        const uint64_t* allowed = guided_->wait(*q.guided);
        if (!allowed) {  // the grammar is complete: nothing else may be generated
          *token = eos_.empty() ? 0 : eos_[0];
          done.emplace_back(&q, "stop");
          return true;
        }
        q.sampler->set_token_mask(allowed);
      }
      const SampleResult r = q.sampler->sample(x, V, q.prompt, q.output);
      *token = r.token;
      RequestOutput& o = output_for(out, q);
      if (append_token(q, r.token, r, o)) {
        done.emplace_back(&q, "stop");
        return true;
      }
      if (static_cast<int64_t>(q.output.size()) >= q.params.max_tokens ||
          (static_cast<int64_t>(q.prompt.size() + q.output.size()) >= max_len_ && !config_.streaming())) {
        done.emplace_back(&q, "length");
        return true;
      }
      if (q.guided) guided_->advance(q.guided, r.token);  // the next mask, overlapped with the next forward
      return false;
    };
    int32_t tok = 0;
    bool ended = false;
    if (sm.num_spec > 0) {
      // Verification: position i's logits decide token i; a proposal is kept while it is
      // what the target model picks (greedy: identical to decoding without proposals).
      for (int64_t i = 0; i <= sm.num_spec && !ended; ++i) {
        ended = sample_into(s, lg + i * V, &tok);
        sampled.emplace_back(s.id, tok);
        if (i == sm.num_spec || tok != s.spec[static_cast<size_t>(i)]) break;
        ++stats_.spec_accepted;
        ++s.draft_valid;  // the draft's K/V of this proposal stays valid
      }
      continue;
    }
    if (!beam_groups_.empty() && collect_beam(s.group, s.id, s.cached_tokens, lg)) continue;
    ended = sample_into(s, lg, &tok);
    sampled.emplace_back(s.id, tok);
    if (s.n > 1 && !s.forked) {  // the prompt is computed: the other samples fork from it
      s.forked = true;
      for (int64_t k = 1; k < s.n; ++k) {
        auto c = std::make_unique<Seq>();
        c->id = s.group + k;
        c->group = s.group;
        c->index = k;
        c->adapter = s.adapter;
        c->prompt = s.prompt;
        c->params = s.params;
        c->sampler = std::make_unique<Sampler>(s.params, eos_, k);
        if (s.guided) c->guided = guided_->restart(*s.guided);
        if (!s.params.stop.empty()) c->stop = std::make_unique<StopChecker>(s.params.stop);
        c->cached_tokens = s.cached_tokens;
        c->forked = true;
        Seq& cr = *c;
        seqs_.emplace(c->id, std::move(c));
        int32_t ctok = 0;
        sample_into(cr, lg, &ctok);
        forks.emplace_back(cr.id, ctok);
      }
    }
  }
  scheduler_->update(so, sampled);
  if (!beam_groups_.empty()) advance_beams(out);
  std::unordered_set<const Seq*> ended;
  for (const auto& [q, reason] : done) ended.insert(q);
  if (mtp)  // the module follows every running sequence's accepted positions
    for (const Span& sp : spans) {
      auto it = seqs_.find(sp.id);
      if (it == seqs_.end() || it->second->finished || ended.count(it->second.get())) continue;
      advance_mtp(*it->second, sp.start, sp.num_tokens, hidden, sp.row0);
    }
  for (const auto& [child, tok] : forks) {
    Seq& c = *seqs_.at(child);
    if (ended.count(&c)) {
      c.scheduled = false;  // finished with its first token: it never joins the scheduler
      continue;
    }
    scheduler_->fork_request(c.group, child, tok);
  }
  for (auto& [s, reason] : done) {
    if (s->finished) continue;
    finish(*s, reason, out);
  }
  attach_prompt_logprobs(out);
  for (auto it = seqs_.begin(); it != seqs_.end();)
    it = it->second->finished ? seqs_.erase(it) : std::next(it);
  return out;
}

structured::GuidedStats Engine::guided_stats() const {
  return guided_ ? guided_->stats() : structured::GuidedStats{};
}

EngineStats Engine::stats() const {
  EngineStats s = stats_;
  const auto b = blocks_->stats();
  s.prefix_queries = b.queries;
  s.prefix_hit_blocks = b.hit_blocks + b.tier_hit_blocks;  // every block not recomputed
  s.prefix_miss_blocks = b.miss_blocks;
  s.preemptions = scheduler_->num_preemptions() + beams_requeued_;
  s.running = static_cast<int64_t>(scheduler_->num_running());
  s.waiting = static_cast<int64_t>(scheduler_->num_waiting());
  s.kv_blocks_used = s.kv_blocks_total - blocks_->num_free_blocks();
  s.swapped_preemptions = scheduler_->num_swapped_preemptions();
  if (tiers_) add_kv_tier_stats(*tiers_, s);
  s.expert_tokens = model_.expert_load();
  return s;
}

KvUsage Engine::kv_usage() const {
  KvUsage u;
  const int64_t bs = config_.block_size;
  std::unordered_map<BlockId, int64_t> filled;  // physical block -> slots holding K/V
  for (RequestId id : scheduler_->running()) {
    const SchedRequest* r = scheduler_->find(id);
    if (!r || !blocks_->has_request(id)) continue;
    ++u.sequences;
    const int64_t cached = r->num_computed_tokens - r->shift;  // attention sinks: the rows held
    u.seq_tokens += cached;
    const auto& table = blocks_->block_table(id);
    for (size_t i = 0; i < table.size(); ++i) {
      const int64_t n = std::clamp<int64_t>(cached - static_cast<int64_t>(i) * bs, 0, bs);
      int64_t& f = filled[table[i]];
      f = std::max(f, n);
    }
  }
  u.blocks = static_cast<int64_t>(filled.size());
  for (const auto& [b, n] : filled) u.tokens += n;
  return u;
}

}  // namespace tessera::infer
