// The engine's structured-output worker: one thread that takes (sequence, accepted token)
// jobs in order, so a sequence's masks come out in the order its tokens were accepted.
#include "tessera/infer/structured/guided_runner.h"

#include <algorithm>
#include <cstring>

#include "tessera/base/error.h"
#include "tessera/infer/structured/convert.h"
#include "tessera/io/tokenizer.h"

namespace tessera::infer::structured {
namespace {

constexpr size_t kMaxCached = 64;          // compiled constraints kept
constexpr size_t kMaxSharedStates = 200000;  // a grammar past this is not shared with new requests

double us_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

GuidedRunner::GuidedRunner(const io::Tokenizer* tokenizer, int64_t vocab, std::vector<int32_t> eos)
    : tokenizer_(tokenizer), vocab_(vocab), eos_(std::move(eos)) {
  worker_ = std::thread([this] { loop(); });
}

GuidedRunner::~GuidedRunner() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

std::shared_ptr<TokenGrammar> GuidedRunner::grammar(const GuidedDecoding& g) {
  const std::string key = g.type + '\n' + g.spec;
  for (auto it = cache_.begin(); it != cache_.end(); ++it)
    if (it->first == key) {
      if (it->second->num_states() > kMaxSharedStates) {  // grown large: new requests start afresh
        cache_.erase(it);
        break;
      }
      cache_.splice(cache_.begin(), cache_, it);
      return it->second;
    }
  const auto t0 = std::chrono::steady_clock::now();
  if (!trie_) {
    trie_ = VocabTrie::from_tokenizer(*tokenizer_, vocab_);
    std::lock_guard<std::mutex> lock(mu_);
    stats_.vocab_us += us_since(t0);
  }
  const auto t1 = std::chrono::steady_clock::now();
  Grammar compiled;
  try {
    compiled = compile_guided(g);
  } catch (const FieldError&) {
    throw;
  } catch (const Error& e) {
    const std::string field = guided_field(g);
    fail_field(field, "'", field, "': ", e.what());
  }
  auto tg = std::make_shared<TokenGrammar>(std::move(compiled), trie_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.grammars;
    stats_.compile_us += us_since(t1);
  }
  cache_.emplace_front(key, tg);
  if (cache_.size() > kMaxCached) cache_.pop_back();
  return tg;
}

std::shared_ptr<GuidedSeq> GuidedRunner::start(const SamplingParams& params) {
  if (!tokenizer_)
    fail_field(guided_field(params.guided), "structured outputs (", guided_field(params.guided),
               ") need the model's tokenizer");
  auto s = std::make_shared<GuidedSeq>();
  s->g_ = grammar(params.guided);
  s->state_ = s->g_->initial();
  for (int32_t t : params.stop_token_ids) s->enders_.push_back(t);
  if (!params.ignore_eos) s->enders_.insert(s->enders_.end(), eos_.begin(), eos_.end());
  submit({s, -1});
  return s;
}

std::shared_ptr<GuidedSeq> GuidedRunner::restart(const GuidedSeq& like) {
  auto s = std::make_shared<GuidedSeq>();
  s->g_ = like.g_;
  s->enders_ = like.enders_;
  s->state_ = s->g_->initial();
  submit({s, -1});
  return s;
}

void GuidedRunner::advance(const std::shared_ptr<GuidedSeq>& s, int32_t token) { submit({s, token}); }

void GuidedRunner::submit(Job job) {
  {
    std::lock_guard<std::mutex> l(job.seq->mu_);
    job.seq->ready_ = false;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void GuidedRunner::loop() {
  while (true) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stop_ and nothing left
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    run(job);
  }
}

void GuidedRunner::run(Job& job) {
  const auto t0 = std::chrono::steady_clock::now();
  GuidedSeq& s = *job.seq;
  bool walked = false;
  try {
    if (job.token >= 0) s.state_ = s.g_->advance_token(s.state_, job.token);
    s.complete_ = s.state_ == TokenGrammar::kDead || s.g_->finished(s.state_);
    if (!s.complete_) {
      const auto m = s.g_->mask(s.state_, &walked);
      s.allowed_.assign(m->begin(), m->end());
      bool any = std::any_of(s.allowed_.begin(), s.allowed_.end(), [](uint64_t w) { return w != 0; });
      if (s.g_->accepting(s.state_))
        for (int32_t t : s.enders_)
          if (t >= 0 && t < vocab_) {
            s.allowed_[t >> 6] |= uint64_t{1} << (t & 63);
            any = true;
          }
      // No token can continue (a byte the vocabulary cannot spell): end rather than fail.
      s.complete_ = !any;
    }
  } catch (const std::exception&) {
    s.complete_ = true;  // out of memory in the caches: the sequence ends here
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.compute_us += us_since(t0);
    stats_.walks += walked ? 1 : 0;
  }
  {
    std::lock_guard<std::mutex> l(s.mu_);
    s.ready_ = true;
  }
  s.cv_.notify_all();
}

const uint64_t* GuidedRunner::wait(GuidedSeq& s) {
  const auto t0 = std::chrono::steady_clock::now();
  {
    std::unique_lock<std::mutex> l(s.mu_);
    s.cv_.wait(l, [&] { return s.ready_; });
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.exposed_us += us_since(t0);
    ++stats_.masks;
  }
  return s.complete_ ? nullptr : s.allowed_.data();
}

GuidedStats GuidedRunner::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace tessera::infer::structured
