// Checkpoint writing: the snapshot (each safetensors file's bytes built in memory), the
// background O_DIRECT write with its tmp-dir / fsync / rename commit protocol, `latest`,
// and pruning to keep_last.
// Verification and finding the newest good checkpoint live in checkpoint_verify.cc.
#include "tessera/train/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "tessera/base/error.h"
#include "tessera/base/logging.h"
#include "tessera/base/thread_pool.h"
#include "tessera/base/timer.h"
#include "tessera/base/trace.h"
#include "tessera/io/json_file.h"
#include "tessera/io/safetensors.h"
#include "tessera/train/checkpoint_files.h"

namespace tessera::train {

namespace fs = std::filesystem;

namespace {

// One safetensors file of a checkpoint, built in memory as the exact bytes of the file
// (the prefix, then every tensor back to back), so the writer hands the disk one aligned
// buffer with O_DIRECT instead of streaming it through the page cache.
struct FileImage {
  std::string file;
  std::string prefix;           // 8-byte length + JSON header
  std::vector<Tensor> sources;  // in file order; released once copied
  size_t size = 0;              // bytes of the file
  char* data = nullptr;         // manager-owned block of at least size (rounded up)
  std::optional<uint64_t> hash; // XXH3-64 of the file, when the copy computed it
};

}  // namespace

// The snapshot memory, kept from one save to the next: a checkpoint of the same state
// has the same sizes every time, and fresh memory would be page-faulted in again on
// each save (seconds for a 124M model's 1.5 GB on the dev box, beside a busy step).
struct CheckpointManager::Buffers {
  struct Block {
    char* p = nullptr;
    size_t bytes = 0;
  };
  std::vector<Block> blocks;
  Buffers() = default;
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
  ~Buffers() {
    for (auto& b : blocks)
      if (b.p) ::munmap(b.p, b.bytes);
  }
  // Block i with room for `bytes` (rounded up to the direct-I/O alignment; mmap gives
  // page alignment); *fresh says whether it was just mapped (no page touched yet).
  char* get(size_t i, size_t bytes, bool* fresh = nullptr) {
    if (blocks.size() <= i) blocks.resize(i + 1);
    Block& b = blocks[i];
    const size_t need = std::max(io::round_up_direct_io(bytes), io::kDirectIoAlignment);
    if (fresh) *fresh = b.bytes < need;
    if (b.bytes < need) {
      if (b.p) ::munmap(b.p, b.bytes);
      b = {};
      void* p = ::mmap(nullptr, need, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      TESSERA_CHECK(p != MAP_FAILED, "checkpoint: cannot map a ", need,
                    "-byte snapshot buffer: ", std::strerror(errno));
      b.p = static_cast<char*>(p);
      b.bytes = need;
    }
    return b.p;
  }
};

struct CheckpointManager::Job {
  int64_t step = 0;
  std::vector<FileImage> images;
  std::vector<std::pair<std::string, std::string>> texts;
};

namespace {

// Rejects what could escape the step directory or clash with the manager's own files,
// before anything is copied or written.
void check_files(int64_t step, const CheckpointFiles& files, bool may_be_empty) {
  TESSERA_CHECK(step >= 0, "checkpoint: step must be >= 0, got ", step);
  TESSERA_CHECK(may_be_empty || !files.safetensors.empty() || !files.texts.empty(),
                "checkpoint step ", step, ": no files to save");
  std::set<std::string> names;
  auto check_name = [&](const std::string& name) {
    TESSERA_CHECK(detail::is_plain_file_name(name), "checkpoint step ", step,
                  ": file name '", name, "' must be a plain name (no '/', not '.' or '..')");
    TESSERA_CHECK(name != detail::kChecksumsName, "checkpoint step ", step, ": file name '",
                  name, "' is reserved for the checksums");
    // Every file is written as NAME.tmp first; a file of that name would be clobbered.
    TESSERA_CHECK(!name.ends_with(".tmp"), "checkpoint step ", step, ": file name '", name,
                  "' must not end in .tmp (used for files being written)");
    TESSERA_CHECK(names.insert(name).second, "checkpoint step ", step,
                  ": file name '", name, "' given twice");
  };
  for (const auto& [file, tensors] : files.safetensors) {
    check_name(file);
    std::set<std::string> tensor_names;
    for (const auto& [name, t] : tensors) {
      TESSERA_CHECK(tensor_names.insert(name).second, "checkpoint step ", step, ": ", file,
                    ": duplicate tensor name '", name, "'");
      TESSERA_CHECK(t.defined(), "checkpoint step ", step, ": ", file, ": tensor '", name,
                    "' is undefined");
      TESSERA_CHECK(t.device() == Device::kCPU, "checkpoint step ", step, ": ", file,
                    ": tensor '", name, "' must be on the CPU");
    }
  }
  for (const auto& [file, text] : files.texts) check_name(file);
}

// memcpy with non-temporal stores: the copy is written once and read back only by the
// writer thread much later, so bypassing the cache skips the read-for-ownership of every
// destination line (glibc's memcpy only streams above ~3/4 of the L3 size, larger than
// most tensors). Measured 1.2-1.3x memcpy on the 2-core dev box (docs/performance.md).
void copy_streaming(char* dst, const char* src, size_t n) {
#if defined(__SSE2__)
  const size_t head = std::min(n, (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {  // one cache line per iteration; dst is 64-byte aligned
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, n - i);
  _mm_sfence();  // streaming stores are weakly ordered: publish before the writer reads
#else
  std::memcpy(dst, src, n);
#endif
}

// Lays out each safetensors file (prefix and size); the caller gives each image its
// memory and fill_images copies the bytes in. Throws on bad names.
std::vector<FileImage> plan_images(const CheckpointFiles& files) {
  std::vector<FileImage> images;
  images.reserve(files.safetensors.size());
  for (const auto& [file, tensors] : files.safetensors) {
    FileImage im;
    im.file = file;
    im.prefix = io::safetensors_prefix(file, tensors);
    im.size = im.prefix.size();
    for (const auto& [name, t] : tensors) {
      im.sources.push_back(t);
      im.size += t.nbytes();
    }
    images.push_back(std::move(im));
  }
  return images;
}

// Copies the prefix and every tensor into each image, then drops the sources. Each
// file is cut into pieces in file order. `parallel`: pieces of a few MiB, all workers
// copy at once (one thread's memcpy reaches only a fraction of the machine's memory
// bandwidth), and the writer hashes the images afterwards. Otherwise (the writer thread,
// beside the step loop) one thread copies each file in order in small pieces and hashes
// them on the way, from the source bytes the copy has just pulled into the cache, so the
// hash costs no second pass over memory.
void fill_images(std::vector<FileImage>& images, bool parallel) {
  const size_t piece_bytes = parallel ? size_t{4} << 20 : size_t{256} << 10;  // 256 KiB: L2
  struct Piece {
    const char* src;
    char* dst;
    size_t bytes;
  };
  std::vector<std::vector<Piece>> pieces(images.size());  // per image, in file order
  std::vector<Tensor> contiguous;  // (a non-contiguous source is copied once here)
  for (size_t f = 0; f < images.size(); ++f) {
    FileImage& im = images[f];
    pieces[f].push_back({im.prefix.data(), im.data, im.prefix.size()});
    size_t at = im.prefix.size();
    for (const Tensor& source : im.sources) {
      const Tensor& t = contiguous.emplace_back(source.contiguous());  // a view when it is
      const char* src = static_cast<const char*>(t.raw_data());
      for (size_t off = 0; off < t.nbytes(); off += piece_bytes)
        pieces[f].push_back({src + off, im.data + at + off, std::min(piece_bytes, t.nbytes() - off)});
      at += t.nbytes();
    }
  }
  if (parallel) {
    std::vector<Piece> all;
    for (const auto& file : pieces) all.insert(all.end(), file.begin(), file.end());
    base::parallel_for(static_cast<int64_t>(all.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) copy_streaming(all[i].dst, all[i].src, all[i].bytes);
    });
  } else {
    std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                    &XXH3_freeState);
    TESSERA_CHECK(state, "checkpoint: out of memory for the checksum state");
    for (size_t f = 0; f < images.size(); ++f) {
      XXH3_64bits_reset(state.get());
      for (const Piece& p : pieces[f]) {
        copy_streaming(p.dst, p.src, p.bytes);
        XXH3_64bits_update(state.get(), p.src, p.bytes);
      }
      images[f].hash = XXH3_64bits_digest(state.get());
    }
  }
  for (FileImage& im : images) im.sources.clear();
}

constexpr int kWriterNice = 10;

void remove_tree(const fs::path& p) {
  std::error_code ec;
  fs::remove_all(p, ec);
  if (ec) TESSERA_LOG(kWarn, "checkpoint: cannot remove ", p.string(), ": ", ec.message());
}

// Leftovers of a killed save: .tmp-* directories and latest.tmp. Never a step_ directory.
void remove_stale(const fs::path& root) {
  std::error_code ec;
  std::vector<fs::path> stale;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(detail::kTmpPrefix, 0) == 0 || name == std::string(detail::kLatestName) + ".tmp")
      stale.push_back(entry.path());
  }
  for (const auto& p : stale) {
    TESSERA_LOG(kDebug, "checkpoint: removing leftover of an interrupted save ", p.string());
    remove_tree(p);
  }
}

// The digest marker a rank > 0 leaves in the tmp directory once its files are written.
std::string rank_marker_name(int rank) { return ".rank-" + std::to_string(rank) + ".json"; }

// Rank 0: waits for every other rank's marker, merges its digests into `listed` and
// removes the markers (they are not part of the checkpoint).
void collect_rank_digests(const fs::path& tmp, int world, double timeout_s,
                          nlohmann::ordered_json& listed) {
  base::Timer waited;
  for (int r = 1; r < world; ++r) {
    const fs::path marker = tmp / rank_marker_name(r);
    while (!fs::exists(marker)) {
      TESSERA_CHECK(waited.seconds() < timeout_s, tmp.string(), ": rank ", r,
                    " did not finish writing its checkpoint files within ", timeout_s, " s");
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const auto part = nlohmann::ordered_json::parse(io::read_file_bytes(marker.string()));
    for (const auto& [file, digest] : part.items()) {
      TESSERA_CHECK(!listed.contains(file), tmp.string(), ": file ", file,
                    " written by two ranks");
      listed[file] = digest;
    }
    fs::remove(marker);
  }
}

void rename_or_fail(const fs::path& from, const fs::path& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0)
    fail(to.string(), ": cannot rename ", from.string(), " into place: ", std::strerror(errno));
}

// Moves the finished tmp directory to `final_dir`. When the step was saved before (a
// resumed run reaching the same step), the two are swapped atomically, so a kill at
// any moment leaves one complete step_ directory under that name.
void commit_dir(const fs::path& tmp, const fs::path& final_dir, const fs::path& root) {
  std::error_code ec;
  if (!fs::exists(final_dir, ec)) {
    rename_or_fail(tmp, final_dir);
    return;
  }
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    remove_tree(tmp);  // now holds the old contents
    return;
  }
  if (errno != EINVAL && errno != ENOSYS)
    fail(final_dir.string(), ": cannot swap in ", tmp.string(), ": ", std::strerror(errno));
  // A file system without RENAME_EXCHANGE: move the old one aside first. A kill in
  // between leaves the older step directories (and this one under .tmp-old-) intact.
  const fs::path old = root / (std::string(detail::kTmpPrefix) + "old-" +
                               final_dir.filename().string());
  remove_tree(old);
  rename_or_fail(final_dir, old);
  rename_or_fail(tmp, final_dir);
  remove_tree(old);
}

// Deletes all but `just_written` and the keep_last - 1 highest other steps. A directory
// is renamed to .tmp-delete-* before its files go, so a kill halfway through never
// leaves a half-deleted step_ directory behind.
void prune(const fs::path& root, int keep_last, int64_t just_written) {
  const std::map<int64_t, std::string> dirs = detail::list_step_dirs(root.string());
  int kept = 1;
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) {
    if (it->first == just_written) continue;
    if (kept < keep_last) {
      ++kept;
      continue;
    }
    const fs::path doomed = root / (std::string(detail::kTmpPrefix) + "delete-" + it->second);
    if (std::rename((root / it->second).c_str(), doomed.c_str()) != 0) {
      TESSERA_LOG(kWarn, "checkpoint: cannot remove old checkpoint ", (root / it->second).string(),
                  ": ", std::strerror(errno));
      continue;
    }
    remove_tree(doomed);
  }
}

}  // namespace

CheckpointManager::CheckpointManager(std::string run_dir, int keep_last)
    : run_dir_(std::move(run_dir)), keep_last_(keep_last), buffers_(std::make_unique<Buffers>()) {
  TESSERA_CHECK(!run_dir_.empty(), "checkpoint: run directory is empty");
  TESSERA_CHECK(keep_last_ >= 1, "checkpoint: keep_last must be >= 1, got ", keep_last_);
}

CheckpointManager::~CheckpointManager() {
  try {
    wait();
  } catch (const std::exception& e) {
    TESSERA_LOG(kError, "checkpoint: ", e.what());
  }
}

void CheckpointManager::set_ranks(int rank, int world_size, std::function<void()> barrier,
                                  double shard_timeout_s) {
  TESSERA_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "checkpoint: rank ", rank,
                " out of range for world size ", world_size);
  TESSERA_CHECK(world_size == 1 || barrier, "checkpoint: several ranks need a barrier");
  rank_ = rank;
  world_ = world_size;
  barrier_ = std::move(barrier);
  shard_timeout_s_ = shard_timeout_s;
}

std::string CheckpointManager::checkpoints_dir() const {
  return (fs::path(run_dir_) / detail::kCheckpointsDirName).string();
}

void CheckpointManager::wait() {
  if (worker_.joinable()) worker_.join();
  snapshot_pending_ = false;
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void CheckpointManager::save(int64_t step, CheckpointFiles files) {
  save_async(step, std::move(files));
  wait();
}

void CheckpointManager::save_async(int64_t step, CheckpointFiles files) {
  start_save(step, std::move(files), false);
}

void CheckpointManager::save_async_deferred(int64_t step, CheckpointFiles files) {
  start_save(step, std::move(files), true);
}

void CheckpointManager::reserve(const CheckpointFiles& files) {
  wait();  // the blocks may be in use by a write in flight
  base::Timer timer;
  const std::vector<FileImage> images = plan_images(files);
  size_t bytes = 0;
  for (size_t i = 0; i < images.size(); ++i) {
    bool fresh = false;
    char* p = buffers_->get(i, images[i].size, &fresh);
    if (!fresh) continue;
    // Fault the pages in now, on every worker (measured on the dev box: 2 threads'
    // memset 0.43 s for 1.5 GB, MAP_POPULATE 0.5-2 s, one thread 0.85 s).
    const size_t n = io::round_up_direct_io(images[i].size);
    constexpr size_t kPiece = size_t{4} << 20;
    base::parallel_for(static_cast<int64_t>((n + kPiece - 1) / kPiece), 1,
                       [&](int64_t b, int64_t e) {
                         for (int64_t k = b; k < e; ++k) {
                           const size_t off = static_cast<size_t>(k) * kPiece;
                           std::memset(p + off, 0, std::min(kPiece, n - off));
                         }
                       });
    bytes += n;
  }
  last_reserve_seconds_ = timer.seconds();
  TESSERA_LOG(kDebug, "checkpoint: reserved ", bytes >> 20, " MiB of snapshot memory in ",
              last_reserve_seconds_, " s");
}

void CheckpointManager::wait_snapshot() {
  if (!snapshot_pending_) return;
  base::Timer timer;
  snapshot_done_.wait();
  snapshot_pending_ = false;
  last_blocking_seconds_ += timer.seconds();
}

void CheckpointManager::start_save(int64_t step, CheckpointFiles files, bool deferred) {
  base::Timer timer;
  wait();  // at most one write in flight; rethrows the previous write's error
  check_files(step, files, /*may_be_empty=*/world_ > 1 && rank_ != 0);  // a rank may own none
  if (world_ > 1) {
    // Rank 0 clears leftovers and makes the step's tmp directory before anyone writes.
    if (rank_ == 0) {
      const fs::path root = checkpoints_dir();
      std::error_code ec;
      fs::create_directories(root, ec);
      TESSERA_CHECK(fs::is_directory(root), root.string(),
                    ": cannot create checkpoint directory: ",
                    ec ? ec.message() : "a file of that name exists");
      remove_stale(root);
      const fs::path tmp = root / (detail::kTmpPrefix + checkpoint_dir_name(step));
      fs::create_directory(tmp, ec);
      TESSERA_CHECK(!ec, tmp.string(), ": cannot create directory: ", ec.message());
    }
    barrier_();
  }
  auto job = std::make_shared<Job>();
  job->step = step;
  job->images = plan_images(files);
  for (size_t i = 0; i < job->images.size(); ++i)
    job->images[i].data = buffers_->get(i, job->images[i].size);
  files.safetensors.clear();  // the images hold the sources now
  std::promise<void> snapshot;
  snapshot_done_ = snapshot.get_future();
  snapshot_pending_ = deferred;
  if (!deferred) {
    fill_images(job->images, /*parallel=*/true);
    snapshot.set_value();
  }
  job->texts = std::move(files.texts);
  write_finished_ = false;
  worker_ = std::thread([this, job, deferred, snapshot = std::move(snapshot)]() mutable {
    bool copied = !deferred;
    try {
      if (deferred) {  // copy at normal priority: the step loop waits for it before it mutates
        base::TraceScope copy("checkpoint_copy");
        fill_images(job->images, /*parallel=*/false);
        snapshot.set_value();
        copied = true;
      }
      // The write is not urgent and the step loop's workers want every core: lower this
      // thread's priority (Linux nice values are per thread) so it runs in their gaps.
      ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), kWriterNice);
      base::TraceScope write("checkpoint_write");
      run_job(*job);
    } catch (...) {
      error_ = std::current_exception();
    }
    if (!copied) snapshot.set_value();
    for (FileImage& im : job->images) im.sources.clear();  // (when the copy itself failed)
    write_finished_ = true;
  });
  last_blocking_seconds_ = timer.seconds();
}

bool CheckpointManager::writing() const {
  return worker_.joinable() && !write_finished_.load();
}

void CheckpointManager::run_job(Job& job) {
  base::Timer timer;
  const fs::path root = checkpoints_dir();
  std::error_code ec;
  const std::string name = checkpoint_dir_name(job.step);
  const fs::path tmp = root / (detail::kTmpPrefix + name);
  if (world_ == 1) {  // (several ranks: rank 0 made it in start_save)
    fs::create_directories(root, ec);
    TESSERA_CHECK(fs::is_directory(root), root.string(), ": cannot create checkpoint directory: ",
                  ec ? ec.message() : "a file of that name exists");
    remove_stale(root);
    fs::create_directory(tmp, ec);
    TESSERA_CHECK(!ec, tmp.string(), ": cannot create directory: ", ec.message());
  }
  double write_s = 0, hash_s = 0;
  try {
    nlohmann::ordered_json listed = nlohmann::ordered_json::object();
    for (const FileImage& im : job.images) {
      base::Timer t;
      const uint64_t hash = im.hash ? *im.hash : detail::digest_bytes(im.data, im.size);
      hash_s += t.seconds();
      t.reset();
      io::write_file_atomic_direct((tmp / im.file).string(), im.data, im.size);  // fsyncs
      write_s += t.seconds();
      listed[im.file] = {{"size", im.size}, {detail::kHashKey, detail::hash_hex(hash)}};
    }
    for (const auto& [file, text] : job.texts) {
      io::write_file_atomic((tmp / file).string(), text);
      listed[file] = {{"size", text.size()},
                      {detail::kHashKey, detail::hash_hex(detail::digest_bytes(text))}};
    }
    if (world_ > 1 && rank_ != 0) {
      // This rank's part is durable: leave the digests for rank 0, which commits.
      detail::fsync_dir(tmp.string());
      io::write_file_atomic((tmp / rank_marker_name(rank_)).string(), listed.dump() + "\n");
      last_write_seconds_ = timer.seconds();
      return;
    }
    if (world_ > 1) collect_rank_digests(tmp, world_, shard_timeout_s_, listed);
    nlohmann::ordered_json sums;
    sums["format"] = detail::kFormat;
    sums["step"] = job.step;
    sums["files"] = std::move(listed);
    io::write_file_atomic((tmp / detail::kChecksumsName).string(), sums.dump(2) + "\n");
    detail::fsync_dir(tmp.string());  // the file names inside are durable before the rename

    commit_dir(tmp, root / name, root);
    detail::fsync_dir(root.string());
  } catch (...) {
    remove_tree(tmp);  // the previous checkpoints are untouched
    throw;
  }
  io::write_file_atomic((root / detail::kLatestName).string(), name + "\n");
  detail::fsync_dir(root.string());
  prune(root, keep_last_, job.step);
  last_write_seconds_ = timer.seconds();
  TESSERA_LOG(kDebug, "checkpoint ", name, ": written in ", last_write_seconds_.load(),
              " s (safetensors O_DIRECT write + fsync ", write_s, " s, checksums ", hash_s, " s)");
}

}  // namespace tessera::train
