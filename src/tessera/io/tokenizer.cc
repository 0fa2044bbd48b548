// Encoding and decoding with a Hugging Face BPE tokenizer.json (byte-level or
// SentencePiece-style; the latter's own steps are in tokenizer_spm.cc).
#include "tessera/io/tokenizer.h"

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <deque>
#include <filesystem>

#include "tessera/base/error.h"
#include "tessera/io/json_file.h"
#include "tessera/io/pretokenize.h"
#include "tessera/io/tokenizer_impl.h"

namespace tessera::io {

using detail::Segment;

namespace {

// Pre-token -> ids, per thread (no locks), for the last few tokenizers used on the thread,
// keyed by serial (never reused, so a destroyed tokenizer's entries are never returned).
// Open addressing over flat pools: a lookup touches one slot and the key bytes.
class PieceCache {
 public:
  uint64_t serial = 0;

  void reset(uint64_t s) {
    serial = s;
    slots_.assign(kInitialSlots, Slot{});
    keys_.clear();
    ids_.clear();
    size_ = 0;
  }
  // The cached ids of piece, or nullptr.
  const int32_t* find(std::string_view piece, uint64_t hash, uint32_t* n) const {
    for (size_t i = hash & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
      const Slot& sl = slots_[i];
      if (sl.hash == 0) return nullptr;
      if (sl.hash == hash && sl.key_len == piece.size() &&
          std::memcmp(keys_.data() + sl.key_off, piece.data(), piece.size()) == 0) {
        *n = sl.n_ids;
        return ids_.data() + sl.ids_off;
      }
    }
  }
  // Adds piece -> ids, keeping the cache within budget bytes (slots, keys and ids): when full
  // it starts over (pre-tokens follow Zipf's law; the frequent ones come back first).
  void insert(std::string_view piece, uint64_t hash, const int32_t* ids, uint32_t n, size_t budget) {
    const size_t slot_bytes = slots_.size() * sizeof(Slot) * ((size_ + 1) * 2 > slots_.size() ? 2 : 1);
    if (slot_bytes + keys_.size() + piece.size() + (ids_.size() + n) * sizeof(int32_t) > budget) {
      reset(serial);
      if (kInitialSlots * sizeof(Slot) + piece.size() + n * sizeof(int32_t) > budget) return;
    }
    if ((size_ + 1) * 2 > slots_.size()) grow();
    size_t i = hash & (slots_.size() - 1);
    while (slots_[i].hash != 0) i = (i + 1) & (slots_.size() - 1);
    slots_[i] = {hash, static_cast<uint32_t>(keys_.size()), static_cast<uint32_t>(ids_.size()),
                 static_cast<uint16_t>(piece.size()), static_cast<uint16_t>(n)};
    keys_.append(piece);
    ids_.insert(ids_.end(), ids, ids + n);
    ++size_;
  }
  static uint64_t hash_of(std::string_view piece) {
    return std::hash<std::string_view>{}(piece) | 1;  // 0 marks an empty slot
  }

 private:
  struct Slot {
    uint64_t hash = 0;
    uint32_t key_off = 0, ids_off = 0;
    uint16_t key_len = 0, n_ids = 0;
  };
  // Small to start: every thread that tokenizes (a server has ~100) holds one per tokenizer.
  static constexpr size_t kInitialSlots = 1 << 8;
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(old.size() * 2, Slot{});
    for (const Slot& sl : old) {
      if (sl.hash == 0) continue;
      size_t i = sl.hash & (slots_.size() - 1);
      while (slots_[i].hash != 0) i = (i + 1) & (slots_.size() - 1);
      slots_[i] = sl;
    }
  }
  std::vector<Slot> slots_;
  std::string keys_;
  std::vector<int32_t> ids_;
  size_t size_ = 0;
};
constexpr size_t kCacheSlots = 4, kMaxCachedPiece = 256;

PieceCache& cache_for(uint64_t serial) {
  thread_local std::array<PieceCache, kCacheSlots> caches;
  thread_local size_t next_victim = 0;
  for (auto& c : caches)
    if (c.serial == serial) return c;
  PieceCache& c = caches[next_victim++ % kCacheSlots];
  c.reset(serial);
  return c;
}

}  // namespace

// BPE on one pre-token: repeatedly merge the adjacent pair of lowest rank, the leftmost
// one among equals (Hugging Face's priority-queue order; tiktoken's too). Short words
// keep the pair ranks in an array and scan it; long ones (a run of CJK or of spaces can be
// hundreds of bytes) use a heap so the cost stays n log n.
void Tokenizer::Impl::merge_word(std::string_view piece, std::vector<int32_t>* out) const {
  thread_local std::vector<int32_t> ids;
  ids.clear();
  if (sentencepiece) {
    spm_symbols(piece, &ids);
  } else {
    for (unsigned char b : piece) {
      int32_t id = byte_ids[b];
      if (id < 0) {
        if (unk_id < 0) continue;  // Hugging Face drops a char missing from the vocabulary
        if (fuse_unk && !ids.empty() && ids.back() == unk_id) continue;
        id = unk_id;
      }
      ids.push_back(id);
    }
  }
  merge_ids(ids, out);
}

void Tokenizer::Impl::merge_ids(std::vector<int32_t>& ids, std::vector<int32_t>* out) const {
  if (ids.size() > 48) {
    merge_word_heap(ids, out);
    return;
  }
  constexpr int32_t kNone = INT32_MAX;
  int32_t rank[48], merged[48];  // of the pair (i, i + 1)
  int32_t n = static_cast<int32_t>(ids.size());
  auto look = [&](int32_t i) {
    const auto* e = merges.find(ids[i], ids[i + 1]);
    rank[i] = e ? e->rank : kNone;
    merged[i] = e ? e->id : -1;
  };
  for (int32_t i = 0; i + 1 < n; ++i) look(i);
  while (n > 1) {
    int32_t best = 0;
    for (int32_t i = 1; i + 1 < n; ++i)
      if (rank[i] < rank[best]) best = i;
    if (rank[best] == kNone) break;
    ids[best] = merged[best];
    for (int32_t i = best + 1; i + 1 < n; ++i) {
      ids[i] = ids[i + 1];
      rank[i] = rank[i + 1];
      merged[i] = merged[i + 1];
    }
    --n;
    if (best > 0) look(best - 1);
    if (best + 1 < n) look(best);
  }
  out->insert(out->end(), ids.begin(), ids.begin() + n);
}

void Tokenizer::Impl::merge_word_heap(const std::vector<int32_t>& start, std::vector<int32_t>* out) const {
  struct Sym {
    int32_t id, prev, next;
    bool alive;
  };
  struct Cand {
    int32_t rank, pos, id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  thread_local std::vector<Sym> syms;
  thread_local std::vector<Cand> heap;
  syms.clear();
  heap.clear();
  const int32_t n = static_cast<int32_t>(start.size());
  for (int32_t i = 0; i < n; ++i) syms.push_back({start[i], i - 1, i + 1 < n ? i + 1 : -1, true});
  auto push_pair = [&](int32_t pos) {
    const int32_t nx = syms[pos].next;
    if (nx < 0) return;
    const auto* e = merges.find(syms[pos].id, syms[nx].id);
    if (!e) return;
    heap.push_back({e->rank, pos, e->id});
    std::push_heap(heap.begin(), heap.end(), std::greater<>());
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>());
    const Cand c = heap.back();
    heap.pop_back();
    Sym& left = syms[c.pos];
    if (!left.alive || left.next < 0) continue;
    // Stale when either side changed since the entry was pushed.
    const auto* e = merges.find(left.id, syms[left.next].id);
    if (!e || e->id != c.id || e->rank != c.rank) continue;
    Sym& right = syms[left.next];
    left.id = c.id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) syms[right.next].prev = c.pos;
    if (left.prev >= 0) push_pair(left.prev);
    push_pair(c.pos);
  }
  for (int32_t i = 0; i >= 0; i = syms[i].next) out->push_back(syms[i].id);
}

void Tokenizer::Impl::encode_piece(std::string_view piece, std::vector<int32_t>* out) const {
  if (piece.size() == 1 && byte_ids[static_cast<uint8_t>(piece[0])] >= 0) {
    out->push_back(byte_ids[static_cast<uint8_t>(piece[0])]);
    return;
  }
  if (ignore_merges) {
    auto it = bytes_ids.find(piece);
    if (it != bytes_ids.end()) {
      out->push_back(it->second);
      return;
    }
  }
  if (piece.size() > kMaxCachedPiece) {
    merge_word(piece, out);
    return;
  }
  PieceCache& cache = cache_for(serial);
  const uint64_t hash = PieceCache::hash_of(piece);
  uint32_t n = 0;
  if (const int32_t* hit = cache.find(piece, hash, &n)) {
    out->insert(out->end(), hit, hit + n);
    return;
  }
  const size_t before = out->size();
  merge_word(piece, out);
  cache.insert(piece, hash, out->data() + before, static_cast<uint32_t>(out->size() - before),
               static_cast<size_t>(piece_cache_bytes.load(std::memory_order_relaxed)));
}

// `at_start`: text begins the input (for Metaspace's prepend_scheme "first").
void Tokenizer::Impl::encode_text(std::string_view text, bool at_start, std::vector<int32_t>* out) const {
  std::string normalized;
  if (!normalizer.empty()) {
    normalized = normalizer.apply(text);
    text = normalized;
  }
  std::vector<Segment> segments;
  if (normalized_added.empty()) {
    segments.push_back({text, -1});
  } else {
    normalized_added.split(text, &segments);
  }
  std::vector<std::string_view> pieces;
  std::deque<std::string> arena;
  for (const Segment& seg : segments) {
    if (seg.id >= 0) {
      out->push_back(seg.id);
      continue;
    }
    pieces.clear();
    pre_tokenizer.split(seg.text, &pieces, &arena, at_start && seg.text.data() == text.data());
    for (std::string_view p : pieces) encode_piece(p, out);
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& m = *impl_;
  const size_t bad = find_invalid_utf8(text);
  TESSERA_CHECK(bad == std::string_view::npos, "tokenizer encode: text is not valid UTF-8 at byte ", bad);
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 8);
  if (add_special_tokens) out = m.prefix;
  std::vector<Segment> segments;
  if (m.raw_added.empty()) {
    if (!text.empty()) segments.push_back({text, -1});
  } else {
    m.raw_added.split(text, &segments);
  }
  for (const Segment& seg : segments) {
    if (seg.id >= 0) {
      out.push_back(seg.id);
    } else {
      m.encode_text(seg.text, seg.text.data() == text.data(), &out);
    }
  }
  if (add_special_tokens) out.insert(out.end(), m.suffix.begin(), m.suffix.end());
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  std::string bytes;
  std::vector<std::string> tokens;  // sentencepiece: the token strings, for the decoder
  for (int32_t id : ids) {
    TESSERA_CHECK(id >= 0 && id < vocab_size() && impl_->id_used[id], "tokenizer decode: token id ", id,
                  " is not in the vocabulary of ", impl_->source, " (size ", vocab_size(), ")");
    if (skip_special_tokens && impl_->id_special[id]) continue;
    if (impl_->sentencepiece) {
      tokens.push_back(impl_->id_token[id]);
    } else {
      bytes += impl_->id_bytes[id];
    }
  }
  if (impl_->sentencepiece) return detail::run_decoder(impl_->decoder, std::move(tokens));
  return utf8_lossy(bytes);
}

std::string Tokenizer::decode_token(int32_t id) const {
  TESSERA_CHECK(id >= 0 && id < vocab_size() && impl_->id_used[id], "tokenizer decode: token id ", id,
                " is not in the vocabulary of ", impl_->source, " (size ", vocab_size(), ")");
  return impl_->id_bytes[id];
}

void Tokenizer::set_piece_cache_bytes(int64_t bytes) const {
  TESSERA_CHECK(bytes >= 0, "tokenizer: the pre-token cache budget must be >= 0 bytes, got ", bytes);
  impl_->piece_cache_bytes.store(bytes, std::memory_order_relaxed);
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_token.size()); }

int32_t Tokenizer::token_to_id(std::string_view token) const {
  auto it = impl_->token_ids.find(token);
  return it == impl_->token_ids.end() ? -1 : it->second;
}

std::string Tokenizer::id_to_token(int32_t id) const {
  return id >= 0 && id < vocab_size() ? impl_->id_token[id] : std::string();
}

int32_t Tokenizer::bos_id() const { return impl_->bos; }
int32_t Tokenizer::eos_id() const { return impl_->eos; }
bool Tokenizer::add_bos() const {
  return impl_->bos >= 0 && !impl_->prefix.empty() && impl_->prefix.front() == impl_->bos;
}
bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && id < vocab_size() && impl_->id_special[id];
}

nlohmann::json Tokenizer::to_json() const { return impl_->json; }

const std::string& Tokenizer::chat_template() const { return impl_->chat_template; }
const std::string& Tokenizer::chat_template_origin() const { return impl_->chat_template_origin; }

nlohmann::json Tokenizer::config_json() const {
  if (!impl_->config.is_null()) return impl_->config;
  const Impl& m = *impl_;
  auto name = [&](int32_t id) -> nlohmann::json {
    return id >= 0 ? nlohmann::json(m.id_token[id]) : nlohmann::json(nullptr);
  };
  return {{"add_bos_token", add_bos()},
          {"add_eos_token", false},
          {"bos_token", name(m.bos)},
          {"eos_token", name(m.eos)},
          {"clean_up_tokenization_spaces", false},
          {"model_max_length", 2048},
          {"tokenizer_class", "PreTrainedTokenizerFast"}};
}

void Tokenizer::save(const std::string& dir) const {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TESSERA_CHECK(std::filesystem::is_directory(dir), dir, ": cannot create directory",
                ec ? ": " + ec.message() : std::string(" (a file has that name)"));
  const auto dump = [](const nlohmann::json& j) { return j.dump(2) + "\n"; };
  write_file_atomic(dir + "/tokenizer.json", dump(to_json()));
  nlohmann::json config = config_json();
  // A template read from a list entry or chat_template.jinja is saved as the plain string.
  if (!chat_template().empty()) config["chat_template"] = chat_template();
  write_file_atomic(dir + "/tokenizer_config.json", dump(config));
}

Tokenizer Tokenizer::load(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const bool is_dir = fs::is_directory(path, ec);
  const std::string file = is_dir ? path + "/tokenizer.json" : path;
  if (is_dir) TESSERA_CHECK(fs::exists(file, ec), path, ": no tokenizer.json in this directory");
  const std::string config_path = (fs::path(file).parent_path() / "tokenizer_config.json").string();
  nlohmann::json config;
  if (fs::is_regular_file(config_path, ec)) config = read_json_file(config_path);
  return build(read_json_file(file), file, config, config_path, fs::path(file).parent_path().string());
}

size_t complete_utf8_prefix(std::string_view b) {
  size_t i = b.size(), cont = 0;  // back over up to 3 continuation bytes to the lead byte
  while (i > 0 && cont < 3 && (static_cast<unsigned char>(b[i - 1]) & 0xC0) == 0x80) --i, ++cont;
  if (i == 0) return b.size();  // malformed: nothing to wait for
  const unsigned char c = static_cast<unsigned char>(b[i - 1]);
  const size_t need = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  return cont + 1 >= need ? b.size() : i - 1;
}

}  // namespace tessera::io
