// A CUDA runtime (and the few cuBLAS calls the project makes) that does no device work, for
// measuring the HOST's side of the GPU path on a machine without a GPU: loaded with LD_PRELOAD
// into specache-bench or specache-run, every call the project makes succeeds at once and nothing
// runs. What a program then spends on its main thread is its own host work (building task lists,
// planning, bookkeeping, launching), without the driver's launch costs or waits for the device:
// the part of a decode step's enqueue that this project's code decides. Read it with the host
// sampler (LD_PRELOAD="libspecache_host_sampler.so libspecache_null_cuda.so", the sampler first:
// its cudaProfilerStart/Stop win) and tools/profile/host_profile.py, or with the programs' own
// host clocks (specache-run bench's "host: X ms to enqueue a step, Y of them in the agent's
// calls").
//
// What it does and does not pretend:
// - The device is "null device (no GPU: host-cost harness)", compute capability 9.0, 132 SMs,
//   80 GiB (cudaMemGetInfo says all free), so the programs take their Hopper paths.
// - Device, pinned and managed allocations are zero-filled host memory (mmap, lazily backed:
//   untouched bytes cost no RAM); a mapped host pointer is its own device pointer.
// - Copies and memsets are NOT carried out: on a GPU they are the copy engine's (asynchronous)
//   work, not the host's. So nothing the host reads back from "device" memory is a result: the
//   bytes are whatever the host last wrote there, zeros at first (a kernel's outputs stay zeros).
//   Figures that come from the device (event timings: 1 us; tokens; counters; selections) are
//   meaningless in such a run; only host-side times are.
// - Kernels, events, streams and graphs are accepted and do nothing; every wait returns at once.
// - SPECACHE_NULL_CUDA_COUNTS=1 prints, at exit, how often each kind of call was made (launches,
//   allocations, copies, waits, and the cheap queries: device, capture state, last error,
//   attributes): what a run asks of the driver, e.g. per decode step.
// - SPECACHE_NULL_CUDA_SITES=FILE writes, at exit, where each counted call came from: the
//   process's memory map, then per call site `site KIND COUNT PC...` (the call's return addresses,
//   innermost first); tools/profile/null_cuda_sites.py names them and divides by the steps.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>
#include <execinfo.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kTotalMemory = size_t{80} << 30;
constexpr int kSms = 132;
constexpr int kSharedOptIn = 232448;   // bytes a block may opt in to (Hopper)
constexpr int kSharedPerSm = 233472;

std::mutex allocations_mutex;
std::unordered_map<void*, size_t>& Allocations() {
  static auto* sizes = new std::unordered_map<void*, size_t>;  // never destroyed: frees may come at exit
  return *sizes;
}

cudaError_t Allocate(void** p, size_t bytes) {
  if (p == nullptr) return cudaErrorInvalidValue;
  const size_t n = bytes == 0 ? 1 : bytes;
  void* m = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) {
    *p = nullptr;
    return cudaErrorMemoryAllocation;
  }
  std::lock_guard lock(allocations_mutex);
  Allocations()[m] = n;
  *p = m;
  return cudaSuccess;
}

cudaError_t Release(void* p) {
  if (p == nullptr) return cudaSuccess;
  size_t n = 0;
  {
    std::lock_guard lock(allocations_mutex);
    auto it = Allocations().find(p);
    if (it == Allocations().end()) return cudaErrorInvalidValue;
    n = it->second;
    Allocations().erase(it);
  }
  munmap(p, n);
  return cudaSuccess;
}

// Distinct non-null handles for streams, events, graphs and kernels.
std::atomic<uintptr_t> next_handle{0x1000};
template <typename T>
T NewHandle() {
  return reinterpret_cast<T>(next_handle.fetch_add(0x10));
}

// Streams in capture (BeginCapture .. EndCapture).
std::mutex capture_mutex;
std::unordered_map<cudaStream_t, bool>& Capturing() {
  static auto* capturing = new std::unordered_map<cudaStream_t, bool>;
  return *capturing;
}

// SPECACHE_NULL_CUDA_COUNTS=1: how often each call was made, printed to stderr at exit (a run's
// calls per decode step: the difference of two runs with different --steps, over the steps).
enum Call {
  kLaunch, kLaunchEx, kMalloc, kFree, kMallocHost, kFreeHost, kHostRegister, kMemcpy, kMemcpyAsync, kMemcpy2DAsync,
  kMemset, kMemsetAsync, kStreamSynchronize, kDeviceSynchronize, kEventSynchronize, kEventRecord, kEventQuery,
  kStreamWaitEvent, kGraphLaunch, kGemm, kGetDevice, kStreamIsCapturing, kGetLastError, kDeviceGetAttribute,
  kCallCount
};
constexpr const char* kCallNames[kCallCount] = {
    "kernel launches (<<<>>>)", "cudaLaunchKernelExC", "cudaMalloc", "cudaFree", "cudaMallocHost/cudaHostAlloc",
    "cudaFreeHost", "cudaHostRegister", "cudaMemcpy", "cudaMemcpyAsync", "cudaMemcpy2DAsync", "cudaMemset",
    "cudaMemsetAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaEventRecord",
    "cudaEventQuery", "cudaStreamWaitEvent", "cudaGraphLaunch", "cublasGemmEx/cublasLtMatmul", "cudaGetDevice",
    "cudaStreamIsCapturing", "cudaGetLastError", "cudaDeviceGetAttribute"};
std::atomic<uint64_t> counts[kCallCount];
const bool counting = [] {
  const char* v = std::getenv("SPECACHE_NULL_CUDA_COUNTS");
  return v != nullptr && v[0] == '1';
}();
const char* const sites_path = std::getenv("SPECACHE_NULL_CUDA_SITES");
constexpr int kSiteDepth = 6;  // the call's frames kept (this file's two first)
std::mutex sites_mutex;
std::map<std::pair<int, std::vector<void*>>, uint64_t>& Sites() {
  static auto* sites = new std::map<std::pair<int, std::vector<void*>>, uint64_t>;  // never destroyed: calls at exit
  return *sites;
}
// noinline: frames 0 and 1 are this function and the counted call.
__attribute__((noinline)) void Count(Call c) {
  if (counting) counts[c].fetch_add(1, std::memory_order_relaxed);
  if (sites_path == nullptr) return;
  void* pcs[kSiteDepth + 2];
  const int n = backtrace(pcs, kSiteDepth + 2);
  std::vector<void*> key(pcs + std::min(n, 2), pcs + n);
  std::lock_guard lock(sites_mutex);
  ++Sites()[{static_cast<int>(c), std::move(key)}];
}
struct PrintCounts {
  ~PrintCounts() {
    if (counting) {
      std::fprintf(stderr, "null CUDA runtime: calls made\n");
      for (int c = 0; c < kCallCount; ++c) {
        std::fprintf(stderr, "  %12llu  %s\n", static_cast<unsigned long long>(counts[c].load()), kCallNames[c]);
      }
    }
    // A process that made no call (a wrapper that only inherited LD_PRELOAD) writes nothing.
    if (sites_path == nullptr || Sites().empty()) return;
    FILE* out = std::fopen(sites_path, "w");
    if (out == nullptr) return;
    if (FILE* maps = std::fopen("/proc/self/maps", "r")) {
      char line[4096];
      while (std::fgets(line, sizeof line, maps)) std::fprintf(out, "map %s", line);
      std::fclose(maps);
    }
    std::lock_guard lock(sites_mutex);
    for (const auto& [key, n] : Sites()) {
      std::fprintf(out, "site %s\t%llu", kCallNames[key.first], static_cast<unsigned long long>(n));
      for (void* pc : key.second) std::fprintf(out, " %p", pc);
      std::fprintf(out, "\n");
    }
    std::fclose(out);
  }
} print_counts;

}  // namespace

extern "C" {

// ---- The compiler's launch and registration hooks (crt/host_runtime.h, crt/device_functions.h).
void** __cudaRegisterFatBinary(void*) {
  static void* handle = nullptr;
  return &handle;
}
void __cudaRegisterFatBinaryEnd(void**) {}
void __cudaUnregisterFatBinary(void**) {}
void __cudaRegisterFunction(void**, const char*, char*, const char*, int, uint3*, uint3*, dim3*, dim3*, int*) {}
void __cudaRegisterVar(void**, char*, char*, const char*, int, size_t, int, int) {}
unsigned __cudaPushCallConfiguration(dim3, dim3, size_t, struct CUstream_st*) { return 0; }
cudaError_t __cudaPopCallConfiguration(dim3* grid, dim3* block, size_t* shared, void* stream) {
  if (grid) *grid = dim3(1);
  if (block) *block = dim3(1);
  if (shared) *shared = 0;
  if (stream) *static_cast<cudaStream_t*>(stream) = nullptr;
  return cudaSuccess;
}
cudaError_t __cudaGetKernel(cudaKernel_t* kernel, const void*) {
  if (kernel) *kernel = NewHandle<cudaKernel_t>();
  return cudaSuccess;
}
cudaError_t __cudaLaunchKernel(cudaKernel_t, dim3, dim3, void**, size_t, cudaStream_t) {
  Count(kLaunch);
  return cudaSuccess;
}
cudaError_t __cudaLaunchKernel_ptsz(cudaKernel_t, dim3, dim3, void**, size_t, cudaStream_t) {
  Count(kLaunch);
  return cudaSuccess;
}

}  // extern "C"

// ---- The runtime API the project calls (declared by cuda_runtime_api.h, so the signatures match).
cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t*, const void*, void**) {
  Count(kLaunchEx);
  return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* count) {
  if (count) *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  Count(kGetDevice);
  if (device) *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (prop == nullptr || device != 0) return cudaErrorInvalidValue;
  std::memset(prop, 0, sizeof(*prop));
  std::snprintf(prop->name, sizeof prop->name, "null device (no GPU: host-cost harness)");
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = kSms;
  prop->totalGlobalMem = kTotalMemory;
  prop->sharedMemPerBlock = 49152;
  prop->sharedMemPerBlockOptin = kSharedOptIn;
  prop->sharedMemPerMultiprocessor = kSharedPerSm;
  prop->regsPerBlock = 65536;
  prop->regsPerMultiprocessor = 65536;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsPerMultiProcessor = 2048;
  prop->canMapHostMemory = 1;
  prop->unifiedAddressing = 1;
  prop->l2CacheSize = 50 << 20;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  Count(kDeviceGetAttribute);
  if (value == nullptr || device != 0) return cudaErrorInvalidValue;
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = kSms; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = kSharedOptIn; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = kSharedPerSm; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = 2048; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrCanMapHostMemory:
    case cudaDevAttrUnifiedAddressing:
    case cudaDevAttrCanUseHostPointerForRegisteredMem: *value = 1; break;
    default: *value = 0; break;
  }
  return cudaSuccess;
}
cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  Count(kDeviceSynchronize);
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  if (free) *free = kTotalMemory;
  if (total) *total = kTotalMemory;
  return cudaSuccess;
}
const char* cudaGetErrorString(cudaError_t error) {
  return error == cudaSuccess ? "no error" : "null CUDA runtime: the call was refused";
}
cudaError_t cudaGetLastError() {
  Count(kGetLastError);
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
  Count(kMalloc);
  return Allocate(p, bytes);
}
cudaError_t cudaFree(void* p) {
  Count(kFree);
  return Release(p);
}
cudaError_t cudaMallocHost(void** p, size_t bytes) {
  Count(kMallocHost);
  return Allocate(p, bytes);
}
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned int) {
  Count(kMallocHost);
  return Allocate(p, bytes);
}
cudaError_t cudaFreeHost(void* p) {
  Count(kFreeHost);
  return Release(p);
}
cudaError_t cudaHostRegister(void*, size_t, unsigned int) {
  Count(kHostRegister);
  return cudaSuccess;
}
cudaError_t cudaHostUnregister(void*) { return cudaSuccess; }
cudaError_t cudaHostGetDevicePointer(void** device, void* host, unsigned int) {
  if (device == nullptr) return cudaErrorInvalidValue;
  *device = host;
  return cudaSuccess;
}

// Not carried out (see the top of the file): the device's copies are not the host's work.
cudaError_t cudaMemcpy(void*, const void*, size_t, cudaMemcpyKind) {
  Count(kMemcpy);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t) {
  Count(kMemcpyAsync);
  return cudaSuccess;
}
cudaError_t cudaMemcpy2DAsync(void*, size_t, const void*, size_t, size_t, size_t, cudaMemcpyKind, cudaStream_t) {
  Count(kMemcpy2DAsync);
  return cudaSuccess;
}
cudaError_t cudaMemset(void*, int, size_t) {
  Count(kMemset);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void*, int, size_t, cudaStream_t) {
  Count(kMemsetAsync);
  return cudaSuccess;
}

cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, const void*) {
  if (attr == nullptr) return cudaErrorInvalidValue;
  std::memset(attr, 0, sizeof(*attr));
  attr->maxThreadsPerBlock = 1024;
  attr->numRegs = 64;
  attr->maxDynamicSharedSizeBytes = kSharedOptIn;
  attr->ptxVersion = 90;
  attr->binaryVersion = 90;
  return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void*, cudaFuncAttribute, int) { return cudaSuccess; }
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* blocks, const void*, int threads, size_t,
                                                                   unsigned int) {
  if (blocks == nullptr) return cudaErrorInvalidValue;
  *blocks = threads > 0 ? std::max(1, 2048 / threads) : 1;
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* s) {
  if (s) *s = NewHandle<cudaStream_t>();
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) { return cudaStreamCreate(s); }
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int, int) { return cudaStreamCreate(s); }
cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) {
  Count(kStreamSynchronize);
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned int) {
  Count(kStreamWaitEvent);
  return cudaSuccess;
}
cudaError_t cudaStreamGetFlags(cudaStream_t, unsigned int* flags) {
  if (flags) *flags = 0;
  return cudaSuccess;
}
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
  std::lock_guard lock(capture_mutex);
  Capturing()[s] = true;
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph) {
  {
    std::lock_guard lock(capture_mutex);
    Capturing().erase(s);
  }
  if (graph) *graph = NewHandle<cudaGraph_t>();
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  Count(kStreamIsCapturing);
  if (status == nullptr) return cudaErrorInvalidValue;
  std::lock_guard lock(capture_mutex);
  *status = Capturing().count(s) ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* e) {
  if (e) *e = NewHandle<cudaEvent_t>();
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) { return cudaEventCreate(e); }
cudaError_t cudaEventDestroy(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) {
  Count(kEventRecord);
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t) {
  Count(kEventQuery);
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) {
  Count(kEventSynchronize);
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t, cudaEvent_t) {
  if (ms) *ms = 0.001f;  // a device figure: meaningless here, but positive (callers divide by it)
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t, unsigned long long) {
  if (exec) *exec = NewHandle<cudaGraphExec_t>();
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t, cudaStream_t) {
  Count(kGraphLaunch);
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t) { return cudaSuccess; }
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t) { return cudaSuccess; }

cudaError_t cudaProfilerStart() { return cudaSuccess; }
cudaError_t cudaProfilerStop() { return cudaSuccess; }

// ---- cuBLAS: the GEMMs' calls (gpu_llama), accepted.
cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  if (handle) *handle = NewHandle<cublasHandle_t>();
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetStream_v2(cublasHandle_t, cudaStream_t) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t, void*, size_t) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasGemmEx(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                            const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                            cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t) {
  Count(kGemm);
  return CUBLAS_STATUS_SUCCESS;
}

// ---- cuBLASLt: the timed choice's calls (model_gemm.cc). No algorithm is ever found, so the
// model's products stay cublasGemmEx's (counted above); cublasLtMatmul is accepted all the same.
cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  if (handle) *handle = NewHandle<cublasLtHandle_t>();
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t, cudaDataType_t) {
  if (desc) *desc = NewHandle<cublasLtMatmulDesc_t>();
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t, const void*,
                                              size_t) {
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType, uint64_t, uint64_t, int64_t) {
  if (layout) *layout = NewHandle<cublasLtMatrixLayout_t>();
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  if (pref) *pref = NewHandle<cublasLtMatmulPreference_t>();
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t, cublasLtMatmulPreferenceAttributes_t,
                                                    const void*, size_t) {
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t,
                                              cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                              cublasLtMatmulPreference_t, int, cublasLtMatmulHeuristicResult_t*,
                                              int* found) {
  if (found) *found = 0;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t, const void*, const void*, cublasLtMatrixLayout_t,
                              const void*, cublasLtMatrixLayout_t, const void*, const void*, cublasLtMatrixLayout_t,
                              void*, cublasLtMatrixLayout_t, const cublasLtMatmulAlgo_t*, void*, size_t, cudaStream_t) {
  Count(kGemm);
  return CUBLAS_STATUS_SUCCESS;
}
