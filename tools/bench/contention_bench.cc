#include "contention_bench.h"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include <cuda_runtime.h>

#include "bench_stats.h"
#include "device_fetch.h"
#include "host_pages.h"
#include "specache/status.h"

namespace specache::bench {
namespace {

constexpr uint64_t kCopyBytes = uint64_t{64} << 20;  // the contiguous copy: a quarter of a chunk

// Lines the GPUs' samples up, so that "at once" means the same moment on every GPU.
class Barrier {
 public:
  explicit Barrier(int parties) : parties_(parties) {}
  void Wait() {
    std::unique_lock lock(mu_);
    const uint64_t generation = generation_;
    if (++waiting_ == parties_) {
      waiting_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const int parties_;
  int waiting_ = 0;
  uint64_t generation_ = 0;
};

enum class Load { kGather, kCopy };

struct DeviceWork {
  int device = 0;
  int blocks = 0;
  TopKRows rows;
  std::unique_ptr<DeviceFetch> fetch;    // the agent's FetchRows over this GPU's sequences
  const uint8_t* copy_source = nullptr;  // host
  uint8_t* d_copy = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;

  uint64_t gather_bytes() const { return rows.host_rows.size() * uint64_t{kRowBytes}; }
  uint64_t bytes(Load load, int launches) const {
    return (load == Load::kGather ? gather_bytes() : kCopyBytes) * static_cast<uint64_t>(launches);
  }
};

// Milliseconds of each sample of `launches` back-to-back loads on one GPU, after one warm-up
// sample; with a barrier, every sample starts when all GPUs are ready for it. Empty on an error
// (after the barrier's last wait, so the other GPUs finish their samples).
std::vector<double> Samples(DeviceWork& w, Load load, int repeats, int launches, Barrier* barrier) {
  cudaSetDevice(w.device);
  std::vector<double> ms;
  std::string error;
  for (int r = -1; r < repeats; ++r) {
    if (barrier) barrier->Wait();
    if (error.empty() && cudaEventRecord(w.start, w.stream) != cudaSuccess) error = cudaGetErrorString(cudaGetLastError());
    for (int l = 0; l < launches && error.empty(); ++l) {
      if (load == Load::kGather) {
        const Status s = w.fetch->Launch(w.blocks, w.stream);
        if (!s.ok()) error = s.ToString();
      } else if (cudaMemcpyAsync(w.d_copy, w.copy_source, kCopyBytes, cudaMemcpyHostToDevice, w.stream) !=
                 cudaSuccess) {
        error = cudaGetErrorString(cudaGetLastError());
      }
    }
    float t = 0;
    if (cudaEventRecord(w.stop, w.stream) != cudaSuccess || cudaEventSynchronize(w.stop) != cudaSuccess ||
        cudaEventElapsedTime(&t, w.start, w.stop) != cudaSuccess) {
      if (error.empty()) error = cudaGetErrorString(cudaGetLastError());
    }
    if (r >= 0) ms.push_back(t);
  }
  if (error.empty()) return ms;
  std::printf("contend: GPU %d: %s\n", w.device, error.c_str());
  return {};
}

bool SetUp(const RegisteredHostPages& pool, const std::vector<uint64_t>& slots, int index,
           const ContendOptions& o, std::mt19937_64& rng, DeviceWork* w) {
  w->device = index;
  cudaSetDevice(index);
  int sms = 0, host_pointers = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, index);
  cudaDeviceGetAttribute(&host_pointers, cudaDevAttrCanUseHostPointerForRegisteredMem, index);
  void* mapped = nullptr;
  if (cudaHostGetDevicePointer(&mapped, pool.chunk(0), 0) != cudaSuccess ||
      reinterpret_cast<uint64_t>(mapped) != pool.device_address(0)) {
    // The pool's addresses were taken on GPU 0; they hold on every GPU only with unified addressing.
    std::printf("contend: GPU %d maps the host pages at another address (host pointers usable: %d)\n", index,
                host_pointers);
    cudaGetLastError();
    return false;
  }
  w->blocks = 2 * sms;
  const uint64_t pages = static_cast<uint64_t>(o.batch) * (o.context / kPageTokens);
  w->rows = PickTopKRows(pool, slots, static_cast<uint64_t>(index) * pages, o.batch, o.context, rng);
  w->copy_source = pool.chunk(index % pool.chunks());
  w->fetch = std::make_unique<DeviceFetch>();
  const Status created = w->fetch->Create(w->rows);
  if (!created.ok()) {
    std::printf("contend: GPU %d: %s\n", index, created.ToString().c_str());
    return false;
  }
  const bool ok = cudaMalloc(&w->d_copy, kCopyBytes) == cudaSuccess &&
                  cudaStreamCreateWithFlags(&w->stream, cudaStreamNonBlocking) == cudaSuccess &&
                  cudaEventCreate(&w->start) == cudaSuccess && cudaEventCreate(&w->stop) == cudaSuccess;
  if (!ok) std::printf("contend: GPU %d: %s\n", index, cudaGetErrorString(cudaGetLastError()));
  return ok;
}

// Rows the last gather on this GPU got wrong; every row when they cannot be read back.
int64_t WrongRows(DeviceWork& w) {
  const Result<int64_t> wrong = cudaSetDevice(w.device) == cudaSuccess
                                    ? w.fetch->WrongRows(w.rows)
                                    : Result<int64_t>(Status::Unavailable(cudaGetErrorString(cudaGetLastError())));
  if (wrong.ok()) return *wrong;
  std::printf("contend: GPU %d: reading the fetched rows back: %s\n", w.device, wrong.status().ToString().c_str());
  return static_cast<int64_t>(w.rows.host_rows.size());
}

void TearDown(DeviceWork& w) {
  cudaSetDevice(w.device);
  w.fetch.reset();
  cudaFree(w.d_copy);
  if (w.start) cudaEventDestroy(w.start);
  if (w.stop) cudaEventDestroy(w.stop);
  if (w.stream) cudaStreamDestroy(w.stream);
}

}  // namespace

bool RunContendSuite(const ContendOptions& o, std::vector<BenchRow>* rows) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::printf("contend: no usable CUDA device\n");
    cudaGetLastError();
    return false;
  }
  const uint64_t pages_per_gpu = static_cast<uint64_t>(o.batch) * (o.context / kPageTokens);
  cudaSetDevice(0);
  RegisteredHostPages pool;
  if (!pool.Create(o.host_gib)) return false;
  if (pages_per_gpu * gpus > pool.page_slots()) {
    std::printf("contend: %d GPUs x %d sequences of %d tokens need %llu pages; --host-gib %d holds %llu\n", gpus,
                o.batch, o.context, static_cast<unsigned long long>(pages_per_gpu * gpus), o.host_gib,
                static_cast<unsigned long long>(pool.page_slots()));
    return false;
  }
  std::mt19937_64 rng(7);
  const std::vector<uint64_t> slots = ShuffledPageSlots(pool.page_slots(), rng);
  std::vector<DeviceWork> work(gpus);
  bool ok = true;
  for (int g = 0; g < gpus && ok; ++g) ok = SetUp(pool, slots, g, o, rng, &work[g]);
  if (!ok) {
    for (auto& w : work) TearDown(w);
    return false;
  }
  std::printf("\ncontend: the agent's fetch kernel (cuda::FetchRows) and contiguous copies; %d GPU(s); %d GiB of host pages registered in %.1f s; per GPU %d sequences x %d tokens, "
              "%zu rows (%.2f MB) per gather, %d gathers or %d copies of %llu MiB per sample, %d samples\n",
              gpus, o.host_gib, pool.setup_seconds(), o.batch, o.context, work[0].rows.host_rows.size(),
              work[0].gather_bytes() / 1e6, o.launches, o.launches, static_cast<unsigned long long>(kCopyBytes >> 20),
              o.repeats);
  std::printf("%-7s %5s %12s %15s %7s\n", "load", "GPU", "alone GB/s", "at once GB/s", "ratio");

  int64_t wrong = 0;
  for (Load load : {Load::kGather, Load::kCopy}) {
    const char* name = load == Load::kGather ? "gather" : "h2d";
    std::vector<double> alone(gpus);
    bool failed = false;
    for (int g = 0; g < gpus; ++g) {
      const std::vector<double> ms = Samples(work[g], load, o.repeats, o.launches, nullptr);
      failed |= ms.empty();
      if (!ms.empty()) alone[g] = work[g].bytes(load, o.launches) / 1e6 / Median(ms);
    }
    // Every GPU at once, one thread each.
    std::vector<std::vector<double>> together(gpus);
    Barrier barrier(gpus);
    std::vector<std::thread> threads;
    for (int g = 0; g < gpus; ++g) {
      threads.emplace_back([&, g] { together[g] = Samples(work[g], load, o.repeats, o.launches, &barrier); });
    }
    for (auto& t : threads) t.join();
    for (const auto& ms : together) failed |= ms.empty();
    if (failed) {
      for (auto& w : work) TearDown(w);
      return false;
    }
    double sum_alone = 0;
    for (int g = 0; g < gpus; ++g) {
      const double at_once = work[g].bytes(load, o.launches) / 1e6 / Median(together[g]);
      sum_alone += alone[g];
      std::printf("%-7s %5d %12.1f %15.1f %7.3f\n", name, g, alone[g], at_once, at_once / alone[g]);
      rows->push_back({std::string(name) + "_gpu" + std::to_string(g),
                       {{"alone_gbps", alone[g]}, {"at_once_gbps", at_once}, {"ratio", at_once / alone[g]}}});
    }
    // The host's total: all GPUs' bytes over the slowest GPU's time, sample by sample.
    std::vector<double> totals;
    for (int r = 0; r < o.repeats; ++r) {
      double bytes = 0, slowest = 0;
      for (int g = 0; g < gpus; ++g) {
        bytes += work[g].bytes(load, o.launches);
        slowest = std::max(slowest, together[g][r]);
      }
      totals.push_back(bytes / 1e6 / slowest);
    }
    const double total = Median(totals);
    std::printf("%-7s %5s %12.1f %15.1f %7.3f   (sum of GPUs alone; all bytes / slowest GPU at once)\n", name, "all",
                sum_alone, total, total / sum_alone);
    rows->push_back({std::string(name) + "_all",
                     {{"gpus", static_cast<double>(gpus)}, {"sum_alone_gbps", sum_alone}, {"at_once_gbps", total},
                      {"ratio", total / sum_alone}}});
    if (load == Load::kGather) {
      for (auto& w : work) wrong += WrongRows(w);
    }
  }
  if (wrong) std::printf("contend: %lld gathered rows WRONG\n", static_cast<long long>(wrong));
  for (auto& w : work) TearDown(w);
  return wrong == 0;
}

}  // namespace specache::bench
