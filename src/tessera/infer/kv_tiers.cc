// Tiered KV cache (see kv_tiers.h): the host and disk tiers behind the block manager, and
// the fingerprint that keeps another model's blocks out of the disk tier.
#include "tessera/infer/kv_tiers.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/base/strings.h"
#include "tessera/model/lora.h"

namespace tessera::infer {

KvTiers::KvTiers(KvPool& pool, const KvTierConfig& c, uint64_t fingerprint)
    : pool_(pool), block_bytes_(pool.block_bytes()) {
  TESSERA_CHECK(c.host_bytes >= 0, "--kv-host-memory must not be negative, got ", c.host_bytes);
  if (c.host_bytes > 0) host_ = std::make_unique<HostKvTier>(c.host_bytes, block_bytes_);
  if (!c.disk_dir.empty())
    disk_ = std::make_unique<DiskKvTier>(c.disk_dir, c.disk_bytes, fingerprint, pool.block_size, block_bytes_);
  scratch_.resize(static_cast<size_t>(block_bytes_));
}

void KvTiers::offload(BlockId b, const BlockKey& key) {
  const uint8_t* bytes = nullptr;  // the block's bytes once read out of the pool
  if (host_) {
    if (uint8_t* slot = host_->insert(key)) {
      pool_.read_block(b, slot);
      bytes = slot;
      ++stats_.offloaded_blocks;
      stats_.bytes_to_tiers += block_bytes_;
    }
  }
  // Write-through: every block leaving the pool reaches the disk (once), so the disk tier
  // holds what the host tier drops and what a restart would otherwise lose.
  if (disk_ && !disk_->contains(key)) {
    if (!bytes) {
      pool_.read_block(b, scratch_.data());
      bytes = scratch_.data();
      stats_.bytes_to_tiers += block_bytes_;
    }
    disk_->put(key, bytes);
    ++stats_.disk_written_blocks;
  }
}

bool KvTiers::contains(const BlockKey& key) {
  return (host_ && host_->find(key)) || (disk_ && disk_->contains(key));
}

bool KvTiers::load(const BlockKey& key, BlockId dst) {
  if (host_) {
    if (const uint8_t* p = host_->find(key)) {
      pool_.write_block(dst, p);
      ++stats_.host_hit_blocks;
      stats_.bytes_from_tiers += block_bytes_;
      return true;
    }
  }
  if (!disk_ || !disk_->get(key, scratch_.data())) return false;
  pool_.write_block(dst, scratch_.data());
  ++stats_.disk_hit_blocks;
  stats_.bytes_from_tiers += block_bytes_;
  if (host_)  // promoted: the next eviction of this block finds it there
    if (uint8_t* slot = host_->insert(key)) std::memcpy(slot, scratch_.data(), scratch_.size());
  return true;
}

bool KvTiers::swap_out(RequestId id, const std::vector<BlockId>& blocks, int64_t num_tokens) {
  std::vector<uint8_t*> slots;
  if (host_ && !blocks.empty()) slots = host_->reserve_swap(id, static_cast<int64_t>(blocks.size()), num_tokens);
  if (slots.empty()) {
    ++stats_.swap_failures;
    return false;
  }
  for (size_t i = 0; i < blocks.size(); ++i) pool_.read_block(blocks[i], slots[i]);
  stats_.swap_out_blocks += static_cast<int64_t>(blocks.size());
  stats_.bytes_to_tiers += static_cast<int64_t>(blocks.size()) * block_bytes_;
  return true;
}

int64_t KvTiers::swapped_tokens(RequestId id) const { return host_ ? host_->swapped_tokens(id) : 0; }

void KvTiers::swap_in(RequestId id, int64_t first, const std::vector<BlockId>& dst) {
  TESSERA_CHECK(host_, "KvTiers::swap_in: no host tier");
  for (size_t i = 0; i < dst.size(); ++i) pool_.write_block(dst[i], host_->swap_block(id, first + static_cast<int64_t>(i)));
  stats_.swap_in_blocks += static_cast<int64_t>(dst.size());
  stats_.bytes_from_tiers += static_cast<int64_t>(dst.size()) * block_bytes_;
}

void KvTiers::drop_swap(RequestId id) {
  if (host_) host_->drop_swap(id);
}

KvTierStats KvTiers::stats() const {
  KvTierStats s = stats_;
  if (host_) {
    s.host_blocks_total = host_->capacity_blocks();
    s.host_blocks_cached = host_->num_cached_blocks();
    s.host_blocks_swapped = host_->num_swapped_blocks();
  }
  if (disk_) s.disk = disk_->stats();
  return s;
}

std::string KvTiers::summary() const {
  std::string s;
  if (host_)
    s += base::strprintf("host tier %lld blocks (%.1f MB)", (long long)host_->capacity_blocks(),
                         static_cast<double>(host_->capacity_blocks() * block_bytes_) / 1e6);
  if (disk_) {
    const DiskTierStats d = disk_->stats();
    s += base::strprintf("%sdisk tier %lld block files at most (%.1f MB; %lld there now)", s.empty() ? "" : ", ",
                         (long long)disk_->capacity_files(),
                         static_cast<double>(disk_->capacity_files() *
                                             DiskKvTier::file_bytes(pool_.block_size, block_bytes_)) / 1e6,
                         (long long)d.files);
  }
  return s;
}

namespace {

void hash_tensor(XXH3_state_t* st, const std::string& name, const Tensor& t) {
  XXH3_64bits_update(st, name.data(), name.size());
  if (!t.defined()) return;
  for (int64_t d : t.shape()) XXH3_64bits_update(st, &d, sizeof(d));
  const int32_t dt = static_cast<int32_t>(t.dtype());
  XXH3_64bits_update(st, &dt, sizeof(dt));
  const Tensor c = t.contiguous();
  const auto* p = static_cast<const uint8_t*>(c.raw_data());
  const size_t n = c.nbytes(), edge = size_t{1} << 19;  // tensors over 1 MiB: 512 KiB at each end
  if (n <= 2 * edge) {
    XXH3_64bits_update(st, p, n);
  } else {
    XXH3_64bits_update(st, p, edge);
    XXH3_64bits_update(st, p + n - edge, edge);
  }
}

}  // namespace

uint64_t kv_fingerprint(const model::Model& m, const KvPool& pool, const std::string& extra_id) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  const std::string head = "tessera kv blocks v1";
  XXH3_64bits_update(st, head.data(), head.size());
  const std::string config = m.config().to_json().dump();
  XXH3_64bits_update(st, config.data(), config.size());
  XXH3_64bits_update(st, extra_id.data(), extra_id.size());
  const std::string quant = m.quantized() ? "quantized" : "dense";
  XXH3_64bits_update(st, quant.data(), quant.size());
  const int64_t layout[] = {static_cast<int64_t>(pool.dtype), pool.block_size, pool.block_bytes(),
                            pool.num_layers(), m.dims().kv_heads};
  XXH3_64bits_update(st, layout, sizeof(layout));
  for (const auto& [name, t] : m.weights().named(m.config())) hash_tensor(st, name, t);
  int64_t k = 0;  // LoRA adapters change K/V: the bank's order is the cache salt's
  for (const model::LoraWeights* w : m.lora_bank())
    for (const auto& [name, t] : w->named(m.config())) hash_tensor(st, std::to_string(k++) + name, t);
  if (const model::LoraWeights* w = m.lora())
    for (const auto& [name, t] : w->named(m.config())) hash_tensor(st, "attached " + name, t);
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return h;
}

void validate_kv_tiers(const EngineConfig& c) {
  TESSERA_CHECK(c.kv_host_memory >= 0, "--kv-host-memory must not be negative, got ", c.kv_host_memory);
  TESSERA_CHECK(c.kv_offload_size >= 0, "--kv-offload-size must not be negative, got ", c.kv_offload_size);
  TESSERA_CHECK(c.kv_offload_dir.empty() || c.kv_offload_size > 0, "--kv-offload-dir ", c.kv_offload_dir,
                " needs --kv-offload-size BYTES > 0 (the disk tier's limit)");
  TESSERA_CHECK(c.kv_offload_size == 0 || !c.kv_offload_dir.empty(), "--kv-offload-size needs --kv-offload-dir");
  TESSERA_CHECK(c.kv_offload_dir.empty() || c.prefix_caching,
                "--kv-offload-dir needs prefix caching (its blocks are found by prefix hash)");
  TESSERA_CHECK(c.preemption == "recompute" || c.preemption == "swap", "--preemption must be swap or recompute, got '",
                c.preemption, "'");
  TESSERA_CHECK(c.preemption != "swap" || c.kv_host_memory > 0,
                "--preemption swap needs --kv-host-memory BYTES > 0 (preempted requests' blocks go there)");
}

std::unique_ptr<KvTiers> make_kv_tiers(const model::Model& m, const EngineConfig& c, KvPool& pool,
                                       bool tensor_parallel) {
  if (c.kv_host_memory == 0 && c.kv_offload_dir.empty()) return nullptr;
  TESSERA_CHECK(!tensor_parallel, "--kv-host-memory, --kv-offload-dir and --preemption swap are not supported "
                "with tensor parallelism (--tp > 1)");
  KvTierConfig tc;
  tc.host_bytes = c.kv_host_memory;
  tc.disk_dir = c.kv_offload_dir;
  tc.disk_bytes = c.kv_offload_size;
  const uint64_t fp = c.kv_offload_dir.empty() ? 0 : kv_fingerprint(m, pool, c.kv_offload_model_id);
  return std::make_unique<KvTiers>(pool, tc, fp);
}

void add_kv_tier_stats(const KvTiers& t, EngineStats& s) {
  const KvTierStats k = t.stats();
  s.kv_host_hit_blocks = k.host_hit_blocks;
  s.kv_disk_hit_blocks = k.disk_hit_blocks;
  s.kv_offloaded_blocks = k.offloaded_blocks;
  s.kv_disk_written_blocks = k.disk_written_blocks;
  s.kv_swap_out_blocks = k.swap_out_blocks;
  s.kv_swap_in_blocks = k.swap_in_blocks;
  s.kv_bytes_to_tiers = k.bytes_to_tiers;
  s.kv_bytes_from_tiers = k.bytes_from_tiers;
  s.kv_host_blocks_total = k.host_blocks_total;
  s.kv_host_blocks_used = k.host_blocks_cached + k.host_blocks_swapped;
  s.kv_disk_files = k.disk.files;
}

std::string model_files_identity(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<std::string> parts;
  auto add = [&](const fs::path& p) {
    const auto size = fs::file_size(p, ec);
    if (ec) return;
    const auto mtime = fs::last_write_time(p, ec).time_since_epoch().count();
    parts.push_back(p.filename().string() + ":" + std::to_string(size) + ":" + std::to_string(mtime));
  };
  if (fs::is_directory(path, ec)) {
    for (const auto& de : fs::directory_iterator(path, ec)) {
      const std::string n = de.path().filename().string();
      if (n == "config.json" || n.find(".safetensors") != std::string::npos || n.ends_with(".gguf")) add(de.path());
    }
  } else {
    add(path);
  }
  std::sort(parts.begin(), parts.end());
  std::string out;
  for (const auto& p : parts) out += p + ";";
  return out;
}

}  // namespace tessera::infer
