// specache-run's GPU path in a build without CUDA: never chosen, and UNAVAILABLE when asked for.
#include "gpu_run.h"
#include "throughput_bench.h"

namespace specache::run {

bool UseGpuModel(const std::string&) { return false; }

Result<GpuGeneration> GenerateOnGpu(const LoadedModel&, const KvConfig&, KvMemory*, const std::vector<std::vector<int32_t>>&,
                                    int, const std::function<void(std::string_view)>&) {
  return Status::Unavailable("this specache-run was built without CUDA: the model cannot run on a GPU");
}

Result<std::vector<nlohmann::json>> RunThroughputBench(const ThroughputOptions& options) {
  SPECACHE_RETURN_IF_ERROR(CheckThroughputOptions(options).status());  // usage errors first, as with CUDA
  return Status::Unavailable("specache-run bench needs a build with CUDA and a GPU");
}

}  // namespace specache::run
