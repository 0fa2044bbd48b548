// KV pools in POSIX shared memory (kv_shm.h).
#include "tessera/infer/kv_shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <signal.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <cstring>

#include "tessera/base/error.h"

namespace tessera::infer {
namespace {
struct Segment {
  std::string name;
  void* data = nullptr;
  size_t bytes = 0;
  ~Segment() {
    if (data) munmap(data, bytes);
    shm_unlink(name.c_str());
  }
};
int64_t round_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

// Segments "/tessera-kv-PID-..." of processes that no longer run (killed before they could
// unlink theirs) are removed, so /dev/shm does not fill up across crashes.
void remove_stale_segments() {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("tessera-kv-", 0) != 0) continue;
    const std::string rest = name.substr(11);
    const long pid = std::strtol(rest.c_str(), nullptr, 10);
    if (pid <= 0 || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    shm_unlink(("/" + name).c_str());
  }
}
}  // namespace

KvShmLayout place_pool_in_shm(KvPool& pool, const std::string& name) {
  remove_stale_segments();
  KvShmLayout L;
  L.name = name;
  L.num_blocks = pool.num_blocks;
  int64_t off = 0;
  for (int64_t l = 0; l < pool.num_layers(); ++l) {
    L.k_offset.push_back(off);
    L.k_block_bytes.push_back(static_cast<int64_t>(pool.k[l].nbytes()) / pool.num_blocks);
    off = round_up(off + static_cast<int64_t>(pool.k[l].nbytes()), 64);
    const int64_t vb = pool.v[l].defined() ? static_cast<int64_t>(pool.v[l].nbytes()) : 0;
    L.v_offset.push_back(off);
    L.v_block_bytes.push_back(vb / pool.num_blocks);
    off = round_up(off + vb, 64);
  }
  L.bytes = std::max<int64_t>(off, 64);
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  TESSERA_CHECK(fd >= 0, "KV pool in shared memory: cannot create segment ", name, ": ", std::strerror(errno));
  auto seg = std::make_shared<Segment>();
  seg->name = name;
  if (ftruncate(fd, L.bytes) != 0) {
    const int e = errno;
    close(fd);
    fail("KV pool in shared memory: cannot size segment ", name, " to ", L.bytes, " bytes: ", std::strerror(e));
  }
  void* p = mmap(nullptr, static_cast<size_t>(L.bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  TESSERA_CHECK(p != MAP_FAILED, "KV pool in shared memory: cannot map segment ", name, ": ", std::strerror(errno));
  seg->data = p;
  seg->bytes = static_cast<size_t>(L.bytes);
  auto* base = static_cast<uint8_t*>(p);
  for (int64_t l = 0; l < pool.num_layers(); ++l) {
    pool.k[l] = Tensor::from_blob(base + L.k_offset[l], pool.k[l].shape(), pool.k[l].dtype(), seg);
    if (pool.v[l].defined())
      pool.v[l] = Tensor::from_blob(base + L.v_offset[l], pool.v[l].shape(), pool.v[l].dtype(), seg);
  }
  return L;
}

KvShmMapping::KvShmMapping(const std::string& name, int64_t bytes) : name_(name) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  TESSERA_CHECK(fd >= 0, "KV shared memory: cannot open segment ", name, ": ", std::strerror(errno),
                " (the decode worker must run on this host)");
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_size < bytes) {
    close(fd);
    fail("KV shared memory: segment ", name, " holds ", static_cast<int64_t>(st.st_size), " bytes, expected ", bytes);
  }
  void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  TESSERA_CHECK(p != MAP_FAILED, "KV shared memory: cannot map segment ", name, ": ", std::strerror(errno));
  data_ = static_cast<uint8_t*>(p);
  size_ = bytes;
}

KvShmMapping::~KvShmMapping() {
  if (data_) munmap(data_, static_cast<size_t>(size_));
}

}  // namespace tessera::infer
