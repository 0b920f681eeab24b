#include "gather_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>

#include <cuda_runtime.h>

#include "bench_stats.h"
#include "device_fetch.h"
#include "host_pages.h"
#include "specache/agent.h"
#include "specache/host_mapping.h"

namespace specache::bench {
namespace {

Status CudaError(const char* what, cudaError_t err) {
  return err == cudaSuccess ? Status::Ok() : Status::Unavailable(std::string(what) + ": " + cudaGetErrorString(err));
}

// Milliseconds of `launch` on the default stream, median over `repeats` after two warm-ups. The
// first failed launch or CUDA call is the result: a launch that failed is never timed.
Result<double> TimeGpu(int repeats, const std::function<Status()>& launch) {
  cudaEvent_t a = nullptr, b = nullptr;
  Status s = CudaError("cudaEventCreate", cudaEventCreate(&a));
  if (s.ok()) s = CudaError("cudaEventCreate", cudaEventCreate(&b));
  for (int i = 0; i < 2 && s.ok(); ++i) s = launch();
  std::vector<double> ms;
  for (int i = 0; i < repeats && s.ok(); ++i) {
    s = CudaError("cudaEventRecord", cudaEventRecord(a));
    if (s.ok()) s = launch();
    if (s.ok()) s = CudaError("cudaEventRecord", cudaEventRecord(b));
    if (s.ok()) s = CudaError("cudaEventSynchronize", cudaEventSynchronize(b));
    float t = 0;
    if (s.ok()) s = CudaError("cudaEventElapsedTime", cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  if (a) cudaEventDestroy(a);
  if (b) cudaEventDestroy(b);
  if (!s.ok()) return s;
  return Median(ms);
}

// Device and pinned buffers of one measurement, freed on every path.
struct Buffers {
  uint8_t* d_copy = nullptr;   // the contiguous copy's destination
  uint8_t* staging = nullptr;  // pinned host buffer of the CPU gather
  ~Buffers() {
    cudaFree(d_copy);
    cudaFreeHost(staging);
  }
};

struct Measured {
  double agent_ms = 0, wide_ms = 0, h2d_ms = 0, cpu_ms = 0;
  int64_t wrong = 0;
};

// One (batch, context) point: the fetch at the agent's block count and at `wide_blocks`, the
// contiguous copy of the same bytes, the CPU gather plus one copy, and the fetched bytes checked.
Result<Measured> MeasurePoint(const RegisteredHostPages& pool, const TopKRows& picked, int agent_blocks,
                              int wide_blocks, int repeats) {
  DeviceFetch fetch;
  SPECACHE_RETURN_IF_ERROR(fetch.Create(picked));
  const uint64_t bytes = fetch.bytes();
  Measured m;
  SPECACHE_ASSIGN_OR_RETURN(m.agent_ms, TimeGpu(repeats, [&] { return fetch.Launch(agent_blocks, nullptr); }));
  SPECACHE_ASSIGN_OR_RETURN(m.wide_ms, TimeGpu(repeats, [&] { return fetch.Launch(wide_blocks, nullptr); }));
  // The bound: one contiguous pinned copy of the same bytes.
  Buffers buffers;
  SPECACHE_RETURN_IF_ERROR(CudaError("cudaMalloc", cudaMalloc(&buffers.d_copy, bytes)));
  SPECACHE_ASSIGN_OR_RETURN(m.h2d_ms, TimeGpu(repeats, [&] {
    return CudaError("H2D copy", cudaMemcpyAsync(buffers.d_copy, pool.chunk(0), bytes, cudaMemcpyHostToDevice, nullptr));
  }));
  // The anchor: the CPU gathers into a pinned buffer, then one copy (the SpeCache code's path).
  SPECACHE_RETURN_IF_ERROR(CudaError("cudaMallocHost", cudaMallocHost(&buffers.staging, bytes)));
  std::vector<double> cpu_ms;
  for (int r = 0; r < std::max(3, repeats / 4); ++r) {
    const auto a = std::chrono::steady_clock::now();
    for (size_t i = 0; i < picked.host_rows.size(); ++i) {
      std::memcpy(buffers.staging + i * kRowBytes, picked.host_rows[i], kRowBytes);
    }
    SPECACHE_RETURN_IF_ERROR(
        CudaError("staged copy", cudaMemcpy(buffers.d_copy, buffers.staging, bytes, cudaMemcpyHostToDevice)));
    cpu_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
  }
  m.cpu_ms = Median(cpu_ms);
  // The fetched rows against the host rows, at both block counts.
  for (int blocks : {agent_blocks, wide_blocks}) {
    SPECACHE_RETURN_IF_ERROR(fetch.ClearRows());
    SPECACHE_RETURN_IF_ERROR(fetch.Launch(blocks, nullptr));
    SPECACHE_RETURN_IF_ERROR(CudaError("fetch", cudaDeviceSynchronize()));
    SPECACHE_ASSIGN_OR_RETURN(const int64_t wrong, fetch.WrongRows(picked));
    m.wrong += wrong;
  }
  return m;
}

}  // namespace

bool RunGatherSuite(const GatherOptions& o, std::vector<GatherRow>* rows) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess) {
    std::printf("gather: no usable CUDA device\n");
    cudaGetLastError();
    return false;
  }
  const int agent_blocks = CudaAgentOptions{}.fetch_blocks;
  const int wide_blocks = o.max_blocks > 0 ? o.max_blocks : 2 * sms;
  RegisteredHostPages pool;
  if (!pool.Create(o.host_gib, o.backing)) return false;
  const uint64_t page_slots = pool.page_slots();
  std::printf("\ngather: the agent's fetch kernel (cuda::FetchRows: per-sequence page tables, selections on the "
              "device, no resident rows)\n");
  std::printf("%d GiB of host pages (%llu pages of 256 KiB in %d chunks of 256 MiB), set up and registered in %.1f s; "
              "%d blocks (the agent's default) and %d blocks x 256 threads\n",
              o.host_gib, static_cast<unsigned long long>(page_slots), pool.chunks(), pool.setup_seconds(),
              agent_blocks, wide_blocks);
  const double huge_share = pool.huge_bytes() < 0 ? -1.0 : double(pool.huge_bytes()) / double(pool.bytes());
  std::printf("host pages: %s; mapped by 2 MiB pages: %s; THP enabled %s, shmem_enabled %s\n",
              HostPageBackingName(o.backing),
              huge_share < 0 ? "unknown (no /proc/self/smaps)" : (std::to_string(int(100 * huge_share + 0.5)) + "%").c_str(),
              TransparentHugePageSetting("enabled").c_str(), TransparentHugePageSetting("shmem_enabled").c_str());
  std::printf("%5s %7s %7s %9s %11s %11s %11s %7s %11s %7s  %s\n", "B", "context", "rows", "MB", "agent GB/s",
              "wide GB/s", "H2D GB/s", "ratio", "CPU+copy", "ratio", "goal (best fetch / H2D)");

  std::mt19937_64 rng(11);
  for (int context : {8192, 32768}) {
    for (int batch : {8, 32, 128}) {
      const uint64_t pages_per_seq = static_cast<uint64_t>(context) / kPageTokens;
      if (pages_per_seq * batch > page_slots) continue;
      // One layer of each sequence: its pages land on distinct random slots of the pool.
      const std::vector<uint64_t> slots = ShuffledPageSlots(page_slots, rng);
      const TopKRows picked = PickTopKRows(pool, slots, 0, batch, context, rng);
      const Result<Measured> m = MeasurePoint(pool, picked, agent_blocks, wide_blocks, o.repeats);
      if (!m.ok()) {
        std::printf("gather: B=%d, context %d: %s\n", batch, context, m.status().ToString().c_str());
        return false;
      }
      const double bytes = static_cast<double>(picked.host_rows.size()) * kRowBytes;
      const double gb = bytes / 1e9;
      const double agent_gbs = gb / (m->agent_ms / 1e3), wide_gbs = gb / (m->wide_ms / 1e3);
      const double h2d_gbs = gb / (m->h2d_ms / 1e3), cpu_gbs = gb / (m->cpu_ms / 1e3);
      const double ratio = std::max(agent_gbs, wide_gbs) / h2d_gbs;
      const char* goal = batch == 32 ? (ratio >= 0.92 ? ">=0.92 met" : ">=0.92 MISSED")
                                     : batch == 128 ? (ratio >= 0.85 ? ">=0.85 met" : ">=0.85 MISSED") : "";
      std::printf("%5d %7d %7zu %9.2f %11.1f %11.1f %11.1f %7.3f %11.1f %7.3f  %s%s\n", batch, context,
                  picked.host_rows.size(), bytes / 1e6, agent_gbs, wide_gbs, h2d_gbs, ratio, cpu_gbs, cpu_gbs / h2d_gbs,
                  goal, m->wrong ? "  WRONG BYTES" : "");
      rows->push_back({"b" + std::to_string(batch) + "_ctx" + std::to_string(context),
                       {{"rows", static_cast<double>(picked.host_rows.size())},
                        {"bytes", bytes},
                        {"agent_blocks", static_cast<double>(agent_blocks)},
                        {"agent_blocks_gbps", agent_gbs},
                        {"wide_blocks", static_cast<double>(wide_blocks)},
                        {"wide_blocks_gbps", wide_gbs},
                        {"h2d_gbps", h2d_gbs},
                        {"ratio", ratio},
                        {"cpu_gather_copy_gbps", cpu_gbs},
                        {"cpu_ratio", cpu_gbs / h2d_gbs},
                        {"rows_wrong", static_cast<double>(m->wrong)},
                        {"host_gib", static_cast<double>(o.host_gib)},
                        {"huge_page_share", huge_share}}});
      if (m->wrong) return false;
    }
  }
  return true;
}

}  // namespace specache::bench
