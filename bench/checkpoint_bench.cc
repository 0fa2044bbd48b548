// Checkpoint cost for a GPT-2 124M-sized training state (f32 weights + Adam's two f32
// moments, ~1.5 GB): what save_async blocks the step loop for (the deep copy) against
// what runs in the background (write, fsync, checksums), the copy's bandwidth against
// single-thread memcpy and STREAM triad measured in the same run, and how much a
// matmul-bound "step" slows down while a background write runs. The background write is
// compared with a plain buffered write() + fsync of the same bytes to the same directory
// (the checkpoint writes its file images with O_DIRECT instead).
// Usage: checkpoint_bench [saves=3] [dir=/tmp/tessera_ckpt_bench_PID]
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "tessera/base/thread_pool.h"
#include "tessera/base/timer.h"
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/peak.h"
#include "tessera/tensor/tensor.h"
#include "tessera/train/checkpoint.h"

namespace {

using tessera::DType;
using tessera::Shape;
using tessera::Tensor;
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
namespace fs = std::filesystem;

// GPT-2 small's parameters by Hugging Face name (124,439,808 values).
std::vector<std::pair<std::string, Shape>> gpt2_124m_shapes() {
  const int64_t d = 768, v = 50257, ctx = 1024;
  std::vector<std::pair<std::string, Shape>> s = {{"transformer.wte.weight", {v, d}},
                                                  {"transformer.wpe.weight", {ctx, d}}};
  for (int l = 0; l < 12; ++l) {
    const std::string p = "transformer.h." + std::to_string(l) + ".";
    s.push_back({p + "ln_1.weight", {d}});
    s.push_back({p + "ln_1.bias", {d}});
    s.push_back({p + "attn.c_attn.weight", {d, 3 * d}});
    s.push_back({p + "attn.c_attn.bias", {3 * d}});
    s.push_back({p + "attn.c_proj.weight", {d, d}});
    s.push_back({p + "attn.c_proj.bias", {d}});
    s.push_back({p + "ln_2.weight", {d}});
    s.push_back({p + "ln_2.bias", {d}});
    s.push_back({p + "mlp.c_fc.weight", {d, 4 * d}});
    s.push_back({p + "mlp.c_fc.bias", {4 * d}});
    s.push_back({p + "mlp.c_proj.weight", {4 * d, d}});
    s.push_back({p + "mlp.c_proj.bias", {d}});
  }
  s.push_back({"transformer.ln_f.weight", {d}});
  s.push_back({"transformer.ln_f.bias", {d}});
  return s;
}

Tensor filled(const Shape& shape, float v) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  float* p = t.data<float>();
  tessera::base::parallel_for(t.numel(), 1 << 16, [&](int64_t b, int64_t e) {
    std::fill(p + b, p + e, v);
  });
  return t;
}

// Seconds to write() every tensor's bytes to one file and fsync it: the disk's own speed.
double raw_write_seconds(const std::string& path, const std::vector<const NamedTensors*>& all) {
  tessera::base::Timer t;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return -1;
  for (const auto* ts : all)
    for (const auto& [n, x] : *ts) {
      const char* p = static_cast<const char*>(x.raw_data());
      for (size_t done = 0; done < x.nbytes();) {
        const ssize_t w = ::write(fd, p + done, x.nbytes() - done);
        if (w <= 0) return -1;
        done += static_cast<size_t>(w);
      }
    }
  ::fsync(fd);
  ::close(fd);
  const double s = t.seconds();
  ::unlink(path.c_str());
  return s;
}

double bytes_of(const NamedTensors& ts) {
  double b = 0;
  for (const auto& [n, t] : ts) b += double(t.nbytes());
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  const int saves = argc > 1 ? std::max(2, std::atoi(argv[1])) : 3;
  const std::string dir =
      argc > 2 ? argv[2]
               : (fs::temp_directory_path() / ("tessera_ckpt_bench_" + std::to_string(::getpid())))
                     .string();
  fs::remove_all(dir);

  NamedTensors weights, moments;
  int64_t params = 0;
  for (const auto& [name, shape] : gpt2_124m_shapes()) {
    weights.push_back({name, filled(shape, 0.5f)});
    moments.push_back({"exp_avg." + name, filled(shape, 0.25f)});
    moments.push_back({"exp_avg_sq." + name, filled(shape, 0.125f)});
    params += tessera::shape_numel(shape);
  }
  const double total_bytes = bytes_of(weights) + bytes_of(moments);
  auto files_for = [&](int64_t step) {
    tessera::train::CheckpointFiles f;
    f.safetensors.push_back({"model.safetensors", weights});
    f.safetensors.push_back({"optimizer.safetensors", moments});
    f.texts.push_back({"config.json", "{\"model_type\": \"gpt2\", \"n_embd\": 768}\n"});
    f.texts.push_back({"trainer_state.json", "{\"step\": " + std::to_string(step) + "}\n"});
    return f;
  };
  std::printf("checkpoint_bench: %lld params, %.2f GB to save (weights + 2 moments, f32), "
              "%d threads, dir %s\n",
              static_cast<long long>(params), total_bytes / 1e9, tessera::base::num_threads(),
              dir.c_str());

  // Peers: one thread's memcpy of the same bytes into reused buffers, and STREAM triad.
  std::vector<Tensor> dst;
  for (const auto* ts : {&weights, &moments})
    for (const auto& [n, t] : *ts) dst.push_back(filled(t.shape(), 0.f));
  std::vector<double> single;
  for (int r = 0; r < 3; ++r) {
    tessera::base::Timer t;
    size_t i = 0;
    for (const auto* ts : {&weights, &moments})
      for (const auto& [n, src] : *ts)
        std::memcpy(dst[i++].raw_data(), src.raw_data(), src.nbytes());
    single.push_back(t.seconds());
  }
  dst.clear();
  const double single_s = tessera::base::median(single);
  const double triad = tessera::kernels::measure_stream_triad_gbps();
  fs::create_directories(dir);
  const double raw_s = raw_write_seconds(dir + "/raw_write_test", {&weights, &moments});

  // Saves: the first copies into freshly mapped memory (page faults); later ones reuse
  // the blocks the allocator cached when the previous copy was freed.
  std::vector<double> blocking, writes;
  {
    tessera::train::CheckpointManager mgr(dir, 2);
    for (int s = 1; s <= saves; ++s) {
      mgr.save_async(s, files_for(s));
      const double b = mgr.last_blocking_seconds();
      mgr.wait();
      blocking.push_back(b);
      writes.push_back(mgr.last_write_seconds());
      std::printf("  save %d: blocking %.3f s, background write %.2f s (%.2f GB/s incl. fsync "
                  "and checksums)\n",
                  s, b, writes.back(), total_bytes / writes.back() / 1e9);
    }

    // A matmul-bound stand-in for a training step, timed alone and while a write runs.
    Tensor a = filled({1024, 768}, 0.01f), w = filled({3072, 768}, 0.02f);
    Tensor c = Tensor::empty({1024, 3072}, DType::kF32);
    auto step = [&] {
      tessera::base::Timer t;
      for (int i = 0; i < 20; ++i) tessera::kernels::matmul(a, w, c, false, true);
      return t.seconds();
    };
    step();
    std::vector<double> alone, during;
    for (int i = 0; i < 7; ++i) alone.push_back(step());
    mgr.save_async(saves + 1, files_for(saves + 1));
    tessera::base::Timer busy;
    for (int i = 0; i < 7; ++i) during.push_back(step());
    const double busy_s = busy.seconds();
    mgr.wait();
    tessera::base::Timer vt;
    std::string why;
    const bool ok = tessera::train::CheckpointManager::verify(
        mgr.checkpoints_dir() + "/" + tessera::train::checkpoint_dir_name(saves + 1), &why);
    std::printf("verify (sizes + XXH3-64 of every file, read(); written with O_DIRECT, so "
                "from the disk): %.2f s, %s\n",
                vt.seconds(), ok ? "ok" : why.c_str());
    const double step_alone = tessera::base::median(alone);
    const double step_during = tessera::base::median(during);
    std::printf("step stand-in (20 x 1024x768x3072 f32 matmul): %.3f s alone, %.3f s while a "
                "checkpoint is written in the background (%+.0f%%; %.1f s of steps measured, "
                "write took %.1f s)\n",
                step_alone, step_during, 100.0 * (step_during / step_alone - 1.0), busy_s,
                mgr.last_write_seconds());
  }
  fs::remove_all(dir);

  std::vector<double> steady(blocking.begin() + 1, blocking.end());
  const double steady_s = tessera::base::median(steady);
  const double write_s = tessera::base::median(writes);
  std::printf("\nblocking (caller waits): first save %.3f s (fresh buffers), then median %.3f s "
              "= %.1f%% of a 1 s step\n",
              blocking[0], steady_s, 100.0 * steady_s);
  std::printf("copy bandwidth: %.1f GB/s (read + write) vs single-thread memcpy %.1f GB/s "
              "(%.2fx) and STREAM triad %.1f GB/s\n",
              2 * total_bytes / steady_s / 1e9, 2 * total_bytes / single_s / 1e9,
              single_s / steady_s, triad);
  std::printf("background write: median %.2f s per checkpoint (%.2f GB/s) vs buffered write + "
              "fsync of the same bytes %.2f s (%.2f GB/s): %.0f%% of its speed\n",
              write_s, total_bytes / write_s / 1e9, raw_s, total_bytes / raw_s / 1e9,
              100.0 * raw_s / write_s);
  return 0;
}
