// Builds without CUDA: the CUDA entry points report that there is no GPU.
#include "specache/cuda_attention.h"
#include "specache/cuda_fetch.h"
#include "specache/cuda_gather.h"
#include "specache/cuda_quantize.h"
#include "specache/cuda_topk.h"

namespace specache::cuda {
namespace {
Status NoCuda() { return Status::Unavailable("built without CUDA"); }
}  // namespace

Result<uint64_t> RegisterHostMemory(void*, size_t) { return NoCuda(); }
Status UnregisterHostMemory(void*) { return NoCuda(); }
Status LaunchGatherRows(const uint64_t*, void*, int64_t, int, int, void*, const uint32_t*) { return NoCuda(); }
Status FetchRows(const FetchTask*, int, int, HostRowFormat, int, int, FetchCounters*, void*, DecodePlan*) { return NoCuda(); }
Status WriteRows(const WriteTask*, int, int, HostRowFormat, int, void*, DecodePlan*) { return NoCuda(); }
Status UpdateRowCaches(const CacheUpdateTask*, int, int, HostRowFormat, FetchCounters*, void*, DecodePlan*) {
  return NoCuda();
}
Status SumCacheCounts(const int32_t* const*, int, int, int64_t*, CountSumScratch) { return NoCuda(); }
Status QuantizeKeyGroups(const Half*, int, int, int, int, uint32_t*, Half*, Half*, void*) { return NoCuda(); }
Status QuantizeValueTokens(const Half*, int, int, int, int, uint32_t*, Half*, Half*, void*) { return NoCuda(); }
Status QuantizeKeyGroupRuns(const KeyGroupRun*, int, int, int, int, void*) { return NoCuda(); }
Status QuantizeValueTokenRuns(const ValueTokenRun*, int, int, int, int, void*) { return NoCuda(); }
Status QuantizeKeyGroupTasks(const KeyGroupRun*, int, int, int, int, void*, DecodePlan*) { return NoCuda(); }
Status AttendDecodeRows(const DeviceReplicaView&, const DeviceDecodeRows&, void*) { return NoCuda(); }
struct DecodePlan::Impl {};
DecodePlan::DecodePlan(SlotReads) : impl_(new Impl) {}
DecodePlan::~DecodePlan() { delete impl_; }
Status AttendDecodeBatch(const DeviceDecodeItem*, int, void*, DecodePlan*) { return NoCuda(); }
Status AttendDecodeBatch(const DeviceDecodeItem*, int, void*) { return NoCuda(); }
Status AttendDecodeBatch(std::vector<DeviceDecodeItem>, void*, DecodePlan*) { return NoCuda(); }
Status AttendPrefill(const float*, const Half*, const Half*, int32_t, int, int, int, float, float*, float*, void*) {
  return NoCuda();
}
Status SelectTopK(const float*, int, int, int32_t, int, GroupReduction, int32_t*, float*, void*) { return NoCuda(); }
Status SelectTopKBatch(const TopKSegment*, int, int, int, GroupReduction, void*, const TopKBudget*, DecodePlan*) {
  return NoCuda();
}

}  // namespace specache::cuda

#include "specache/agent.h"

namespace specache {

Result<std::unique_ptr<Agent>> CreateCudaAgent(const ModelShape&, const KvConfig&, FullPrecisionSource*,
                                               const CudaAgentOptions&) {
  return Status::Unavailable("built without CUDA");
}

}  // namespace specache

#include "specache/host_tensor_agent.h"

namespace specache {

Result<std::unique_ptr<Agent>> WrapHostTensors(std::unique_ptr<Agent>) { return Status::Unavailable("built without CUDA"); }

}  // namespace specache
