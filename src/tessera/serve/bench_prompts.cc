// bench serve --url prompts: token ids, tokenizer-decoded random text, text-file windows.
#include "tessera/serve/bench_prompts.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <random>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/infer/bench_serve.h"
#include "tessera/io/json_file.h"

namespace tessera::serve {
namespace {

constexpr int64_t kWarmupTokens = 16;  // the warm-up's tokens after the shared prefix (as offline)
constexpr int kMaxFitRounds = 10;      // decode / re-encode rounds to hit a prompt length

int64_t draw_length(std::mt19937_64& rng, const infer::LengthRange& r) {
  if (r.min == r.max) return r.min;
  return std::uniform_int_distribution<int64_t>(r.min, r.max)(rng);
}

void check_fits(int64_t prefix, int64_t plen, int64_t olen, int64_t max_len, const char* unit) {
  TESSERA_CHECK(prefix + plen + olen <= max_len, "bench serve: a prompt of ", prefix + plen, " ", unit,
                " + --output-len ", olen, " exceeds the server's context length ", max_len,
                " (max_model_len in /v1/models)");
}

bool is_valid_utf8(const std::string& s) {
  try {
    (void)nlohmann::json(s).dump();
    return true;
  } catch (const nlohmann::json::exception&) {
    return false;
  }
}

// Random token ids rendered as text through a tokenizer.
class RandomText {
 public:
  RandomText(const io::Tokenizer& tok, int64_t vocab, uint64_t seed) : tok_(tok), rng_(seed) {
    const int64_t n = std::min(vocab, tok.vocab_size());
    in_pool_.assign(static_cast<size_t>(std::max<int64_t>(n, 0)), false);
    // Tokens that are whole UTF-8 text on their own: a byte token of a multi-byte character
    // would decode to U+FFFD, which re-encodes longer, and the fit would never settle.
    for (int32_t id = 0; id < n; ++id) {
      if (tok.is_special(id) || tok.id_to_token(id).empty()) continue;
      const std::string bytes = tok.decode_token(id);
      if (bytes.empty() || io::complete_utf8_prefix(bytes) != bytes.size() || !is_valid_utf8(bytes)) continue;
      pool_.push_back(id);
      in_pool_[static_cast<size_t>(id)] = true;
    }
    TESSERA_CHECK(pool_.size() >= 2, "--tokenizer: only ", pool_.size(),
                  " non-special tokens below the vocabulary size ", n, ": too few for random prompts");
  }

  // Text that re-encodes to ids.size() tokens when the tokenizer allows it (a few rounds of
  // decode, re-encode, cut or top up); *tokens is what it re-encodes to.
  std::string fit(const std::vector<int32_t>& ids, int64_t* tokens) {
    const size_t target = ids.size();
    std::vector<int32_t> cur;
    cur.reserve(target);
    for (int32_t id : ids)  // the generator's ids, kept when they are ordinary tokens
      cur.push_back(id >= 0 && static_cast<size_t>(id) < in_pool_.size() && in_pool_[static_cast<size_t>(id)]
                        ? id
                        : pool_[static_cast<size_t>(id) % pool_.size()]);
    std::string text;
    std::vector<int32_t> re;
    for (int round = 0;; ++round) {
      text = tok_.decode(cur, false);
      re = tok_.encode(text, false);
      if (re.size() == target || round == kMaxFitRounds) break;
      // Cut to the length, never inside a character, and top up with random tokens.
      size_t cut = std::min(re.size(), target);
      std::string bytes;
      for (size_t k = 0; k < cut; ++k) bytes += tok_.decode_token(re[k]);
      while (cut > 0 && io::complete_utf8_prefix(bytes) != bytes.size()) {
        bytes.resize(bytes.size() - tok_.decode_token(re[cut - 1]).size());
        --cut;
      }
      cur.assign(re.begin(), re.begin() + static_cast<std::ptrdiff_t>(cut));
      std::uniform_int_distribution<size_t> d(0, pool_.size() - 1);
      while (cur.size() < target) cur.push_back(pool_[d(rng_)]);
    }
    *tokens = static_cast<int64_t>(re.size());
    return text;
  }

  int64_t count(const std::string& text) const { return static_cast<int64_t>(tok_.encode(text, false).size()); }

 private:
  const io::Tokenizer& tok_;
  std::mt19937_64 rng_;  // top-up tokens only
  std::vector<int32_t> pool_;
  std::vector<bool> in_pool_;
};

std::vector<HttpPrompt> random_prompts(const HttpBenchOptions& o, const io::Tokenizer* tok, int64_t vocab,
                                       int64_t max_len, HttpPrompt* warmup) {
  infer::ServeBenchOptions gen;
  gen.num_requests = o.num_requests;
  gen.prompt_len = o.prompt_len;
  int64_t longest = 0;
  for (const auto& [len, w] : o.prompt_mix) longest = std::max(longest, len);
  if (longest > 0) gen.prompt_len = {longest, longest};  // cut to each request's drawn length below
  gen.output_len = o.output_len;
  gen.shared_prefix = o.shared_prefix;
  gen.seed = o.seed;
  infer::BenchRequest w;
  std::vector<infer::BenchRequest> reqs = infer::make_bench_requests(gen, vocab, max_len, &w);
  if (!o.prompt_mix.empty()) {  // each request's length drawn from the mix (its own seeded stream)
    std::vector<double> weights;
    for (const auto& m : o.prompt_mix) weights.push_back(m.second);
    std::discrete_distribution<size_t> pick(weights.begin(), weights.end());
    std::mt19937_64 rng(o.seed ^ 0x6d69786c656e73ull);
    for (auto& r : reqs) r.prompt.resize(static_cast<size_t>(o.shared_prefix + o.prompt_mix[pick(rng)].first));
  }
  std::vector<HttpPrompt> out;
  out.reserve(reqs.size());
  if (!tok) {
    for (const auto& r : reqs)
      out.push_back(HttpPrompt{false, r.prompt, "", static_cast<int64_t>(r.prompt.size()), true, r.max_tokens});
    *warmup = HttpPrompt{false, w.prompt, "", static_cast<int64_t>(w.prompt.size()), true, w.max_tokens};
    return out;
  }
  // The prefix is rendered once, so every prompt starts with the same text.
  RandomText rt(*tok, vocab, o.seed ^ 0x5bd1e995ull);
  const auto split = static_cast<std::ptrdiff_t>(o.shared_prefix);
  int64_t fitted = 0;  // tokens of the last text fit() made
  const std::string prefix =
      o.shared_prefix > 0 ? rt.fit(std::vector<int32_t>(w.prompt.begin(), w.prompt.begin() + split), &fitted) : "";
  auto render = [&](const infer::BenchRequest& r) {
    HttpPrompt p;
    p.as_text = true;
    p.text = prefix + rt.fit(std::vector<int32_t>(r.prompt.begin() + split, r.prompt.end()), &fitted);
    p.tokens = prefix.empty() ? fitted : rt.count(p.text);  // the joint may merge tokens
    p.max_tokens = r.max_tokens;
    return p;
  };
  for (const auto& r : reqs) {
    out.push_back(render(r));
    check_fits(0, out.back().tokens, r.max_tokens, max_len, "tokens");
  }
  *warmup = render(w);
  return out;
}

std::vector<HttpPrompt> text_prompts(const HttpBenchOptions& o, const io::Tokenizer* tok, int64_t max_len,
                                     HttpPrompt* warmup) {
  const std::string& path = o.dataset_path;
  const std::string text = io::read_file_bytes(path);
  TESSERA_CHECK(is_valid_utf8(text), "--dataset-path ", path, ": not UTF-8 text");
  // Units: tokens of the tokenizer, else whitespace-separated words (about one token each).
  std::vector<int32_t> ids;
  std::vector<std::string> words;
  if (tok) {
    ids = tok->encode(text, false);
  } else {
    size_t i = 0;
    while (i < text.size()) {
      while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
      const size_t start = i;
      while (i < text.size() && !std::isspace(static_cast<unsigned char>(text[i]))) ++i;
      if (i > start) words.push_back(text.substr(start, i - start));
    }
  }
  const int64_t units = tok ? static_cast<int64_t>(ids.size()) : static_cast<int64_t>(words.size());
  const char* unit = tok ? "tokens" : "words";
  TESSERA_CHECK(units >= o.prompt_len.max, "--dataset-path ", path, " has ", units, " ", unit,
                (tok ? " (by --tokenizer)" : ""), ", fewer than the longest prompt (", o.prompt_len.max,
                "); give a longer file or a smaller --prompt-len");
  auto window = [&](int64_t start, int64_t n) {
    HttpPrompt p;
    p.as_text = true;
    if (tok) {
      p.text = tok->decode(std::vector<int32_t>(ids.begin() + start, ids.begin() + start + n), false);
      p.tokens = static_cast<int64_t>(tok->encode(p.text, false).size());
    } else {
      for (int64_t k = start; k < start + n; ++k) p.text += (k > start ? " " : "") + words[static_cast<size_t>(k)];
      p.tokens = n;
      p.tokens_exact = false;
    }
    return p;
  };
  std::mt19937_64 rng(o.seed);
  std::vector<HttpPrompt> out;
  for (int64_t i = 0; i < o.num_requests; ++i) {
    const int64_t plen = draw_length(rng, o.prompt_len), olen = draw_length(rng, o.output_len);
    check_fits(0, plen, olen, max_len, unit);
    const int64_t start = std::uniform_int_distribution<int64_t>(0, units - plen)(rng);
    out.push_back(window(start, plen));
    out.back().max_tokens = olen;
  }
  *warmup = window(0, std::min(kWarmupTokens, units));
  warmup->max_tokens = 1;
  return out;
}

}  // namespace

io::Tokenizer load_bench_tokenizer(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  TESSERA_CHECK(fs::exists(path, ec), "--tokenizer ", path, ": no such directory");
  if (fs::is_directory(path, ec))
    TESSERA_CHECK(fs::is_regular_file(fs::path(path) / "tokenizer.json", ec), "--tokenizer ", path,
                  ": no tokenizer.json in this directory (pass the model's Hugging Face directory)");
  try {
    return io::Tokenizer::load(path);
  } catch (const Error& e) {
    fail("--tokenizer ", path, ": ", e.what());
  }
}

std::vector<std::pair<int64_t, double>> parse_prompt_mix(const std::string& text) {
  std::vector<std::pair<int64_t, double>> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = std::min(text.find(',', pos), text.size());
    const std::string item = text.substr(pos, comma - pos);
    const size_t colon = item.find(':');
    int64_t len = 0;
    double w = 0;
    try {
      size_t a = 0, b = 0;
      TESSERA_CHECK(colon != std::string::npos, "");
      len = std::stoll(item.substr(0, colon), &a);
      w = std::stod(item.substr(colon + 1), &b);
      TESSERA_CHECK(a == colon && b == item.size() - colon - 1, "");
    } catch (const std::exception&) {
      len = 0;
    }
    TESSERA_CHECK(len >= 1 && w > 0 && std::isfinite(w), "--prompt-len-mix: '", item,
                  "' is not LEN:WEIGHT (a length >= 1 and a weight > 0), e.g. 64:0.8,1024:0.2");
    out.emplace_back(len, w);
    pos = comma + 1;
  }
  return out;
}

std::vector<HttpPrompt> make_http_prompts(const HttpBenchOptions& o, const io::Tokenizer* tok, int64_t vocab,
                                          int64_t max_len, HttpPrompt* warmup) {
  TESSERA_CHECK(o.prompt_mix.empty() || o.dataset != "text",
                "--prompt-len-mix needs random prompts (--dataset random or shared-prefix), not --dataset text");
  if (o.dataset == "text") return text_prompts(o, tok, max_len, warmup);
  return random_prompts(o, tok, vocab, max_len, warmup);
}

}  // namespace tessera::serve
