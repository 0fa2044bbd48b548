// Chat data for supervised fine-tuning: a JSONL of conversations rendered with a model's chat
// template (serve/chat_sft.h) into a chat data directory (train/chat_data.h). Used by
// `tessera data prepare --format chat` and by `tessera train` with data.format = "chat" and
// data.path.
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include <xxhash.h>

#include "tessera/base/error.h"
#include "tessera/cli/commands.h"
#include "tessera/io/json_file.h"
#include "tessera/io/tokenizer.h"
#include "tessera/serve/chat_sft.h"
#include "tessera/serve/chat_template.h"
#include "tessera/train/chat_data.h"

namespace tessera::cli {
namespace fs = std::filesystem;
namespace {

// xxh64 over the JSONL, the template and the tokenizer, as 16 hex digits: a rendering is reused
// only when all three are as they were.
std::string digest(const std::string& jsonl, const serve::ChatTemplate& tmpl, const io::Tokenizer& tok) {
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0);
  const std::string bytes = io::read_file_bytes(jsonl);
  const std::string tokenizer = tok.to_json().dump();
  for (const std::string* s : {&bytes, &tmpl.source(), &tmpl.bos_token(), &tmpl.eos_token(), &tokenizer}) {
    const uint64_t n = s->size();
    XXH64_update(st, &n, sizeof n);
    XXH64_update(st, s->data(), s->size());
  }
  const uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, h);
  return buf;
}

int world_rank() {
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMI_RANK"})
    if (const char* r = std::getenv(v); r && *r) return std::atoi(r);
  return 0;
}

}  // namespace

ChatPrepareResult prepare_chat_data(const ChatPrepareOptions& o) {
  TESSERA_CHECK(fs::is_regular_file(o.jsonl), o.jsonl, ": conversation file not found");
  TESSERA_CHECK(o.val_fraction >= 0 && o.val_fraction < 1, "chat data: val fraction ", o.val_fraction,
                " must be in [0, 1)");
  const io::Tokenizer tok = io::Tokenizer::load(o.tokenizer_dir);
  // A tokenizer without a template (a base model) gets ChatML, as the server renders its chats.
  const serve::ChatTemplate tmpl = serve::ChatTemplate::from_tokenizer(tok);
  ChatPrepareResult r;
  r.out_dir = o.out_dir;
  const std::string want = digest(o.jsonl, tmpl, tok);
  const auto current = [&] {
    return train::is_chat_data(o.out_dir) && train::read_chat_meta(o.out_dir).source_digest == want;
  };
  if (o.reuse && current()) {
    r.reused = true;
    r.meta = train::read_chat_meta(o.out_dir);
    return r;
  }
  if (o.reuse && world_rank() != 0) {
    // Under mpirun rank 0 renders; the others wait for its directory.
    for (int i = 0; i < 6000 && !current(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    TESSERA_CHECK(current(), o.out_dir, ": rank 0 did not finish rendering ", o.jsonl, " within 10 minutes");
    r.reused = true;
    r.meta = train::read_chat_meta(o.out_dir);
    return r;
  }
  TESSERA_CHECK(!fs::exists(o.out_dir) || train::is_chat_data(o.out_dir) || fs::is_empty(o.out_dir), o.out_dir,
                ": exists and is not a chat data directory (not replaced)");
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<serve::SftExample> all = serve::render_sft_file(o.jsonl, tmpl, tok);
  TESSERA_CHECK(!all.empty(), o.jsonl, ": no conversations");
  const size_t n_val = static_cast<size_t>(std::floor(static_cast<double>(all.size()) * o.val_fraction));
  std::vector<train::ChatDocument> train_docs, val_docs;
  for (size_t i = 0; i < all.size(); ++i)
    (i < all.size() - n_val ? train_docs : val_docs).push_back({std::move(all[i].tokens), std::move(all[i].mask)});
  train::ChatDataMeta meta;
  meta.vocab_size = tok.vocab_size();
  meta.eos_id = tok.eos_id();
  meta.pad_id = tok.eos_id() >= 0 ? tok.eos_id() : 0;
  meta.tokenizer = o.tokenizer_dir;
  meta.source = o.jsonl;
  meta.source_digest = want;
  meta.template_origin = tok.chat_template().empty() ? "ChatML (the tokenizer has none)" : tok.chat_template_origin();
  // Into a fresh directory beside the old one, which it replaces only once complete.
  const std::string tmp = o.out_dir + ".tmp-" + std::to_string(::getpid());
  std::error_code ec;
  fs::remove_all(tmp, ec);
  train::write_chat_data(tmp, meta, train_docs, val_docs);
  fs::remove_all(o.out_dir, ec);
  fs::rename(tmp, o.out_dir, ec);
  TESSERA_CHECK(!ec, o.out_dir, ": cannot move the rendered data into place: ", ec.message());
  r.meta = train::read_chat_meta(o.out_dir);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

std::string describe_chat_data(const ChatPrepareResult& r) {
  const auto& m = r.meta;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "%s %s: %lld train conversations (%lld tokens, %lld trained on), %lld val (%lld tokens, %lld "
                "trained on)%s",
                r.reused ? "chat data (up to date)" : "wrote chat data", r.out_dir.c_str(),
                static_cast<long long>(m.train_docs), static_cast<long long>(m.train_tokens),
                static_cast<long long>(m.train_trained), static_cast<long long>(m.val_docs),
                static_cast<long long>(m.val_tokens), static_cast<long long>(m.val_trained),
                r.reused ? "" : (" in " + std::to_string(r.seconds).substr(0, 5) + " s").c_str());
  return buf;
}

}  // namespace tessera::cli
