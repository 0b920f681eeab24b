// The host's cost of one kernel launch by how a ~31 KB task batch reaches the kernel: as kernel
// parameters (what the agent's top-k, page-write, cache-update and quantize launches do), through a
// copy to device memory (on a side stream with an event, or in the stream), or read by the kernel
// from mapped pinned host memory (plain or write-combined); next to a launch with 4 bytes of
// parameters and an event record alone. Standalone (not built by CMake); on a GPU machine:
//   nvcc -O3 -arch=sm_90 -o /tmp/launch_probe tools/bench/launch_probe.cu && /tmp/launch_probe
// Prints host microseconds per launch over 3000 launches (after 200 warm-up ones), the wall time
// including the final synchronisation, and the GPU time per launch between two events.
// H200 machine, 2026-12-02 (gpu_agent/bench_results/NOTES.md): 4.3 us with 4 bytes, 8.7 by value,
// 11.1 copy + event, 10.7 copy in stream, 8.0 mapped, 8.2 write-combined, 0.3 an event record.
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>
struct Task { void* a; void* b; int n; int pad[5]; };  // 40 bytes
constexpr int kBig = 780;
struct Big { Task t[kBig]; int count; };
__global__ void ByValue(Big b, int* out) { if (threadIdx.x == 0) out[blockIdx.x] = b.t[blockIdx.x].n + b.count; }
__global__ void Small(int n, int* out) { if (threadIdx.x == 0) out[blockIdx.x] = n; }
__global__ void ByPointer(const Big* b, int* out) { if (threadIdx.x == 0) out[blockIdx.x] = b->t[blockIdx.x].n + b->count; }
using Clock = std::chrono::steady_clock;
double Us(Clock::time_point a) { return std::chrono::duration<double, std::micro>(Clock::now() - a).count(); }
int main() {
  cudaStream_t s, copy; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking);
  int* out; cudaMalloc(&out, 1 << 20);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  const int N = 3000, grid = 396;
  Big host_big{}; for (int i = 0; i < kBig; ++i) host_big.t[i].n = i; host_big.count = kBig;
  const int ring = 64;
  Big *pinned, *dev, *mapped, *wc;
  cudaHostAlloc(&pinned, sizeof(Big) * ring, cudaHostAllocDefault);
  cudaHostAlloc(&mapped, sizeof(Big) * ring, cudaHostAllocMapped);
  cudaHostAlloc(&wc, sizeof(Big) * ring, cudaHostAllocMapped | cudaHostAllocWriteCombined);
  cudaMalloc(&dev, sizeof(Big) * ring);
  std::vector<cudaEvent_t> ev(ring); for (auto& e : ev) cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  auto run = [&](const char* name, auto body) {
    for (int i = 0; i < 200; ++i) body(i);  // warm
    cudaDeviceSynchronize();
    cudaEventRecord(e0, s);
    auto t = Clock::now();
    for (int i = 0; i < N; ++i) body(i);
    const double host = Us(t) / N;
    cudaEventRecord(e1, s); cudaEventSynchronize(e1);
    const double wall = Us(t) / N;
    float ms = 0; cudaEventElapsedTime(&ms, e0, e1);
    printf("%-44s host %6.2f us/launch  wall %6.2f  gpu %6.2f us/launch  %s\n", name, host, wall, ms * 1000 / N,
           cudaGetErrorString(cudaGetLastError()));
  };
  run("small params (4 B)", [&](int) { Small<<<grid, 128, 0, s>>>(1, out); });
  run("by value (31 KB)", [&](int) { Big b; std::memcpy(&b, &host_big, sizeof(Big)); ByValue<<<grid, 128, 0, s>>>(b, out); });
  run("copy on side stream + event (31 KB)", [&](int i) {
    const int k = i % ring; cudaEventSynchronize(ev[k]);
    std::memcpy(pinned + k, &host_big, sizeof(Big));
    cudaMemcpyAsync(dev + k, pinned + k, sizeof(Big), cudaMemcpyHostToDevice, copy);
    cudaEventRecord(ev[k], copy); cudaStreamWaitEvent(s, ev[k], 0);
    ByPointer<<<grid, 128, 0, s>>>(dev + k, out);
  });
  run("copy in stream (31 KB)", [&](int i) {
    const int k = i % ring; cudaEventSynchronize(ev[k]);
    std::memcpy(pinned + k, &host_big, sizeof(Big));
    cudaMemcpyAsync(dev + k, pinned + k, sizeof(Big), cudaMemcpyHostToDevice, s);
    ByPointer<<<grid, 128, 0, s>>>(dev + k, out);
    cudaEventRecord(ev[k], s);
  });
  run("mapped host memory (31 KB)", [&](int i) {
    const int k = i % ring; cudaEventSynchronize(ev[k]);
    std::memcpy(mapped + k, &host_big, sizeof(Big));
    ByPointer<<<grid, 128, 0, s>>>(mapped + k, out);
    cudaEventRecord(ev[k], s);
  });
  run("mapped write-combined (31 KB)", [&](int i) {
    const int k = i % ring; cudaEventSynchronize(ev[k]);
    std::memcpy(wc + k, &host_big, sizeof(Big));
    ByPointer<<<grid, 128, 0, s>>>(wc + k, out);
    cudaEventRecord(ev[k], s);
  });
  run("mapped write-combined, event per 16", [&](int i) {
    const int k = i % ring; if (k % 16 == 0) cudaEventSynchronize(ev[k]);
    std::memcpy(wc + k, &host_big, sizeof(Big));
    ByPointer<<<grid, 128, 0, s>>>(wc + k, out);
    if (k % 16 == 15) cudaEventRecord(ev[k - 15], s);
  });
  run("event record alone", [&](int i) { cudaEventRecord(ev[i % ring], s); });
  return 0;
}
