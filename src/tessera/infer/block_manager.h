// Paged KV cache bookkeeping: a pool of fixed-size blocks shared by all layers, per-request
// block tables, reference counts, copy-on-write for forks and a hash-chained prefix cache.
#pragma once
#include <cstdint>
#include <deque>
#include <list>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tessera/infer/kv_offload.h"

namespace tessera::infer {

struct BlockManagerConfig {
  int64_t num_blocks = 0;   // physical blocks in the pool (every layer uses the same ids)
  int64_t block_size = 16;  // tokens per block
  bool prefix_caching = true;
};

// Outcome of BlockManager::copy_on_write. ok == false: the pool had no block for the copy and
// nothing changed (the caller frees memory, e.g. preempts a request, and retries). copy is set
// when the runner must copy the K/V data of block first -> second before writing.
struct CowResult {
  bool ok = true;
  std::optional<std::pair<BlockId, BlockId>> copy;  // {src, dst}
};

// Every block is in exactly one state:
//   free       ref 0, no hash, in free_ (FIFO: handed out from the front, returned at the back);
//   evictable  ref 0, has a hash, in evictable_ (LRU order: front = least recently released);
//   used       ref > 0, held by that many block tables (it may or may not have a hash).
// A block gets a hash only once it is full and its K/V is written (commit), so a cached block's
// contents never change; partial blocks are never shared except through fork().
class BlockManager {
 public:
  explicit BlockManager(BlockManagerConfig c);  // throws on bad config

  // Blocks a new allocation can take right now: free + cached-but-unreferenced (evictable).
  int64_t num_free_blocks() const { return static_cast<int64_t>(free_.size() + evictable_.size()); }

  // Prefix-cache lookup for a request about to start (tokens = its full token list so far):
  // the longest chain of cached full blocks matching tokens[0 : k*block_size], never all of the
  // tokens (at most (tokens.size()-1)/block_size blocks, so at least one token is computed).
  // Creates the request's block table (it must not have one) starting with the hit blocks, each
  // taking a reference. Returns the number of cached tokens (k*block_size). With prefix caching
  // on it counts one query and, per candidate block ((tokens.size()-1)/block_size of them), a
  // hit or a miss; with it off it only creates the empty table and returns 0.
  // cache_salt: requests whose K/V differs for the same tokens (a LoRA adapter) pass a
  // different salt; the chain of their blocks starts from root_hash(salt), so they share
  // cached blocks only with requests of the same salt (0: the base model's chain).
  // With an offloader (set_offloader), the chain continues in the lower tiers where the pool
  // has no block of it (and in the pool again after): each block found there is copied into a
  // fresh pool block (taken as allocate_slots takes them), which joins the prefix cache as
  // committed; these count as tier hits, not misses. A request with swapped-out blocks (swap_out) instead gets its pool prefix hits
  // and then its swapped blocks copied back (when the pool has room for them; otherwise it
  // recomputes), and the returned count is its swapped tokens; the swap copy is forgotten at
  // its next successful allocate_slots.
  int64_t allocate_cached_prefix(RequestId id, const std::vector<int32_t>& tokens, uint64_t cache_salt = 0);

  // KV transfer (prefill/decode disaggregation; block_manager_transfer.cc): creates holder's
  // table (it must not have one) with the longest cached chain of full blocks of
  // tokens[0, floor(size/block_size) * block_size) under root_hash(cache_salt), each taking a
  // reference, so they stay put while their bytes are read or until a request claims them.
  // Unlike allocate_cached_prefix every full block may match and no query is counted. Returns
  // the blocks held. An importer then extends the table with allocate_slots, writes the new
  // blocks and commit()s them: "import a cached chain". free(holder) ends the hold.
  int64_t hold_cached_chain(RequestId holder, const std::vector<int32_t>& tokens, uint64_t cache_salt = 0);

  // Makes the request's table cover `num_tokens` tokens, appending new blocks (taken from the
  // free list first, then by evicting least-recently-used cached blocks). Returns false, with
  // nothing changed, when the pool cannot provide them. Creates the table if the request has none.
  bool allocate_slots(RequestId id, int64_t num_tokens);

  // Tokens [0, num_computed) of the request now have their K/V written: every block that became
  // full gets its chain hash and, with prefix caching on, is entered in the prefix cache (unless
  // another block already holds that hash; this one then stays private). Call after each step.
  // A num_computed below what was committed before is a no-op for the blocks already hashed.
  void commit(RequestId id, const std::vector<int32_t>& tokens, int64_t num_computed);

  // Fork (n > 1 samples, beam search): child's table = parent's table, every block ref+1.
  // The child must not have a table yet.
  void fork(RequestId parent, RequestId child);

  // Before writing token position `pos` of the request: if the block holding it is shared
  // (ref > 1) the request gets a private copy and the result carries {src, dst} for the runner
  // to copy (before the write). ok == false when no block is available for the copy. Throws when
  // the table does not cover `pos` or `pos` lies in a committed full block (committed K/V is
  // never rewritten).
  CowResult copy_on_write(RequestId id, int64_t pos);

  // Sliding-window attention: the request's first `num_blocks` logical blocks will never be
  // read again. Those not released yet are released (in order, as free() releases them)
  // while the table keeps their ids, now stale (the attention never reads them; they may be
  // handed to other requests). Fewer than released before is a no-op.
  void release_leading(RequestId id, int64_t num_blocks);
  int64_t num_released(RequestId id) const;  // leading blocks released so far

  // Releases the request's blocks, last block first: ref-1; a block reaching 0 that has a hash
  // stays cached (evictable, appended at the most-recently-used end, so a request's tail blocks
  // are evicted before its head), otherwise it goes back to the free list. Unknown id: no-op.
  void free(RequestId id);

  // Lower tiers (kv_tiers.h): committed blocks are offered to it before eviction, prefix
  // lookups continue in it, and swap_out uses it. nullptr (the default): none. Not owned.
  void set_offloader(KvOffloader* o) { offloader_ = o; }
  // Swap preemption, before free(id): copies the blocks covering the request's first
  // num_tokens tokens to the offloader. False (nothing kept: the request recomputes) without
  // an offloader, with no room there, for num_tokens 0, or after release_leading.
  bool swap_out(RequestId id, int64_t num_tokens);
  // The request left for good: its swapped-out blocks, if any, are dropped.
  void drop_swap(RequestId id);

  bool has_request(RequestId id) const { return reqs_.count(id) != 0; }
  const std::vector<BlockId>& block_table(RequestId id) const;  // throws for an unknown id
  // Chain hashes of the request's committed full blocks (empty with prefix caching off).
  const std::vector<uint64_t>& block_hashes(RequestId id) const;

  struct Stats {
    int64_t queries = 0, hit_blocks = 0, miss_blocks = 0, evictions = 0;
    int64_t tier_hit_blocks = 0;   // found in a lower tier (copied back), not counted in hit_blocks
    int64_t swap_in_blocks = 0;    // swapped-out blocks copied back on resumption
  };
  Stats stats() const { return stats_; }

  // Introspection for tests and metrics.
  int32_t ref_count(BlockId b) const;
  std::optional<uint64_t> cached_hash(BlockId b) const;  // set while the block is in the cache
  int64_t num_cached_blocks() const { return static_cast<int64_t>(cached_.size()); }
  std::vector<BlockId> eviction_order() const;  // evictable blocks, next victim first

  // Invariant check for tests: every block is exactly one of free / evictable / used, ref
  // counts equal the number of tables holding the block, hash map and block hashes agree.
  void check_invariants() const;  // throws tessera::Error describing the first violation

  int64_t num_blocks() const { return cfg_.num_blocks; }
  int64_t block_size() const { return cfg_.block_size; }
  bool prefix_caching() const { return cfg_.prefix_caching; }

  // Chain hash of one block: XXH3-64 of its token ids (int32, native byte order) seeded with
  // the parent block's hash (kRootHash for the first block).
  static constexpr uint64_t kRootHash = 0x7465737365726121ull;  // "tessera!"
  static uint64_t hash_block(uint64_t parent, const int32_t* tokens, int64_t n);
  // The parent hash of a request's first block: kRootHash for salt 0, else a hash of it and
  // the salt.
  static uint64_t root_hash(uint64_t cache_salt);

 private:
  enum class State : uint8_t { kFree, kEvictable, kUsed };
  struct Block {
    int32_t ref = 0;
    State state = State::kFree;
    bool hashed = false;           // in cached_ (full, committed, prefix caching on)
    uint64_t hash = 0;             // valid while hashed
    uint64_t parent_hash = 0;      // valid while hashed; compared on lookup with the tokens
    std::vector<int32_t> tokens;   // (block_size) token ids while hashed, to rule out collisions
    std::list<BlockId>::iterator lru_pos;  // valid while kEvictable
  };
  struct RequestBlocks {
    std::vector<BlockId> table;     // logical block i -> physical block
    std::vector<uint64_t> hashes;   // chain hashes of the committed full blocks (prefix of table)
    int64_t released = 0;           // table[0, released) are stale (release_leading)
    uint64_t root = kRootHash;      // parent hash of block 0 (root_hash of the cache salt)
    bool swap_pending = false;      // has a swapped copy, dropped once admitted (allocate_slots)
  };

  BlockId take_block();            // caller checked num_free_blocks() > 0
  void untake_block(BlockId b);    // gives back a block take_block just handed out, unused
  void cache_block(BlockId b, uint64_t hash, uint64_t parent, const int32_t* tokens);
  void extend_chain(RequestBlocks& r, const std::vector<int32_t>& tokens, int64_t candidates, bool tiers,
                    int64_t& pool_hits, int64_t& tier_hits);
  int64_t swap_in(RequestId id, RequestBlocks& r, int64_t swapped);
  void release_block(BlockId b);
  RequestBlocks& get(RequestId id, const char* what);
  const RequestBlocks& get(RequestId id, const char* what) const;

  BlockManagerConfig cfg_;
  std::vector<Block> blocks_;
  std::deque<BlockId> free_;
  std::list<BlockId> evictable_;
  std::unordered_map<uint64_t, BlockId> cached_;  // chain hash -> the block holding it
  std::unordered_map<RequestId, RequestBlocks> reqs_;
  Stats stats_;
  KvOffloader* offloader_ = nullptr;
};

}  // namespace tessera::infer
