// prepare_data: encodes text files with a trained tokenizer and writes train/val token
// shards into a temporary directory that replaces --out only once it is complete.
#include "tessera/train/data_prepare.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string_view>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/base/mix64.h"
#include "tessera/base/timer.h"
#include "tessera/io/json_file.h"
#include "tessera/io/tokenizer.h"
#include "tessera/train/token_shard.h"

namespace tessera::train {
namespace fs = std::filesystem;
namespace {

// Throws naming the file and byte offset of the first byte that breaks UTF-8 (overlong
// forms, surrogates and code points above U+10FFFF included).
void check_utf8(const std::string& s, const std::string& path) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned c = p[i];
    size_t len;
    unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c < 0x80) {
      ++i;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;  // no overlongs
      if (c == 0xED) hi = 0x9F;  // no surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;  // <= U+10FFFF
    } else {
      len = 0;
    }
    bool ok = len > 0 && i + len <= n && p[i + 1] >= lo && p[i + 1] <= hi;
    for (size_t k = 2; ok && k < len; ++k) ok = (p[i + k] & 0xC0) == 0x80;
    if (!ok) {
      char byte[8];
      std::snprintf(byte, sizeof byte, "0x%02X", c);
      fail(path, ": not UTF-8 text (invalid byte ", byte, " at offset ", i, ")");
    }
    i += len;
  }
}

bool visible_ascii(char c) { return c > 0x20 && c < 0x7F; }

// The absolute output path without a trailing separator ("out/" and "out" are the same).
fs::path normalize_out(const std::string& out) {
  fs::path p = fs::absolute(fs::path(out)).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p;
}

// An existing --out may only be replaced when it is an earlier data directory or empty;
// anything else is the user's and is never touched.
void check_replaceable(const fs::path& out, const std::string& as_given) {
  std::error_code ec;
  if (!fs::exists(out, ec)) return;
  TESSERA_CHECK(fs::is_directory(out, ec), "--out ", as_given, ": exists and is not a directory");
  const bool empty = fs::is_empty(out, ec);
  TESSERA_CHECK(empty || fs::exists(out / "meta.json", ec), "--out ", as_given,
                ": exists and is not a Tessera data directory (no meta.json); refusing to "
                "replace it");
}

// Puts the finished `tmp` where `out` is. With an existing `out` the two are exchanged
// atomically (renameat2 RENAME_EXCHANGE), so a reader sees the old or the new directory.
void commit_dir(const fs::path& tmp, const fs::path& out) {
  std::error_code ec;
  if (!fs::exists(out, ec)) {
    if (::rename(tmp.c_str(), out.c_str()) != 0)
      fail(out.string(), ": cannot move the new data into place: ", std::strerror(errno));
    return;
  }
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, out.c_str(), RENAME_EXCHANGE) != 0) {
    // File systems without the exchange: move the old one aside first, then the new in.
    const fs::path old = out.string() + ".old-" + std::to_string(::getpid());
    if (::rename(out.c_str(), old.c_str()) != 0)
      fail(out.string(), ": cannot move the old data aside: ", std::strerror(errno));
    if (::rename(tmp.c_str(), out.c_str()) != 0) {
      const int err = errno;
      ::rename(old.c_str(), out.c_str());
      fail(out.string(), ": cannot move the new data into place: ", std::strerror(err));
    }
    fs::remove_all(old, ec);
    return;
  }
  fs::remove_all(tmp, ec);  // now holds the old data
}

// True when this tokenizer encodes text cut at next_safe_cut() the same as uncut, on probes
// covering the cases the argument in next_safe_cut() relies on. A tokenizer whose
// pre-tokenizer adds a prefix space to every piece (ByteLevel add_prefix_space) fails
// this, and its files are then encoded whole.
bool safe_cuts_are_exact(const io::Tokenizer& tok) {
  const char* probes[] = {"ab\ncd", "x.\n'sy", "1\n2", "a!\n!b", "end.\n<|endoftext|>x"};
  for (const char* p : probes) {
    const std::string text = p;
    const size_t cut = next_safe_cut(text, 0);
    if (cut >= text.size()) return false;
    auto parts = tok.encode(std::string_view(text).substr(0, cut), false);
    const auto rest = tok.encode(std::string_view(text).substr(cut), false);
    parts.insert(parts.end(), rest.begin(), rest.end());
    if (parts != tok.encode(text, false)) return false;
  }
  return true;
}

// Removes the temporary directory unless it was committed.
struct TempDirGuard {
  fs::path path;
  ~TempDirGuard() {
    std::error_code ec;
    if (!path.empty()) fs::remove_all(path, ec);
  }
};

}  // namespace

size_t next_safe_cut(std::string_view text, size_t from) {
  // Under byte-level BPE pre-tokenizers (GPT-2, Llama 3 patterns) a lone '\n' between two
  // visible characters is a pre-token of its own, so no pre-token or special token spans
  // the cut and encoding the two sides separately gives the same ids as encoding it whole.
  const size_t n = text.size();
  for (size_t i = from == 0 ? 1 : from - 1; i + 1 < n; ++i) {
    i = text.find('\n', i);
    if (i == std::string::npos || i + 1 >= n) break;
    if (i >= 1 && visible_ascii(text[i - 1]) && visible_ascii(text[i + 1])) return i + 1;
  }
  return n;
}

namespace {

bool is_jsonl(const std::string& path, const std::string& format) {
  if (format == "jsonl") return true;
  if (format == "text") return false;
  const std::string ext = fs::path(path).extension().string();
  return ext == ".jsonl" || ext == ".ndjson";
}

// Each non-blank line of a JSON-lines file: {"text": "..."} (other keys are ignored).
void for_each_jsonl_text(const std::string& text, const std::string& path,
                         const std::function<void(std::string_view)>& fn) {
  size_t line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string_view line = std::string_view(text).substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      fail(path, ":", line_no, ": not a JSON object (", e.what(), ")");
    }
    TESSERA_CHECK(j.is_object() && j.contains("text") && j["text"].is_string(), path, ":", line_no,
                  ": each line must be an object with a string \"text\" (a document)");
    const std::string& doc = j["text"].get_ref<const std::string&>();
    if (!doc.empty()) fn(doc);
  }
}

// The documents of a text file: the whole file, or its pieces between separators (empty
// pieces skipped).
void for_each_document(const std::string& text, const std::string& separator,
                       const std::function<void(std::string_view)>& fn) {
  if (separator.empty()) return fn(text);
  for (size_t pos = 0; pos <= text.size();) {
    size_t end = text.find(separator, pos);
    if (end == std::string::npos) end = text.size();
    if (end > pos) fn(std::string_view(text).substr(pos, end - pos));
    pos = end + separator.size();
  }
}

// Moves the validation split out of `tokens` into `val` (see PrepareOptions::val_fraction).
void split_validation(std::vector<int32_t>& tokens, const std::vector<int64_t>& doc_ends,
                      const PrepareOptions& o, std::vector<int32_t>& val, PrepareResult& r) {
  const int64_t total = static_cast<int64_t>(tokens.size());
  const int64_t target = static_cast<int64_t>(std::floor(static_cast<double>(total) * o.val_fraction));
  if (target == 0) {
    r.val_split = "none";
    return;
  }
  const size_t n = doc_ends.size();
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return base::mix64(a ^ (o.split_seed * 0x9E3779B97F4A7C15ull)) < base::mix64(b ^ (o.split_seed * 0x9E3779B97F4A7C15ull));
  });
  const auto doc_size = [&](size_t i) { return doc_ends[i] - (i ? doc_ends[i - 1] : 0); };
  const int64_t lo = target - target / 10, hi = target + target / 10;
  std::vector<bool> in_val(n, false);
  int64_t taken = 0, docs = 0;
  for (size_t i : order) {
    if (taken >= lo) break;
    if (taken + doc_size(i) > hi || docs + 1 >= static_cast<int64_t>(n)) continue;  // keep one for train
    in_val[i] = true;
    taken += doc_size(i);
    ++docs;
  }
  if (taken < lo) {  // too few (or too large) documents: the tail of the stream
    r.val_split = "stream tail";
    val.assign(tokens.end() - target, tokens.end());
    tokens.resize(static_cast<size_t>(total - target));
    return;
  }
  r.val_split = "documents";
  r.val_documents = docs;
  std::vector<int32_t> train;
  train.reserve(static_cast<size_t>(total - taken));
  val.reserve(static_cast<size_t>(taken));
  for (size_t i = 0; i < n; ++i) {
    auto& dst = in_val[i] ? val : train;
    dst.insert(dst.end(), tokens.begin() + (i ? doc_ends[i - 1] : 0), tokens.begin() + doc_ends[i]);
  }
  tokens = std::move(train);
}

}  // namespace

PrepareResult prepare_data(const PrepareOptions& o) {
  base::Timer timer;
  TESSERA_CHECK(!o.out_dir.empty(), "--out: no output directory given");
  TESSERA_CHECK(!o.inputs.empty(), "--input: no corpus files given");
  TESSERA_CHECK(o.val_fraction >= 0.0 && o.val_fraction < 1.0, "--val-fraction ", o.val_fraction,
                ": must be in [0, 1)");
  TESSERA_CHECK(o.shard_tokens >= 1, "--shard-tokens ", o.shard_tokens, ": must be at least 1");
  TESSERA_CHECK(o.chunk_bytes >= 1, "chunk_bytes ", o.chunk_bytes, ": must be at least 1");
  TESSERA_CHECK(o.input_format == "auto" || o.input_format == "text" || o.input_format == "jsonl",
                "--input-format must be auto, text or jsonl, got '", o.input_format, "'");
  const fs::path out = normalize_out(o.out_dir);
  check_replaceable(out, o.out_dir);

  // Check every input before the (slow) encoding starts.
  int64_t total_bytes = 0;
  for (const auto& path : o.inputs) {
    struct stat sb;
    if (::stat(path.c_str(), &sb) != 0)
      fail(path, ": cannot read corpus file: ", std::strerror(errno));
    TESSERA_CHECK(S_ISREG(sb.st_mode), path, ": corpus input is not a regular file");
    TESSERA_CHECK(sb.st_size > 0, path, ": corpus file is empty");
    total_bytes += sb.st_size;
  }

  const io::Tokenizer tok = io::Tokenizer::load(o.tokenizer_dir);
  PrepareResult r;
  r.vocab_size = tok.vocab_size();
  r.token_bytes = token_bytes_for_vocab(r.vocab_size);
  r.input_bytes = total_bytes;
  const int32_t eos = tok.eos_id();
  const bool cut = safe_cuts_are_exact(tok);

  std::vector<int32_t> tokens;
  std::vector<int64_t> doc_ends;  // tokens[doc_ends[i-1], doc_ends[i]) is document i
  base::ProgressBar bar("encode (bytes)", total_bytes);
  int64_t done_bytes = 0;
  const auto encode_document = [&](std::string_view text) {
    for (size_t pos = 0; pos < text.size();) {
      const size_t target = pos + static_cast<size_t>(o.chunk_bytes);
      const size_t end = !cut || target >= text.size() ? text.size() : next_safe_cut(text, target);
      const auto ids = tok.encode(text.substr(pos, end - pos), false);
      tokens.insert(tokens.end(), ids.begin(), ids.end());
      pos = end;
    }
    if (eos >= 0) tokens.push_back(eos);
    if (tokens.size() > static_cast<size_t>(doc_ends.empty() ? 0 : doc_ends.back()))
      doc_ends.push_back(static_cast<int64_t>(tokens.size()));
  };
  for (const auto& path : o.inputs) {
    const std::string text = io::read_file_bytes(path);
    TESSERA_CHECK(!text.empty(), path, ": corpus file is empty");
    if (is_jsonl(path, o.input_format)) {
      for_each_jsonl_text(text, path, encode_document);
    } else {
      check_utf8(text, path);
      for_each_document(text, o.separator, encode_document);
    }
    done_bytes += static_cast<int64_t>(text.size());
    if (o.progress && done_bytes < total_bytes)  // finish() draws the last state
      bar.update(done_bytes, std::to_string(tokens.size()) + " tokens");
  }
  if (o.progress) bar.finish(std::to_string(tokens.size()) + " tokens");
  TESSERA_CHECK(!tokens.empty(), "--input: the corpus holds no documents");

  const int64_t total = static_cast<int64_t>(tokens.size());
  r.documents = static_cast<int64_t>(doc_ends.size());
  std::vector<int32_t> val;
  split_validation(tokens, doc_ends, o, val, r);
  r.val_tokens = static_cast<int64_t>(val.size());
  r.train_tokens = total - r.val_tokens;
  if (total < 20 * r.vocab_size)
    r.warnings.push_back(detail::concat(
        "the vocabulary (", r.vocab_size, " tokens) is large for a corpus of ", total,
        " tokens: most embeddings will see few updates; a smaller tokenizer (tessera tokenizer train "
        "--vocab-size) or more text fits better"));

  TempDirGuard tmp{out.string() + ".tmp-" + std::to_string(::getpid())};
  std::error_code ec;
  fs::remove_all(tmp.path, ec);  // a leftover of an earlier crashed run with this pid
  fs::create_directories(tmp.path, ec);
  TESSERA_CHECK(!ec, tmp.path.string(), ": cannot create directory: ", ec.message());

  DataMeta meta;
  meta.vocab_size = r.vocab_size;
  meta.eos_id = eos;
  meta.token_bytes = r.token_bytes;
  meta.train_tokens = r.train_tokens;
  meta.val_tokens = r.val_tokens;
  meta.train_shards = write_token_shards(tmp.path, "train", tokens, r.vocab_size, o.shard_tokens);
  meta.val_shards = write_token_shards(tmp.path, "val", val, r.vocab_size, o.shard_tokens);
  meta.tokenizer = o.tokenizer_dir;
  meta.inputs = o.inputs;
  write_data_meta(tmp.path, meta);
  check_replaceable(out, o.out_dir);  // again: it may have changed while we encoded
  commit_dir(tmp.path, out);
  tmp.path.clear();

  r.train_shards = static_cast<int64_t>(meta.train_shards.size());
  r.val_shards = static_cast<int64_t>(meta.val_shards.size());
  r.seconds = timer.seconds();
  return r;
}

}  // namespace tessera::train
