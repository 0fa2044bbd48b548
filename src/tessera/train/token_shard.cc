// Writing and mmap-reading token shards, meta.json, and a split's shards as one stream.
#include "tessera/train/token_shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/io/json_file.h"
#include "tessera/train/chat_data.h"

namespace tessera::train {
namespace {

static_assert(std::endian::native == std::endian::little,
              "token shards are little-endian and read by memcpy");

std::string hex64(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(path, ": write failed: ", std::strerror(errno));
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void encode_header(uint8_t* h, int token_bytes, uint64_t count, uint64_t checksum) {
  const uint32_t version = kShardVersion, tb = static_cast<uint32_t>(token_bytes);
  std::memcpy(h, kShardMagic, 8);
  std::memcpy(h + 8, &version, 4);
  std::memcpy(h + 12, &tb, 4);
  std::memcpy(h + 16, &count, 8);
  std::memcpy(h + 24, &checksum, 8);
}

}  // namespace

int token_bytes_for_vocab(int64_t vocab_size) {
  TESSERA_CHECK(vocab_size >= 1 && vocab_size <= (int64_t{1} << 31),
                "vocab_size ", vocab_size, " out of range [1, 2^31]");
  return vocab_size <= 65536 ? 2 : 4;
}

void write_token_shard(const std::string& path, const int32_t* tokens, int64_t count,
                       int64_t vocab_size) {
  const int tb = token_bytes_for_vocab(vocab_size);
  TESSERA_CHECK(count >= 0, path, ": negative token count ", count);
  for (int64_t i = 0; i < count; ++i)
    TESSERA_CHECK(tokens[i] >= 0 && tokens[i] < vocab_size, path, ": token ", i, " has id ",
                  tokens[i], ", outside the vocabulary [0, ", vocab_size, ")");

  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(tmp, ": cannot create: ", std::strerror(errno));
  try {
    uint8_t header[kShardHeaderBytes] = {};
    write_all(fd, header, sizeof header, tmp);  // rewritten once the checksum is known
    XXH64_state_t* st = XXH64_createState();
    TESSERA_CHECK(st != nullptr, tmp, ": out of memory for the checksum state");
    XXH64_reset(st, 0);
    // Converted and hashed in blocks so a 100M-token shard needs no second full copy.
    constexpr int64_t kBlock = 1 << 20;
    std::vector<uint8_t> buf(static_cast<size_t>(std::min(count, kBlock) * tb));
    for (int64_t b = 0; b < count; b += kBlock) {
      const int64_t n = std::min(kBlock, count - b);
      for (int64_t i = 0; i < n; ++i) {
        if (tb == 2) {
          const uint16_t v = static_cast<uint16_t>(tokens[b + i]);
          std::memcpy(buf.data() + i * 2, &v, 2);
        } else {
          const uint32_t v = static_cast<uint32_t>(tokens[b + i]);
          std::memcpy(buf.data() + i * 4, &v, 4);
        }
      }
      XXH64_update(st, buf.data(), static_cast<size_t>(n * tb));
      write_all(fd, buf.data(), static_cast<size_t>(n * tb), tmp);
    }
    const uint64_t checksum = XXH64_digest(st);
    XXH64_freeState(st);
    encode_header(header, tb, static_cast<uint64_t>(count), checksum);
    if (::pwrite(fd, header, sizeof header, 0) != static_cast<ssize_t>(sizeof header))
      fail(tmp, ": header write failed: ", std::strerror(errno));
    if (::fsync(fd) != 0) fail(tmp, ": fsync failed: ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    fail(tmp, ": close failed: ", std::strerror(errno));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail(path, ": cannot rename ", tmp, " into place: ", std::strerror(err));
  }
}

std::vector<std::string> write_token_shards(const std::string& out_dir, const std::string& split,
                                            const std::vector<int32_t>& tokens,
                                            int64_t vocab_size, int64_t shard_tokens) {
  TESSERA_CHECK(shard_tokens >= 1, "shard_tokens ", shard_tokens, " must be at least 1");
  TESSERA_CHECK(!split.empty() && split.find('/') == std::string::npos, "split name \"", split,
                "\" must be a plain name like train or val");
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  TESSERA_CHECK(!ec, out_dir, ": cannot create directory: ", ec.message());
  std::vector<std::string> names;
  const int64_t total = static_cast<int64_t>(tokens.size());
  for (int64_t begin = 0; begin < total; begin += shard_tokens) {
    char name[64];
    std::snprintf(name, sizeof name, "%s_%05zu.bin", split.c_str(), names.size());
    const int64_t n = std::min(shard_tokens, total - begin);
    write_token_shard(out_dir + "/" + name, tokens.data() + begin, n, vocab_size);
    names.emplace_back(name);
  }
  return names;
}

// ---- reading ----

std::shared_ptr<TokenShard> TokenShard::open(const std::string& path) {
  std::shared_ptr<TokenShard> s(new TokenShard());
  s->path_ = path;
  s->map_ = base::MappedFile::map(path, base::MappedFile::Mode::kReadOnly, "token shard");
  const size_t bytes = s->map_.size();
  if (bytes < static_cast<size_t>(kShardHeaderBytes))
    fail(path, ": ", bytes, " bytes is too small for a token shard (header is ", kShardHeaderBytes, " bytes)");
  const uint8_t* h = s->map_.data();
  TESSERA_CHECK(std::memcmp(h, kShardMagic, 8) == 0, path,
                ": not a Tessera token shard (bad magic; expected \"TSRTOKS\")");
  uint32_t version, tb;
  uint64_t count, checksum;
  std::memcpy(&version, h + 8, 4);
  std::memcpy(&tb, h + 12, 4);
  std::memcpy(&count, h + 16, 8);
  std::memcpy(&checksum, h + 24, 8);
  TESSERA_CHECK(version == kShardVersion, path, ": token shard version ", version,
                " is not supported (this build reads version ", kShardVersion, ")");
  TESSERA_CHECK(tb == 2 || tb == 4, path, ": token_bytes ", tb, " must be 2 or 4");
  const uint64_t payload = bytes - kShardHeaderBytes;
  TESSERA_CHECK(count <= payload / tb && count * tb == payload, path, ": header says ", count,
                " tokens x ", tb, " bytes but the file has ", payload,
                " bytes after the header (truncated or padded)");
  s->payload_ = h + kShardHeaderBytes;
  const uint64_t actual = XXH64(s->payload_, payload, 0);
  TESSERA_CHECK(actual == checksum, path, ": checksum mismatch (payload xxh64 ", hex64(actual),
                ", header says ", hex64(checksum), "): the file is corrupt");
  s->count_ = static_cast<int64_t>(count);
  s->token_bytes_ = static_cast<int>(tb);
  s->checksum_ = checksum;
  return s;
}

void TokenShard::read(int64_t begin, int64_t n, int32_t* out) const {
  TESSERA_CHECK(begin >= 0 && n >= 0 && begin + n <= count_, path_, ": read of tokens [", begin,
                ", ", begin + n, ") outside [0, ", count_, ")");
  const uint8_t* p = payload_ + begin * token_bytes_;
  if (token_bytes_ == 2) {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      out[i] = v;
    }
  } else {
    std::memcpy(out, p, static_cast<size_t>(n) * 4);  // ids < 2^31, so int32 bits match
  }
}

// ---- meta.json ----

void write_data_meta(const std::string& dir, const DataMeta& m) {
  nlohmann::ordered_json j;  // keys in the order docs/data.md lists them
  j["format"] = "tessera-token-shards";
  j["version"] = kShardVersion;
  j["vocab_size"] = m.vocab_size;
  j["eos_id"] = m.eos_id;
  j["token_bytes"] = m.token_bytes;
  j["train_tokens"] = m.train_tokens;
  j["val_tokens"] = m.val_tokens;
  j["shards"] = {{"train", m.train_shards}, {"val", m.val_shards}};
  j["tokenizer"] = m.tokenizer;
  j["inputs"] = m.inputs;
  io::write_file_atomic(dir + "/meta.json", j.dump(2) + "\n");
}

namespace {

const nlohmann::json& get_key(const nlohmann::json& j, const char* key, const std::string& file) {
  TESSERA_CHECK(j.contains(key), file, ": missing key \"", key, "\"");
  return j.at(key);
}

int64_t get_int(const nlohmann::json& j, const char* key, const std::string& file, int64_t lo) {
  const auto& v = get_key(j, key, file);
  TESSERA_CHECK(v.is_number_integer(), file, ": key \"", key, "\" must be an integer, got ",
                v.dump());
  const int64_t x = v.get<int64_t>();
  TESSERA_CHECK(x >= lo, file, ": key \"", key, "\" is ", x, ", must be >= ", lo);
  return x;
}

std::vector<std::string> get_strings(const nlohmann::json& j, const char* key,
                                     const std::string& file) {
  const auto& v = get_key(j, key, file);
  TESSERA_CHECK(v.is_array(), file, ": key \"", key, "\" must be a list of strings");
  std::vector<std::string> out;
  for (const auto& s : v) {
    TESSERA_CHECK(s.is_string(), file, ": key \"", key, "\" must be a list of strings, has ",
                  s.dump());
    out.push_back(s.get<std::string>());
  }
  return out;
}

}  // namespace

DataMeta read_data_meta(const std::string& dir) {
  TESSERA_CHECK(std::filesystem::is_directory(dir), dir, ": data directory not found");
  const std::string file = dir + "/meta.json";
  TESSERA_CHECK(std::filesystem::exists(file), file,
                ": missing (not a directory written by `tessera data prepare`)");
  const nlohmann::json j = io::read_json_file(file);
  TESSERA_CHECK(j.is_object(), file, ": must be a JSON object");
  DataMeta m;
  if (is_chat_data(dir)) {
    const ChatDataMeta c = read_chat_meta(dir);
    m.chat = true;
    m.vocab_size = c.vocab_size;
    m.eos_id = c.eos_id;
    m.token_bytes = token_bytes_for_vocab(c.vocab_size);
    m.train_tokens = c.train_tokens;
    m.val_tokens = c.val_tokens;
    m.tokenizer = c.tokenizer;
    m.inputs = {c.source};
    return m;
  }
  const int64_t version = get_int(j, "version", file, 0);
  TESSERA_CHECK(version == kShardVersion, file, ": version ", version,
                " is not supported (this build reads version ", kShardVersion, ")");
  m.vocab_size = get_int(j, "vocab_size", file, 1);
  m.eos_id = static_cast<int32_t>(get_int(j, "eos_id", file, -1));
  m.token_bytes = static_cast<int>(get_int(j, "token_bytes", file, 2));
  TESSERA_CHECK(m.token_bytes == token_bytes_for_vocab(m.vocab_size), file, ": token_bytes ",
                m.token_bytes, " does not match vocab_size ", m.vocab_size);
  m.train_tokens = get_int(j, "train_tokens", file, 0);
  m.val_tokens = get_int(j, "val_tokens", file, 0);
  const auto& shards = get_key(j, "shards", file);
  TESSERA_CHECK(shards.is_object(), file, ": key \"shards\" must be an object {train, val}");
  m.train_shards = get_strings(shards, "train", file + " shards");
  m.val_shards = get_strings(shards, "val", file + " shards");
  for (const auto* list : {&m.train_shards, &m.val_shards})
    for (const auto& name : *list)
      TESSERA_CHECK(!name.empty() && name.find('/') == std::string::npos, file, ": shard name \"",
                    name, "\" must be a file name inside the data directory");
  if (j.contains("tokenizer") && j["tokenizer"].is_string()) m.tokenizer = j["tokenizer"];
  if (j.contains("inputs")) m.inputs = get_strings(j, "inputs", file);
  return m;
}

// ---- one split as a stream ----

TokenStream::TokenStream(const std::string& data_dir, const std::string& split) {
  meta_ = read_data_meta(data_dir);
  TESSERA_CHECK(!meta_.chat, data_dir, ": a chat data directory has no token stream (data.format = \"chat\")");
  TESSERA_CHECK(split == "train" || split == "val", data_dir, ": unknown split \"", split,
                "\" (expected train or val)");
  const auto& names = split == "train" ? meta_.train_shards : meta_.val_shards;
  const int64_t expected = split == "train" ? meta_.train_tokens : meta_.val_tokens;
  for (const auto& name : names) {
    auto s = TokenShard::open(data_dir + "/" + name);
    TESSERA_CHECK(s->token_bytes() == meta_.token_bytes, s->path(), ": token_bytes ",
                  s->token_bytes(), " but meta.json says ", meta_.token_bytes);
    starts_.push_back(total_);
    total_ += s->count();
    shards_.push_back(std::move(s));
  }
  TESSERA_CHECK(total_ == expected, data_dir, ": ", split, " shards hold ", total_,
                " tokens but meta.json says ", expected);
}

void TokenStream::read(int64_t begin, int64_t n, int32_t* out) const {
  TESSERA_CHECK(begin >= 0 && n >= 0 && begin + n <= total_, "token stream read [", begin, ", ",
                begin + n, ") outside [0, ", total_, ")");
  // The last shard starting at or before `begin`.
  size_t s = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), begin) -
                                 starts_.begin()) - 1;
  while (n > 0) {
    const int64_t off = begin - starts_[s];
    const int64_t take = std::min(n, shards_[s]->count() - off);
    shards_[s]->read(off, take, out);
    out += take;
    begin += take;
    n -= take;
    ++s;
  }
}

}  // namespace tessera::train
