// Chat data directories (meta.json + one binary file per split) and the packing of their
// documents into training rows.
#include "tessera/train/chat_data.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/io/atomic_file.h"
#include "tessera/io/json_file.h"
#include "tessera/kernels/cross_entropy.h"

namespace tessera::train {
namespace {

constexpr char kFormat[] = "tessera-chat";
constexpr int64_t kVersion = 1;
constexpr char kMagic[8] = {'T', 'S', 'C', 'H', 'A', 'T', '0', '1'};

// A split file: magic, u64 documents, u64 tokens, u64 offsets[documents + 1],
// i32 tokens[tokens], u8 mask[tokens] (little-endian, as written by this machine kind).
std::string split_file(const std::string& dir, const std::string& split) {
  TESSERA_CHECK(split == "train" || split == "val", dir, ": unknown split \"", split,
                "\" (expected train or val)");
  return dir + "/" + split + ".chat";
}

void write_split(const std::string& path, const std::vector<ChatDocument>& docs) {
  std::vector<uint64_t> offsets{0};
  for (const auto& d : docs) {
    TESSERA_CHECK(d.tokens.size() == d.mask.size(), path, ": a document has ", d.tokens.size(),
                  " tokens but ", d.mask.size(), " mask entries");
    offsets.push_back(offsets.back() + d.tokens.size());
  }
  io::AtomicFileWriter w(path);
  w.write(kMagic, sizeof kMagic);
  const uint64_t head[2] = {docs.size(), offsets.back()};
  w.write(head, sizeof head);
  w.write(offsets.data(), offsets.size() * sizeof(uint64_t));
  for (const auto& d : docs) w.write(d.tokens.data(), d.tokens.size() * sizeof(int32_t));
  for (const auto& d : docs) w.write(d.mask.data(), d.mask.size());
  w.commit();
}

int64_t get_int(const nlohmann::json& j, const char* key, const std::string& file, int64_t lo) {
  TESSERA_CHECK(j.contains(key), file, ": missing key \"", key, "\"");
  const auto& v = j.at(key);
  TESSERA_CHECK(v.is_number_integer() && v.get<int64_t>() >= lo, file, ": key \"", key,
                "\" must be an integer >= ", lo, ", got ", v.dump());
  return v.get<int64_t>();
}

std::string get_string(const nlohmann::json& j, const char* key) {
  return j.contains(key) && j.at(key).is_string() ? j.at(key).get<std::string>() : std::string();
}

}  // namespace

bool is_chat_data(const std::string& dir) {
  const std::string file = dir + "/meta.json";
  if (!std::filesystem::exists(file)) return false;
  const nlohmann::json j = io::read_json_file(file);
  return j.is_object() && j.contains("format") && j["format"] == kFormat;
}

ChatDataMeta read_chat_meta(const std::string& dir) {
  const std::string file = dir + "/meta.json";
  TESSERA_CHECK(std::filesystem::exists(file), file, ": missing (not a chat data directory)");
  const nlohmann::json j = io::read_json_file(file);
  TESSERA_CHECK(j.is_object() && j.contains("format") && j["format"] == kFormat, file,
                ": not a chat data directory (\"format\" is not \"", kFormat, "\")");
  const int64_t version = get_int(j, "version", file, 0);
  TESSERA_CHECK(version == kVersion, file, ": version ", version, " is not supported (this build reads ",
                kVersion, ")");
  ChatDataMeta m;
  m.vocab_size = get_int(j, "vocab_size", file, 1);
  m.eos_id = static_cast<int32_t>(get_int(j, "eos_id", file, -1));
  m.pad_id = static_cast<int32_t>(get_int(j, "pad_id", file, 0));
  TESSERA_CHECK(m.pad_id < m.vocab_size, file, ": pad_id ", m.pad_id, " is outside the vocabulary of ",
                m.vocab_size);
  m.train_docs = get_int(j, "train_documents", file, 0);
  m.val_docs = get_int(j, "val_documents", file, 0);
  m.train_tokens = get_int(j, "train_tokens", file, 0);
  m.val_tokens = get_int(j, "val_tokens", file, 0);
  m.train_trained = get_int(j, "train_trained_tokens", file, 0);
  m.val_trained = get_int(j, "val_trained_tokens", file, 0);
  m.tokenizer = get_string(j, "tokenizer");
  m.source = get_string(j, "source");
  m.source_digest = get_string(j, "source_digest");
  m.template_origin = get_string(j, "chat_template");
  return m;
}

void write_chat_data(const std::string& dir, ChatDataMeta meta, const std::vector<ChatDocument>& train,
                     const std::vector<ChatDocument>& val) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TESSERA_CHECK(!ec, dir, ": cannot create directory: ", ec.message());
  const auto count = [](const std::vector<ChatDocument>& docs, int64_t& tokens, int64_t& trained) {
    tokens = trained = 0;
    for (const auto& d : docs) {
      tokens += static_cast<int64_t>(d.tokens.size());
      for (uint8_t x : d.mask) trained += x != 0;
    }
  };
  meta.train_docs = static_cast<int64_t>(train.size());
  meta.val_docs = static_cast<int64_t>(val.size());
  count(train, meta.train_tokens, meta.train_trained);
  count(val, meta.val_tokens, meta.val_trained);
  for (const auto* docs : {&train, &val})
    for (const auto& d : *docs)
      for (int32_t t : d.tokens)
        TESSERA_CHECK(t >= 0 && t < meta.vocab_size, dir, ": token id ", t, " is outside the vocabulary of ",
                      meta.vocab_size);
  write_split(split_file(dir, "train"), train);
  write_split(split_file(dir, "val"), val);
  nlohmann::ordered_json j;
  j["format"] = kFormat;
  j["version"] = kVersion;
  j["vocab_size"] = meta.vocab_size;
  j["eos_id"] = meta.eos_id;
  j["pad_id"] = meta.pad_id;
  j["train_documents"] = meta.train_docs;
  j["val_documents"] = meta.val_docs;
  j["train_tokens"] = meta.train_tokens;
  j["val_tokens"] = meta.val_tokens;
  j["train_trained_tokens"] = meta.train_trained;
  j["val_trained_tokens"] = meta.val_trained;
  j["tokenizer"] = meta.tokenizer;
  j["source"] = meta.source;
  j["source_digest"] = meta.source_digest;
  j["chat_template"] = meta.template_origin;
  io::write_file_atomic(dir + "/meta.json", j.dump(2) + "\n");
}

std::vector<ChatDocument> read_chat_split(const std::string& dir, const std::string& split) {
  const ChatDataMeta meta = read_chat_meta(dir);
  const std::string path = split_file(dir, split);
  const std::string bytes = io::read_file_bytes(path);
  const auto need = [&](size_t at, size_t n) {
    TESSERA_CHECK(at + n <= bytes.size() && at + n >= at, path, ": truncated (", bytes.size(), " bytes)");
  };
  need(0, sizeof kMagic + 16);
  TESSERA_CHECK(std::memcmp(bytes.data(), kMagic, sizeof kMagic) == 0, path, ": not a chat split file");
  uint64_t head[2];
  std::memcpy(head, bytes.data() + sizeof kMagic, sizeof head);
  const int64_t docs = split == "train" ? meta.train_docs : meta.val_docs;
  const int64_t tokens = split == "train" ? meta.train_tokens : meta.val_tokens;
  TESSERA_CHECK(head[0] == static_cast<uint64_t>(docs) && head[1] == static_cast<uint64_t>(tokens), path, ": holds ",
                head[0], " documents of ", head[1], " tokens but meta.json says ", docs, " of ", tokens);
  size_t at = sizeof kMagic + sizeof head;
  need(at, (head[0] + 1) * 8 + head[1] * 5);
  TESSERA_CHECK(bytes.size() == at + (head[0] + 1) * 8 + head[1] * 5, path, ": ", bytes.size(),
                " bytes, expected ", at + (head[0] + 1) * 8 + head[1] * 5);
  std::vector<uint64_t> off(head[0] + 1);
  std::memcpy(off.data(), bytes.data() + at, off.size() * 8);
  at += off.size() * 8;
  const char* tok = bytes.data() + at;
  const char* mask = tok + head[1] * 4;
  std::vector<ChatDocument> out(head[0]);
  for (uint64_t d = 0; d < head[0]; ++d) {
    TESSERA_CHECK(off[d] <= off[d + 1] && off[d + 1] <= head[1], path, ": document ", d, " has bad offsets");
    const uint64_t n = off[d + 1] - off[d];
    out[d].tokens.resize(n);
    std::memcpy(out[d].tokens.data(), tok + off[d] * 4, n * 4);
    out[d].mask.assign(mask + off[d], mask + off[d] + n);
    for (int32_t t : out[d].tokens)
      TESSERA_CHECK(t >= 0 && t < meta.vocab_size, path, ": document ", d, " has token id ", t,
                    " outside the vocabulary of ", meta.vocab_size);
  }
  return out;
}

double PackedRows::fill() const {
  return rows == 0 ? 0.0 : static_cast<double>(slots_used) / static_cast<double>(rows * seq_len);
}

PackedRows pack_documents(const std::vector<ChatDocument>& docs, int64_t seq_len, int32_t pad_id) {
  TESSERA_CHECK(seq_len >= 2, "packing: seq_len ", seq_len, " must be at least 2");
  PackedRows out;
  out.seq_len = seq_len;
  // Each kept document's length after truncation; a document needs a target to be kept.
  std::vector<std::pair<int64_t, size_t>> order;  // (length, index)
  for (size_t i = 0; i < docs.size(); ++i) {
    const auto& d = docs[i];
    TESSERA_CHECK(d.tokens.size() == d.mask.size(), "packing: document ", i, " has ", d.tokens.size(),
                  " tokens but ", d.mask.size(), " mask entries");
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(d.tokens.size()), seq_len);
    if (static_cast<int64_t>(d.tokens.size()) > seq_len) ++out.truncated;
    bool any = false;
    for (int64_t t = 1; t < n && !any; ++t) any = d.mask[t] != 0;
    if (!any) {
      ++out.dropped;
      continue;
    }
    order.emplace_back(n, i);
  }
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  // Best fit: the row with the least room that still holds the document (room, row).
  std::set<std::pair<int64_t, int64_t>> room;
  std::vector<std::vector<size_t>> row_docs;
  std::vector<int64_t> row_room;
  for (const auto& [n, i] : order) {
    auto it = room.lower_bound({n, -1});
    int64_t r;
    if (it == room.end()) {
      r = static_cast<int64_t>(row_docs.size());
      row_docs.emplace_back();
      row_room.push_back(seq_len);
    } else {
      r = it->second;
      room.erase(it);
    }
    row_docs[r].push_back(i);
    row_room[r] -= n;
    if (row_room[r] > 0) room.insert({row_room[r], r});
  }
  out.rows = static_cast<int64_t>(row_docs.size());
  const size_t total = static_cast<size_t>(out.rows * seq_len);
  out.ids.assign(total, pad_id);
  out.targets.assign(total, kernels::kIgnoreIndex);
  out.positions.assign(total, 0);
  for (int64_t r = 0; r < out.rows; ++r) {
    int64_t at = r * seq_len;
    for (size_t i : row_docs[r]) {
      const auto& d = docs[i];
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(d.tokens.size()), seq_len);
      for (int64_t t = 0; t < n; ++t) {
        out.ids[at + t] = d.tokens[t];
        out.positions[at + t] = static_cast<int32_t>(t);
        if (t + 1 < n && d.mask[t + 1]) {
          out.targets[at + t] = d.tokens[t + 1];
          ++out.targets_counted;
        }
      }
      at += n;
      out.slots_used += n;
      ++out.documents;
    }
    for (int64_t p = 0; at < (r + 1) * seq_len; ++at, ++p) out.positions[at] = static_cast<int32_t>(p);
  }
  return out;
}

}  // namespace tessera::train
